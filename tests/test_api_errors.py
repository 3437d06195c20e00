"""Bad inputs to the public API: each raises an md error (ShapeError, LayoutError, ConfigError) in
one line that names the offending argument or thing and the numbers, never a raw JAX or Python
traceback, and nothing is silently accepted (a float one_hot index, a float where condition).

Each case is ``(md error class, call, strings the message must contain)``; a call runs eagerly
unless it builds a compiled function itself.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

D = md.Dim
X = md.tensor(np.arange(32, dtype=np.float32).reshape(4, 8), [D("a", 4), D("b", 8)])
A4 = md.tensor(np.arange(4, dtype=np.float32), [D("a", 4)])
IDX = md.tensor(np.arange(4, dtype=np.int32), [D("a", 4)])
COND = md.tensor(np.arange(8) % 2 == 0, [D("b", 8)])
KEY = jax.random.key(0)


def mesh2() -> md.Mesh:
    return md.Mesh({"x": 2})


def reduce_a(t):
    return md.reduce_sum(t, "a")


def compiled(fn, layout="a:x", **kwargs):
    return md.compile(fn, mesh2(), layout, **kwargs)


def explain_while_loop():
    def fn(t):
        def body(c):
            return c[0] + 1, c[1] + reduce_a(t)

        return jax.lax.while_loop(lambda c: c[0] < reduce_a(t).array.sum(), body, (0.0, md.zeros([D("b", 8)])))[1]

    return md.explain(fn, mesh2(), "a:x", X)


def scan_changing_carry():
    xs = md.tensor(np.ones((3, 4), np.float32), [D("steps", 3), D("a", 4)])
    return md.scan(lambda c, x: (md.reduce_sum(c * x), None), md.zeros([D("a", 4)]), xs, "steps")


def scan_not_a_pair():
    xs = md.tensor(np.ones((3, 4), np.float32), [D("steps", 3), D("a", 4)])
    return md.scan(lambda c, x: c + x, md.zeros([D("a", 4)]), xs, "steps")


CASES = {
    # ---- meshes ----
    "mesh size --1": (md.LayoutError, lambda: md.Mesh("data=--1"), ["data=--1"]),
    "mesh size 4x": (md.LayoutError, lambda: md.Mesh("data=4x model=2"), ["data=4x"]),
    "mesh without sizes": (md.LayoutError, lambda: md.Mesh("data model"), ["'data'"]),
    "mesh of an int": (md.LayoutError, lambda: md.Mesh(8), ["int", "8"]),
    "mesh size 0": (md.LayoutError, lambda: md.Mesh({"data": 0}), ["data", "0"]),
    "mesh size float": (md.LayoutError, lambda: md.Mesh({"data": 2.0}), ["data", "2.0"]),
    "mesh too large": (md.LayoutError, lambda: md.Mesh({"data": 16}), ["16 devices", "8"]),
    "mesh axis name": (md.LayoutError, lambda: md.Mesh({"1d": 2}), ["'1d'"]),
    "mesh repeated axis": (md.LayoutError, lambda: md.Mesh("a=2 a=2"), ["'a'"]),
    "mesh two wildcards": (md.LayoutError, lambda: md.Mesh("a=-1 b=-1"), ["a, b"]),
    # ---- dims and tensors ----
    "dim negative size": (md.ShapeError, lambda: D("a", -2), ["'a'", "-2"]),
    "dim float size": (md.ShapeError, lambda: D("a", 2.5), ["'a'", "2.5"]),
    "dim name with a space": (md.ShapeError, lambda: D("a b", 2), ["'a b'"]),
    "tensor dim size mismatch": (md.ShapeError, lambda: md.tensor(np.ones(3), [D("a", 4)]), ["a=4", "3"]),
    "tensor rank mismatch": (md.ShapeError, lambda: md.tensor(np.ones((2, 3)), "a"), ["(2, 3)", "1 dims"]),
    "tensor dims not names": (md.ShapeError, lambda: md.tensor(np.ones(3), 5), ["dims", "5"]),
    "tensor of a string": (md.ShapeError, lambda: md.tensor("abc", "a"), ["'abc'", "str"]),
    "tensor repeated names": (md.ShapeError, lambda: md.tensor(np.ones((2, 2)), "a a"), ["a"]),
    # ---- element-wise ----
    "add a string": (md.ShapeError, lambda: X + "a", ["add", "'a'", "str"]),
    "multiply by None": (md.ShapeError, lambda: X * None, ["multiply", "None"]),
    "add an unnamed array": (md.ShapeError, lambda: X + np.ones(8), ["add", "(8,)"]),
    "add mismatched sizes": (md.ShapeError, lambda: X + md.tensor(np.ones(5), "b"), ["add", "b", "8", "5"]),
    "cast to an unknown dtype": (md.ShapeError, lambda: md.cast(X, "foo"), ["cast", "'foo'"]),
    "where with a float condition": (md.ShapeError, lambda: md.where(A4, X, 0.0), ["where", "condition", "float32"]),
    "where with a string branch": (md.ShapeError, lambda: md.where(COND, X, "zero"), ["where", "'zero'"]),
    "exp of a string": (md.ShapeError, lambda: md.exp("e"), ["exp", "'e'"]),
    # ---- reductions ----
    "reduce an array": (
        md.ShapeError,
        lambda: md.reduce_sum(np.ones((4, 8), np.float32), "a"),
        ["reduce_sum", "md tensor", "float32[4, 8]"],
    ),
    "reduce an unknown dim": (md.ShapeError, lambda: md.reduce_sum(X, "c"), ["reduce_sum", "'c'", "[a=4, b=8]"]),
    "reduce a dim of another size": (md.ShapeError, lambda: md.reduce_max(X, D("a", 5)), ["a=5", "a=4"]),
    "reduce over an int": (md.ShapeError, lambda: md.reduce_mean(X, 5), ["reduce_mean", "dims", "int 5"]),
    "softmax over None": (md.ShapeError, lambda: md.softmax(X, None), ["softmax", "dims", "None"]),
    "log_softmax over None": (md.ShapeError, lambda: md.log_softmax(X, None), ["log_softmax", "dims", "None"]),
    "truth value of a tensor": (md.ShapeError, lambda: bool(X > 0), ["truth value", "[a=4, b=8]"]),
    "reduce a dim twice": (md.ShapeError, lambda: md.reduce_sum(X, ["a", "a"]), ["reduce_sum", "'a'", "twice"]),
    "softmax over an unknown dim": (md.ShapeError, lambda: md.softmax(X, "c"), ["softmax", "'c'"]),
    "logsumexp of an array": (md.ShapeError, lambda: md.logsumexp(jnp.ones(3), "a"), ["logsumexp", "float32[3]"]),
    # ---- einsum, reshapes ----
    "einsum output repeats a dim": (md.ShapeError, lambda: md.einsum(X, out="a a"), ["einsum", "a"]),
    "einsum out an int": (md.ShapeError, lambda: md.einsum(X, out=5), ["einsum", "out", "int 5"]),
    "einsum of an array": (md.ShapeError, lambda: md.einsum(X, np.ones(3)), ["einsum", "input 1", "float64[3]"]),
    "reshape to another size": (md.ShapeError, lambda: md.reshape(X, [D("c", 5)]), ["32", "5"]),
    "rename an unknown dim": (md.ShapeError, lambda: md.rename(X, "zz", "c"), ["rename", "'zz'"]),
    "transpose to other dims": (md.ShapeError, lambda: md.transpose(X, "a"), ["transpose", "a=4, b=8"]),
    "rearrange cannot split": (
        md.ShapeError,
        lambda: md.rearrange(X, "(x y) b -> x y b", x=3),
        ["rearrange", "a=4", "3"],
    ),
    # ---- cuts and joins ----
    "concat of one tensor": (md.ShapeError, lambda: md.concat(X, "a"), ["concat", "list", "[a=4, b=8]"]),
    "concat along a dim of another size": (
        md.ShapeError,
        lambda: md.concat([X, X], D("a", 3)),
        ["concat", "a=3", "a=4"],
    ),
    "stack under an existing name": (md.ShapeError, lambda: md.stack([X, X], "a"), ["stack", "a"]),
    "slice by a fraction": (md.ShapeError, lambda: md.slice(X, 0.5, 2, "a"), ["slice", "0.5"]),
    "concat mismatched": (
        md.ShapeError,
        lambda: md.concat([X, md.tensor(np.ones((4, 2)), "a c")], "a"),
        ["concat", "c=2", "b=8"],
    ),
    "slice out of range": (md.ShapeError, lambda: md.slice(X, 3, 4, "a"), ["slice", "3", "4", "a=4"]),
    "slice negative begin": (md.ShapeError, lambda: md.slice(X, -1, 2, "a"), ["slice", "-1", "a=4"]),
    "pad negative": (md.ShapeError, lambda: md.pad(X, [-1, 0], "a"), ["pad", "[-1, 0]"]),
    "pad with one number": (md.ShapeError, lambda: md.pad(X, 2, "a"), ["pad", "paddings", "2"]),
    "split into unequal parts": (md.ShapeError, lambda: md.split(X, "a", 3), ["split", "a=4", "3"]),
    "stack mismatched": (md.ShapeError, lambda: md.stack([X, A4], "n"), ["stack", "[a=4]", "[a=4, b=8]"]),
    # ---- index ops ----
    "one_hot of float indices": (md.ShapeError, lambda: md.one_hot(A4, D("c", 4)), ["one_hot", "float32"]),
    "one_hot into a name": (md.ShapeError, lambda: md.one_hot(IDX, "c"), ["one_hot", "output_dim", "'c'"]),
    "top_k into a name": (md.ShapeError, lambda: md.top_k(X, "b", "k"), ["top_k", "k_dim", "'k'"]),
    "top_k too many": (md.ShapeError, lambda: md.top_k(X, "b", D("k", 9)), ["top_k", "k=9", "b=8"]),
    "gather float indices": (md.ShapeError, lambda: md.gather(X, A4, "b"), ["gather", "float32"]),
    "gather an unknown dim": (md.ShapeError, lambda: md.gather(X, IDX, "c"), ["gather", "'c'"]),
    "top_k over a dim of another size": (
        md.ShapeError,
        lambda: md.top_k(X, D("b", 5), D("k", 2)),
        ["top_k", "b=5", "b=8"],
    ),
    "gather along a dim of another size": (
        md.ShapeError,
        lambda: md.gather(X, IDX, D("b", 5)),
        ["gather", "b=5", "b=8"],
    ),
    "cumsum along a dim of another size": (md.ShapeError, lambda: md.cumsum(X, D("a", 3)), ["cumsum", "a=3", "a=4"]),
    "one_hot of an unknown dtype": (
        md.ShapeError,
        lambda: md.one_hot(IDX, D("c", 4), dtype="foo"),
        ["one_hot", "'foo'"],
    ),
    "shift by a fraction": (md.ShapeError, lambda: md.shift(X, 1.5, "a"), ["shift", "1.5"]),
    "range of a name": (md.ShapeError, lambda: md.range("a"), ["range", "'a'"]),
    "cumsum of an array": (md.ShapeError, lambda: md.cumsum(np.ones(3), "a"), ["cumsum", "float64[3]"]),
    # ---- creation and random ----
    "zeros of an unknown dtype": (md.ShapeError, lambda: md.zeros([D("a", 2)], dtype="foo"), ["zeros", "'foo'"]),
    "full of a string": (md.ShapeError, lambda: md.full([D("a", 2)], "x"), ["full", "'x'"]),
    "zeros of names": (md.ShapeError, lambda: md.zeros("a b"), ["'a b'", "md.Dim"]),
    "random with an int key": (md.ShapeError, lambda: md.random.normal(123, [D("a", 2)]), ["random", "key", "int"]),
    "uniform of an unknown dtype": (
        md.ShapeError,
        lambda: md.random.uniform(KEY, [D("a", 2)], dtype="foo"),
        ["uniform", "'foo'"],
    ),
    "dropout noise over another dim": (
        md.ShapeError,
        lambda: md.dropout(KEY, X, 0.5, noise_shape=[D("c", 3)]),
        ["dropout", "'c'", "[a=4, b=8]"],
    ),
    "full of an int shape": (md.ShapeError, lambda: md.full(5, 1.0), ["shape", "int 5"]),
    "dropout rate above 1": (md.ConfigError, lambda: md.dropout(KEY, X, 1.5), ["dropout", "1.5"]),
    # ---- compile and compiled functions ----
    "compile on a mesh string": (
        md.ConfigError,
        lambda: md.compile(reduce_a, "x=2", "a:x"),
        ["mesh", "'x=2'", "md.Mesh"],
    ),
    "compile with an unknown backend": (
        md.ConfigError,
        lambda: compiled(reduce_a, backend="xla"),
        ["backend", "'xla'", "spmd", "gspmd"],
    ),
    "compile with a layout int": (md.LayoutError, lambda: compiled(reduce_a, layout=5), ["layout", "5"]),
    "compile with an unknown axis": (md.LayoutError, lambda: compiled(reduce_a, layout="a:q"), ["a:q", "'q'"]),
    "out_layouts of another length": (
        md.LayoutError,
        lambda: compiled(reduce_a, out_layouts=["", ""])(X),
        ["out_layouts", "2", "result"],
    ),
    "in_layouts of another length": (
        md.LayoutError,
        lambda: compiled(reduce_a, in_layouts=["", ""])(X),
        ["in_layouts", "2", "1 argument"],
    ),
    "compiled given an array": (
        md.ShapeError,
        lambda: compiled(reduce_a)(np.ones((4, 8), np.float32)),
        ["reduce_sum", "md tensor", "float32[4, 8]"],
    ),
    "compiled given other dims": (
        md.ShapeError,
        lambda: compiled(reduce_a)(md.tensor(np.ones((4, 8)), "c b")),
        ["reduce_sum", "'a'", "[c=4, b=8]"],
    ),
    "compiled given an indivisible size": (
        md.LayoutError,
        lambda: compiled(reduce_a)(md.tensor(np.ones((3, 8)), "a b")),
        ["a", "3", "2"],
    ),
    "compiled given two arguments": (md.ShapeError, lambda: compiled(reduce_a)(X, X), ["reduce_a", "2 argument"]),
    "compile with a bad grad_reduce_dtype": (
        md.ConfigError,
        lambda: compiled(reduce_a, grad_reduce_dtype="foo"),
        ["grad_reduce_dtype", "'foo'"],
    ),
    "donate an argument there is not": (
        md.ConfigError,
        lambda: compiled(reduce_a, donate_argnums=(3,))(X),
        ["donate_argnums", "3", "1 argument"],
    ),
    "compile a non-function": (md.ConfigError, lambda: md.compile(5, mesh2(), ""), ["fn", "int 5"]),
    "compiled given a string": (md.ShapeError, lambda: compiled(reduce_a)("a"), ["argument [0]", "str"]),
    "explain a while_loop with collectives": (
        md.ConfigError,
        explain_while_loop,
        ["md.explain", "while_loop", "cannot be counted", "scan"],
    ),
    # ---- scan ----
    "scan carry changes shape": (md.ShapeError, scan_changing_carry, ["scan", "carry", "[a=4]", "[]"]),
    "scan body returns no pair": (md.ShapeError, scan_not_a_pair, ["scan", "(carry, y)"]),
    "scan over a missing dim": (
        md.ShapeError,
        lambda: md.scan(lambda c, x: (c, None), A4, X, "steps"),
        ["scan", "steps"],
    ),
    "scan over a dim of another size": (
        md.ShapeError,
        lambda: md.scan(lambda c, x: (c, None), A4, X, D("a", 3)),
        ["scan", "a=3", "a=4"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_one_line_md_error(case):
    assert_one_line_md_error(case, *CASES[case])


def assert_one_line_md_error(case, error, call, needles):
    """``call()`` raises exactly ``error``, in one line holding every needle and no JAX internals."""
    with pytest.raises(md.MeshDslError) as info:
        call()
    message = str(info.value)
    assert type(info.value) is error, f"{case}: {type(info.value).__name__}: {message}"
    assert "\n" not in message, f"{case}: not one line: {message!r}"
    for needle in needles:
        assert needle in message, f"{case}: {needle!r} not in {message!r}"
    assert not re.search(r"Tracer|Traced<|jaxpr", message), f"{case}: JAX internals in {message!r}"


def test_rearrange_takes_dims_named_x_and_pattern():
    # x and pattern are positional-only: a dim may be called x or pattern.
    t = md.tensor(np.arange(6, dtype=np.float32), "n")
    out = md.rearrange(t, "(n: x pattern) -> pattern x", x=3)
    assert out.names == ("pattern", "x")
    np.testing.assert_array_equal(out.numpy(), np.arange(6).reshape(3, 2).T)


# ---- round two: every argument of the public API checked where it enters (issue 21) ----------------------------------

NAN = float("nan")
XI = md.tensor(np.ones((4, 8), np.int32), [D("a", 4), D("b", 8)])
SEQ = md.tensor(np.ones((2, 4, 8), np.float32), "batch length d")
Q = md.tensor(np.ones((2, 4, 3), np.float32), "heads length d_kv")
KV = md.tensor(np.ones((2, 4, 3), np.float32), "heads memory d_kv")
ATTENTION = md.nn.MultiHeadAttention(D("d", 8), D("heads", 2), D("d_kv", 4))
EMBEDDING = md.nn.Embedding(D("vocab", 16), D("d", 4))


def apply(layer, x, key=KEY):
    """``layer(layer.init(key), x)``: a layer applied to ``x`` eagerly."""
    return layer(layer.init(key), x)


CASES_ROUND_TWO = {
    # ---- tensors and dims ----
    "tensor of None": (md.ShapeError, lambda: md.tensor(None, "a"), ["md.tensor", "None"]),
    "tensor of ids beyond int32": (
        md.ShapeError,
        lambda: md.tensor(np.array([3, 2**40]), "a"),
        ["md.tensor", "1099511627776", "int32"],
    ),
    "tensor of uint64 beyond uint32": (
        md.ShapeError,
        lambda: md.tensor(np.array([2**33], np.uint64), "a"),
        ["md.tensor", "8589934592", "uint32"],
    ),
    "dim of 2**63": (md.ShapeError, lambda: D("a", 2**63), ["'a'", "9223372036854775808", "2**63"]),
    "range beyond int8": (md.ShapeError, lambda: md.range(D("a", 300), jnp.int8), ["range", "a=300", "int8", "127"]),
    "einsum of nothing": (md.ShapeError, lambda: md.einsum(), ["einsum", "at least one"]),
    # ---- meshes, compile, explain ----
    "mesh of one device twice": (
        md.LayoutError,
        lambda: md.Mesh({"x": 2}, devices=[jax.devices()[0]] * 2),
        ["devices", "twice", str(jax.devices()[0])],
    ),
    "mesh of a device string": (
        md.LayoutError,
        lambda: md.Mesh({"x": 2}, devices="cpu"),
        ["devices", "'cpu'", "jax.devices()"],
    ),
    "mesh larger than the simulated devices": (
        md.LayoutError,
        lambda: md.Mesh({"data": 16}),
        ["16 devices", "8", "XLA_FLAGS=--xla_force_host_platform_device_count=16", "before JAX starts"],
    ),
    "compiled on an abstract mesh": (
        md.ConfigError,
        lambda: md.compile(reduce_a, md.Mesh.abstract({"x": 2}), "a:x")(X),
        ["reduce_a", "abstract", "x=2", "md.explain"],
    ),
    "compiled given a keyword": (
        md.ShapeError,
        lambda: compiled(reduce_a)(t=X),
        ["reduce_a", "keyword", "'t'", "positional"],
    ),
    "explain with no arguments": (md.ConfigError, lambda: md.explain(), ["md.explain", "fn", "mesh"]),
    # ---- random ----
    "uniform minval nan": (
        md.ConfigError,
        lambda: md.random.uniform(KEY, [D("a", 2)], minval=NAN),
        ["uniform", "minval", "nan"],
    ),
    "uniform minval above maxval": (
        md.ConfigError,
        lambda: md.random.uniform(KEY, [D("a", 2)], minval=2.0, maxval=1.0),
        ["uniform", "minval 2.0", "maxval 1.0"],
    ),
    "normal of int32": (
        md.ShapeError,
        lambda: md.random.normal(KEY, [D("a", 2)], dtype=jnp.int32),
        ["normal", "int32", "floating"],
    ),
    "uniform of int32": (
        md.ShapeError,
        lambda: md.random.uniform(KEY, [D("a", 2)], dtype="int32"),
        ["uniform", "int32", "floating"],
    ),
    "md.dropout rate nan": (md.ConfigError, lambda: md.dropout(KEY, X, NAN), ["dropout", "rate", "nan"]),
    "nn.dropout rate nan": (md.ConfigError, lambda: md.nn.dropout(KEY, X, NAN), ["dropout", "rate", "nan"]),
    "nn.dropout rate nan, deterministic": (
        md.ConfigError,
        lambda: md.nn.dropout(KEY, X, NAN, deterministic=True),
        ["dropout", "rate", "nan"],
    ),
    "nn.dropout rate a string": (md.ConfigError, lambda: md.nn.dropout(KEY, X, "0.1"), ["dropout", "rate", "'0.1'"]),
    # ---- layers: options ----
    "attention with a size-0 dim": (
        md.ShapeError,
        lambda: md.nn.MultiHeadAttention(D("d", 8), D("heads", 0), D("d_kv", 4)),
        ["MultiHeadAttention", "heads=0", "at least 1"],
    ),
    "kv_projection of attention without kv_heads": (
        md.ShapeError,
        lambda: md.nn.MultiHeadAttention(D("d", 8), D("heads", 2), D("d_kv", 4)).kv_projection,
        ["MultiHeadAttention", "kv_projection", "kv_heads"],
    ),
    "conv kernel of size 0": (
        md.ShapeError,
        lambda: md.nn.Conv2d(D("c", 3), D("o", 4), kernel=(0, 3)),
        ["Conv2d", "kernel", "(0, 3)"],
    ),
    "conv stride 0": (
        md.ShapeError,
        lambda: md.nn.Conv2d(D("c", 3), D("o", 4), stride=(1, 0)),
        ["Conv2d", "stride", "(1, 0)"],
    ),
    "linear with a size-0 dim": (
        md.ShapeError,
        lambda: md.nn.Linear(D("a", 0), D("f", 4)),
        ["Linear", "a=0", "at least 1"],
    ),
    "embedding of a size-0 vocab": (
        md.ShapeError,
        lambda: md.nn.Embedding(D("vocab", 0), D("d", 4)),
        ["Embedding", "vocab=0"],
    ),
    "MLP activation a string": (
        md.ConfigError,
        lambda: md.nn.MLP(D("a", 4), D("f", 8), activation="relu"),
        ["MLP", "activation", "'relu'", "md.relu"],
    ),
    "MoE activation a string": (
        md.ConfigError,
        lambda: md.nn.MoE(D("d", 8), D("f", 16), D("experts", 4), activation="gelu"),
        ["MoE", "activation", "'gelu'"],
    ),
    "MoE capacity_factor nan": (
        md.ConfigError,
        lambda: md.nn.MoE(D("d", 8), D("f", 16), D("experts", 4), capacity_factor=NAN),
        ["MoE", "capacity_factor", "nan"],
    ),
    "LayerNorm eps nan": (md.ConfigError, lambda: md.nn.LayerNorm(D("d", 8), eps=NAN), ["LayerNorm", "eps", "nan"]),
    "RMSNorm eps -1": (md.ConfigError, lambda: md.nn.RMSNorm(D("d", 8), eps=-1), ["RMSNorm", "eps", "-1"]),
    "Linear init_scale nan": (
        md.ConfigError,
        lambda: md.nn.Linear(D("a", 8), D("f", 4), init_scale=NAN),
        ["Linear", "init_scale", "nan"],
    ),
    "Embedding init_scale inf": (
        md.ConfigError,
        lambda: md.nn.Embedding(D("vocab", 8), D("f", 4), init_scale=float("inf")),
        ["Embedding", "init_scale", "inf"],
    ),
    "attention scale nan": (
        md.ConfigError,
        lambda: md.nn.dot_product_attention(Q, KV, KV, scale=NAN),
        ["dot_product_attention", "scale", "nan"],
    ),
    # ---- layers: inputs ----
    "Linear on int input": (
        md.ShapeError,
        lambda: apply(md.nn.Linear(D("b", 8), D("f", 4)), XI),
        ["Linear", "int32", "md.cast"],
    ),
    "MLP on int input": (md.ShapeError, lambda: apply(md.nn.MLP(D("b", 8), D("f", 4)), XI), ["MLP", "int32"]),
    "LayerNorm on int input": (md.ShapeError, lambda: apply(md.nn.LayerNorm(D("b", 8)), XI), ["LayerNorm", "int32"]),
    "dot_product_attention of int queries": (
        md.ShapeError,
        lambda: md.nn.dot_product_attention(md.cast(Q, "int32"), KV, KV),
        ["dot_product_attention queries", "int32"],
    ),
    "attention on int input": (
        md.ShapeError,
        lambda: apply(ATTENTION, md.cast(SEQ, "int32")),
        ["MultiHeadAttention", "int32"],
    ),
    "Embedding of an id beyond vocab": (
        md.ShapeError,
        lambda: EMBEDDING(EMBEDDING.init(KEY), md.tensor(np.array([3, 70]), "t")),
        ["Embedding", "70", "vocab=16"],
    ),
    "Embedding of a negative id": (
        md.ShapeError,
        lambda: EMBEDDING(EMBEDDING.init(KEY), md.tensor(np.array([-1, 2]), "t")),
        ["Embedding", "-1", "vocab=16"],
    ),
}


@pytest.mark.parametrize("case", list(CASES_ROUND_TWO))
def test_every_public_argument_is_checked_where_it_enters(case):
    assert_one_line_md_error(case, *CASES_ROUND_TWO[case])


def test_the_checks_leave_good_arguments_alone():
    """Arguments at the edges of what the checks allow still compute the reference values."""
    np.testing.assert_array_equal(md.tensor(np.array([0, 2**31 - 1]), "a").numpy(), [0, 2**31 - 1])
    np.testing.assert_array_equal(md.range(D("a", 128), jnp.int8).numpy(), np.arange(128))
    u = md.random.uniform(KEY, [D("a", 64)], minval=-2.0, maxval=-2.0).numpy()
    np.testing.assert_array_equal(u, np.full(64, -2.0, np.float32))
    table = EMBEDDING.init(KEY)
    ids = np.array([0, 15, 7])
    np.testing.assert_array_equal(EMBEDDING(table, md.tensor(ids, "t")).numpy(), table.numpy()[ids])
    np.testing.assert_array_equal(md.nn.dropout(None, X, 0.0).numpy(), X.numpy())
    zero = md.nn.Linear(D("b", 8), D("f", 4), init_scale=0.0)
    np.testing.assert_array_equal(apply(zero, X).numpy(), np.zeros((4, 4), np.float32))


def test_embedding_ids_traced_out_of_range_give_zeros():
    """Inside a traced function ids cannot be read, so ids outside the vocab give zero rows (as md.gather)."""
    table = EMBEDDING.init(KEY)
    out = jax.jit(lambda t, i: EMBEDDING(t, i).array)(table, md.tensor(np.array([3, 70, -1]), "t"))
    np.testing.assert_array_equal(np.asarray(out), np.stack([table.numpy()[3], np.zeros(4), np.zeros(4)]))


def test_the_readme_mesh_on_one_cpu_device_names_the_flag():
    """The README's first program run without XLA_FLAGS (one CPU device): the error says how to get 8."""
    import subprocess
    import sys

    import harness

    program = "import meshdsl as md\nmd.Mesh({'data': 4, 'model': 2})\n"
    done = subprocess.run(
        [sys.executable, "-c", program], env=harness.subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "meshdsl.errors.LayoutError: mesh data=4 model=2 needs 8 devices, but only 1 are available"
    ), last
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts" in last, last


