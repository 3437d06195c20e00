"""Training gives the same numbers under every layout, and learns.

Each model trains 5 steps under every shipped layout it lists, on 8 simulated devices, and must
reproduce the single-device run's losses (relative 1e-4). Adafactor's factored statistics and
global-norm clipping reduce over named dims, so their updates must also match the single-device
update under layouts that split those dims. The reference is always the same code on a 1-device
mesh with no rules, where nothing is split and no collective runs.
"""

import dataclasses
import functools
import re
from pathlib import Path

import harness
import jax
import meshdsl.models.mlp as mlp
import meshdsl.models.transformer as transformer
import model_figures
import numpy as np
import optax
import pytest

import meshdsl as md
from meshdsl.analysis import hlo
from meshdsl.measure import timing
from meshdsl.train import optim
from meshdsl.train.step import Trainer

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"
SINGLE = (md.Mesh({"x": 1}), md.Layout())


def _losses(model, optimizer, mesh, layout, steps=5):
    return harness.train(Trainer(model, optimizer, mesh, layout), steps)


MODELS = {
    "mlp": lambda: mlp.Model(mlp.Config.preset("tiny")),
    "transformer": lambda: transformer.Model(transformer.Config.preset("tiny")),
}

FALL_STEPS = 30
"""Steps of the one-device run whose loss must fall; its first 5 are the layouts' reference."""


@functools.cache
def _adamw_losses(name: str, layout_name: str | None, steps: int) -> np.ndarray:
    """The losses of ``steps`` AdamW(1e-2) steps of ``MODELS[name]`` under the shipped layout ``layout_name`` (None:
    one device), computed once per session: the same run is the reference of one test and the subject of another
    (a run's first losses are those of a shorter run: the same compiled step from the same state and data)."""
    if layout_name is None:
        mesh, layout = SINGLE
    else:
        layout = md.Layout.load(LAYOUTS / f"{layout_name}.toml")
        mesh = layout.mesh()
    losses, _ = _losses(MODELS[name](), optim.adamw(1e-2), mesh, layout, steps=steps)
    losses.flags.writeable = False
    return losses


@pytest.mark.parametrize("name", MODELS)
def test_every_layout_trains_like_one_device(name):
    model = MODELS[name]()
    reference = _adamw_losses(name, None, FALL_STEPS)[:5]
    why = model_figures.recorded_losses_mismatch(name, reference)
    assert why is None, why
    for layout_name in model.LAYOUTS:
        losses = _adamw_losses(name, layout_name, 5)
        np.testing.assert_allclose(losses, reference, rtol=1e-4, err_msg=f"{name} under {layout_name}")


@pytest.mark.parametrize("name", MODELS)
def test_loss_falls_on_the_synthetic_task(name):
    losses = _adamw_losses(name, None, FALL_STEPS)
    assert losses[-5:].mean() < 0.6 * losses[0], losses


def _params(state):
    return {
        k: v.numpy()
        for k, v in jax.tree_util.tree_leaves_with_path(state["params"], is_leaf=lambda x: isinstance(x, md.Tensor))
    }


@pytest.mark.parametrize(
    "optimizer",
    [
        optim.Adafactor(min_dim_size_to_factor=8),
        optim.sgd(0.5, clip_norm=0.05),
        optim.adamw(1e-2, clip_norm=0.05),
    ],
    ids=["adafactor", "sgd-clipped", "adamw-clipped"],
)
def test_statistics_over_split_dims_give_the_same_update(optimizer):
    """Factored moments (over d_io, d_ff) and global norms, with those dims split over the mesh."""
    model = mlp.Model(mlp.Config.preset("tiny"))
    ref_losses, ref_state = _losses(model, optimizer, *SINGLE, steps=3)
    assert optimizer.__class__ is not optim.Adafactor or optimizer.factored_dims(
        model.init(jax.random.key(0))["w1"].shape
    )
    for rules in ["d_io:data; d_ff:model", "batch:data; d_ff:model", "d_ff:(data, model)"]:
        layout = md.Layout(rules, params="d_io:(data, model)")
        losses, state = _losses(model, optimizer, md.Mesh({"data": 4, "model": 2}), layout, steps=3)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        got, want = _params(state), _params(ref_state)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{key} under {rules}")


