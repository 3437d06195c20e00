"""The training loop a person watches: schedules, gradient accumulation, evaluation, progress and logs.

References are independent: optax's own schedules written out by formula, and plain-JAX losses and
gradients of the whole batch (``jax.grad`` of a jax.numpy function on global arrays).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import meshdsl.models.mlp as mlp
import numpy as np
import pytest

import meshdsl as md
from meshdsl.cli import main
from meshdsl.runtime import waiting
from meshdsl.train import optim
from meshdsl.train.loop import RunConfig, train
from meshdsl.train.progress import Progress, Step
from meshdsl.train.step import Trainer

# ---- schedules ---------------------------------------------------------------------------------


def _expected(kind: str, step: int, steps: int, warmup: int, ratio: float) -> float:
    """The multiplier of ``step`` written out by formula (optax's conventions: warmup from 0)."""
    if step < warmup:
        return step / warmup
    t = step - warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        return ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * min(t, steps - warmup) / (steps - warmup)))
    if kind == "linear":
        return 1 + (ratio - 1) * min(t, steps - warmup) / (steps - warmup)
    decay = max(1, round(0.2 * (steps - warmup)))
    start = steps - decay
    return 1.0 if step < start else 1 + (ratio - 1) * min(step - start, decay) / decay


@pytest.mark.parametrize("kind", optim.SCHEDULES)
def test_schedules_follow_their_formulas(kind):
    f = optim.schedule(kind, 50, 10, 0.1)
    got = [float(f(s)) for s in range(51)]
    want = [_expected(kind, s, 50, 10, 0.1) for s in range(51)]
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got[0] == 0.0 and got[10] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (("cosine", 10, 10, 0.0), "--warmup-steps 10"),
        (("cosine", 10, -1, 0.0), "--warmup-steps -1"),
        (("cosine", 10, 0, 1.5), "--min-lr-ratio 1.5"),
        (("cosine", 10, 0, float("nan")), "--min-lr-ratio nan"),
        (("step", 10, 0, 0.0), "--lr-schedule 'step'"),
    ],
)
def test_bad_schedules_are_named(args, message):
    with pytest.raises(md.ConfigError, match=message):
        optim.schedule(*args)


@pytest.mark.parametrize("name", ["sgd", "adamw", "adafactor"])
def test_the_optimizer_steps_with_the_scheduled_rate(name):
    """SGD's update is exactly -lr(step) * grad; every optimizer reports the rate it used."""
    f = optim.schedule("linear", 8, 2, 0.25)
    opt = optim.make(name, f, **({} if name == "adafactor" else {"learning_rate": 0.5}))
    for step in range(8):
        base = 0.5 if name != "adafactor" else min(1e-2, 1 / math.sqrt(step + 1))
        assert opt.learning_rate_at(step) == pytest.approx(base * _expected("linear", step, 8, 2, 0.25), rel=1e-6)
    sgd = optim.make("sgd", f, learning_rate=0.5)
    p = {"w": md.tensor(jnp.ones(3), ["x"])}
    g = {"w": md.tensor(jnp.asarray([1.0, 2.0, 3.0]), ["x"])}
    state = sgd.init(p)
    for step in range(4):
        new, state = sgd.update(g, state, p, jnp.asarray(step))
        np.testing.assert_allclose(
            new["w"].numpy(), 1 - 0.5 * _expected("linear", step, 8, 2, 0.25) * np.array([1, 2, 3]), rtol=1e-6
        )


# ---- gradient accumulation -----------------------------------------------------------------------


