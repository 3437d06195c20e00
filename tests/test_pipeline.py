"""Pipeline parallelism (``meshdsl.pipeline``): GPipe and 1F1B give the single-device numbers.

The reference is ``jax.value_and_grad`` of the model's own loss on global arrays (one device, no
microbatches). Pipelined runs split ``layers`` over ``stage`` on a 3-D mesh (stage=2, data=2,
model=2) and must match it to relative 1e-5, loss and every gradient leaf.
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import jax
import numpy as np
import pytest
from jax import lax
from meshdsl.models import moe, transformer

import meshdsl as md
from meshdsl import pipeline
from meshdsl.analysis import hlo, hlo_flops
from meshdsl.pipeline.schedule import backward_item, forward_item, residual_slots
from meshdsl.train import optim
from meshdsl.train.step import Trainer

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


def _assert_like_one_device(got: tuple, ref_loss: jax.Array, ref_grads: Any) -> None:
    """A pipelined ``(loss, grads)`` equals one device's to relative 1e-5, leaf for leaf, shapes included."""
    loss, grads = got
    assert _relative(np.asarray(loss), np.asarray(ref_loss)) < 1e-5
    leaves = jax.tree_util.tree_leaves_with_path(grads, is_leaf=_is_tensor)
    want = jax.tree_util.tree_leaves(ref_grads, is_leaf=_is_tensor)
    assert len(leaves) == len(want)
    for (path, g), r in zip(leaves, want):
        assert g.shape == r.shape
        assert _relative(g.numpy(), r.numpy()) < 1e-5, jax.tree_util.keystr(path)


def _shapes(model) -> tuple:
    """Abstract parameters and batch of ``model``: enough to compile, or to hit a tracing error."""
    return jax.eval_shape(model.init, jax.random.key(0)), jax.eval_shape(model.batch, jax.random.key(1))


def _config(schedule: str, microbatches: int, layers: int, stages: int) -> pipeline.PipelineConfig:
    """``schedule`` over ``microbatches``; interleaved with 2 virtual stages where the layers allow, else 1."""
    v = 2 if schedule == "interleaved" and layers % (2 * stages) == 0 else 1
    return pipeline.PipelineConfig(microbatches=microbatches, schedule=schedule, virtual_stages=v)


def _step(model: transformer.Model, schedule: str) -> Callable:
    """The pipelined value-and-grad of ``model`` over 2 microbatches on 2 stages."""
    config = _config(schedule, 2, model.config.layers, 2)
    return lambda p, b: pipeline.value_and_grad(model, p, b, config)


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_schedule_matches_one_device_and_explain_matches_hlo(schedule):
    model, params, batch, (ref_loss, ref_grads) = _case(layers=4)
    mesh = md.Mesh({"stage": 2, "data": 2, "model": 2})
    step = _step(model, schedule)
    compiled = md.compile(step, mesh, RULES).lower(params, batch).compile()
    _assert_like_one_device(compiled(params, batch), ref_loss, ref_grads)
    predicted = md.explain(step, mesh, RULES, params, batch).summary()
    # Two stages, v M activations forward and v M cotangents backward in as many permutes (interleaved:
    # v = 2 chunks per stage), one microbatch's [rows, length, d_model] each. Bytes: what one device sends.
    c, v = model.config, 2 if schedule == "interleaved" else 1
    activation = c.batch // 2 // 2 * c.length * c.d_model * 4  # batch over data=2, 2 microbatches, float32
    assert predicted["collective-permute"] == {"count": 2 * 2 * v, "bytes": _busiest(2, 2, v) * activation}
    assert predicted == hlo.summary(compiled.as_text(), num_devices=mesh.size)


