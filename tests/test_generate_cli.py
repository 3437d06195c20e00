"""``meshdsl generate`` and ``meshdsl bench --decode`` as a user runs them: a checkpoint of ``meshdsl train``
continued under a data-parallel and a tensor-parallel layout gives the same greedy tokens, which
equal ``md.generate`` on the restored parameters; the decode benchmark ranks layouts with a
verdict; mistakes are one line before anything runs."""

from __future__ import annotations

import re

import cli_errors
import jax
import pytest

import meshdsl as md
from meshdsl.cli import main

TINY = ["--model", "llama", "--preset", "tiny", "--set", "length=12"]


def _new_ids(out: str) -> list[list[int]]:
    return [
        [int(t) for t in line.split("] ", 1)[1].split()] for line in out.splitlines() if re.match(r"\[\d+\] ", line)
    ]


def test_generate_continues_a_trained_checkpoint_alike_under_two_layouts(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["train", *TINY, "--steps", "2", "--layout", "data_parallel", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    prompts = "1 2 3; 4 5; 6; 7 8 9 10; 11 12; 13 14 15; 16; 17 18"
    runs = {}
    for layout in ("data_parallel", "megatron"):
        argv = ["generate", "--checkpoint-dir", str(ckpt), "--layout", layout, "--prompt-ids", prompts]
        assert main([*argv, "--max-new-tokens", "4"]) == 0
        out, err = capsys.readouterr()
        assert "tokens/s" in out and "generated 4/4 tokens" in err
        runs[layout] = _new_ids(out)
    assert runs["data_parallel"] == runs["megatron"] and len(runs["megatron"]) == 8
    state, _ = md.checkpoint.restore(md.checkpoint.latest(ckpt), md.Mesh({"data": 8}), "batch:data")
    from meshdsl.model.loader import build_model

    model = build_model("llama", "tiny", length=12)
    rows = [[int(t) for t in p.split()] for p in prompts.split(";")]
    ids = md.generate(model, state["params"], rows, max_new_tokens=4, mesh=md.Mesh({"data": 8}), layout="batch:data")
    assert ids[:, -4:].tolist() == runs["megatron"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--prompt-ids", "1 x"], "--prompt-ids: prompt 0 '1 x' is not ids"),
        (["--prompt-ids", "1; ;2"], "prompt 1 is empty"),
        ([], "give prompts as --prompt-ids or as --prompt"),
        (["--prompt-ids", "1", "--max-new-tokens", "20"], "more than the model's 12"),
        (["--prompt-ids", "1", "--temperature", "1", "--top-p", "2"], "top_p must be in (0, 1]"),
        (["--prompt", "hello"], "needs a tokenizer.json"),
        (["--prompt-ids", "1", "--checkpoint-dir", "/nonexistent"], "is not a directory"),
    ],
)
def test_generate_mistakes_are_one_line(argv, expected, capsys):
    assert main(["generate", *TINY, "--max-new-tokens", "2", *argv]) == 2
    out, err = capsys.readouterr()
    cli_errors.one_error_line(err, expected)


def test_bench_decode_ranks_layouts_with_a_verdict(capsys):
    argv = ["bench", *TINY, "--decode", "--layouts", "data_parallel", "megatron", "--rounds", "1"]
    assert main([*argv, "--decode-batch", "8", "--prompt-length", "4", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| data_parallel") or line.startswith("| megatron")]
    assert len(rows) == 2
    assert re.search(r"verdict: (data_parallel|megatron) decodes fastest", out)
    assert "md.explain of" in out
    assert jax.device_count() == 8
