"""Attention over a split sequence (a layout's ``[attention]`` strategy): ``ring`` and ``all_to_all``
give the values and gradients of attention on the global arrays (numpy, float64), causal or not,
grouped-query or not, with a padding mask that hides every key of some rows; md.explain counts
their permutes and all-to-alls as the compiled HLO does (the harness); the layout option's
mistakes are named."""

import json
from pathlib import Path

import harness
import jax
import numpy as np
import pytest
from reference import Named, xp_of

import meshdsl as md

MASKED = -0.7 * float(np.finfo(np.float32).max)
MESH = {"data": 2, "context": 4}
RULES = "batch:data; length:context; memory:context"


def _attend_ref(q: Named, k: Named, v: Named, mask: Named | None, causal: bool, grouped: bool) -> Named:
    """softmax(q k / sqrt(d)) v on the global arrays, masked logits ``MASKED`` (one device's rule)."""
    xp = xp_of(q, k, v)
    qa = q.to(["batch", "kv", "group", "length", "d_kv"] if grouped else ["batch", "kv", "length", "d_kv"]).array
    if not grouped:
        qa = qa[:, :, None]
    ka, va = k.to("batch kv memory d_kv").array, v.to("batch kv memory d_kv").array
    scores = xp.einsum("bkgtd,bksd->bkgts", qa, ka) * qa.shape[-1] ** -0.5
    t, s = scores.shape[-2:]
    allowed = np.ones((1, 1, 1, t, s), bool)
    if causal:
        allowed = allowed & (np.arange(t)[:, None] >= np.arange(s)[None, :])
    if mask is not None:
        allowed = allowed & mask.to("batch memory").array[:, None, None, None, :]
    scores = xp.where(allowed, scores, MASKED)
    probs = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
    probs = probs / xp.sum(probs, axis=-1, keepdims=True)
    out = xp.einsum("bkgts,bksd->bkgtd", probs, va)
    names = ["batch", "kv", "group", "length", "d_kv"]
    return Named(out if grouped else out[:, :, 0], names if grouped else [n for n in names if n != "group"])


def _inputs(kv: int, group: int | None, masked: bool, length: int = 16) -> list[md.Tensor]:
    rng = np.random.default_rng(kv * 10 + (group or 0))
    heads = [("kv", kv)] + ([("group", group)] if group else [])
    q = md.tensor(
        rng.standard_normal((2, *(s for _, s in heads), length, 4)).astype(np.float32),
        harness.dims([("batch", 2), *heads, ("length", length), ("d_kv", 4)]),
    )
    k, v = (
        md.tensor(
            rng.standard_normal((2, kv, length, 4)).astype(np.float32),
            harness.dims([("batch", 2), ("kv", kv), ("memory", length), ("d_kv", 4)]),
        )
        for _ in "kv"
    )
    args = [q, k, v]
    if masked:  # row 1 sees its first 5 keys (its early queries then every key masked under causal)... and none
        pad = np.arange(length)[None, :] < np.array([length, 0])[:, None]
        pad[1, 9:12] = True
        args.append(md.tensor(pad, harness.dims([("batch", 2), ("memory", length)])))
    return args


CASES = [  # (strategy, causal, kv heads, query group, padding mask)
    ("ring", False, 4, None, True),
    ("ring", True, 4, None, False),
    ("ring", True, 2, 2, True),
    ("ring", False, 2, 2, False),
    ("all_to_all", False, 4, 2, True),
    ("all_to_all", True, 4, None, True),
    ("all_to_all", True, 2, 4, True),  # 2 kv heads on 4 devices: each its share of every kv head's group
    ("all_gather", True, 2, 2, True),
]


@pytest.mark.parametrize("strategy, causal, kv, group, masked", CASES)
def test_strategy_equals_attention_on_global_arrays(strategy, causal, kv, group, masked):
    args = _inputs(kv, group, masked)

    def fn(q, k, v, mask=None):
        return md.nn.dot_product_attention(q, k, v, heads="kv", causal=causal, mask=mask)

    def ref(q, k, v, mask=None):
        return _attend_ref(q, k, v, mask, causal, group is not None)

    layout = md.Layout(RULES, attention={"context": strategy})
    backends = ("spmd", "gspmd") if strategy == "all_gather" else ("spmd",)
    assert harness.check(fn, args, ref, md.Mesh(MESH), layout, backends=backends)