def _busiest(p: int, m: int, v: int) -> int:
    """Microbatch transfers the busiest device sends in a step: each of the v p - 1 boundaries between virtual
    stages carries m activations forward and m cotangents back, and stage s sends across those after its
    own chunks (forward) and before them (backward). Two stages: stage 0 sends v m forward and (v - 1) m
    back, stage 1 the reverse; more: a middle stage sends v m each way."""
    return (2 * v - 1) * m if p == 2 else 2 * v * m


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_explain_matches_hlo_with_one_layer_per_stage(schedule):
    # XLA removes each stage's one-trip layer loop, then drops the (1F1B) recompute's dead last all-reduce.
    # GPipe is left out: its stages' one-trip loops are removed alike, and it has no recompute to drop.
    model = _tiny(layers=2)
    params, batch = _shapes(model)
    mesh = md.Mesh({"stage": 2, "data": 2, "model": 2})
    step = _step(model, schedule)
    compiled = md.compile(step, mesh, RULES).lower(params, batch).compile()
    predicted = md.explain(step, mesh, RULES, params, batch).summary()
    assert predicted == hlo.summary(compiled.as_text(), num_devices=mesh.size)


@pytest.mark.parametrize(
    ("schedule", "policy"), [("gpipe", "full"), ("gpipe", "dots"), ("1f1b", "full"), ("interleaved", "dots")]
)
def test_a_one_layer_chunk_under_remat_matches_one_device_and_explain_matches_hlo(schedule, policy):
    """Under remat a chunk of one layer is a one-trip loop that XLA removes, and its stored residuals wait for the
    output gradient (``pipeline.run._after``; GPipe's through a custom vjp) so that XLA recomputes the layer in the
    backward, not beside the forward: the select changes no number (loss and gradients as one device's, without
    remat), and the collectives it may add are explain's as they are XLA's. Its memory is test_planner's (the remat
    rows). Under the ``dots`` policy the residuals include the saved matmul outputs: they wait too."""
    layers = 4 if schedule == "interleaved" else 2  # one layer a chunk on two stages (interleaved: two chunks a stage)
    model = _tiny(layers=layers, remat=True, remat_policy=policy)
    _, params, batch, (ref_loss, ref_grads) = _case(layers=layers)
    mesh = md.Mesh({"stage": 2, "data": 2, "model": 2})
    step = _step(model, schedule)
    compiled = md.compile(step, mesh, RULES).lower(params, batch).compile()
    _assert_like_one_device(compiled(params, batch), ref_loss, ref_grads)
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
    compiled = md.compile(
        lambda p, b: pipeline.value_and_grad(model, p, b, config), md.Mesh({"stage": 2}), {"layers": "stage"}
    )
    return compiled.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_activation_memory_is_flat_in_microbatches_and_gpipe_grows():
    # 1F1B keeps the residuals of at most 2p - 1 = 3 microbatches in flight (a ring of 3 slots from M = 3
    # on); GPipe those of all M + p - 1 ticks.
    few, many = 3, 9
    assert [residual_slots(2, m).max() + 1 for m in (few, many)] == [3, 3]
    gpipe = [_temp_bytes("gpipe", m) for m in (few, many)]
    one_f_one_b = [_temp_bytes("1f1b", m) for m in (few, many)]
    assert gpipe[1] > 2 * gpipe[0], gpipe
    # 1F1B's temporaries do not grow with M but by the microbatched token and target arrays (int32, 6 more
    # microbatches of 2 rows x 16 positions each), should XLA copy them twice (reshaped to [rows / M, M],
    # then the microbatch axis moved to the front): 3072 bytes here, where GPipe's grow by about 1 MB.
    c = _tiny().config
    assert one_f_one_b[1] - one_f_one_b[0] <= 2 * (2 * (many - few) * 2 * c.length * 4), (one_f_one_b, gpipe)
    assert one_f_one_b[1] < gpipe[1]


