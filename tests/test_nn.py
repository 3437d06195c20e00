"""md.nn layers against independent references, under several layouts, on both backends, with gradients.

One harness program strings every layer together (compiles are the cost): a Transformer block
(Embedding, RMSNorm, causal MultiHeadAttention with a padding mask, LayerNorm, MLP with biases, a
two-in two-out Linear, the tied unembedding), an MoE layer on its output, and a convolution
stack (Conv2d with stride 2 and "SAME", max_pool, Conv2d "VALID", avg_pool "SAME").
``harness.check`` runs it on spmd and gspmd under each layout of :data:`LAYOUTS` against a
reference written here from the layers' definitions with :mod:`reference` (numpy float64; its
gradients in jax.numpy float64), checks the gradients of every float input, and that md.explain
predicts the compiled program's collectives exactly.

The attention kernel is also checked against ``jax.nn.dot_product_attention`` on global arrays,
and shown to run on each shard's local blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as R
from reference import Named

import meshdsl as md

D = md.Dim
SIZES = dict(batch=4, length=8, d_model=8, heads=4, d_kv=2, d_ff=8, vocab=16, experts=4)
MASKED = -0.7 * float(np.finfo(np.float32).max)


def dim(name: str) -> md.Dim:
    return D(name, SIZES[name])


# ---- the layers of the program ---------------------------------------------------------------------

EMB = md.nn.Embedding(dim("vocab"), dim("d_model"))
RMS = md.nn.RMSNorm(dim("d_model"))
MHA = md.nn.MultiHeadAttention(dim("d_model"), dim("heads"), dim("d_kv"), causal=True)
LN = md.nn.LayerNorm(dim("d_model"))
FFN = md.nn.MLP(dim("d_model"), dim("d_ff"), activation=md.relu, bias=True)
# Two input dims to two output dims: [heads, d_kv] -> [rows, cols].
PROJ = md.nn.Linear([dim("heads"), dim("d_kv")], [D("rows", 3), D("cols", 2)], bias=True)


def block(ids, pad, table, scale, wqkv, wo, ln_scale, ln_bias, w_in, b_in, w_out, b_out, w2, b2):
    x = EMB(table, ids)
    x = x + MHA({"wqkv": wqkv, "wo": wo}, RMS(scale, x), mask=pad)
    x = x + FFN(
        {"w_in": {"kernel": w_in, "bias": b_in}, "w_out": {"kernel": w_out, "bias": b_out}},
        LN({"scale": ln_scale, "bias": ln_bias}, x),
    )
    proj = PROJ({"kernel": w2, "bias": b2}, md.reshape(x, [dim("batch"), dim("length"), dim("heads"), dim("d_kv")]))
    return EMB.unembed(table, x), proj, x


def ref_attention(q: Named, k: Named, v: Named, allowed: Named, scale: float) -> Named:
    scores = R.einsum("batch heads length memory", q, k) * scale
    probs = R.softmax(R.where(allowed, scores, MASKED), "memory")
    return R.einsum("batch heads length d_kv", probs, v)


def ref_block(ids, pad, table, scale, wqkv, wo, ln_scale, ln_bias, w_in, b_in, w_out, b_out, w2, b2):
    x = R.gather(table, ids, "vocab")
    h = x * R.rsqrt(R.reduce("mean", R.square(x), "d_model") + 1e-6) * scale
    q, k, v = R.unstack(R.einsum("qkv batch heads length d_kv", h, wqkv), "qkv")
    k, v = R.rename(k, "length", "memory"), R.rename(v, "length", "memory")
    n = SIZES["length"]
    causal = Named(np.arange(n)[:, None] >= np.arange(n)[None, :], "length memory")
    attended = ref_attention(q, k, v, R.logical_and(causal, pad), SIZES["d_kv"] ** -0.5)
    x = x + R.einsum("batch length d_model", attended, wo)
    c = x - R.reduce("mean", x, "d_model")
    h = c * R.rsqrt(R.reduce("mean", R.square(c), "d_model") + 1e-6) * ln_scale + ln_bias
    hidden = R.relu(R.einsum("batch length d_ff", h, w_in) + b_in)
    x = x + R.einsum("batch length d_model", hidden, w_out) + b_out
    split = R.reshape(x, [("batch", 4), ("length", 8), ("heads", 4), ("d_kv", 2)])
    return R.einsum("batch length vocab", x, table), R.einsum("batch length rows cols", split, w2) + b2, x


# ---- the attention kernel ----------------------------------------------------------------------


def _qkv(rng, b=2, t=6, s=6, n=4, h=8):
    q = rng.standard_normal((b, n, t, h)).astype(np.float32)
    k = rng.standard_normal((b, n, s, h)).astype(np.float32)
    v = rng.standard_normal((b, n, s, h)).astype(np.float32)
    return q, k, v


def test_attention_equals_jax_nn_dot_product_attention_on_global_arrays():
    """On global arrays md.nn.dot_product_attention equals jax.nn.dot_product_attention fed BTNH
    arrays: unmasked, causal, with a padding mask and both, queries and memory of different lengths."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, t=5, s=7)
    pad = np.arange(7)[None, :] < np.array([7, 4])[:, None]
    cases = [(False, None), (True, None), (True, pad), (False, pad)]

    @jax.jit
    def want(q, k, v):
        btnh = lambda a: jnp.transpose(a, (0, 2, 1, 3))  # noqa: E731
        return [
            btnh(
                jax.nn.dot_product_attention(
                    btnh(q), btnh(k), btnh(v), mask=None if m is None else m[:, None, None, :], is_causal=c
                )
            )
            for c, m in cases
        ]

    @jax.jit  # md ops on global arrays
    def got(q, k, v):
        return [
            md.nn.dot_product_attention(q, k, v, causal=c, mask=None if m is None else md.tensor(m, "batch memory"))
            for c, m in cases
        ]

    kv = "batch heads memory d_kv"
    for (c, m), w, g in zip(
        cases, want(q, k, v), got(md.tensor(q, "batch heads length d_kv"), md.tensor(k, kv), md.tensor(v, kv))
    ):
        assert g.names == ("batch", "heads", "length", "d_kv")
        harness.assert_values_close(g.numpy(), np.asarray(w), 1e-6, f"causal={c} mask={m is not None}")


