"""SIGTERM and Ctrl-C during ``meshdsl train`` (:mod:`meshdsl.train.signals`): the work is saved, the
run ends in one line without a traceback, and a resume continues with the uninterrupted losses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from meshdsl.train.loop import RunConfig, train

HANG_GUARD_S = 600  # only stops a hung run from stalling CI; never a performance bound
STEPS = 200  # the run goes on long after the signal is sent, however fast the machine
RUN = ["train", "--model", "mlp", "--preset", "tiny", "--steps", str(STEPS), "--log-every", "1"]
RUN += ["--checkpoint-dir", "ck", "--log-json", "log.jsonl"]


def _env() -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_llvm_disable_expensive_passes=true"
    return {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": flags}


def _popen(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "meshdsl.cli", *argv],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _signal_after(proc: subprocess.Popen, prefix: str, sig: signal.Signals) -> tuple[str, str]:
    """Send ``sig`` once ``proc`` printed a line starting with ``prefix``; its whole stdout and stderr."""
    assert proc.stdout is not None
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(prefix):
                proc.send_signal(sig)
                break
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
    return "".join(seen) + out, err


def _losses(log: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps  # each step once
    return {r["step"]: (r["loss"], r["learning_rate"]) for r in records}


def test_sigterm_at_a_random_step_saves_it_and_the_resumed_run_has_the_uninterrupted_losses(tmp_path: Path) -> None:
    nth = random.randint(1, 20)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "meshdsl.cli", *RUN], cwd=whole, env=_env(), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr

    out, err = _signal_after(_popen(RUN, cut), f"step {nth:>{len(str(STEPS))}}/{STEPS}", signal.SIGTERM)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    stopped = int(last.split("stopped after step ")[1].split()[0])
    assert stopped >= nth and last == (
        f"meshdsl train: SIGTERM: stopped after step {stopped} of {STEPS}: saved ck/step_{stopped}; "
        "continue with --resume"
    ), (nth, err)
    assert sorted(p.name for p in (cut / "ck").iterdir()) == [f"step_{stopped}"]  # no lock, no .partial-
    assert sorted(_losses(cut / "log.jsonl")) == list(range(1, stopped + 1))

    resumed = subprocess.run(
        [sys.executable, "-m", "meshdsl.cli", *RUN, "--resume"],
        cwd=cut,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from ck/step_{stopped} at step {stopped}" in resumed.stdout
    assert _losses(cut / "log.jsonl") == _losses(whole / "log.jsonl")


def test_ctrl_c_while_compiling_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    out, err = _signal_after(_popen(RUN, tmp_path), "compiling", signal.SIGINT)
    assert err.strip().splitlines() == ["meshdsl train: Ctrl-C (SIGINT): before the first step: nothing to save"], err
    assert not (tmp_path / "ck").exists()  # the lock made the folder and took it away again
    assert not (tmp_path / "log.jsonl").exists()


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from meshdsl.train.signals import Stops

    with Stops(sys.stderr, release=lambda: print("released", flush=True)) as stops:
        stops.training()
        stops.step = 4
        os.kill(os.getpid(), signal.SIGINT)
        while stops.requested is None:
            time.sleep(0.01)
        print("requested", stops.requested, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print("a repeated signal other than Ctrl-C changes nothing", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(600)
    print("not reached")
    """
)


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert done.returncode == 130, done.stderr
    assert done.stdout.splitlines() == [
        "requested 2",
        "a repeated signal other than Ctrl-C changes nothing",
        "released",
    ]
    assert done.stderr.splitlines() == [
        "meshdsl train: Ctrl-C (SIGINT): finishing step 5, then saving and stopping (Ctrl-C again stops at once)",
        "meshdsl train: Ctrl-C (SIGINT): a second Ctrl-C during step 5: stopped at once, nothing more saved",
    ]


def test_without_a_signal_nothing_changes(tmp_path: Path) -> None:
    """The handlers are gone after the run: SIGINT is Python's KeyboardInterrupt again."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    run = RunConfig(model="mlp", preset="tiny", steps=2)
    with open(os.devnull, "w") as sink:
        assert len(train(run, out=sink, signals=True)) == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_closed_output_pipe_is_one_line(tmp_path: Path) -> None:
    """``meshdsl train ... | head -1``: the reader leaves; the run stops with one line, SIGPIPE's status."""
    proc = _popen(RUN, tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
    assert proc.returncode == 141, err
    assert err.strip().splitlines()[-1] == "meshdsl train: stopped: the reader of its output closed the pipe", err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not (tmp_path / "ck" / ".meshdsl-lock").exists()