def test_global_norm_of_a_tree_without_tensors_is_zero():
    """As optax.tree.norm: a tree with no tensors has norm 0 and clipping leaves it alone."""
    norm = optim.global_norm({"step": 3})
    assert norm.shape.rank == 0 and float(norm.numpy()) == float(optax.tree.norm({})) == 0.0
    assert optim.clip_by_global_norm({"step": 3}, 1.0) == {"step": 3}


def test_clipping_really_clips():
    """With a tiny threshold, the first SGD step moves the parameters by exactly lr * threshold."""
    model = mlp.Model(mlp.Config.preset("tiny"))
    trainer = Trainer(model, optim.sgd(1.0, clip_norm=1e-3), md.Mesh({"data": 8}), md.Layout("d_ff:data"))
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    before = {k: v.numpy() for k, v in state["params"].items()}
    state, _ = trainer.step(state, jax.random.key_data(jax.random.key(1)))
    moved = np.sqrt(sum(np.sum((state["params"][k].numpy() - before[k]) ** 2) for k in before))
    np.testing.assert_allclose(moved, 1e-3, rtol=1e-4)


def test_fsdp_stores_parameters_split_and_reduce_scatters_gradients():
    model = transformer.Model(transformer.Config.preset("tiny"))
    layout = md.Layout.load(LAYOUTS / "fsdp.toml")
    trainer = Trainer(model, optim.adamw(1e-2), layout.mesh(), layout)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    wqkv = state["params"]["layers"]["wqkv"]
    assert wqkv.array.sharding.shard_shape(wqkv.array.shape)[1] == wqkv.shape["d_model"].size // 8
    report = trainer.explain(state, jax.random.key_data(jax.random.key(1)))
    summary = report.summary()
    # Every parameter is gathered once and its gradient reduce-scattered once; the layers'
    # parameters are gathered again in the backward loop (ZeRO-3: one layer's gathered copy at a
    # time), each layer's together: one all-gather forward, one backward, one reduce-scatter.
    layers = jax.tree_util.tree_leaves(state["params"]["layers"], is_leaf=lambda x: isinstance(x, md.Tensor))
    regathered = sum(t.shape.size for t in layers) * 4 * 7 / 8
    assert summary["reduce-scatter"]["bytes"] > 0
    assert summary["all-gather"]["bytes"] == summary["reduce-scatter"]["bytes"] + regathered
    outside = len(state["params"]) - 1  # embed, final_norm, unembed: gathered once each, outside the loop
    assert summary["reduce-scatter"]["count"] == model.config.layers + outside
    assert summary["all-gather"]["count"] == 2 * model.config.layers + outside
    # Only scalars are all-reduced: the loss and the global norm that AdamW clips by.
    assert {(r.op, r.buffer_bytes) for r in report.rows if r.collective.value == "all-reduce"} == {
        ("array", 4),
        ("sqrt", 4),
    }


def test_fsdp_reduce_scatters_gradients_in_bf16():
    """``grad_reduce_dtype="bfloat16"`` under FSDP: every gradient reduce-scatter runs in bf16 (half
    the bytes on an accelerator), the gathers of f32 parameters stay f32, and training matches f32."""
    model = transformer.Model(transformer.Config.preset("tiny"))
    layout = md.Layout.load(LAYOUTS / "fsdp.toml")
    full = Trainer(model, optim.adamw(1e-2), layout.mesh(), layout)
    narrow = Trainer(model, optim.adamw(1e-2), layout.mesh(), layout, grad_reduce_dtype="bfloat16")
    state = full.init(jax.random.key_data(jax.random.key(0)))
    key = jax.random.key_data(jax.random.key(1))
    f32 = full.explain(state, key, platform="gpu").summary()
    bf16 = narrow.explain(state, key, platform="gpu").summary()
    assert bf16["reduce-scatter"]["count"] == f32["reduce-scatter"]["count"]
    assert bf16["reduce-scatter"]["bytes"] == f32["reduce-scatter"]["bytes"] / 2
    assert bf16["all-gather"] == f32["all-gather"]
    jaxpr = str(jax.make_jaxpr(narrow.step.spmd_function)(state, key))
    assert (
        len(re.findall(r"bf16\[[\d,]*\](?:{[^}]*})? = reduce_scatter", jaxpr))
        == f32["reduce-scatter"]["count"] - model.config.layers + 1
    )
    assert not re.findall(r"f32\[[\d,]*\](?:{[^}]*})? = reduce_scatter", jaxpr)
    # on CPU, explain's figures (16-bit sums priced as the f32 XLA's CPU backend runs) are the HLO's
    assert (
        hlo.summary(narrow.step.lower(state, key).compile().as_text(), num_devices=8)
        == narrow.explain(state, key).summary()
    )
    reference = _adamw_losses("transformer", "fsdp", 5)  # f32 sums: test_every_layout_trains_like_one_device's run
    losses, _ = harness.train(narrow, 5)
    np.testing.assert_allclose(losses, reference, rtol=2e-2)