def test_attention_runs_the_kernel_on_local_blocks(monkeypatch):
    """Under the spmd lowering the kernel sees each device's block: batch over data, heads over model."""
    seen = []
    kernel = jax.nn.dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape, k.shape, kwargs.get("is_causal")))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q, k, v = (
        md.tensor(a, n)
        for a, n in zip(
            _qkv(np.random.default_rng(2), b=4), ["batch heads length d_kv", *["batch heads memory d_kv"] * 2]
        )
    )
    fn = lambda q, k, v: md.nn.dot_product_attention(q, k, v, causal=True)  # noqa: E731
    report = md.explain(fn, harness.mesh("data4_model2"), "batch:data; heads:model", q, k, v)
    assert ((1, 6, 2, 8), (1, 6, 2, 8), True) in seen  # [B, T, N, H] of one device's block
    assert report.summary() == {}
    seen.clear()
    md.explain(fn, harness.mesh("data4_model2"), "batch:data; memory:model", q, k, v)
    assert all(
        q == (4, 6, 4, 8) for q, _, _ in seen
    )  # keys split: the einsum formulation, the kernel only on global arrays


def test_attention_errors():
    q, k, v = (
        md.tensor(a, n)
        for a, n in zip(_qkv(np.random.default_rng(3)), ["batch heads length d_kv", *["batch heads memory d_kv"] * 2])
    )
    with pytest.raises(md.ShapeError, match="distinct names"):
        md.nn.dot_product_attention(
            q, md.rename(k, "memory", "length"), md.rename(v, "memory", "length"), memory="length"
        )
    with pytest.raises(md.ShapeError, match="lacks dims"):
        md.nn.dot_product_attention(q, k, md.rename(v, "d_kv", "depth"))
    with pytest.raises(md.ShapeError, match="boolean"):
        md.nn.dot_product_attention(q, k, v, mask=md.ones([D("batch", 2), D("memory", 6)]))
    with pytest.raises(md.ShapeError, match="differ"):
        md.nn.dot_product_attention(q, md.slice(k, 0, 2, "heads"), md.slice(v, 0, 2, "heads"))


