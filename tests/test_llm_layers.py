"""The LLM pieces of md.nn and their ops against independent references, under several layouts, on both backends.

One harness program strings them together (compiles are the cost): ``md.sin``, ``md.cos``,
``md.erf``, ``md.silu`` and ``md.map``; a LLaMA block (RMSNorm, grouped-query causal attention
with rotate-half rotary embeddings, a SwiGLU ``GatedMLP``); a GPT-2-style block (a learned
``PositionEmbedding``, biased attention with interleaved rotary embeddings and a padding mask,
a GeGLU with biases); multi-query attention straight through ``md.nn.dot_product_attention``.
``harness.check`` runs it on spmd and gspmd under each layout of :data:`LAYOUTS` against the
reference written here in numpy / jax.numpy from the layers' definitions (rotary tables from
``theta ** (-2i / d)``, the rotation by slicing halves or even/odd entries), with the gradient of
every input inside and around ``md.compile``, and md.explain against the compiled program.
"""

from __future__ import annotations

import collections

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as R
import scipy.special
from reference import Named

import meshdsl as md

D = md.Dim
SIZES = dict(batch=4, length=8, d_model=8, kv_heads=2, heads=2, d_kv=8, d_ff=8, one_kv=1, qkv=3)
MASKED = -0.7 * float(np.finfo(np.float32).max)
THETA = 500.0


def dim(name: str) -> md.Dim:
    return D(name, SIZES[name])


RMS = md.nn.RMSNorm(dim("d_model"))
GQA = md.nn.MultiHeadAttention(
    dim("d_model"),
    dim("heads"),
    dim("d_kv"),
    kv_heads=dim("kv_heads"),
    causal=True,
    rotary=md.nn.Rotary(dim("d_kv"), theta=THETA),
)
SWIGLU = md.nn.GatedMLP(dim("d_model"), dim("d_ff"))
POS = md.nn.PositionEmbedding(D("positions", 8), dim("d_model"))
BIASED = md.nn.MultiHeadAttention(
    dim("d_model"),
    dim("heads"),
    dim("d_kv"),
    bias=True,
    rotary=md.nn.Rotary(dim("d_kv"), theta=THETA, interleaved=True),
)
GEGLU = md.nn.GatedMLP(dim("d_model"), dim("d_ff"), activation=md.gelu, bias=True)


def ops(y, z):
    return {
        "sin": md.sin(y),
        "cos": md.cos(y),
        "erf": md.erf(y),
        "silu": md.silu(y),
        "swish": md.swish(z),
        "map": md.map(lambda a, b: a * jnp.cos(b) + 1.0, y, z),
    }


INPUTS = (
    "y z x pad scale wq wkv wo w_gate w_in w_out table wqkv bqkv wo2 bo2 "
    "g_gate gb_gate g_in gb_in g_out gb_out mq mk mv"
).split()
Inputs = collections.namedtuple("Inputs", INPUTS)
"""The program's inputs by name, in :func:`_args`'s order: one list for the program and its reference."""


def program(*args: md.Tensor):
    a = Inputs(*args)
    h = a.x + GQA({"wq": a.wq, "wkv": a.wkv, "wo": a.wo}, RMS(a.scale, a.x))
    h = h + SWIGLU({"w_gate": a.w_gate, "w_in": a.w_in, "w_out": a.w_out}, RMS(a.scale, h))
    g = POS(a.table, a.x)
    g = g + BIASED({"wqkv": {"kernel": a.wqkv, "bias": a.bqkv}, "wo": {"kernel": a.wo2, "bias": a.bo2}}, g, mask=a.pad)
    g = g + GEGLU(
        {
            "w_gate": {"kernel": a.g_gate, "bias": a.gb_gate},
            "w_in": {"kernel": a.g_in, "bias": a.gb_in},
            "w_out": {"kernel": a.g_out, "bias": a.gb_out},
        },
        g,
    )
    mqa = md.nn.dot_product_attention(a.mq, a.mk, a.mv, heads="one_kv", causal=True)
    return ops(a.y, a.z), h, g, mqa


# ---- the reference -------------------------------------------------------------------------------


