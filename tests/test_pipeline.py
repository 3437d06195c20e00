"""Pipeline parallelism (``meshdsl.pipeline``): GPipe and 1F1B give the single-device numbers.

The reference is ``jax.value_and_grad`` of the model's own loss on global arrays (one device, no
microbatches). Pipelined runs split ``layers`` over ``stage`` on a 3-D mesh (stage=2, data=2,
model=2) and must match it to relative 1e-5, loss and every gradient leaf.
"""

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

import harness
import meshdsl as md
from meshdsl import hlo, pipeline
from meshdsl.train import optim
from meshdsl.train.step import Trainer
from meshdsl.models import moe, transformer

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"
RULES = {"layers": "stage", "batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}


def _is_tensor(x):
    return isinstance(x, md.Tensor)


def _tiny(**overrides) -> transformer.Model:
    return transformer.Model(transformer.Config.preset("tiny", **overrides))


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@functools.cache
def _case(layers: int) -> tuple:
    """The tiny Transformer with ``layers`` layers, its parameters and batch, and the reference ``(loss, grads)``."""
    model = _tiny(layers=layers)
    params, batch = jax.jit(lambda: (model.init(jax.random.key(0)), model.batch(jax.random.key(1))))()
    reference = jax.jit(jax.value_and_grad(lambda p, b: model.loss(p, b).array))(params, batch)
    return model, params, batch, reference


def _shapes(model) -> tuple:
    """Abstract parameters and batch of ``model``: enough to compile, or to hit a tracing error."""
    return jax.eval_shape(model.init, jax.random.key(0)), jax.eval_shape(model.batch, jax.random.key(1))


def _step(model: transformer.Model, schedule: str) -> Callable:
    """The pipelined value-and-grad of ``model`` over 2 microbatches."""
    config = pipeline.PipelineConfig(microbatches=2, schedule=schedule)
    return lambda p, b: pipeline.value_and_grad(model, p, b, config)


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_schedule_matches_one_device_and_explain_matches_hlo(schedule):
    model, params, batch, (ref_loss, ref_grads) = _case(layers=4)
    mesh = md.Mesh({"stage": 2, "data": 2, "model": 2})
    step = _step(model, schedule)
    compiled = md.compile(step, mesh, RULES).lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    assert _relative(np.asarray(loss), np.asarray(ref_loss)) < 1e-5
    got = jax.tree_util.tree_leaves_with_path(grads, is_leaf=_is_tensor)
    want = jax.tree_util.tree_leaves(ref_grads, is_leaf=_is_tensor)
    assert len(got) == len(want)
    for (path, g), r in zip(got, want):
        assert g.shape == r.shape
        assert _relative(g.numpy(), r.numpy()) < 1e-5, jax.tree_util.keystr(path)
    predicted = md.explain(step, mesh, RULES, params, batch).summary()
    assert predicted["collective-permute"]["count"] > 0
    assert predicted == hlo.summary(compiled.as_text(), num_devices=mesh.size)


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_explain_matches_hlo_with_one_layer_per_stage(schedule):
    # XLA removes each stage's one-trip layer loop, then drops the (1F1B) recompute's dead last all-reduce.
    model = _tiny(layers=2)
    params, batch = _shapes(model)
    mesh = md.Mesh({"stage": 2, "data": 2, "model": 2})
    step = _step(model, schedule)
    compiled = md.compile(step, mesh, RULES).lower(params, batch).compile()
    predicted = md.explain(step, mesh, RULES, params, batch).summary()
    assert predicted == hlo.summary(compiled.as_text(), num_devices=mesh.size)


def test_trainer_with_shipped_pipeline_layout_trains_like_one_device():
    model = _tiny()
    layout = md.Layout.load(LAYOUTS / "pipeline.toml")
    assert layout.pipeline == pipeline.PipelineConfig(microbatches=4, schedule="1f1b")
    pipelined = Trainer(model, optim.adamw(1e-2), layout.mesh(), layout)
    assert pipelined.pipelined
    single = Trainer(model, optim.adamw(1e-2), md.Mesh({"x": 1}), md.Layout())
    np.testing.assert_allclose(harness.train(pipelined, 3)[0], harness.train(single, 3)[0], rtol=1e-5)


def _temp_bytes(schedule: str, microbatches: int, rows: int = 2) -> int:
    """Compiled temporary bytes per device of a pipelined value-and-grad at ``rows`` rows per microbatch."""
    model = _tiny(batch=rows * microbatches)
    params, batch = _shapes(model)
    config = pipeline.PipelineConfig(microbatches=microbatches, schedule=schedule)
    compiled = md.compile(lambda p, b: pipeline.value_and_grad(model, p, b, config), md.Mesh({"stage": 2}), {"layers": "stage"})
    return compiled.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_activation_memory_is_flat_in_microbatches_and_gpipe_grows():
    gpipe = [_temp_bytes("gpipe", m) for m in (1, 4)]
    one_f_one_b = [_temp_bytes("1f1b", m) for m in (1, 4)]
    assert gpipe[1] > 2 * gpipe[0], gpipe
    # Only the microbatched token arrays (int32) grow with M under 1F1B: 3 more microbatches of 2 x 16.
    assert one_f_one_b[1] - one_f_one_b[0] < 0.1 * (gpipe[1] - gpipe[0]), (one_f_one_b, gpipe)
    assert one_f_one_b[1] < gpipe[1]


def test_errors_name_the_problem(tmp_path):
    model = _tiny()
    params, batch = _shapes(model)
    mesh = md.Mesh({"stage": 2, "data": 4})
    with pytest.raises(md.ConfigError, match="3 microbatches do not divide the batch: batch is 8"):
        md.compile(lambda p, b: pipeline.value_and_grad(model, p, b, pipeline.PipelineConfig(3)), mesh, {"layers": "stage"})(params, batch)
    with pytest.raises(md.ConfigError, match="4 microbatches do not divide the rows one device holds: batch is 8, split over data into 2 rows"):
        md.compile(lambda p, b: pipeline.value_and_grad(model, p, b, pipeline.PipelineConfig(4)), mesh, {"layers": "stage", "batch": "data"})(params, batch)
    three = _tiny(layers=3)
    with pytest.raises(md.LayoutError, match="dim layers \\(size 3\\) is split over mesh axis stage \\(size 2\\)"):
        md.compile(lambda p, b: pipeline.value_and_grad(three, p, b, pipeline.PipelineConfig(2)), mesh, {"layers": "stage"})(
            *_shapes(three)
        )
    layout = md.Layout.load(LAYOUTS / "pipeline.toml")
    with pytest.raises(md.ConfigError, match="needs the spmd backend, not gspmd"):
        Trainer(model, optim.sgd(0.1), layout.mesh(), layout, backend="gspmd")
    with pytest.raises(md.ConfigError, match="models.moe.Model cannot be pipelined"):
        Trainer(moe.Model(moe.Config.preset("tiny")), optim.sgd(0.1), layout.mesh(), layout)
    with pytest.raises(md.ConfigError, match="schedule must be one of gpipe, 1f1b, got 'zigzag'"):
        pipeline.PipelineConfig(4, "zigzag")
    with pytest.raises(md.ConfigError, match="microbatches must be a positive integer, got 0"):
        pipeline.PipelineConfig(0)
    bad = tmp_path / "bad.toml"
    bad.write_text('[rules]\nlayers = "stage"\n[pipeline]\nmicro_batches = 4\n')
    with pytest.raises(md.ConfigError, match="bad.toml.*unknown key\\(s\\) \\['micro_batches'\\]"):
        md.Layout.load(bad)