def test_errors_name_the_problem(tmp_path):
    model = _tiny()
    params, batch = _shapes(model)
    mesh = md.Mesh({"stage": 2, "data": 4})
    with pytest.raises(md.ConfigError, match="3 microbatches do not divide the batch: batch is 8"):
        md.compile(
            lambda p, b: pipeline.value_and_grad(model, p, b, pipeline.PipelineConfig(3)), mesh, {"layers": "stage"}
        )(params, batch)
    with pytest.raises(
        md.ConfigError,
        match="4 microbatches do not divide the rows one device holds: batch is 8, split over data into 2 rows",
    ):
        md.compile(
            lambda p, b: pipeline.value_and_grad(model, p, b, pipeline.PipelineConfig(4)),
            mesh,
            {"layers": "stage", "batch": "data"},
        )(params, batch)
    three = _tiny(layers=3)
    with pytest.raises(md.LayoutError, match="dim layers \\(size 3\\) is split over mesh axis stage \\(size 2\\)"):
        md.compile(
            lambda p, b: pipeline.value_and_grad(three, p, b, pipeline.PipelineConfig(2)), mesh, {"layers": "stage"}
        )(*_shapes(three))
    layout = md.Layout.load(LAYOUTS / "pipeline.toml")
    with pytest.raises(md.ConfigError, match="needs the spmd backend, not gspmd"):
        Trainer(model, optim.sgd(0.1), layout.mesh(), layout, backend="gspmd")
    with pytest.raises(md.ConfigError, match="models.moe.Model cannot be pipelined"):
        Trainer(moe.Model(moe.Config.preset("tiny")), optim.sgd(0.1), layout.mesh(), layout)
    with pytest.raises(md.ConfigError, match="schedule must be one of gpipe, 1f1b, interleaved, got 'zigzag'"):
        pipeline.PipelineConfig(4, "zigzag")
    with pytest.raises(md.ConfigError, match="microbatches must be a positive integer, got 0"):
        pipeline.PipelineConfig(0)
    with pytest.raises(md.ConfigError, match="virtual_stages = 2 needs schedule 'interleaved', not '1f1b'"):
        pipeline.PipelineConfig(4, "1f1b", 2)
    with pytest.raises(md.ConfigError, match="virtual_stages must be a positive integer, got 0"):
        pipeline.PipelineConfig(4, "interleaved", 0)
    four = md.Mesh({"stage": 4, "data": 2})
    for layers, batch_size, m, message in (
        (8, 12, 6, "groups of the 4 stages: 6 microbatches is not a multiple of 4"),
        (4, 8, 4, "4 stages x 2 virtual stages do not divide layers \\(4\\) into equal chunks"),
    ):
        other = _tiny(layers=layers, batch=batch_size)
        config = pipeline.PipelineConfig(m, "interleaved", 2)
        with pytest.raises(md.ConfigError, match=message):
            step = md.compile(
                lambda p, b, other=other, config=config: pipeline.value_and_grad(other, p, b, config),
                four,
                {"layers": "stage"},
            )
            step(*_shapes(other))
    bad = tmp_path / "bad.toml"
    bad.write_text('[rules]\nlayers = "stage"\n[pipeline]\nmicro_batches = 4\n')
    with pytest.raises(md.ConfigError, match="bad.toml.*unknown key\\(s\\) \\['micro_batches'\\]"):
        md.Layout.load(bad)


# ---- four stages: the schedules' timetables, FLOPs, transfers and where the embedding and head run ----

MESH4 = {"stage": 4, "data": 2}
RULES4 = {"layers": "stage", "batch": "data"}


