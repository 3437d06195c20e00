"""Decoding with the KV cache (``md.generate``, ``md.nn.KVCache``, ``update_slice``) against independent references.

Greedy ids must equal the argmax of the model's own full forward pass (``Model.logits``, no
cache, eager on global arrays) re-run over the growing sequence, each prompt alone and unpadded;
the decode step's logits must equal the full forward's last position; sampled ids must be the
same under every layout for one key; the decode step's compiled FLOPs must grow linearly with
the cache length. Tiny models, 8 simulated devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshdsl.models import llama, transformer

import meshdsl as md
from meshdsl.analysis.hlo_flops import matmul_flops
from meshdsl.decoding.decoder import Decoder
from meshdsl.decoding.generate import run
from meshdsl.decoding.sampling import Sampling, filtered
from meshdsl.ops.update import update_slice

TRANSFORMER = transformer.Model(transformer.Config.preset("tiny", length=12))
LLAMA = llama.Model(llama.Config.preset("tiny", length=12, heads=8, kv_heads=4))
MODELS = {"transformer": TRANSFORMER, "llama": LLAMA}
MESH = {"data": 2, "model": 4}
LAYOUTS = {
    "data_parallel": "batch:data",
    "tensor_parallel": "heads:model; kv_heads:model; d_ff:model; vocab:model",
    "mixed": "batch:data; heads:model; kv_heads:model; d_ff:model",
}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8], [7, 9, 3]]


def params_of(model):
    return model.init(jax.random.key(1))


@functools.cache
def reference_greedy(name: str, n: int) -> list[list[int]]:
    """``n`` greedy ids after each of ``PROMPTS`` from ``Model.logits`` over the whole sequence at every
    step. Each prompt is alone in its row, right-padded to the model's length: causal attention makes
    a position's logits independent of the padding after it, so one compiled shape serves every step."""
    model = MODELS[name]
    params, length = params_of(model), model.config.length
    dims = [md.Dim("batch", len(PROMPTS)), md.Dim("length", length)]
    logits = jax.jit(lambda p, ids: model.logits(p, md.tensor(ids, dims)).array)
    seqs = [list(p) for p in PROMPTS]
    for _ in range(n):
        ids = np.zeros((len(seqs), length), np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        last = np.asarray(logits(params, ids))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(last[i, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, PROMPTS)]


@pytest.mark.parametrize(
    "name, layout, backend",
    [
        ("llama", "data_parallel", "spmd"),
        ("llama", "tensor_parallel", "spmd"),
        ("llama", "mixed", "spmd"),
        ("llama", "mixed", "gspmd"),  # gspmd once: mixed splits what the other two do
        ("transformer", "mixed", "spmd"),
    ],
)
def test_greedy_ids_equal_the_full_forward_re_run(name, layout, backend):
    model = MODELS[name]
    params = params_of(model)
    n = 5
    out = md.generate(
        model, params, PROMPTS, max_new_tokens=n, mesh=md.Mesh(MESH), layout=LAYOUTS[layout], backend=backend
    )
    longest = max(map(len, PROMPTS))
    assert out.shape == (len(PROMPTS), longest + n)
    for row, prompt, expect in zip(out, PROMPTS, reference_greedy(name, n)):
        assert row[longest - len(prompt) : longest].tolist() == prompt
        assert row[longest:].tolist() == expect


@pytest.mark.parametrize(
    "layout",
    ["batch:data; kv_heads:model", "batch:data; memory:model", "d_kv:model; vocab:data"],
)
def test_decode_step_logits_equal_the_full_forward_last_position(layout):
    """Prefill over 6 ids, then one decode step: its logits are ``Model.logits``' last row over all 7,
    with the cache's ``memory`` split too (the update's masked write, attention over a split memory)."""
    model, mesh = LLAMA, md.Mesh(MESH)
    params = params_of(model)
    ids = np.random.default_rng(0).integers(0, model.config.vocab, (4, 7)).astype(np.int32)
    decoder = Decoder(model, mesh, layout)
    placed = decoder.place(params)
    memory = 8
    valid = jnp.ones((4, memory), bool)
    cache = decoder.cache(4, memory)
    positions = jnp.broadcast_to(jnp.arange(6), (4, 6))
    tokens, step = decoder.step_inputs(jnp.asarray(ids[:, :6]), 0, positions, valid)
    prefill, cache = decoder.step(placed, tokens, cache, step)
    tokens, step = decoder.step_inputs(jnp.asarray(ids[:, 6:]), 6, jnp.full((4, 1), 6), valid)
    logits, cache = decoder.step(placed, tokens, cache, step)
    dims = [md.Dim("batch", 4), md.Dim("length", 7)]
    full = np.asarray(jax.jit(lambda p: model.logits(p, md.tensor(ids, dims)).array)(params))
    np.testing.assert_allclose(prefill.numpy(), full[:, 5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits.numpy(), full[:, 6], rtol=1e-5, atol=1e-5)
    assert cache["keys"].names == ("layers", "batch", "kv_heads", "memory", "d_kv")


def test_sampled_ids_are_the_same_under_every_layout_for_one_key():
    model, mesh = LLAMA, md.Mesh(MESH)
    params = params_of(model)
    sampling = Sampling(temperature=1.5, top_k=40, top_p=0.95)
    decoders = {
        (layout, backend): Decoder(model, mesh, rules, backend, sampling)
        for layout, rules in LAYOUTS.items()
        for backend in ("spmd", "gspmd")
        if backend == "spmd" or layout == "mixed"
    }
    runs = {k: run(d, d.place(params), PROMPTS, 6, jax.random.key(7)).ids for k, d in decoders.items()}
    first = runs["data_parallel", "spmd"]
    for out in runs.values():
        np.testing.assert_array_equal(out, first)
    d = decoders["data_parallel", "spmd"]
    assert (run(d, d.place(params), PROMPTS, 6, jax.random.key(8)).ids != first).any()  # the key matters


def test_top_k_and_top_p_keep_the_tokens_numpy_keeps():
    logits = np.random.default_rng(3).standard_normal((5, 50)).astype(np.float32)
    for k, p in ((7, None), (None, 0.6), (10, 0.3), (None, 1.0)):
        kept = np.isfinite(np.asarray(filtered(jnp.asarray(logits), Sampling(0.7, k, p))))
        for row, keep in zip(logits / 0.7, kept):
            order = np.argsort(-row, kind="stable")
            allowed = np.zeros(50, bool)
            allowed[order[: k or 50]] = True
            if p is not None:
                probs = np.exp(row[allowed] - row[allowed].max())
                probs = np.sort(probs / probs.sum())[::-1]
                need = int(np.searchsorted(np.cumsum(probs), p) + 1) if p < 1 else allowed.sum()
                allowed = np.zeros(50, bool)
                allowed[order[:need]] = True
            np.testing.assert_array_equal(keep, allowed)


def test_a_row_stops_at_eos_and_is_padded_after_it():
    model, mesh = TRANSFORMER, md.Mesh(MESH)
    greedy = reference_greedy("transformer", 5)
    eos = greedy[1][1]  # row 1's second new token
    out = md.generate(
        model, params_of(model), PROMPTS, max_new_tokens=5, mesh=mesh, layout="batch:data", eos_token_id=eos
    )
    for row, expect in zip(out, greedy):
        end = expect.index(eos) + 1 if eos in expect else len(expect)
        assert row[5:].tolist() == expect[:end] + [eos] * (len(expect) - end)


def test_decode_step_flops_grow_linearly_with_the_cache_length():
    """The compiled decode step at cache lengths 16, 32 and 48: its matmul FLOPs per device
    (``meshdsl.analysis.hlo_flops``, loop trip counts included) grow by exactly the attention's QK and PV
    over the added positions, for every layer, and XLA's own cost analysis (all ops, a loop body
    counted once) by about equal increments: linear in the cache length, no prefix recomputed."""
    c = llama.Config.preset("tiny", length=48, heads=8, kv_heads=4)
    model, mesh = llama.Model(c), md.Mesh(MESH)
    decoder = Decoder(model, mesh, "batch:data; kv_heads:model")
    params = decoder.place(params_of(model))

    def flops(memory: int) -> tuple[float, float]:
        tokens, step = decoder.step_inputs(
            jnp.zeros((4, 1), jnp.int32), memory - 1, jnp.zeros((4, 1)), jnp.ones((4, memory), bool)
        )
        compiled = decoder.step.lower(params, tokens, decoder.cache(4, memory), step).compile()
        cost = compiled.cost_analysis()
        return matmul_flops(compiled.as_text()), float((cost[0] if isinstance(cost, list) else cost)["flops"])

    (m16, x16), (m32, x32), (m48, x48) = flops(16), flops(32), flops(48)
    local_query_heads, local_rows = c.heads // 4, 4 // 2  # one device's, under kv_heads:model and batch:data
    per_position = c.layers * 2 * (2 * c.d_kv * local_query_heads * local_rows)  # QK and PV, every layer
    assert m32 - m16 == m48 - m32 == 16 * per_position
    assert 0 < x32 - x16 == pytest.approx(x48 - x32, rel=0.15)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(max_new_tokens=-1), md.ConfigError, "max_new_tokens must be at least 0, got -1"),
        (dict(max_new_tokens=8), md.ConfigError, "more than the model's 12"),
        (dict(temperature=-0.5), md.ConfigError, "temperature must be a finite number, at least 0.0"),
        (dict(temperature=float("nan")), md.ConfigError, "temperature must be a finite number"),
        (dict(temperature=1.0, top_p=1.5), md.ConfigError, "top_p must be in (0, 1]"),
        (dict(temperature=1.0, top_p=0.0), md.ConfigError, "top_p must be a finite number, above 0.0"),
        (dict(temperature=1.0, top_k=0), md.ConfigError, "top_k must be in [1, 65)"),
        (dict(temperature=1.0), md.ConfigError, "needs key="),
        (dict(top_k=3), md.ConfigError, "top_k and top_p apply to sampling"),
        (dict(eos_token_id=64), md.ConfigError, "eos_token_id must be in [0, 64)"),
        (dict(prompt_ids=np.zeros((2, 2, 2), np.int32)), md.ShapeError, "2-d integer array"),
        (dict(prompt_ids=[[1, 2], []]), md.ShapeError, "prompt 1 must be a non-empty list"),
        (dict(prompt_ids=[[1, 99]]), md.ShapeError, "prompt 0 id 1 is 99, outside the model's vocab of 64"),
        (dict(mesh={"data": 8}), md.ConfigError, "mesh must be an md.Mesh"),
    ],
)
def test_mistakes_are_one_line_md_errors(kwargs, error, words):
    args = {**dict(prompt_ids=PROMPTS, max_new_tokens=2, mesh=md.Mesh(MESH), layout="batch:data"), **kwargs}
    with pytest.raises(error) as caught:
        md.generate(TRANSFORMER, {}, **args)
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("layout", ["batch:data", "memory:model", "batch:data; memory:model; d_kv:(x)"])
@pytest.mark.parametrize("backend", ["spmd", "gspmd"])
def test_update_slice_equals_numpy(layout, backend):
    mesh = md.Mesh({"data": 2, "model": 2, "x": 2})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, 2)).astype(np.float32)
    new = rng.standard_normal((3, 4, 2)).astype(np.float32)
    dims = [md.Dim("batch", 4), md.Dim("memory", 8), md.Dim("d_kv", 2)]
    new_dims = [md.Dim("length", 3), dims[0], dims[2]]
    f = md.compile(lambda a, b, i: update_slice(a, b, i, "memory", "length"), mesh, layout, backend)
    for index in (0, 2, 5, 7):  # 7: clamped to 5, as lax.dynamic_update_slice
        out = f(md.tensor(x, dims), md.tensor(new, new_dims), md.tensor(jnp.int32(index), []))
        expect = x.copy()
        at = min(index, 5)
        expect[:, at : at + 3] = new.transpose(1, 0, 2)
        np.testing.assert_array_equal(out.numpy(), expect)


def test_a_model_whose_forward_is_not_decode_is_refused():
    from meshdsl.models import moe

    with pytest.raises(md.ConfigError, match="cannot decode"):
        md.generate(moe.Model(moe.Config.preset("tiny")), {}, PROMPTS, max_new_tokens=1, mesh=md.Mesh(MESH), layout="")