def test_chunked_loss_trains_like_the_recorded_losses():
    """The Transformer's loss a chunk of 4 positions at a time (``loss_chunk``, a rematerialised scan
    with the unembedding inside) gives the recorded losses in pipeline stages, batch and vocabulary split
    (3-D: test_cross_entropy checks the loss's values and gradients under more layouts)."""
    config = dataclasses.replace(transformer.Config.preset("tiny"), loss_chunk=4)
    for layout_name in ("pipeline",):
        layout = md.Layout.load(LAYOUTS / f"{layout_name}.toml")
        trainer = Trainer(transformer.Model(config), optim.adamw(model_figures.LEARNING_RATE), layout.mesh(), layout)
        losses, _ = harness.train(trainer, model_figures.STEPS)
        why = model_figures.recorded_losses_mismatch("transformer", losses)
        assert why is None, f"under {layout_name}: {why}"


def _step_figures(**changes) -> tuple[int, float]:
    """Temporary bytes and FLOPs (XLA's, each loop body once) of a compiled AdamW step of a small 2-layer
    Transformer on one device (nothing run)."""
    config = transformer.Config(batch=4, length=64, d_model=64, heads=4, d_kv=16, d_ff=256, vocab=64, layers=2)
    trainer = Trainer(transformer.Model(dataclasses.replace(config, **changes)), optim.adamw(1e-2), *SINGLE)
    compiled = timing.compile_abstract(trainer, jax.random.key_data(jax.random.key(1)))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return compiled.memory_analysis().temp_size_in_bytes, cost["flops"]


def test_remat_policy_dots_trains_alike_and_recomputes_no_matmul():
    """``remat_policy="dots"`` keeps the layers' matmul outputs: the recorded losses, fewer temporaries
    than no remat, and fewer FLOPs than full remat (its matmuls are not run twice)."""
    config = dataclasses.replace(transformer.Config.preset("tiny"), remat=True, remat_policy="dots")
    losses, _ = harness.train(Trainer(transformer.Model(config), optim.adamw(model_figures.LEARNING_RATE), *SINGLE), 3)
    why = model_figures.recorded_losses_mismatch("transformer", losses)
    assert why is None, why
    (none_bytes, none_flops), (dots_bytes, dots_flops), (_, full_flops) = (
        _step_figures(remat=r, remat_policy=p) for r, p in [(False, "full"), (True, "dots"), (True, "full")]
    )
    assert dots_bytes < none_bytes, (dots_bytes, none_bytes)
    assert none_flops <= dots_flops < full_flops, (none_flops, dots_flops, full_flops)


def test_remat_policy_mistake_is_named():
    with pytest.raises(md.ConfigError, match="remat_policy must be one of 'full', 'dots', got 'some'"):
        transformer.Config(remat_policy="some")


def test_the_synthetic_tasks_terms_are_the_powers_and_their_geometric_sums() -> None:
    """``task_terms`` builds in one pass what the task is defined as: ``5^i mod vocab`` and ``3 (5^0 + ... +
    5^(i-1)) mod vocab`` (summed anew per position it took half a minute at the 8B preset's 4,096)."""
    from meshdsl.models.transformer import task_terms

    for vocab in (1, 2, 7, 64, 32000):
        powers, offsets = task_terms(vocab, 40)
        assert powers == [pow(5, i, vocab) for i in range(40)]
        assert offsets == [3 * sum(pow(5, j, vocab) for j in range(i)) % vocab for i in range(40)]
