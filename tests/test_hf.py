"""``md.hf`` against transformers itself: the folders under ``tests/data/hf/`` were written by
``save_pretrained`` (``tests/hf_fixtures/make_fixtures.py``, run by hand) with transformers' float32 logits,
losses and greedy ids beside them. Every family loads and gives those logits and losses under data-parallel,
tensor-parallel and FSDP layouts; ``save`` writes the fixtures' own tensor names and shapes and reads back
bit for bit; a field the decoder does not model is a ConfigError naming it. No torch, no transformers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import harness
import jax
import numpy as np
import pytest
from meshdsl.models import llama
from safetensors import safe_open

import meshdsl as md

DATA = Path(__file__).resolve().parent / "data" / "hf"
FAMILIES = ("llama", "llama_tied_llama3", "mistral", "qwen2", "qwen3", "gemma")

MESH = {"data": 2, "model": 4}
LAYOUTS = {
    "dp": md.Layout("batch:data"),
    "tp": md.Layout("batch:data; d_ff:model; vocab:model; d_kv:model"),
    "fsdp": md.Layout("batch:data", params="d_model:model"),
}
"""Data parallel; Megatron's tensor parallel (d_kv splits on every family: its heads sizes differ); FSDP."""
CASES = [
    ("llama", "dp", "spmd"),
    ("llama", "tp", "spmd"),
    ("llama", "fsdp", "spmd"),
    ("llama_tied_llama3", "fsdp", "gspmd"),
    ("mistral", "tp", "spmd"),
    ("qwen2", "fsdp", "spmd"),
    ("qwen3", "tp", "spmd"),
    ("gemma", "fsdp", "spmd"),
]
"""Every family under a split layout, llama under all three, one on gspmd."""


def expected(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name / "expected.npz") as f:
        return {k: f[k] for k in f.files}


def tokens(ids: np.ndarray) -> md.Tensor:
    return md.tensor(ids.astype(np.int32), "batch length")


def _padded(targets: np.ndarray, length: int) -> np.ndarray:
    """``targets`` padded with -100 to ``length`` positions (the loss leaves those out)."""
    return np.pad(targets, ((0, 0), (0, length - targets.shape[1])), constant_values=-100)


