"""``meshdsl train --init-from-hf DIR --data examples.npz`` fine-tunes a Hugging Face checkpoint under FSDP and
``meshdsl export`` hands it back as a folder ``md.hf.load`` reads; each bad input is one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import meshdsl as md
from meshdsl import cli

DATA = Path(__file__).resolve().parent / "data" / "hf"


def _examples(path: Path, vocab: int = 96) -> Path:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (24, 9))
    labels = ids.copy()
    labels[:, :3] = -100
    np.savez(path, input_ids=ids, labels=labels)
    return path


def test_fine_tune_under_fsdp_then_export(tmp_path, capsys):
    """At a learning rate too small to move them, the exported weights are the folder's: the run started from
    them; and a trained run's export loads back as what its checkpoint holds."""
    data, ck, out = _examples(tmp_path / "ex.npz"), tmp_path / "ck", tmp_path / "out"
    train = ["train", "--init-from-hf", str(DATA / "qwen2"), "--data", str(data), "--layout", "fsdp"]
    train += ["--set", "batch=8", "--set", "length=8", "--steps", "2", "--checkpoint-dir", str(ck)]
    assert cli.main([*train, "--learning-rate", "1e-12"]) == 0
    assert "parameters from" in capsys.readouterr().out
    assert cli.main(["export", "--checkpoint-dir", str(ck), "--out", str(out)]) == 0
    mesh = md.Mesh({"data": 1})
    _, original = md.hf.load(DATA / "qwen2", mesh=mesh)
    model, exported = md.hf.load(out, mesh=mesh)
    assert model.config.qkv_bias and model.config.tie_embeddings
    for a, b in zip(jax.tree_util.tree_leaves(original), jax.tree_util.tree_leaves(exported)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-8)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("command", ["train", "explain"])
def test_bad_folders_are_one_line_exit_2(tmp_path, capsys, command):
    shutil.copytree(DATA / "llama", tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "num_experts": 4}))
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "nowhere", "not found"),
        (tmp_path / "empty", "has no config.json"),
        (tmp_path / "bad", "field num_experts=4 is not modelled for llama"),
    ]
    for folder, message in cases:
        assert cli.main([command, "--init-from-hf", str(folder), "--set", "batch=8", "--set", "length=8"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"meshdsl {command}: error: ") and message in err and "\n" not in err, err


def test_weights_of_the_wrong_shape_are_one_line_exit_2(tmp_path, capsys):
    shutil.copytree(DATA / "llama", tmp_path / "wrong")
    config = json.loads((tmp_path / "wrong" / "config.json").read_text())
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, "vocab_size": 128}))
    argv = ["train", "--init-from-hf", str(tmp_path / "wrong"), "--set", "batch=8", "--set", "length=8"]
    assert cli.main([*argv, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.embed_tokens.weight" in err and "has shape [96, 32]" in err and "\n" not in err, err


def test_export_mistakes_are_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "ck").mkdir()
    assert cli.main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