# ---- round three: size-0 dims, mixed dtypes and float-only ops on integers (issue 31) ------------------------------

EMPTY = md.tensor(np.ones((4, 0), np.float32), [D("a", 4), D("z", 0)])
LOGITS_X = md.tensor(np.ones((2, 4, 8), np.float32), "batch length d")
LABELS = md.tensor(np.zeros((2, 4), np.int32), "batch length")
UNEMBED = md.tensor(np.ones((8, 5), np.float32), "d vocab")
MLP_G = md.nn.GatedMLP(D("d", 8), D("f", 4))


FLOAT_ONLY = {
    name: getattr(md, name)
    for name in "silu swish gelu sigmoid tanh exp log sqrt rsqrt erf softplus log_sigmoid sin cos".split()
}


def _logits(t):
    return md.einsum(t, UNEMBED, out=[*t.shape.without(["d"]), D("vocab", 5)])


CASES_ROUND_THREE = {
    # ---- reductions over a size-0 dim: no identity to give (jnp raises, md.argmax gave 2147483647) ----
    **{
        f"{name} over a size-0 dim": (md.ShapeError, call, [name, "z=0", "size 0"])
        for name, call in {
            "reduce_max": lambda: md.reduce_max(EMPTY, "z"),
            "reduce_min": lambda: md.reduce_min(EMPTY, "z"),
            "argmax": lambda: md.argmax(EMPTY, "z"),
            "softmax": lambda: md.softmax(EMPTY, "z"),
            "logsumexp": lambda: md.logsumexp(EMPTY, "z"),
            "log_softmax": lambda: md.log_softmax(EMPTY, "z"),
            "top_k": lambda: md.top_k(EMPTY, "z", D("k", 0)),
        }.items()
    },
    "argmax over a size-0 dim, compiled": (
        md.ShapeError,
        lambda: md.compile(lambda x: md.argmax(x, "z"), md.Mesh({"x": 2}), "a:x")(EMPTY),
        ["argmax", "z=0"],
    ),
    # ---- float-only element-wise ops on integers: one rule for the family ----
    **{
        f"{name} of int32": (md.ShapeError, lambda op=op: op(XI), [op.__name__, "int32", "md.cast"])
        for name, op in FLOAT_ONLY.items()
    },
    "softmax of int32": (md.ShapeError, lambda: md.softmax(XI, "b"), ["softmax", "int32"]),
    # ---- Rotary ----
    **{
        f"Rotary theta {theta!r}": (
            md.ConfigError,
            lambda theta=theta: md.nn.Rotary(D("d_kv", 4), theta=theta),
            needles,
        )
        for theta, needles in (
            (float("inf"), ["Rotary", "theta", "inf"]),
            (NAN, ["Rotary", "theta", "nan"]),
            ("1e4", ["Rotary", "theta", "'1e4'"]),
            (0.0, ["Rotary", "theta", "0.0"]),
            (-1, ["Rotary", "theta", "-1"]),
            (True, ["Rotary", "theta", "True"]),
        )
    },
    "Rotary of int32": (
        md.ShapeError,
        lambda: md.nn.Rotary(D("d", 8))(md.tensor(np.ones((2, 4, 8), np.int32), "batch length d")),
        ["Rotary", "int32", "md.cast"],
    ),
    "Rotary offset 2**31": (
        md.ShapeError,
        lambda: md.nn.Rotary(D("d", 8))(SEQ, offset=2**31),
        ["Rotary", "offset", "2147483648", "int32"],
    ),
    "Rotary offset a float": (
        md.ShapeError,
        lambda: md.nn.Rotary(D("d", 8))(SEQ, offset=1.5),
        ["Rotary", "offset", "1.5"],
    ),
    # ---- attention ----
    "attention mask of another memory size": (
        md.ShapeError,
        lambda: md.nn.dot_product_attention(Q, KV, KV, mask=md.tensor(np.ones((4, 5), bool), "length memory")),
        ["dot_product_attention", "mask", "memory=5", "memory=4"],
    ),
    "attention of bf16 queries and f32 keys": (
        md.ShapeError,
        lambda: md.nn.dot_product_attention(md.cast(Q, "bfloat16"), KV, KV),
        ["dot_product_attention", "bfloat16", "float32", "md.cast"],
    ),
    # ---- GatedMLP params ----
    "GatedMLP params without w_gate": (
        md.ConfigError,
        lambda: MLP_G({k: v for k, v in MLP_G.init(KEY).items() if k != "w_gate"}, SEQ),
        ["GatedMLP", "w_gate", "w_in", "w_out"],
    ),
    "GatedMLP params a list": (
        md.ConfigError,
        lambda: MLP_G(list(MLP_G.init(KEY).values()), SEQ),
        ["GatedMLP", "params", "list"],
    ),
    # ---- cross_entropy ----
    "cross_entropy targets of another length": (
        md.ShapeError,
        lambda: md.nn.cross_entropy(
            LOGITS_X, md.tensor(np.zeros((2, 3), np.int32), "batch length"), _logits, "vocab", "length"
        ),
        ["cross_entropy", "length=3", "length=4"],
    ),
    "cross_entropy targets of another length, chunked": (
        md.ShapeError,
        lambda: md.nn.cross_entropy(
            LOGITS_X, md.tensor(np.zeros((2, 3), np.int32), "batch length"), _logits, "vocab", "length", chunk=2
        ),
        ["cross_entropy", "length=3", "length=4"],
    ),
    "cross_entropy logits_fn None": (
        md.ConfigError,
        lambda: md.nn.cross_entropy(LOGITS_X, LABELS, None, "vocab", "length"),
        ["cross_entropy", "logits_fn", "None"],
    ),
    "cross_entropy float targets": (
        md.ShapeError,
        lambda: md.nn.cross_entropy(LOGITS_X, md.cast(LABELS, "float32"), _logits, "vocab", "length"),
        ["cross_entropy", "targets", "float32"],
    ),
    "cross_entropy label beyond vocab": (
        md.DataError,
        lambda: md.nn.cross_entropy(LOGITS_X, LABELS + 7, _logits, "vocab", "length"),
        ["cross_entropy", "label 7", "[0, 5)"],
    ),
}


@pytest.mark.parametrize("case", list(CASES_ROUND_THREE))
def test_size_0_dims_mixed_dtypes_and_int_inputs_are_one_line_md_errors(case):
    assert_one_line_md_error(case, *CASES_ROUND_THREE[case])
