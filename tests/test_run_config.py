"""``meshdsl train``'s settings, each defined once as a ``RunConfig`` field: the parser and ``--help``
built from the fields, a resume that keeps what the checkpoint records, and flags the run would
ignore refused (one line, exit 2, nothing written)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from cli_errors import one_error_line, snapshot

from meshdsl import commands
from meshdsl.cli import main
from meshdsl.train import config, settings
from meshdsl.train.config import Resume, RunConfig
from meshdsl.train.loop import train

HF = Path(__file__).resolve().parent / "data" / "hf" / "llama"
MLP = ["--model", "mlp", "--preset", "tiny", "--layout", "batch:data"]


def _train_parser():
    sub = next(a for a in commands.parser()._actions if a.dest == "command")
    return sub.choices["train"]


def test_every_flag_is_a_field_and_help_shows_the_defaults(capsys) -> None:
    """The parser, ``--help``, the ``[train]`` keys and the checkpoint's record all come from the fields."""
    flags = {a.dest for a in _train_parser()._actions if a.dest != "help"}
    assert flags == set(config.settings()) == {f.name for f in dataclasses.fields(RunConfig)} - {"given"}
    assert set(settings.KEYS) == {n for n in config.settings() if config.setting_of(n).table}
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS steps to train (a resumed run: up to this step) (default: 200)" in shown
    assert "(default: transformer)" in shown and "--keep K keep the newest K checkpoints (default: 3)" in shown
    assert "(default: the layout file's [train] learning_rate, else the optimizer's own)" in shown
    for name in config.settings():  # every flag says what it is for
        assert config.setting_of(name).help or name in ("model", "preset", "overrides", "layout")
        assert config.setting_of(name).resume in Resume


IGNORED = {
    "min-lr-ratio under the constant schedule": (
        ["--min-lr-ratio", "0.1"],
        ["--min-lr-ratio 0.1:", "decaying --lr-schedule", "this run's --lr-schedule: constant"],
    ),
    "eval-fraction without data": (["--eval-fraction", "0.2"], ["--eval-fraction 0.2:", "without --data"]),
    "eval-steps without eval-every": (["--eval-steps", "3"], ["--eval-steps 3:", "without --eval-every"]),
    "eval-steps with eval-every 0": (
        ["--eval-steps", "3", "--eval-every", "0"],
        ["--eval-steps 3:", "this run's --eval-every: 0"],
    ),
    "keep without a checkpoint dir": (["--keep", "2"], ["--keep 2:", "without --checkpoint-dir"]),
    "a layout file's min_lr_ratio under the constant schedule": (
        ["--layout", "ratio.toml"],
        ["layout file 'ratio.toml' [train] min_lr_ratio = 0.1:", "decaying --lr-schedule"],
    ),
    "a layout file's bad learning rate": (
        ["--layout", "bad.toml"],
        ["layout file 'bad.toml' [train] learning_rate = -0.1:", "positive, finite"],
    ),
    "interleaved virtual stages on 2 stages": (
        ["--model", "transformer", "--layout", "pipeline", "--schedule", "interleaved", "--virtual-stages", "3"],
        ["pipeline: 2 stages x 3 virtual stages do not divide layers (2)"],
    ),
    "interleaved virtual stages on 4 stages": (
        ["--model", "transformer", "--layout", "pipeline4", "--schedule", "interleaved", "--virtual-stages", "3"],
        ["pipeline: 4 stages x 3 virtual stages do not divide layers (2)"],
    ),
    "a run flag after the command": (["--devices", "2"], ["--devices is a flag of meshdsl itself", "before"]),
    "token ids beyond the vocab": (
        ["--model", "transformer", "--data", "ids.npy"],
        ["holds id 64 at position 64", "pass --set vocab=300 for a model that reads ids up to 299"],
    ),
}


@pytest.mark.parametrize("flags, expected", list(IGNORED.values()), ids=list(IGNORED))
def test_a_flag_the_run_would_ignore_or_a_wrong_value_is_one_line(flags, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    table = '[mesh]\ndata = -1\n[rules]\nbatch = "data"\n[train]\n'
    (tmp_path / "ratio.toml").write_text(table + "min_lr_ratio = 0.1\n")
    (tmp_path / "bad.toml").write_text(table + "learning_rate = -0.1\n")
    np.save(tmp_path / "ids.npy", np.arange(4000, dtype=np.int32) % 300)
    before = snapshot(tmp_path)
    code = main(["train", *MLP, "--steps", "2", *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    line = one_error_line(err, *expected)
    assert "--learning-rate" not in line
    assert snapshot(tmp_path) == before


def _losses(log: Path) -> list[tuple[int, float, float | None]]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("eval_loss")) for r in rows]


def test_a_resume_keeps_what_the_checkpoint_records(tmp_path, monkeypatch, capsys) -> None:
    """Resumed with only ``--checkpoint-dir --resume``: the learning rate, seed, model and evaluation
    come from the checkpoint (said in one line each), so steps 3-4 and the eval loss equal the
    uninterrupted run's exactly; a different seed, or a profile window before the resumed step, is refused."""
    monkeypatch.chdir(tmp_path)
    flags = ["--optimizer", "sgd", "--learning-rate", "0.5", "--seed", "7", "--eval-every", "2", "--eval-steps", "2"]
    whole = RunConfig(
        model="mlp", preset="tiny", layout="batch:data", optimizer="sgd", learning_rate=0.5, seed=7, eval_every=2
    )
    train(dataclasses.replace(whole, steps=4, eval_steps=2, log_json="whole.jsonl"), io.StringIO())
    assert main(["train", *MLP, *flags, "--steps", "2", "--checkpoint-dir", "ck"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    for refused, expected in (
        (["--seed", "8"], "--seed 8: checkpoint ck/step_2 was trained with seed 7"),
        (["--learning-rate", "0.1"], "--learning-rate 0.1: checkpoint ck/step_2 was trained with learning rate 0.5"),
        (["--profile-steps", "1:3"], "--profile-steps 1:3: the run resumes from ck/step_2 at step 2"),
        (["--init-from-hf", str(HF)], f"--init-from-hf {HF}: checkpoint ck/step_2 was trained with init from hf None"),
    ):
        assert main(["train", "--checkpoint-dir", "ck", "--resume", "--steps", "4", *refused]) == 2
        one_error_line(capsys.readouterr().err, expected)
        assert snapshot(tmp_path) == before
    assert main(["train", "--checkpoint-dir", "ck", "--resume", "--steps", "4", "--log-json", "resumed.jsonl"]) == 0
    out = capsys.readouterr().out
    for said in ("learning rate 0.5", "seed 7", "model mlp", "eval every 2", "steps 4 (the checkpoint's: 2)"):
        assert f"--resume: {said}" in out, out
    assert _losses(tmp_path / "resumed.jsonl") == _losses(tmp_path / "whole.jsonl")[2:]
    np.testing.assert_array_equal([r[2] is not None for r in _losses(tmp_path / "resumed.jsonl")], [False, True])