def ref_rotary(x: Named, interleaved: bool) -> Named:
    """RoPE written from its definition: angles ``p * THETA ** (-2i / d)``, pairs by halves or by even/odd."""
    xp = R.xp_of(x)
    names = [n for n in x.names if n not in ("length", "d_kv")] + ["length", "d_kv"]
    a = x.to(names).array
    d = a.shape[-1]
    angles = np.arange(a.shape[-2])[:, None] * THETA ** (-2.0 * np.arange(d // 2) / d)[None, :]
    c, s = np.cos(angles), np.sin(angles)
    if interleaved:
        first, second = a[..., 0::2], a[..., 1::2]
        out = xp.stack([first * c - second * s, second * c + first * s], axis=-1).reshape(a.shape)
    else:
        first, second = a[..., : d // 2], a[..., d // 2 :]
        out = xp.concatenate([first * c - second * s, second * c + first * s], axis=-1)
    return Named(out, names).to(x.names)


def ref_rms(x: Named, scale: Named) -> Named:
    return x * R.rsqrt(R.reduce("mean", R.square(x), "d_model") + 1e-6) * scale


def ref_attend(q: Named, k: Named, v: Named, heads: list[str], allowed: Named) -> Named:
    scores = R.einsum(["batch", *heads, "length", "memory"], q, k) * SIZES["d_kv"] ** -0.5
    probs = R.softmax(R.where(allowed, scores, MASKED), "memory")
    return R.einsum(["batch", *heads, "length", "d_kv"], probs, v)


def causal() -> Named:
    n = SIZES["length"]
    return Named(np.arange(n)[:, None] >= np.arange(n)[None, :], "length memory")


def silu(x: Named) -> Named:
    return x * R.sigmoid(x)


def ref_ops(y, z):
    erf = R.lift(lambda xp, a: jax.scipy.special.erf(a) if xp is jnp else scipy.special.erf(a))
    return {
        "sin": R.lift(lambda xp, a: xp.sin(a))(y),
        "cos": R.lift(lambda xp, a: xp.cos(a))(y),
        "erf": erf(y),
        "silu": silu(y),
        "swish": silu(z),
        "map": y * R.lift(lambda xp, a: xp.cos(a))(z) + 1.0,
    }


def ref_program(*args: Named):
    a = Inputs(*args)
    n = ref_rms(a.x, a.scale)
    q = ref_rotary(R.einsum("batch kv_heads heads length d_kv", n, a.wq), False)
    k, v = R.unstack(R.einsum("kv batch kv_heads length d_kv", n, a.wkv), "kv")
    k, v = R.rename(ref_rotary(k, False), "length", "memory"), R.rename(v, "length", "memory")
    h = a.x + R.einsum("batch length d_model", ref_attend(q, k, v, ["kv_heads", "heads"], causal()), a.wo)
    n = ref_rms(h, a.scale)
    gated = silu(R.einsum("batch length d_ff", n, a.w_gate)) * R.einsum("batch length d_ff", n, a.w_in)
    h = h + R.einsum("batch length d_model", gated, a.w_out)

    g = a.x + R.rename(a.table, "positions", "length")
    qkv = R.einsum("qkv batch heads length d_kv", g, a.wqkv) + a.bqkv
    q, k, v = R.unstack(qkv, "qkv")
    q, k = ref_rotary(q, True), R.rename(ref_rotary(k, True), "length", "memory")
    attended = ref_attend(q, k, R.rename(v, "length", "memory"), ["heads"], a.pad)
    g = g + R.einsum("batch length d_model", attended, a.wo2) + a.bo2
    gate = R.gelu(R.einsum("batch length d_ff", g, a.g_gate) + a.gb_gate)
    g = (
        g
        + R.einsum("batch length d_model", gate * (R.einsum("batch length d_ff", g, a.g_in) + a.gb_in), a.g_out)
        + a.gb_out
    )

    mqa = ref_attend(a.mq, a.mk, a.mv, ["one_kv", "heads"], causal())
    return ref_ops(a.y, a.z), h, g, mqa.to(a.mq.names)


def _args() -> list[md.Tensor]:
    rng = np.random.default_rng(23)

    def r(spec, scale=1.0):
        return md.tensor(np.asarray(rng.standard_normal(list(spec.values())) * scale, np.float32), list(spec))

    pad = np.arange(SIZES["length"])[None, :] < np.array([8, 5, 3, 8])[:, None]
    s = SIZES
    w = 0.4
    return [
        r({"batch": 4, "d_ff": 8}),
        r({"d_ff": 8, "d_model": 8}),
        r({"batch": 4, "length": 8, "d_model": 8}),
        md.tensor(pad, "batch memory"),
        r({"d_model": 8}) * 0.2 + 1.0,
        r({"d_model": s["d_model"], "kv_heads": 2, "heads": 2, "d_kv": 8}, w),
        r({"d_model": 8, "kv": 2, "kv_heads": 2, "d_kv": 8}, w),
        r({"kv_heads": 2, "heads": 2, "d_kv": 8, "d_model": 8}, w),
        r({"d_model": 8, "d_ff": 8}, w),
        r({"d_model": 8, "d_ff": 8}, w),
        r({"d_ff": 8, "d_model": 8}, w),
        r({"positions": 8, "d_model": 8}, 0.3),
        r({"d_model": 8, "qkv": 3, "heads": 2, "d_kv": 8}, w),
        r({"qkv": 3, "heads": 2, "d_kv": 8}, 0.1),
        r({"heads": 2, "d_kv": 8, "d_model": 8}, w),
        r({"d_model": 8}, 0.1),
        r({"d_model": 8, "d_ff": 8}, w),
        r({"d_ff": 8}, 0.1),
        r({"d_model": 8, "d_ff": 8}, w),
        r({"d_ff": 8}, 0.1),
        r({"d_ff": 8, "d_model": 8}, w),
        r({"d_model": 8}, 0.1),
        r({"batch": 4, "one_kv": 1, "heads": 2, "length": 8, "d_kv": 8}),
        r({"batch": 4, "one_kv": 1, "memory": 8, "d_kv": 8}),
        r({"batch": 4, "one_kv": 1, "memory": 8, "d_kv": 8}),
    ]


LAYOUTS = {
    # Rotate-half rotary under a split d_kv (model=4: each device holds 2 of the 8 entries, the
    # halves live on different devices), data parallel, Megatron feed-forward.
    "dkv_model4": ("data2_model4", "batch:data; d_kv:model; d_ff:model"),
    # Megatron grouped-query attention: key/value heads split (each device its kv heads' queries).
    "kv_heads_megatron": ("data4_model2", "batch:data; kv_heads:model; d_ff:model"),
    # The query group split (keys whole on each device); queries and positions split along length
    # (causal mask and rotary angles at each block's offset).
    "group_and_length": ("a2_b2_c2", "batch:a; heads:b; length:c; positions:c"),
    # Keys split (the einsum formulation, with query groups); parameters split along d_model.
    "memory_and_d_model": ("data4_model2", "memory:model; d_model:data"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llm_layers(name):
    """Values and gradients on both backends under each layout; the gradient taken around md.compile
    (a third more compiling) under every other layout."""
    mesh_name, rules = LAYOUTS[name]
    around = list(LAYOUTS).index(name) % 2 == 0
    assert harness.check(program, _args(), ref_program, harness.mesh(mesh_name), rules, around=around)


def test_grouped_query_attention_runs_the_fused_kernel_with_fewer_kv_heads(monkeypatch):
    """The kernel gets each device's queries with kv_heads x group heads and keys with kv_heads: no copies."""
    seen = []
    kernel = jax.nn.dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape, k.shape, kwargs.get("implementation")))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    args = _args()[-3:]
    q = md.concat([args[0]] * 4, "heads")  # [batch, one_kv=1, heads=8, length, d_kv]

    def fn(q, k, v):
        return md.nn.dot_product_attention(q, k, v, heads="one_kv", causal=True, implementation="xla")

    assert md.explain(fn, harness.mesh("data4_model2"), "batch:data; heads:model", q, *args[1:]).summary() == {}
    assert ((1, 8, 4, 8), (1, 8, 1, 8), "xla") in seen  # [B, T, N, H]: 4 of the 8 query heads, the one kv head
    seen.clear()
    kv = lambda x: md.concat([x] * 2, "one_kv")  # noqa: E731  (2 kv heads, split over model)
    rules = "batch:data; one_kv:model"
    md.explain(fn, harness.mesh("data4_model2"), rules, md.concat([q] * 2, "one_kv"), kv(args[1]), kv(args[2]))
    assert ((1, 8, 8, 8), (1, 8, 1, 8), "xla") in seen


def test_layer_mistakes_are_named():
    x = md.zeros([dim("batch"), dim("length"), dim("d_model")])
    with pytest.raises(md.ShapeError, match="Rotary: depth must be an md.Dim of even size"):
        md.nn.Rotary(D("d_kv", 5))
    with pytest.raises(md.ShapeError, match="Rotary: input .* needs the depth dim d_kv=8"):
        md.nn.Rotary(dim("d_kv"))(x)
    with pytest.raises(md.ShapeError, match="rotary over .* must be over this layer's"):
        md.nn.MultiHeadAttention(dim("d_model"), dim("heads"), dim("d_kv"), rotary=md.nn.Rotary(D("d_kv", 4)))
    with pytest.raises(md.ShapeError, match=r"positions 4..11 of .* are outside the table's positions=8"):
        POS(md.zeros([D("positions", 8), dim("d_model")]), x, offset=4)
    with pytest.raises(md.ShapeError, match="map: sum turned blocks of shape .* into"):
        md.map(jnp.sum, x)
    with pytest.raises(md.ShapeError, match="must be callable"):
        md.map(3, x)
    with pytest.raises(md.ShapeError, match="differ in dims other than length and memory"):
        q = md.zeros([dim("batch"), dim("kv_heads"), dim("heads"), dim("length"), dim("d_kv")])
        k = md.zeros([dim("batch"), D("kv_heads", 3), D("memory", 8), dim("d_kv")])
        md.nn.dot_product_attention(q, k, k, heads="kv_heads")
    with pytest.raises(md.ConfigError, match="GatedMLP: activation must be a function of an md tensor"):
        md.nn.GatedMLP(dim("d_model"), dim("d_ff"), activation="silu")
    gated = md.nn.GatedMLP(dim("d_model"), dim("d_ff"))
    tokens = md.zeros([dim("batch"), dim("d_model")], dtype=jnp.int32)
    with pytest.raises(md.ShapeError, match="GatedMLP"):
        gated(gated.init(jax.random.key(0)), tokens)


def test_rotary_offset_and_positions_on_global_arrays():
    """Rotating the last 5 of 8 positions with ``offset=3`` or ``positions=3..7`` is the same as
    rotating all 8 and keeping the last 5; both conventions equal the reference."""
    x = _args()[2]  # [batch, length=8, d_model=8]: d_model as the depth here
    rope = {flag: md.nn.Rotary(dim("d_model"), theta=THETA, interleaved=flag) for flag in (False, True)}
    tail = md.slice(x, 3, 5, "length")
    positions = md.range(D("length", 5)) + 3
    for interleaved, layer in rope.items():
        whole = layer(x).numpy()
        want = ref_rotary(Named(x.numpy().astype(np.float64), ("batch", "length", "d_kv")), interleaved).array
        harness.assert_values_close(whole, want, 1e-5, f"interleaved={interleaved}")
        harness.assert_values_close(layer(tail, offset=3).numpy(), whole[:, 3:], 1e-6, "offset")
        harness.assert_values_close(layer(tail, positions=positions).numpy(), whole[:, 3:], 1e-6, "positions")


def test_grouped_query_mask_over_query_groups():
    """A mask over the query group (and batch, memory) on the fused path equals the reference."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 3, 4, 8)).astype(np.float32)  # [batch, kv_heads, heads, length, d_kv]
    k, v = (rng.standard_normal((2, 2, 6, 8)).astype(np.float32) for _ in range(2))  # [batch, kv_heads, memory, d_kv]
    mask = rng.random((2, 3, 6)) < 0.7
    mask[..., 0] = True  # every query sees something
    kv = "batch kv_heads memory d_kv"
    queries = md.tensor(q, "batch kv_heads heads length d_kv")
    got = md.nn.dot_product_attention(
        queries, md.tensor(k, kv), md.tensor(v, kv), heads="kv_heads", mask=md.tensor(mask, "batch heads memory")
    )
    scores = np.einsum("bkgtd,bksd->bkgts", q, k) / np.sqrt(8)
    scores = np.where(mask[:, None, :, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bkgts,bksd->bkgtd", probs / probs.sum(-1, keepdims=True), v)
    harness.assert_values_close(got.numpy(), want, 1e-5, "grouped-query attention with a group mask")