@functools.cache
def _four_stages(schedule: str, microbatches: int) -> tuple:
    """The tiny Transformer (8 layers, 2 per stage, one row per microbatch and device) on stage=4 data=2:
    the model, the compiled step and explain's summary. The model notes where its embedding and head
    run (:class:`_Recording`: host callbacks, no FLOPs and no collectives), so one compiled step serves
    the tests of values, transfers, FLOPs and placement alike."""
    model = _Recording(transformer.Config.preset("tiny", layers=8, batch=2 * microbatches))
    params, batch = _shapes(model)
    config = _config(schedule, microbatches, 8, 4)
    step = lambda p, b: pipeline.value_and_grad(model, p, b, config)  # noqa: E731
    mesh = md.Mesh(MESH4)
    compiled = md.compile(step, mesh, RULES4).lower(params, batch).compile()
    return model, compiled, md.explain(step, mesh, RULES4, params, batch).summary()


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_four_stages_match_one_device_and_send_only_the_schedules_transfers(schedule):
    model, compiled, predicted = _four_stages(schedule, 4)
    ref_model, params, batch, (ref_loss, ref_grads) = _case(layers=8)
    assert ref_model.config == model.config
    loss, grads = compiled(params, batch)
    assert _relative(np.asarray(loss), np.asarray(ref_loss)) < 1e-5
    got = jax.tree_util.tree_leaves_with_path(grads, is_leaf=_is_tensor)
    for (path, g), r in zip(got, jax.tree_util.tree_leaves(ref_grads, is_leaf=_is_tensor)):
        assert _relative(g.numpy(), r.numpy()) < 1e-5, jax.tree_util.keystr(path)
    # Each direction runs a permute in the v M + p - 2 ticks in which some boundary has a microbatch to
    # pass, only from the stages that have one: a middle stage sends its v M activations and v M cotangents.
    m, p, v, c = 4, 4, 2 if schedule == "interleaved" else 1, model.config
    activation = c.batch // 2 // m * c.length * c.d_model * 4
    assert predicted["collective-permute"] == {"count": 2 * (v * m + p - 2), "bytes": _busiest(p, m, v) * activation}
    assert predicted == hlo.summary(compiled.as_text(), num_devices=8)
    text = compiled.as_text()
    pairs = sorted({pair for cp in hlo.collectives(text, num_devices=8) if cp.pairs for pair in [cp.pairs]}, key=len)
    assert pairs[0] and len(pairs[0]) == 2, pairs  # warm-up's first tick: stage 0 alone sends (on both data rows)


def test_1f1b_runs_no_more_flops_than_gpipe_and_its_ticks_give_gpipes_bubble():
    """At M = 4 (the four-stage test's compiled steps): 1F1B's matmul FLOPs at most GPipe's, at least
    the layers' count over M + p - 1 ticks; the tick and bubble formulas at M = 4 and 8 (the timetable
    test runs those schedules tick by tick)."""
    microbatches = 4
    flops = {s: hlo_flops.matmul_flops(_four_stages(s, microbatches)[1].as_text()) for s in ("gpipe", "1f1b")}
    assert flops["1f1b"] <= flops["gpipe"], flops
    c = _four_stages("gpipe", microbatches)[0].config
    # The layer matmuls alone, forward and backward (3 x forward), of (M + p - 1) ticks of 2 layers on a microbatch.
    tokens = c.batch // 2 // microbatches * c.length
    layer = 2 * tokens * (4 * c.d_model * c.heads * c.d_kv + 2 * c.d_model * c.d_ff)
    assert flops["1f1b"] >= 3 * 2 * layer * (microbatches + 3)
    for m in (4, 8):
        for schedule in ("gpipe", "1f1b"):
            assert pipeline.ticks(schedule, 4, m) == m + 3
            assert pipeline.schedule_bubble(schedule, 4, m) == pytest.approx(3 / (m + 3))
        assert pipeline.ticks("interleaved", 4, m, 2) == 2 * m + 3
        assert pipeline.schedule_bubble("interleaved", 4, m, 2) == pytest.approx(3 / (2 * m + 3))