@pytest.mark.parametrize("name, layout_name, backend", CASES)
def test_logits_losses_and_greedy_ids_equal_transformers(name, layout_name, backend):
    """One compiled forward over transformers' greedy sequence (the ids, then 6 generated): the logits of the
    ids within 1e-4 of their scale; each generated token the argmax after the ones before it; the loss (in
    chunks of 5 positions) with plain and with -100 labels within 1e-5 relative, the positions past the ids
    padded with -100."""
    e = expected(name)
    ids, generated = e["input_ids"], e["generated"]
    batch, length = ids.shape
    seq = generated.shape[1] - 1
    mesh, layout = md.Mesh(MESH), LAYOUTS[layout_name]
    model, params = md.hf.load(DATA / name, mesh=mesh, layout=layout, batch=batch, length=seq, loss_chunk=5)
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, md.Tensor)):
        harness.assert_laid_out(leaf, layout.param_layout, mesh, "loaded parameter")

    def run(params, inputs, plain, masked):
        losses = [model.loss(params, {"inputs": inputs, "targets": t}) for t in (plain, masked)]
        return model.logits(params, inputs), *losses

    inputs = tokens(generated[:, :seq])
    plain, masked = (tokens(_padded(labels[:, 1:], seq)) for labels in (ids, e["labels"]))
    logits, loss, loss_masked = md.compile(run, mesh, layout, backend)(params, inputs, plain, masked)
    logits = logits.numpy()
    scale = np.abs(e["logits"]).max()
    np.testing.assert_allclose(logits[:, :length], e["logits"], rtol=0, atol=1e-4 * scale)
    np.testing.assert_array_equal(logits[:, length - 1 :].argmax(-1), generated[:, length:])
    np.testing.assert_allclose(float(loss.numpy()), float(e["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(loss_masked.numpy()), float(e["loss_masked"]), rtol=1e-5)


def test_configs_of_the_families():
    """Each family's switches, from transformers' own config.json."""
    c = {n: md.hf.config_of(DATA / n) for n in FAMILIES}
    assert not c["llama"].tie_embeddings and c["llama"].rope_scaling == "none"
    assert c["llama_tied_llama3"].tie_embeddings and c["llama_tied_llama3"].rope_scaling == "llama3"
    assert c["llama_tied_llama3"].rope_original_length == 64
    assert (c["mistral"].kv_heads, c["mistral"].rope_theta) == (1, 1e6)
    assert c["qwen2"].qkv_bias and c["qwen2"].tie_embeddings and not c["qwen2"].qk_norm
    assert c["qwen3"].qk_norm and not c["qwen3"].qkv_bias and c["qwen3"].d_kv == 16
    g = c["gemma"]
    assert (g.activation, g.embed_scale, g.norm_offset, g.tie_embeddings) == ("gelu_tanh", True, 1.0, True)
    assert "unembed" not in md.hf.model(DATA / "gemma").hf_names()


def _as_4x(config: dict) -> dict:
    """transformers 4.x's layout of the same config: rope_theta and rope_scaling at the top level."""
    out = dict(config)
    rope = dict(out.pop("rope_parameters"))
    out["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type") != "default":
        out["rope_scaling"] = rope
    return out


@pytest.mark.parametrize("name", ["llama_tied_llama3", "qwen3"])
def test_the_4x_config_layout_reads_the_same(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(_as_4x(json.loads((DATA / name / "config.json").read_text()))))
    assert md.hf.config_of(tmp_path) == md.hf.config_of(DATA / name)


MISTAKES = [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "of type 'yarn' is not modelled"),
    ({"num_local_experts": 8}, "num_local_experts=8 is not modelled"),
    ({"model_type": "gpt2"}, "model_type='gpt2' is not modelled"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not modelled for llama"),
    ({"mlp_bias": True}, "mlp_bias=True"),
]


@pytest.mark.parametrize("change, message", MISTAKES)
def test_an_unmodelled_field_is_named(tmp_path, change, message):
    config = {**json.loads((DATA / "llama" / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(md.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        md.hf.model(tmp_path)


def test_a_sliding_window_shorter_than_the_sequence_is_named():
    assert md.hf.config_of(DATA / "mistral", length=4096).length == 4096  # sliding_window 4096: full attention
    with pytest.raises(md.ConfigError, match="sliding_window=4096 is shorter than the sequence"):
        md.hf.model(DATA / "mistral", length=4097)


def test_folder_mistakes_are_named(tmp_path):
    with pytest.raises(md.DataError, match="not found"):
        md.hf.model(tmp_path / "nowhere")
    with pytest.raises(md.DataError, match="has no config.json"):
        md.hf.model(tmp_path)
    with pytest.raises(md.ConfigError, match="d_model=64 would change the checkpoint's model"):
        md.hf.model(DATA / "llama", d_model=64)
    shutil.copytree(DATA / "qwen3", tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(md.DataError, match=r"mlp.gate_proj.weight.* has shape \[64, 32\].* needs \[48, 32\]"):
        md.hf.load(tmp_path / "q", mesh=md.Mesh({"data": 1}))


def _file_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_save_writes_the_fixtures_tensors_and_reads_back_bit_exact(tmp_path, name):
    """The key set, shapes and values written equal the folder transformers wrote (transformers would
    fill a forgotten bias with zeros unseen); loading the saved folder gives the same bits and Config."""
    mesh, layout = md.Mesh(MESH), LAYOUTS["fsdp"]
    model, params = md.hf.load(DATA / name, mesh=mesh, layout=layout)
    md.hf.save(tmp_path, model, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    mine, theirs = _file_tensors(tmp_path), _file_tensors(DATA / name)
    assert set(mine) == set(theirs)
    for k in theirs:
        assert mine[k].shape == theirs[k].shape and mine[k].dtype == np.float32, k
        np.testing.assert_array_equal(mine[k], theirs[k], err_msg=k)
    saved = md.hf.config_of(tmp_path)
    assert saved == md.hf.config_of(DATA / name)
    family = json.loads((DATA / name / "config.json").read_text())["model_type"]
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family.replace("mistral", "llama")
    _, again = md.hf.load(tmp_path, mesh=mesh, layout=layout)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_shards_above_the_threshold(tmp_path):
    """Above ``max_shard_bytes`` the tensors go into numbered files with transformers' index, which load reads."""
    mesh = md.Mesh({"data": 1})
    model, params = md.hf.load(DATA / "qwen2", mesh=mesh)
    md.hf.save(tmp_path, model, params, max_shard_bytes=20_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    tensors = _file_tensors(tmp_path)
    assert set(index["weight_map"]) == set(tensors) == set(_file_tensors(DATA / "qwen2"))
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for f in files:
        with safe_open(str(tmp_path / f), framework="numpy") as h:
            assert all(index["weight_map"][k] == f for k in h.keys())
    _, again = md.hf.load(tmp_path, mesh=mesh)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    md.hf.save(tmp_path, model, params)  # one file again: the shards and the index go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_tied_embeddings_are_one_table_with_one_gradient():
    """A tied model has no ``unembed``; the table's gradient is the lookup's plus the logits': the untied
    model's two gradients at the same table, added."""
    mesh = md.Mesh({"data": 1})
    model, params = md.hf.load(DATA / "llama_tied_llama3", mesh=mesh, batch=2, length=4)
    untied = llama.Model(dataclasses.replace(model.config, tie_embeddings=False))
    assert "unembed" not in params and "unembed" in untied.hf_names()
    ids = np.array([[1, 5, 9, 2], [7, 7, 3, 0]], np.int32)
    batch = {"inputs": tokens(ids), "targets": tokens(np.roll(ids, -1, 1))}

    def grads(params, batch):
        tied = jax.grad(lambda p: model.loss(p, batch).array)(params)["embed"]
        both = jax.grad(lambda p: untied.loss(p, batch).array)({**params, "unembed": params["embed"]})
        return tied, both["embed"], both["unembed"]

    tied, lookup, logits = md.compile(grads, mesh, md.Layout({}))(params, batch)
    np.testing.assert_allclose(tied.numpy(), lookup.numpy() + logits.numpy(), rtol=1e-5, atol=1e-6)