def test_rows_with_every_key_masked_average_the_values_as_on_one_device():
    """NaN-free, and the mean of every value (as ``jax.nn.dot_product_attention`` on one device)."""
    q, k, v, mask = _inputs(4, None, True)
    fn = md.compile(
        lambda q, k, v, m: md.nn.dot_product_attention(q, k, v, heads="kv", causal=True, mask=m),
        md.Mesh(MESH),
        md.Layout(RULES, attention={"context": "ring"}),
    )
    out = np.asarray(fn(q, k, v, md.tensor(np.zeros((2, 16), bool), mask.shape.dims)).array)
    np.testing.assert_allclose(out, np.broadcast_to(v.numpy().mean(2, keepdims=True), out.shape), rtol=1e-5, atol=1e-6)


def test_layouts_differing_only_in_attention_differ():
    a, b = md.Layout(RULES), md.Layout(RULES, attention={"context": "ring"})
    assert a != b and hash(a) != hash(b) and len({a, b, md.Layout(b)}) == 2
    assert md.Layout(b) == b and "ring" in repr(b)


def test_attention_mistakes_are_named(tmp_path):
    with pytest.raises(md.LayoutError, match="strategy 'rung' for mesh axis 'context' is not one of"):
        md.Layout(RULES, attention={"context": "rung"})
    path = tmp_path / "bad.toml"
    path.write_text('[mesh]\ndata = 2\ncontext = 4\n[rules]\nlength = "context"\n[attention]\nctx = "ring"\n')
    layout = md.Layout.load(path)
    with pytest.raises(md.LayoutError, match="attention ctx = 'ring' names mesh axis 'ctx'"):
        layout.check_mesh(md.Mesh(MESH))
    q, k, v = _inputs(2, None, False)
    attend = lambda q, k, v: md.nn.dot_product_attention(q, k, v, heads="kv")  # noqa: E731
    ulysses = md.Layout(RULES, attention={"context": "all_to_all"})
    with pytest.raises(md.LayoutError, match=r"needs 4 to divide the key/value heads kv \(2\)"):
        md.compile(attend, md.Mesh(MESH), ulysses)(q, k, v)
    ring_keys_only = md.Layout("memory:context", attention={"context": "ring"})
    with pytest.raises(md.LayoutError, match="splits length over \\(\\) and memory over \\('context',\\)"):
        md.compile(attend, md.Mesh(MESH), ring_keys_only)(q, k, v)
    ring = md.Layout(RULES, attention={"context": "ring"})
    with pytest.raises(md.LayoutError, match="needs the spmd backend"):
        md.compile(attend, md.Mesh(MESH), ring, backend="gspmd")(q, k, v)


def test_meshdsl_train_under_the_shipped_context_layouts_gives_the_data_parallel_losses(tmp_path, capsys):
    """``meshdsl train --model llama --layout layouts/context_<strategy>.toml``: the shipped llama (causal
    grouped-query attention, rotary, its loss; the data each device reads a quarter of each sequence)
    takes the data-parallel layout's losses, step by step (so its gradients too)."""
    from meshdsl.cli import main

    layouts = Path(__file__).resolve().parents[1] / "layouts"
    losses = {}
    for name in ("data_parallel", "context_ring", "context_all_to_all"):
        log = tmp_path / f"{name}.jsonl"
        args = [
            "train",
            "--model",
            "llama",
            "--preset",
            "tiny",
            "--steps",
            "3",
            "--layout",
            str(layouts / f"{name}.toml"),
        ]
        assert main([*args, "--log-json", str(log)]) == 0, capsys.readouterr()
        losses[name] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    for name in ("context_ring", "context_all_to_all"):
        np.testing.assert_allclose(losses[name], losses["data_parallel"], rtol=1e-5, err_msg=name)


def test_explain_counts_the_ring_and_the_all_to_alls_as_design_md_says():
    """docs/design.md's formula (n = 4 context devices, key/value blocks of B bytes): forward, the ring
    sends each key and value block n - 1 times, causal adds two half-block permutes per reordered
    operand (queries, keys, values, output); the gradient adds n - 2 sends of each block (the first is
    the forward's) and n of the float32 key and value gradients; all_to_all moves (n - 1) / n of each
    operand. (The harness checks these against the compiled HLO.)"""
    n, block = 4, 1 * 4 * 4 * 4 * 4  # batch 1 of 2, kv 4, memory 16 / 4, d_kv 4, float32
    q, k, v = _inputs(4, None, False)

    def report(strategy: str, causal: bool, grad: bool) -> dict:
        layout = md.Layout(RULES, attention={"context": strategy})

        def attend(q, k, v):
            return md.nn.dot_product_attention(q, k, v, heads="kv", causal=causal)

        def step(q, k, v, w):
            return jax.grad(lambda a: md.reduce_sum(attend(*a) * w).array)((q, k, v))

        args = (q, k, v, q) if grad else (q, k, v)
        return md.explain(step if grad else attend, md.Mesh(MESH), layout, *args).summary()

    def permutes(count: int, total: float) -> dict:
        return {"collective-permute": {"count": count, "bytes": total}}

    assert report("ring", False, False) == permutes(2 * (n - 1), 2 * (n - 1) * block)
    assert report("ring", True, False) == permutes(2 * (n - 1) + 8, 2 * (n - 1) * block + 8 * block / 2)
    ring_grad = 2 * (n - 1) + 2 * (n - 2) + 2 * n
    assert report("ring", False, True) == permutes(ring_grad, ring_grad * block)
    # the gradient needs no output reordered back: q, k, v in, and dq, dk, dv, d_out back
    assert report("ring", True, True) == permutes(ring_grad + 14, ring_grad * block + 14 * block / 2)
    a2a = (n - 1) / n * block
    assert report("all_to_all", True, False) == {"all-to-all": {"count": 4, "bytes": 4 * a2a}}
    assert report("all_to_all", False, True) == {"all-to-all": {"count": 7, "bytes": 7 * a2a}}