@pytest.mark.parametrize(
    "schedule,stages,microbatches,v",
    [
        ("1f1b", 1, 3, 1),
        ("1f1b", 2, 2, 1),
        ("1f1b", 4, 3, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 3, 5, 1),
        ("interleaved", 2, 4, 2),
        ("interleaved", 4, 8, 2),
        ("interleaved", 3, 6, 3),
        ("interleaved", 1, 2, 2),
    ],
)
def test_timetable_runs_each_microbatch_once_each_way_in_dependency_order(schedule, stages, microbatches, v):
    p = stages
    forward, backward = {}, {}  # (microbatch, virtual stage) -> tick
    for segment in pipeline.timetable(schedule, p, microbatches, v):
        for t in range(segment.start, segment.start + segment.length):
            for s in range(p):
                mb, j, _ = forward_item(t, s, p, v)
                assert (s in segment.forward) == (0 <= mb < microbatches)
                if s in segment.forward:
                    assert (mb, j * p + s) not in forward
                    forward[(mb, j * p + s)] = t
                    assert (s in segment.forward_sends) == (j * p + s < v * p - 1)
                mb, j, _ = backward_item(t, s, p, v)
                assert (s in segment.backward) == (0 <= mb < microbatches)
                if s in segment.backward:
                    assert (mb, j * p + s) not in backward
                    backward[(mb, j * p + s)] = t
                    assert (s in segment.backward_sends) == (j * p + s > 0)
    everything = {(mb, k) for mb in range(microbatches) for k in range(v * p)}
    assert set(forward) == everything == set(backward)
    for mb, k in everything:
        assert k == 0 or forward[(mb, k)] > forward[(mb, k - 1)]
        assert backward[(mb, k)] >= forward[(mb, k)]
        assert k == v * p - 1 or backward[(mb, k)] > backward[(mb, k + 1)]
    # Each stage's ticks with work: v M forwards and v M backwards, within v M + p - 1 ticks each way.
    ticks = max(forward.values()) + 1
    assert ticks == v * microbatches + p - 1 == pipeline.ticks(schedule, p, microbatches, v)
    assert pipeline.schedule_bubble(schedule, p, microbatches, v) == pytest.approx((p - 1) / (v * microbatches + p - 1))
    # The residual ring: a stage holds a chunk-microbatch's residuals from its forward's tick to its
    # backward's, both included (a tick writes before it reads). No two held at once share a slot, and the
    # ring has as many slots as the most any stage holds at once: min(v M, (v + 1) p - 1).
    slots = residual_slots(p, microbatches, v)
    most = 0
    for s in range(p):
        held = {(mb, k): (forward[(mb, k)], backward[(mb, k)]) for mb, k in everything if k % p == s}
        seq = {item: n for n, item in enumerate(sorted(held, key=lambda item: held[item][0]))}  # s's n-th forward
        for t in range(max(backward.values()) + 1):
            now = [item for item, (a, b) in held.items() if a <= t <= b]
            assert len({slots[s, seq[item]] for item in now}) == len(now), (s, t)
            most = max(most, len(now))
    assert slots.max() + 1 == most == min(v * microbatches, (v + 1) * p - 1)


_CALLS: list[tuple[str, int]] = []


def _note(kind: str) -> None:
    """At run time, ``(kind, stage)`` appended to ``_CALLS`` by each device that runs this point of the program."""
    try:
        stage = lax.axis_index("stage")
    except NameError:  # traced outside the mesh (md.compile's shape pass): nothing runs
        return
    jax.debug.callback(lambda s: _CALLS.append((kind, int(s))), stage)


class _Recording(transformer.Model):
    """The tiny Transformer noting, at run time, which stage runs its embedding and its head."""

    def pre(self, params, batch):
        _note("pre")
        return super().pre(params, batch)

    def post(self, params, x, batch):
        _note("post")
        return super().post(params, x, batch)


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_embedding_runs_only_on_the_first_stage_and_head_only_on_the_last(schedule):
    step = _four_stages(schedule, 4)[1]
    _, params, batch, _ = _case(layers=8)
    _CALLS.clear()
    jax.block_until_ready(step(params, batch))
    jax.effects_barrier()
    stages = {kind: sorted({s for k, s in _CALLS if k == kind}) for kind in ("pre", "post")}
    assert stages == {"pre": [0], "post": [3]}, stages
    # Each of the stage's 2 devices (data=2) runs the head once per microbatch.
    assert sum(k == "post" for k, _ in _CALLS) == 2 * 4