# ---- the MoE layer -----------------------------------------------------------------------------

MOE = md.nn.MoE(dim("d_model"), dim("d_ff"), dim("experts"), capacity_factor=1.0)
CAPACITY = 2  # ceil(1.0 * 8 tokens / 4 experts): some choices are dropped


def moe_layer(x, w_gate, w_in, w_out):
    return MOE({"w_gate": w_gate, "w_in": w_in, "w_out": w_out}, x)


def ref_moe(x, w_gate, w_in, w_out):
    """Each token's output computed directly: the sum over its kept choices of gate x its expert's FFN."""
    E = SIZES["experts"]
    probs = R.softmax(R.einsum("batch length experts_unsplit", x, w_gate), "experts_unsplit")
    gate, index = R.top_k(probs, "experts_unsplit", "top", 2)
    gate = gate / (R.reduce("sum", gate, "top") + 1e-9)
    choice = R.one_hot(index, "experts_unsplit", E, dtype=np.int32)
    # A choice's place in its expert's queue: earlier tokens' choices at the same rank, plus all
    # tokens' choices of that expert at better ranks.
    earlier = R.cumsum(choice, "length", exclusive=True)
    better = R.cumsum(R.reduce("sum", choice, "length"), "top", exclusive=True)
    place = R.reduce("sum", (earlier + better) * choice, "experts_unsplit")
    kept = R.cast(R.less(place, CAPACITY), gate.array.dtype)
    weight = R.einsum("batch length experts_unsplit", R.cast(choice, gate.array.dtype), kept * gate)
    w_in, w_out = R.rename(w_in, "experts", "experts_unsplit"), R.rename(w_out, "experts", "experts_unsplit")
    hidden = R.gelu(R.einsum("batch length experts_unsplit d_ff", x, w_in))
    every = R.einsum("batch length experts_unsplit d_model", hidden, w_out)
    y = R.einsum("batch length d_model", weight, every)
    first = R.one_hot(R.unstack(index, "top")[0], "experts_unsplit", E, dtype=gate.array.dtype)
    aux = R.reduce("sum", R.reduce("mean", first, "length") * R.reduce("mean", probs, "length"), "experts_unsplit") * E
    return y, aux


def test_moe_drops_past_capacity_and_switch_keeps_the_probability():
    """In the program of test_every_layer some choices are dropped (so capacity is tested) and some
    kept; top-1 routing (Switch) weighs a token by its probability, not a normalised 1."""
    switch = md.nn.MoE(dim("d_model"), dim("d_ff"), dim("experts"), top=1)

    @jax.jit  # on global arrays, one program (eagerly, every op would compile its own)
    def routes(args):
        _, _, x = block(*args[:2], *args[3:15])
        probs = md.softmax(MOE.router(args[15], x), "experts_unsplit")
        return probs, MOE.route(probs)[0], switch.route(probs)[1]

    probs, dispatch, combine = routes(_args())
    assert dispatch.names == ("batch", "length", "experts_unsplit", "expert_capacity")
    assert 0 < float(md.reduce_sum(dispatch).array) < 2 * 4 * 8
    kept = md.reduce_sum(combine, ["experts_unsplit", "expert_capacity"]).numpy()
    best = md.reduce_max(probs, "experts_unsplit").numpy()
    np.testing.assert_allclose(kept[kept > 0], best[kept > 0], rtol=1e-6)


# ---- convolutions and pooling ------------------------------------------------------------------

CONV1 = md.nn.Conv2d(D("channels", 2), D("hidden", 4), (3, 3), stride=(2, 2))
CONV2 = md.nn.Conv2d(D("hidden", 4), D("out", 2), (3, 3), padding="VALID", bias=False)