def test_ring_temporaries_shrink_with_the_context_axis_and_causal_computes_little_more_than_half():
    """The performance claim's check, at a small size (docs/performance.md has 4,096 tokens): XLA's
    compiled temporaries per device for one attention layer's forward and backward pass under ring
    are at most half of all_gather's at 8 devices and shrink from 4 devices to 8; causal ring's FLOPs
    (XLA's cost analysis) are at most 0.6 of non-causal ring's."""
    from meshdsl.measure.context_attention import attention_layer_costs

    def costs(strategy: str, context: int, causal: bool = False) -> dict[str, float]:
        return attention_layer_costs(strategy, context, 1024, causal, heads=2, d_kv=16)

    ring8, ring4 = costs("ring", 8), costs("ring", 4)
    assert ring8["temp_bytes"] <= 0.5 * costs("all_gather", 8)["temp_bytes"]
    assert ring8["temp_bytes"] < ring4["temp_bytes"]
    assert costs("ring", 8, causal=True)["flops"] <= 0.6 * ring8["flops"]


def test_search_proposes_context_splits_and_prices_them_below_data_parallel_for_long_sequences():
    """The planner's candidates for llama hold the sequence over ``context`` with each strategy
    (written out with their ``[attention]`` table); traced and priced at 1,024 tokens, ring on 8
    devices predicts a fraction of data parallel's peak memory (one sequence's activations
    dominate). docs/performance.md has the search that picks it under a memory limit."""
    from meshdsl.models import llama

    from meshdsl.planner.cost import price
    from meshdsl.planner.profile import load_profile
    from meshdsl.planner.search import abstract_state, candidates, model_roles
    from meshdsl.planner.trace import abstract_batch, trace_step
    from meshdsl.train import optim

    config = llama.Config(batch=8, length=1024, d_model=32, heads=4, kv_heads=2, d_kv=8, d_ff=64, vocab=32, layers=1)
    model, adamw, cpu = llama.Model(config), optim.make("adamw"), load_profile("cpu-sim")
    batch = abstract_batch(model)
    found = {c.name: c for c in candidates(model, model_roles(model, abstract_state(model, adamw), batch.shapes), 8)}
    ring = found["[context=8] length:context; memory:context | attention context=ring"]
    assert "[data=2 context=4] batch:data; length:context; memory:context | attention context=all_to_all" in found
    assert md.Layout.load(_written(ring)) == ring.layout

    def peak(candidate) -> float:
        traced = trace_step(model, adamw, candidate.axis_sizes, candidate.layout, batch=batch, platform=cpu.platform)
        return price(traced, model, cpu).memory.total

    assert peak(ring) < 0.25 * peak(found["[data=8] batch:data"])


def _written(candidate) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "best.toml"
    path.write_text(candidate.toml("test"))
    return path


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_a_sequence_split_over_two_axes_against_their_mesh_order(strategy):
    """``length:(b, a)``: positions run over b then a (not the mesh's order); causal, grouped, masked."""
    args = _inputs(4, 2, True)

    def fn(q, k, v, mask):
        return md.nn.dot_product_attention(q, k, v, heads="kv", causal=True, mask=mask)

    def ref(q, k, v, mask):
        return _attend_ref(q, k, v, mask, True, True)

    layout = md.Layout("batch:c; length:(b, a); memory:(b, a)", attention={"a": strategy, "b": strategy})
    assert harness.check(fn, args, ref, md.Mesh({"a": 2, "b": 2, "c": 2}), layout, backends=("spmd",))
    mixed = md.Layout("batch:c; length:(b, a); memory:(b, a)", attention={"a": strategy})
    with pytest.raises(md.LayoutError, match=r"strategies differ \(b = 'all_gather', a = '" + strategy):
        md.compile(fn, md.Mesh({"a": 2, "b": 2, "c": 2}), mixed)(*args)