@pytest.mark.parametrize("anchor", [0.0, -0.0, 1.0, -2.5, 1e-45, np.inf, -np.inf, np.nan], ids=repr)
@pytest.mark.parametrize("dtype", [np.float32, np.dtype("bfloat16")], ids=str)
def test_a_forward_that_waits_for_the_backward_reads_its_input_unchanged(anchor: float, dtype: np.dtype) -> None:
    """The order a 1F1B tick's forward keeps (pipeline.run._after) changes no number whatever the gradient it
    waits for holds: zeros of both signs (bits 0 and the sign bit), a subnormal, infinities, NaN, beside a gradient
    of another shape and dtype; the input keeps its own NaN and infinities too."""
    from meshdsl.pipeline.run import _after

    x = np.array([[1.5, -0.0, np.nan, np.inf], [-np.inf, 3.0, 0.0, -7.25]], np.float32).astype(dtype)
    gradients = [np.full((3, 2), anchor, np.float32).astype(dtype), np.full((5,), -anchor, np.float16)]
    got = np.asarray(jax.jit(_after)(x, gradients))
    bits = np.dtype(f"u{x.dtype.itemsize}")  # bit for bit: -0.0 stays -0.0, NaN stays the same NaN
    assert got.dtype == x.dtype and np.array_equal(got.view(bits), x.view(bits))


@pytest.mark.parametrize(
    "name",
    [
        "[stage=4 data=2] batch:data; layers:stage | 8 microbatches",
        "[stage=4 model=2] vocab:model; d_ff:model; heads:model; layers:stage | 8 microbatches",
        "[stage=2 model=4] vocab:model; d_ff:model; heads:model; layers:stage | 4 microbatches, interleaved v=2",
    ],
)
def test_a_pipelined_step_updates_its_residual_rings_in_place(name: str) -> None:
    """Each tick's forward writes its residuals into the rings the previous tick's backward read; it waits
    for that backward's gradients (pipeline.run._after), so XLA writes every activation-sized ring in place.
    Waiting for one weight gradient only left each ring that gradient does not read copied every tick (84 copies
    of an update in the first program, 48 of them of activation-sized rings: 1F1B over four stages of the small
    transformer compiled 29.4 MiB a device, 26.3 MiB without them). Over ``model``, the gradients of the weights
    split there joined only through a ``pmax`` (the input is replicated along ``model``): without it the rings
    their backward read were copied every tick (interleaved over model=4 at the small preset: 25.6 MiB a device,
    20.4 MiB without)."""
    import re

    from meshdsl.measure.timing import compile_abstract
    from meshdsl.planner.search import legal_candidates

    model = transformer.Model(transformer.Config.preset("tiny", layers=4, batch=16))
    (candidate,) = [c for c in legal_candidates(model, optim.make("adamw"), 8) if c.name == name]
    trainer = Trainer(model, optim.make("adamw"), md.Mesh(candidate.axis_sizes), candidate.layout)
    text = compile_abstract(trainer, jax.random.key_data(jax.random.key(0))).as_text()
    copies = re.findall(r"= (\w+)\[([\d,]*)\]\S* copy\(%?[\w.-]*dynamic-update-slice[\w.-]*\)", text)
    activation = 8 * 16 * 32  # slots x length x d_model: one microbatch row's residual in every slot
    copied = [
        (t, s) for t, s in copies if t.startswith(("f", "bf")) and np.prod([int(d) for d in s.split(",")]) >= activation
    ]
    assert not copied, copied