class Regression:
    """A user's model without pipeline parts: ``pred = x . w + b``, mean squared error per example.
    ``loss_dims`` names its output dims by the model's ``Dim`` (sized as the whole batch) rather than by name;
    ``rows`` names the batch dim (``batch_dim`` says which it is)."""

    def __init__(self, batch: int = 16, features: int = 6, loss_dims: bool = False, rows: str = "batch"):
        self.rows, self.features = md.Dim(rows, batch), md.Dim("features", features)
        self.batch_dim = self.rows
        self.loss_dims = loss_dims

    def init(self, key):
        return {"w": md.random.normal(key, [self.features]), "b": md.zeros([])}

    def batch(self, key):
        k1, k2 = jax.random.split(key)
        return {"x": md.random.normal(k1, [self.rows, self.features]), "y": md.random.normal(k2, [self.rows])}

    def loss(self, params, batch):
        out = [self.rows] if self.loss_dims else [self.rows.name]
        return md.reduce_mean(md.square(md.einsum(batch["x"], params["w"], out=out) + params["b"] - batch["y"]))


def _regression_loss(p, x, y):
    return jnp.mean(jnp.square(x @ p["w"] + p["b"] - y))


def _mlp_loss(p, x, y):
    return jnp.mean(jnp.square(jax.nn.relu(x @ p["w1"]) @ p["w2"] - y))


def _numpy(tree):
    return {k: v.numpy() for k, v in tree.items()}


CASES = {
    "mlp, batch and d_ff split": (
        lambda: mlp.Model(mlp.Config.preset("tiny")),
        _mlp_loss,
        {"data": 4, "model": 2},
        "batch:data; d_ff:model",
        "spmd",
    ),
    "mlp, gspmd": (
        lambda: mlp.Model(mlp.Config.preset("tiny")),
        _mlp_loss,
        {"data": 4, "model": 2},
        "batch:data; d_ff:model",
        "gspmd",
    ),
    "user model naming its batch dim examples": (
        lambda: Regression(rows="examples"),
        _regression_loss,
        {"data": 2},
        "examples:data",
        "spmd",
    ),
    "user model, fsdp": (
        Regression,
        _regression_loss,
        {"data": 2},
        md.Layout("batch:data", params="features:data"),
        "spmd",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_accumulated_gradients_equal_the_whole_batch(case):
    """One SGD step (lr 1, no clipping) with 4 microbatches moves the parameters by the whole batch's
    gradient, and reports the whole batch's mean loss and gradient norm (plain JAX on global arrays)."""
    make, reference, axes, layout, backend = CASES[case]
    model = make()
    layout = layout if isinstance(layout, md.Layout) else md.Layout(layout)
    trainer = Trainer(model, optim.sgd(1.0), md.Mesh(axes), layout, backend, donate=False, accumulate=4, metrics=True)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    batch = model.batch(jax.random.fold_in(jax.random.key(1), 0))
    x, y = (batch[k].numpy() for k in ("x", "y"))
    before = _numpy(state["params"])
    new, metrics = trainer.step(state, jax.random.key_data(jax.random.key(1)))
    want_loss, want_grads = jax.value_and_grad(reference)(before, x, y)
    grads = {k: before[k] - v for k, v in _numpy(new["params"]).items()}
    for k in before:
        np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in want_grads.values()))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)


def test_accumulation_that_does_not_divide_the_rows_is_named():
    model = mlp.Model(mlp.Config.preset("tiny"))  # batch 16: 2 rows on each of 8 devices
    trainer = Trainer(model, optim.sgd(1.0), md.Mesh({"data": 8}), md.Layout("batch:data"), accumulate=4)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    with pytest.raises(md.ConfigError, match=r"--accumulate 4 does not divide the batch of 16 \(2 rows on each device"):
        trainer.step(state, jax.random.key_data(jax.random.key(1)))
    with pytest.raises(md.ConfigError, match="--accumulate 0"):
        Trainer(model, optim.sgd(1.0), md.Mesh({"data": 8}), md.Layout("batch:data"), accumulate=0)
    fixed = Trainer(
        Regression(loss_dims=True), optim.sgd(1.0), md.Mesh({"data": 2}), md.Layout("batch:data"), accumulate=2
    )
    state = fixed.init(jax.random.key_data(jax.random.key(0)))
    with pytest.raises(
        md.ConfigError, match="--accumulate 2: the model's loss fails on a microbatch of 8 rows .*batch=16"
    ):
        fixed.step(state, jax.random.key_data(jax.random.key(1)))