def convnet(x, k1, b1, k2):
    y = md.relu(CONV1({"kernel": k1, "bias": b1}, x))  # [batch, 8, 4, hidden]
    y = md.nn.max_pool(y, {"height": 2})  # height 4
    y = CONV2(k2, y)  # [batch, 2, 2, out]
    return md.nn.avg_pool(y, {"height": 3, "width": 3}, {"height": 1, "width": 1}, padding="SAME")


def _same_pads(size: int, window: int, stride: int, padding: str) -> tuple[int, int, int]:
    """(before, after, output rows): XLA's "SAME" puts the odd padding row after."""
    out = -(-size // stride) if padding == "SAME" else (size - window) // stride + 1
    total = max((out - 1) * stride + window - size, 0) if padding == "SAME" else 0
    return total // 2, total - total // 2, out


def ref_conv(x: Named, k: Named, stride: tuple[int, int], padding: str, out: str) -> Named:
    """``x[batch, height, width, c] * k[kh, kw, c, out]``: in numpy a zero-padded strided sum over
    kernel offsets; in jax.numpy (the gradient reference) ``lax.conv_general_dilated``."""
    c = x.names[-1]
    a, ka = x.to(["batch", "height", "width", c]).array, k.to(["kh", "kw", c, out]).array
    kh, kw = ka.shape[:2]
    (th, bh, mh), (tw, bw, mw) = (_same_pads(n, w, s, padding) for n, w, s in zip(a.shape[1:3], (kh, kw), stride))
    if R.xp_of(x, k) is jnp:
        y = jax.lax.conv_general_dilated(
            a, ka, stride, [(th, bh), (tw, bw)], dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    else:
        a = np.pad(a, ((0, 0), (th, bh), (tw, bw), (0, 0)))
        y = sum(
            a[:, u : u + (mh - 1) * stride[0] + 1 : stride[0], v : v + (mw - 1) * stride[1] + 1 : stride[1]] @ ka[u, v]
            for u in range(kh)
            for v in range(kw)
        )
    return Named(y, ["batch", "height", "width", out])


def ref_pool(x: Named, window: dict, stride: dict, padding: str, kind: str) -> Named:
    """Max, or mean over the entries inside the input, of every window: in numpy from strided
    slices of the padded input; in jax.numpy with ``lax.reduce_window``."""
    pads = [_same_pads(x.sizes[n], window.get(n, 1), stride.get(n, 1), padding)[:2] for n in x.names]
    dims, steps = [window.get(n, 1) for n in x.names], [stride.get(n, 1) for n in x.names]
    fill, np_op, lax_op = (-np.inf, np.maximum, jax.lax.max) if kind == "max" else (0.0, np.add, jax.lax.add)
    if R.xp_of(x) is jnp:
        pool = lambda a, f: jax.lax.reduce_window(a, f, lax_op, dims, steps, pads)  # noqa: E731
    else:

        def pool(a, f):
            a = np.pad(a, pads, constant_values=f)
            outs = [(a.shape[i] - d) // s + 1 for i, (d, s) in enumerate(zip(dims, steps))]
            parts = [
                a[tuple(slice(o, o + (m - 1) * s + 1, s) for o, m, s in zip(offset, outs, steps))]
                for offset in np.ndindex(*dims)
            ]
            return functools.reduce(np_op, parts)

    total = pool(x.array, fill)
    return Named(total if kind == "max" else total / pool(R.xp_of(x).ones(x.array.shape), 0.0), x.names)


def ref_convnet(x, k1, b1, k2):
    y = R.relu(ref_conv(x, k1, (2, 2), "SAME", "hidden") + b1)
    y = ref_pool(y, {"height": 2}, {"height": 2}, "VALID", "max")
    y = ref_conv(y, k2, (1, 1), "VALID", "out")
    return ref_pool(y, {"height": 3, "width": 3}, {"height": 1, "width": 1}, "SAME", "mean")


# ---- every layer, under several layouts ---------------------------------------------------------


def _every_layer(block_fn: Callable, moe_fn: Callable, conv_fn: Callable) -> Callable:
    """The program wiring every layer together, built of the md layers or of their references: one
    list of the 21 inputs (in :func:`_args`'s order) for both."""

    def run(
        ids,
        pad,
        image,
        table,
        scale,
        wqkv,
        wo,
        ln_scale,
        ln_bias,
        w_in,
        b_in,
        w_out,
        b_out,
        w2,
        b2,
        w_gate,
        e_in,
        e_out,
        k1,
        b1,
        k2,
    ):
        logits, proj, x = block_fn(
            ids, pad, table, scale, wqkv, wo, ln_scale, ln_bias, w_in, b_in, w_out, b_out, w2, b2
        )
        return logits, proj, *moe_fn(x, w_gate, e_in, e_out), conv_fn(image, k1, b1, k2)

    return run


every_layer = _every_layer(block, moe_layer, convnet)
ref_every_layer = _every_layer(ref_block, ref_moe, ref_convnet)


def _args(seed: int = 0) -> list[md.Tensor]:
    rng = np.random.default_rng(seed)
    b, n = SIZES["batch"], SIZES["length"]
    ids = harness.from_numpy(rng.integers(0, SIZES["vocab"], (b, n)).astype(np.int32), [dim("batch"), dim("length")])
    lengths = np.array([8, 5, 3, 7])  # padding at the end; position 0 is always real
    pad = harness.from_numpy(np.arange(n)[None, :] < lengths[:, None], [dim("batch"), D("memory", n)])
    r = functools.partial(harness.rand, rng)
    return [
        ids,
        pad,
        r({"batch": 4, "height": 16, "width": 8, "channels": 2}),
        # the Transformer block
        r({"vocab": 16, "d_model": 8}),
        r({"d_model": 8}, "positive"),
        r({"d_model": 8, "qkv": 3, "heads": 4, "d_kv": 2}) * 0.5,
        r({"heads": 4, "d_kv": 2, "d_model": 8}) * 0.4,
        r({"d_model": 8}, "positive"),
        r({"d_model": 8}),
        r({"d_model": 8, "d_ff": 8}) * 0.4,
        r({"d_ff": 8}),
        r({"d_ff": 8, "d_model": 8}) * 0.4,
        r({"d_model": 8}),
        r({"heads": 4, "d_kv": 2, "rows": 3, "cols": 2}) * 0.3,
        r({"rows": 3, "cols": 2}),
        # the MoE layer
        r({"d_model": 8, "experts_unsplit": 4}),
        r({"experts": 4, "d_model": 8, "d_ff": 8}) * 0.4,
        r({"experts": 4, "d_ff": 8, "d_model": 8}) * 0.4,
        # the convolutions
        r({"kh": 3, "kw": 3, "channels": 2, "hidden": 4}) * 0.4,
        r({"hidden": 4}),
        r({"kh": 3, "kw": 3, "hidden": 4, "out": 2}) * 0.4,
    ]


LAYOUTS = {
    # Data parallel; d_kv gathered for the attention kernel; Megatron feed-forwards (the MLP's and
    # the experts' hidden width) and vocab; the first convolution's output channels split.
    "data_dkv_megatron": ("data4_model2", "batch:data; groups:data; d_kv:model; d_ff:model; vocab:model; hidden:model"),
    # Expert parallel (all_to_all dispatch and combine); Megatron heads; queries split (the causal
    # mask at each block's offset, the MoE's cumsum over a split length); the image split in bands:
    # a stride-2 halo, pooling within blocks, "VALID" 3x3 windows drifting across blocks
    # (gathered), a "SAME" halo each way.
    "experts_heads_queries_spatial": ("a2_b2_c2", "batch:a; experts:a; length:b; height:b; heads:c"),
    # Keys split: the einsum formulation of attention; the vocab-parallel lookup over an axis
    # tuple; the router over split experts (softmax, top_k, one_hot into the split dim); a split
    # convolution input (pending psum) and output channels.
    "memory_vocab_tuple_router_channels": (
        "data4_model2",
        "memory:model; vocab:(model, data); experts_unsplit:model; channels:model; out:model",
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layer(name):
    mesh_name, rules = LAYOUTS[name]
    assert harness.check(every_layer, _args(), ref_every_layer, harness.mesh(mesh_name), rules)


# ---- parameters --------------------------------------------------------------------------------


def test_init_shapes_scales_and_stacks():
    """Parameters are named and stacked in front (shapes from jax.eval_shape), and scaled as documented."""
    key = jax.random.key(0)
    L = D("layers", 3)
    shapes = jax.eval_shape(
        lambda k: {"mha": MHA.init(k, [L]), "moe": MOE.init(k, [L]), "ffn": FFN.init(k), "conv": CONV2.init(k, [L])},
        key,
    )
    names = jax.tree_util.tree_map(lambda t: t.names, shapes, is_leaf=lambda t: isinstance(t, md.Tensor))
    assert names == {
        "mha": {"wqkv": ("layers", "d_model", "qkv", "heads", "d_kv"), "wo": ("layers", "heads", "d_kv", "d_model")},
        "moe": {
            "w_gate": ("layers", "d_model", "experts_unsplit"),
            "w_in": ("layers", "experts", "d_model", "d_ff"),
            "w_out": ("layers", "experts", "d_ff", "d_model"),
        },
        "ffn": {
            "w_in": {"kernel": ("d_model", "d_ff"), "bias": ("d_ff",)},
            "w_out": {"kernel": ("d_ff", "d_model"), "bias": ("d_model",)},
        },
        "conv": ("layers", "kh", "kw", "hidden", "out"),
    }
    p = jax.jit(
        lambda k: (
            md.nn.Linear(D("a", 256), [D("b", 64), D("c", 4)], init_scale=2.0).init(k),
            LN.init(None),
            RMS.init(None),
        )
    )(key)
    np.testing.assert_allclose(np.std(p[0].numpy()), 2.0 / 16, rtol=0.03)  # init_scale / sqrt(fan_in)
    assert p[1]["scale"].numpy().tolist() == [1.0] * 8 and not p[1]["bias"].numpy().any()
    assert isinstance(p[2], md.Tensor) and p[2].numpy().tolist() == [1.0] * 8


def test_layer_errors_name_the_layer():
    x = md.zeros([D("batch", 2), D("d_model", 8)])
    with pytest.raises(md.ShapeError, match="Linear: input .* needs the input dim d_ff=8"):
        jax.eval_shape(md.nn.Linear(dim("d_ff"), dim("d_model")), md.zeros([dim("d_ff"), dim("d_model")]), x)
    with pytest.raises(md.ShapeError, match="distinct names"):
        md.nn.Linear(dim("d_model"), dim("d_model"))
    with pytest.raises(md.ShapeError, match="md.Dim"):
        md.nn.RMSNorm("d_model")
    with pytest.raises(md.ShapeError, match="Linear outputs: expected an md.Dim .* got 8"):
        md.nn.Linear(dim("d_model"), 8)
    with pytest.raises(md.ShapeError, match="MoE: input"):
        jax.eval_shape(MOE, jax.eval_shape(MOE.init, jax.random.key(0)), x)
    with pytest.raises(ValueError, match="dropout rate"):
        md.nn.dropout(None, x, 1.0, deterministic=True)


def test_dropout_deterministic_and_layout_free():
    x = md.ones([D("batch", 8), D("d", 16)])
    assert md.nn.dropout(None, x, 0.5, deterministic=True) is x
    key = jax.random.key(3)
    whole = jax.jit(md.nn.dropout, static_argnums=2)(key, x, 0.25).numpy()  # on global arrays
    assert set(np.unique(whole)) == {0.0, np.float32(1 / 0.75)} and 0.1 < np.mean(whole == 0) < 0.4
    split = md.compile(lambda k, x: md.nn.dropout(k, x, 0.25), harness.mesh("x8"), "batch:x")(key, x)
    np.testing.assert_array_equal(split.numpy(), whole)


def test_every_md_nn_name_is_in_the_api_docs():
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [n for n in md.nn.__all__ if f"md.nn.{n}" not in text]
    assert not missing, f"docs/api.md does not mention md.nn.{missing}"