def test_accumulation_memory_is_flat_in_the_microbatches():
    """XLA's temporary memory for one step does not grow with the number of microbatches."""
    model = mlp.Model(mlp.Config(batch=512, d_io=32, d_ff=512))
    temp = {}
    for n in (1, 4, 16):
        trainer = Trainer(model, optim.sgd(1.0), md.Mesh({"data": 1}), md.Layout(), accumulate=n)
        key = jax.random.key_data(jax.random.key(0))
        state = trainer.init(key)
        temp[n] = trainer.step.lower(state, key).compile().memory_analysis().temp_size_in_bytes
    assert temp[16] <= temp[4] <= temp[1], temp
    assert temp[16] < temp[1] / 4, temp


# ---- the loop: evaluation, progress, logs, traces ------------------------------------------------


MLP = dict(model="mlp", preset="tiny", layout="batch:data", optimizer="sgd", learning_rate=0.05)


def _json(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plain_mlp_loss(params: dict, batch: dict) -> float:
    """The MLP's mean squared error on a batch, in numpy from global arrays."""
    h = np.maximum(batch["x"] @ params["w1"], 0)
    return float(np.mean(np.square(h @ params["w2"] - batch["y"])))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_watched_run_evaluates_logs_and_traces(tmp_path, monkeypatch):
    """A cosine schedule with warmup and 2 microbatches, evaluated every 3 steps: the printed lines,
    JSON log, TensorBoard events (read back by tensorboard's own reader), PNG, trace and summary agree,
    the learning rates follow the schedule's formula and the eval loss is the mean loss of the eval
    key stream's batches at the saved parameters (numpy)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = io.StringIO()
    run = RunConfig(
        **MLP,
        steps=6,
        lr_schedule="cosine",
        warmup_steps=2,
        min_lr_ratio=0.1,
        accumulate=2,
        eval_every=3,
        eval_steps=2,
        log_every=2,
        log_json=str(tmp_path / "log.jsonl"),
        tensorboard=str(tmp_path / "tb"),
        profile_steps="2:3",
        checkpoint_dir=str(tmp_path / "ck"),
    )
    monkeypatch.setattr(waiting, "HEARTBEAT_S", 0.05)
    err = _Terminal()
    losses = train(run, out, err=err)
    printed = out.getvalue()
    assert "compiling the train step and the eval step ...\ncompiled in " in printed
    # never silent 10 s: a heartbeat line (its elapsed time is the host's: a loaded one wakes the thread late)
    assert re.search(r"meshdsl train: still compiling the train step, \d+:\d\d elapsed", err.getvalue())
    assert f"(view: pip install tensorboard; tensorboard --logdir {tmp_path / 'tb'})" in printed  # not in the base
    lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [line.split("/")[0] for line in lines] == ["step 1", "step 2", "step 3", "step 4", "step 6"], printed
    assert "eval loss" in lines[2] and "eval loss" in lines[4] and "ETA" in lines[1]
    records = _json(tmp_path / "log.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and [r["loss"] for r in records] == losses
    np.testing.assert_allclose(
        [r["learning_rate"] for r in records], [0.05 * _expected("cosine", s, 6, 2, 0.1) for s in range(6)], rtol=1e-6
    )
    assert all(r["grad_norm"] > 0 for r in records) and all(r["examples_per_second"] > 0 for r in records)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert "eval_perplexity" not in records[2]  # the MLP has no vocabulary

    state, _ = md.checkpoint.restore(tmp_path / "ck" / "step_6", md.Mesh({"x": 1}, jax.devices()[:1]), md.Layout())
    params = {k: v.numpy() for k, v in state["params"].items()}
    model = mlp.Model(mlp.Config.preset("tiny"))
    eval_key = jax.random.fold_in(jax.random.key(0), 2)
    batches = [{k: v.numpy() for k, v in model.batch(jax.random.fold_in(eval_key, i)).items()} for i in range(2)]
    np.testing.assert_allclose(
        records[5]["eval_loss"], np.mean([_plain_mlp_loss(params, b) for b in batches]), rtol=1e-5
    )

    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "perf/step_seconds",
        "perf/examples_per_second",
        "eval/loss",
    } <= tags
    assert [e.step for e in board.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([e.value for e in board.Scalars("train/loss")], losses, rtol=1e-6)
    np.testing.assert_allclose(
        [e.value for e in board.Scalars("eval/loss")], [r["eval_loss"] for r in records if "eval_loss" in r], rtol=1e-6
    )
    assert (tmp_path / "log.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "tb").glob("plugins/profile/*/*.xplane.pb")), "no profiler trace"
    assert f"profiled steps 2-3 into {tmp_path / 'tb'}" in printed
    summary = printed[printed.index("done: ") :]
    assert summary.startswith("done: 6 steps in ") and "compiling" in summary and "mean after the first" in summary
    best = min((r["eval_loss"], r["step"]) for r in records if "eval_loss" in r)
    assert f"final {records[5]['eval_loss']:.4f} at step 6, best {best[0]:.4f} at step {best[1]}" in summary
    assert f"latest {tmp_path / 'ck' / 'step_6'}" in summary
    # CPU devices keep no peak, so the compiled step's memory is said: at least the f32 parameters (SGD keeps no
    # other state) that data parallelism holds whole on each device, counted from the restored arrays
    needed = re.search(r"peak memory: not kept by cpu devices; the compiled step needs ([\d.]+) KiB a device", summary)
    state_bytes = 4 * sum(int(np.prod(a.shape)) for a in params.values())
    assert needed is not None and state_bytes <= float(needed[1]) * 2**10 < 20 * state_bytes, summary
    assert f"loss curve {tmp_path / 'log.png'}" in summary


def test_a_resumed_schedule_continues_exactly(tmp_path):
    """Killed after step 3 (its later checkpoint removed) and resumed: the learning rates and losses of
    steps 4-6 are bit-identical to the uninterrupted run's; resuming under another schedule is refused."""
    common = dict(**MLP, steps=6, lr_schedule="wsd", warmup_steps=2, min_lr_ratio=0.2, accumulate=2, save_every=3)
    train(RunConfig(**common, checkpoint_dir=str(tmp_path / "a"), log_json=str(tmp_path / "a.jsonl")), io.StringIO())
    with _compiles() as fresh:
        train(RunConfig(**common, checkpoint_dir=str(tmp_path / "b")), io.StringIO())
    for part in (tmp_path / "b" / "step_6").iterdir():
        part.unlink() if part.is_file() else __import__("shutil").rmtree(part)
    (tmp_path / "b" / "step_6").rmdir()
    with pytest.raises(
        md.ConfigError, match="--lr-schedule cosine: checkpoint .*step_3 was trained with lr schedule wsd"
    ):
        train(
            RunConfig(**{**common, "lr_schedule": "cosine"}, checkpoint_dir=str(tmp_path / "b"), resume=True),
            io.StringIO(),
        )
    with _compiles() as again:
        train(
            RunConfig(**common, checkpoint_dir=str(tmp_path / "b"), resume=True, log_json=str(tmp_path / "b.jsonl")),
            io.StringIO(),
        )
    whole, resumed = _json(tmp_path / "a.jsonl")[3:], _json(tmp_path / "b.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [(r["learning_rate"], r["loss"]) for r in resumed] == [(r["learning_rate"], r["loss"]) for r in whole]
    # Each program compiles once: a fresh run its init and its step, a resumed run its step (the
    # restored data key once had the checkpoint's sharding, not the one the step was compiled for,
    # and the resumed run's first step compiled the step again).
    assert (len(fresh), len(again)) == (2, 1), (fresh, again)


@contextlib.contextmanager
def _compiles() -> Iterator[list[str]]:
    """The meshdsl programs XLA compiles inside the block (``jax.log_compiles``' lines naming ``spmd_function``)."""
    found: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Compiling ") and "spmd_function" in message.split(" with ")[0]:
                found.append(message.split(" with ")[0])

    seen, logger = Seen(), logging.getLogger("jax")
    logger.addHandler(seen)
    try:
        with jax.log_compiles(True):
            yield found
    finally:
        logger.removeHandler(seen)


def test_the_train_table_of_a_layout_file_sets_the_schedule(tmp_path):
    layout = tmp_path / "dp.toml"
    layout.write_text(
        '[mesh]\ndata = -1\n[rules]\nbatch = "data"\n'
        '[train]\nlr_schedule = "linear"\nwarmup_steps = 1\nlearning_rate = 0.1\n'
    )
    out = io.StringIO()
    train(
        RunConfig(**{**MLP, "learning_rate": None, "layout": str(layout)}, steps=3, log_json=str(tmp_path / "t.jsonl")),
        out,
    )
    assert "(linear learning rate, 1 warmup steps)" in out.getvalue().splitlines()[0]
    got = [r["learning_rate"] for r in _json(tmp_path / "t.jsonl")]
    np.testing.assert_allclose(got, [0.1 * _expected("linear", s, 3, 1, 0.0) for s in range(3)], rtol=1e-6)
    train(
        RunConfig(
            **{**MLP, "layout": str(layout)},
            steps=3,
            lr_schedule="constant",
            warmup_steps=0,
            log_json=str(tmp_path / "f.jsonl"),
            given=frozenset({"lr_schedule", "warmup_steps"}),  # as flags at their defaults
        ),
        io.StringIO(),
    )
    assert [r["learning_rate"] for r in _json(tmp_path / "f.jsonl")] == pytest.approx([0.05] * 3)  # the flags win


def test_the_header_names_the_parameter_rules():
    out = io.StringIO()
    train(RunConfig(model="mlp", preset="tiny", layout="fsdp", steps=1), out)
    header = out.getvalue().splitlines()[0]
    assert "under batch:data; groups:data; parameters stored under d_model:data; d_io:data" in header, header


def test_a_nan_loss_stops_the_run_naming_the_step(tmp_path, capsys):
    argv = [
        "train",
        "--model",
        "mlp",
        "--preset",
        "tiny",
        "--layout",
        "batch:data",
        "--optimizer",
        "sgd",
        "--learning-rate",
        "1e30",
        "--steps",
        "6",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--save-every",
        "1",
    ]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    step = int(err.split("at step ")[1].split(":")[0])
    value = err.split("loss is ")[1].split(" ")[0]  # nan or inf, as the float rounding of the version at hand gives
    assert value in ("nan", "inf") and err == (
        f"meshdsl train: error: loss is {value} at step {step}: stopped (the last checkpoint, "
        f"{tmp_path / 'ck' / f'step_{step - 1}'}, is intact); pass --allow-nan to train on\n"
    ), err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == f"step_{step - 1}"
    assert main([*argv[:-4], "--allow-nan"]) == 0
    assert "done: 6 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval-every", "-1"], "--eval-every -1"),
        (["--eval-steps", "0"], "--eval-steps 0"),
        (["--log-every", "0"], "--log-every 0"),
        (["--accumulate", "0"], "--accumulate 0"),
        (["--warmup-steps", "5"], "--warmup-steps 5: warm up over 0 to 4 steps"),
        (["--min-lr-ratio", "nan", "--lr-schedule", "cosine"], "--min-lr-ratio nan"),
        (["--profile-steps", "3:2"], "--profile-steps 3:2"),
        (["--profile-steps", "1:9"], "--profile-steps 1:9"),
        (["--profile-steps", "x"], "--profile-steps 'x'"),
        (["--profile-dir", "p"], "--profile-dir p: the run would ignore it without --profile-steps"),
        (["--tensorboard", "afile"], "--tensorboard 'afile'"),
        (["--profile-steps", "1:2", "--profile-dir", "afile/x"], "--profile-dir 'afile/x'"),
        (["--log-json", "adir/log.jsonl"], "--log-json's loss curve"),
        (["--layout", "bad_train.toml"], "[train] has unknown key 'schedule'"),
    ],
)
def test_bad_watch_flags_are_one_line(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "log.png").mkdir()
    (tmp_path / "bad_train.toml").write_text(
        '[mesh]\ndata = -1\n[rules]\nbatch = "data"\n[train]\nschedule = "cosine"\n'
    )
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code = main(["train", "--model", "mlp", "--preset", "tiny", "--steps", "5", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("meshdsl train: error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_terminal_gets_a_bar_with_loss_throughput_and_eta():
    out = io.StringIO()
    progress = Progress(0, 4, "tokens", out, live=True)
    for step in range(1, 5):
        progress.update(Step(step, 2.0 / step, 0.01, 1e-3, 1000.0, 0.25, eval_loss=1.5 if step == 2 else None))
    text = out.getvalue()
    assert "4/4" in text and "loss 0.5000" in text and "1,000 tokens/s" in text and "MFU 25.0%" in text
    assert "<" in text  # tqdm's elapsed<remaining
    assert "step 2:  eval loss 1.5000" in text


def test_a_resumed_run_s_logs_replace_the_killed_run_s_later_steps(tmp_path):
    """Killed at step 5 (mid-way through writing step 6's JSON line) with its checkpoint at step 3,
    then resumed: tensorboard's own reader and the JSON log show each step once, steps 4-6 from the
    resumed run, and the loss curve is drawn from all six."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshdsl.train.logs import Logs

    log = tmp_path / "log.jsonl"
    killed = Logs(str(log), str(tmp_path / "tb"))
    for step in range(1, 6):
        killed.write(step, {"loss": float(step), "eval_loss": 0.5} if step == 2 else {"loss": float(step)})
    killed.board.close()  # what reached the disk before the kill (tensorboardX writes from a thread)
    killed.json.write('{"step": 6, "lo')
    killed.json.flush()
    resumed = Logs(str(log), str(tmp_path / "tb"), first=3)
    for step in range(4, 7):
        resumed.write(step, {"loss": 10.0 + step})
    assert resumed.close() == tmp_path / "log.png"
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0, "eval_loss": 0.5},
        {"step": 3, "loss": 3.0},
        {"step": 4, "loss": 14.0},
        {"step": 5, "loss": 15.0},
        {"step": 6, "loss": 16.0},
    ]
    assert resumed.curve == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    assert resumed.eval_curve == [(2, 0.5)]
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 14.0),
        (5, 15.0),
        (6, 16.0),
    ]


def test_accumulation_of_a_batch_without_a_batch_dim_says_how_to_name_it():
    model = Regression(rows="examples")
    del model.batch_dim
    trainer = Trainer(model, optim.sgd(1.0), md.Mesh({"data": 2}), md.Layout("examples:data"), accumulate=2)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    with pytest.raises(
        md.ConfigError, match="needs a dim 'batch' to cut, got \\[examples=16, features=6\\]; .*batch_dim"
    ):
        trainer.step(state, jax.random.key_data(jax.random.key(1)))


def test_resume_may_change_what_is_recomputed_or_chunked_not_what_is_computed():
    """A checkpoint saved before ``remat_policy`` and ``loss_chunk`` existed (or with other values)
    resumes; another ``d_model`` is refused, naming it."""
    from meshdsl.train.resume import check_config

    saved = {"step": 3, "config": {"d_model": 32, "remat": False}}
    mine = {"d_model": 32, "remat": True, "remat_policy": "dots", "loss_chunk": 8}
    check_config(Path("ckpt/step_3"), saved, mine, "transformer")
    with pytest.raises(md.ConfigError, match=r"different transformer config: d_model=32 \(this run: 64\)$"):
        check_config(Path("ckpt/step_3"), saved, {**mine, "d_model": 64}, "transformer")
