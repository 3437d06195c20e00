"""Multi-process runs: ``meshdsl launch`` against a one-process run, a killed process, bad flags.

These start real processes (2 x 4 simulated CPU devices, joined through gloo), so each launch
costs a JAX start-up and a compile; the models are the smallest presets.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshdsl.errors import ConfigError
from meshdsl.runtime import distributed
from meshdsl.runtime import launch as launch_module
from meshdsl.runtime.launch import describe, free_port
from meshdsl.train.loop import RunConfig, train

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600  # only stops a hung run from stalling CI; never a performance bound
# The launched processes compile as this one does (unoptimised LLVM, conftest.py) and also skip
# LLVM's expensive passes; the losses still agree with the one-process reference to 1e-5.
FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}", **extra}


def _launch_cmd(*run: str, processes: int = 2, top: tuple[str, ...] = ()) -> list[str]:
    """``meshdsl [top flags] launch --local N --devices-per-process 4 -- <run>``."""
    return [
        sys.executable,
        "-m",
        "meshdsl.cli",
        *top,
        "launch",
        "--local",
        str(processes),
        "--devices-per-process",
        "4",
        "--",
        *run,
    ]


def _pids(output: str) -> list[int]:
    """The children's pids from the launcher's first line."""
    return [int(p) for p in re.findall(r"process \d+ pid (\d+)", output)]


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


LAYOUTS = ["dp_tp", "fsdp", "pipeline_across"]
STEPS = 3

# 1F1B over ``stage`` with remat, one layer a stage (the tiny preset's 2 layers): each backward's stored residuals
# wait for the output gradient through ``pipeline.run._after``, whose ``pmax`` joins the gradients of weights split
# over ``model``. ``model`` is the mesh's first axis, so it is the one that spans the two processes (each holds 4
# consecutive devices): that pmax and the Megatron all-reduces go between processes, through gloo.
PIPELINE_ACROSS = """description = "1F1B with remat, model split across the processes"

[mesh]
model = 2
stage = 2
data = 2

[rules]
layers = "stage"
batch = "data"
heads = "model"
d_ff = "model"
vocab = "model"

[pipeline]
microbatches = 4
schedule = "1f1b"

[train]
remat = true
"""


def _layout_arg(layout: str, folder: Path) -> str:
    """``--layout``'s value for ``layout``: a shipped name, or for ``pipeline_across`` a file written to ``folder``."""
    if layout != "pipeline_across":
        return layout
    path = folder / "pipeline_across.toml"
    path.write_text(PIPELINE_ACROSS)
    return str(path)


def _start_training(layout: str, folder: Path) -> subprocess.Popen:
    """``meshdsl launch`` of a 2-process training run under ``layout``; its output goes to ``folder``."""
    cmd = _launch_cmd(
        "train",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--layout",
        _layout_arg(layout, folder),
        "--steps",
        str(STEPS),
        "--log-json",
        str(folder / "losses.jsonl"),
        "--checkpoint-dir",
        str(folder / "ckpt"),
        "--save-every",
        "2",
    )
    with open(folder / "output.txt", "w") as output:
        # PYTHONFAULTHANDLER: a crash inside the runtime prints the Python stack it happened under.
        env = _env(PYTHONFAULTHANDLER="1")
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)


def _finished(proc: subprocess.Popen, folder: Path) -> int:
    """The launch's exit status; a hung launch fails the test with its output."""
    try:
        return proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"meshdsl launch hung:\n{(folder / 'output.txt').read_text()}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """Both layouts' 2-process runs, started together: they overlap each other and the references."""
    runs = {}
    for layout in LAYOUTS:
        folder = tmp_path_factory.mktemp(layout)
        runs[layout] = (_start_training(layout, folder), folder)
    yield runs
    for proc, folder in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_leftovers(_pids((folder / "output.txt").read_text()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_match_one(layout: str, launched: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """2 processes x 4 devices train exactly as 1 process x 8 devices, and only process 0 prints."""
    proc, folder = launched[layout]
    run = RunConfig(model="transformer", preset="tiny", layout=_layout_arg(layout, folder), steps=STEPS)
    reference = train(run, out=io.StringIO())
    code = _finished(proc, folder)
    if code == 128 + signal.SIGSEGV:
        # XLA:CPU's gloo collectives crash now and then on a loaded 2-core host (CI saw it once in
        # many runs, in fsdp's reduce-scatter program; openxla/xla#16430 and jax-ml/jax#40830 are
        # the runtime's open faults there). A crash is never taken for a pass: the run starts again,
        # once, and must then train exactly as one process does.
        first = (folder / "output.txt").read_text()
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
        (folder / "losses.jsonl").unlink(missing_ok=True)
        proc = _start_training(layout, folder)
        launched[layout] = (proc, folder)  # the checkpoint test reads this run's files
        code = _finished(proc, folder)
        print(f"the first launch was killed by SIGSEGV; its output:\n{first}")
    output = (folder / "output.txt").read_text()
    assert code == 0, output
    got = [json.loads(line) for line in (folder / "losses.jsonl").read_text().splitlines()]
    assert [g["step"] for g in got] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([g["loss"] for g in got], reference, rtol=1e-5)
    assert "[p0] meshdsl train: transformer tiny on mesh" in output
    assert re.search(rf"\[p0\] step +{STEPS}/{STEPS} ", output)
    assert not re.search(r"\[p1\] (meshdsl train|step)", output), output


def test_checkpoint_saved_by_two_processes_resumes_in_one(
    launched: dict[str, tuple[subprocess.Popen, Path]], tmp_path: Path
) -> None:
    """Each of 2 processes wrote its own shards of step 2 (dp_tp); one process on 8 devices resumes it
    under fsdp (resharding) and its step 3 has the loss the 2-process run logged."""
    proc, folder = launched["dp_tp"]
    assert proc.wait(timeout=HANG_GUARD_S) == 0, (folder / "output.txt").read_text()
    logged = [json.loads(line)["loss"] for line in (folder / "losses.jsonl").read_text().splitlines()]
    resumed_dir = tmp_path / "ckpt"
    shutil.copytree(folder / "ckpt" / "step_2", resumed_dir / "step_2")
    manifest = json.loads((resumed_dir / "step_2" / "manifest.json").read_text())
    assert manifest["processes"] == 2
    run = RunConfig(
        model="transformer", preset="tiny", layout="fsdp", steps=STEPS, checkpoint_dir=str(resumed_dir), resume=True
    )
    resumed = train(run, out=io.StringIO())
    np.testing.assert_allclose(resumed, logged[2:], rtol=1e-5)


def test_killed_process_stops_the_run() -> None:
    """SIGKILL process 1 mid-run: process 0 stops by itself (it aborts, told by the coordinator's
    heartbeat check, given with ``--heartbeat-timeout`` at the default's value, or by gloo), not
    by the launcher, and the launcher stops, naming process 1 as the cause. No wall-clock bound:
    the hang guard only keeps a broken run from hanging the suite."""
    timeout = distributed.HEARTBEAT_TIMEOUT_S
    cmd = _launch_cmd(
        "train",
        "--model",
        "mlp",
        "--preset",
        "tiny",
        "--layout",
        "data_parallel",
        "--steps",
        "100000",
        top=("--heartbeat-timeout", str(timeout), "--verbose"),
    )  # --verbose: JAX's own words about process 1
    env = {k: v for k, v in _env().items() if k != distributed.HEARTBEAT_ENV}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard = threading.Timer(HANG_GUARD_S, proc.kill)
    guard.start()
    lines: list[str] = []
    pids: list[int] = []
    killed = stopped = False
    try:
        for line in proc.stdout:
            lines.append(line)
            pids = pids or _pids(line)
            if not killed and re.match(r"\[p0\] step +1/", line):
                os.kill(pids[1], signal.SIGKILL)
                killed = True
            stopped = stopped or "because of it" in line  # the launcher's last line: every process has ended
        code = proc.wait()
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
        _kill_leftovers(pids)
    output = "".join(lines)
    assert killed and stopped, output
    assert code == 128 + signal.SIGKILL, output  # the first failure's status, not the hang guard's kill
    # "stopping the others" comes only if the launcher saw process 1 dead while process 0 still ran;
    # where process 0 aborted within the same look, the last line alone names process 1 first
    stopping = re.findall(r"meshdsl launch: process (\d) was killed by SIGKILL; stopping the others", output)
    assert stopping in ([], ["1"]), output
    assert re.search(
        r"meshdsl launch: process 1 was killed by SIGKILL first; then, because of it: process 0 "
        r"(was killed by SIGABRT|exited with code 1)",
        output,
    ), output
    # a survivor's collective that gloo ended says so in a line, not a Python traceback of where it stood
    assert "Traceback (most recent call last)" not in output, output
    # process 0 stops by itself, told either by JAX's coordinator (which names the task whose
    # heartbeats stopped) or, when a collective was in flight, by gloo's broken connection
    heartbeat = re.search(r"\[p0\] .*tasks are unhealthy \(stopped sending heartbeats\):\s*\n\[p0\] 1\n", output)
    assert heartbeat or re.search(r"\[p0\] .*gloo", output), output
    # JAX's C++ stack trace of the stopped process is counted, not printed
    assert "Check failure stack trace" not in output and not re.search(r"\]\s+@\s+0x", output), output
    assert not any(_alive(pid) for pid in pids)


def test_heartbeat_timeout_from_flag_environment_or_default() -> None:
    """The flag wins over ``MESHDSL_HEARTBEAT_TIMEOUT``, which wins over the default; this JAX takes it."""
    env = {distributed.HEARTBEAT_ENV: "3"}
    assert distributed.heartbeat_timeout(7, env) == 7
    assert distributed.heartbeat_timeout(None, env) == 3
    assert distributed.heartbeat_timeout(None, {}) == distributed.HEARTBEAT_TIMEOUT_S
    assert distributed._options(7)["heartbeat_timeout_seconds"] == 7


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"coordinator": "127.0.0.1:1234", "num_processes": 2, "process_id": 3},
            "--process-id 3 is outside 0..1 for --num-processes 2",
        ),
        ({"coordinator": "127.0.0.1:1234", "num_processes": 2}, "needs --process-id"),
        ({"num_processes": 2, "process_id": 0}, "needs --coordinator HOST:PORT"),
        ({"coordinator": "127.0.0.1", "num_processes": 2, "process_id": 0}, "'127.0.0.1' is not HOST:PORT"),
        ({"coordinator": "127.0.0.1:1234", "process_id": 0}, "needs --num-processes"),
    ],
)
def test_bad_process_flags(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        distributed.resolve(**flags, environ={})


def test_process_group_from_flags_environment_and_cluster() -> None:
    env = {distributed.COORDINATOR_ENV: "h:1", distributed.NUM_PROCESSES_ENV: "4", distributed.PROCESS_ID_ENV: "2"}
    assert distributed.resolve(environ=env) == distributed.ProcessGroup("h:1", 4, 2)
    assert distributed.resolve(process_id=3, environ=env) == distributed.ProcessGroup("h:1", 4, 3)
    assert distributed.resolve(environ={}) is None
    assert distributed.resolve(num_processes=1, process_id=0, environ={}) is None
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert distributed.resolve(environ={**slurm, "SLURM_NTASKS": "2"}) == distributed.ProcessGroup(None, None, None)
    assert distributed.resolve(environ={**slurm, "SLURM_NTASKS": "1"}) is None
    with pytest.raises(ConfigError, match="MESHDSL_NUM_PROCESSES='two' is not an integer"):
        distributed.resolve(environ={distributed.NUM_PROCESSES_ENV: "two"})


def test_wait_for_coordinator() -> None:
    """A process other than 0 waits for the coordinator to listen, and says so when it never does."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        distributed.wait_for_coordinator(f"127.0.0.1:{listening.getsockname()[1]}", timeout=5)
    port = free_port()
    with pytest.raises(ConfigError, match=rf"no coordinator answers at 127.0.0.1:{port} after 1 s"):
        distributed.wait_for_coordinator(f"127.0.0.1:{port}", timeout=1)


def test_bad_process_id_on_the_command_line() -> None:
    """The CLI prints the mistake as one line and exits with 2 before starting anything."""
    cmd = [
        sys.executable,
        "-m",
        "meshdsl.cli",
        "--coordinator",
        "127.0.0.1:1234",
        "--num-processes",
        "2",
        "--process-id",
        "3",
        "train",
    ]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 2
    assert done.stderr.strip() == "meshdsl train: error: --process-id 3 is outside 0..1 for --num-processes 2"


def test_launch_rejects_other_commands() -> None:
    with pytest.raises(ConfigError, match="meshdsl launch runs train or bench.*got 'explain'"):
        launch_module.launch(["--", "explain"], 2)
    with pytest.raises(ConfigError, match="--local 0"):
        launch_module.launch(["train"], 0)


def test_launcher_stops_processes_that_outlive_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failure: the grace period, then SIGTERM, then SIGKILL for one that ignores SIGTERM."""
    monkeypatch.setattr(launch_module, "KILL_AFTER_S", 0.5)
    shell = ["exit 3", "sleep 60", "trap '' TERM; sleep 60"]
    children = [subprocess.Popen(["sh", "-c", s], start_new_session=True) for s in shell]
    err = io.StringIO()
    try:
        codes, first = launch_module._supervise(children, 0.5, err, launch_module._Forwarder(io.StringIO(), err))
    finally:
        _kill_leftovers([c.pid for c in children])
    assert codes == [3, -signal.SIGTERM, -signal.SIGKILL] and first == 0
    lines = err.getvalue().splitlines()
    assert lines[0] == "meshdsl launch: process 0 exited with code 3; stopping the others (at most 1 s)"
    assert lines[1] == "meshdsl launch: sending SIGTERM to the processes still running"
    assert lines[-1] == (
        "meshdsl launch: process 0 exited with code 3 first; then, because of it: process 1 was killed by SIGTERM, "
        "process 2 was killed by SIGKILL"
    )


@pytest.mark.parametrize(
    ("survivor", "code", "ended"),
    [("kill -ABRT $$", -signal.SIGABRT, "was killed by SIGABRT"), ("exit 1", 1, "exited with code 1")],
    ids=["aborted", "exited"],
)
def test_a_peer_that_ended_beside_a_killed_one_is_not_blamed(survivor: str, code: int, ended: str) -> None:
    """Process 1 killed and process 0 ending because of it, both ended by the launcher's first look:
    process 1 is named first. A survivor that notices a peer gone aborts (JAX's coordinator) or exits
    with a status (gloo's error in a collective, raised at once: seen in CI), never by another signal."""
    shell = (survivor, "kill -KILL $$")
    children = [subprocess.Popen(["sh", "-c", s], start_new_session=True) for s in shell]
    for child in children:  # both ended (zombies, not yet reaped) before the launcher looks
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)
    err = io.StringIO()
    codes, first = launch_module._supervise(children, 0.5, err, launch_module._Forwarder(io.StringIO(), err))
    assert codes == [code, -signal.SIGKILL] and first == 1
    assert err.getvalue().splitlines()[-1] == (
        f"meshdsl launch: process 1 was killed by SIGKILL first; then, because of it: process 0 {ended}"
    )


@pytest.mark.parametrize(
    "words",
    [
        "Gloo AllGather failed: [tcp/pair.cc:538] Read error [127.0.0.1]:15236: Connection reset by peer",
        "Gloo ReduceScatter failed: [gloo/transport/tcp/buffer.cc:72] Read timeout [::1]:38624",
        "Gloo ReduceScatter failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [::1]:2475",
        "Gloo context initialization failed: [external/xla++third_party_ext+gloo/gloo/transport/tcp/pair.cc:152] "
        "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:42398$32",
    ],
)
def test_a_collective_that_gloo_ended_is_said_in_a_line(words: str) -> None:
    """gloo's broken, refused or silent connection (the words of CI's failures, one a survivor's new gloo
    context on JAX 0.12 that found its peer gone, and of jax-ml/jax#40831) is named, with
    gloo's own words, as another process gone; any other error is not (its traceback is printed)."""
    import jax

    said = distributed.peer_gone(jax.errors.JaxRuntimeError(f"UNKNOWN: {words}\nmore lines"))
    assert said is not None and words in said and "another process of the run is gone or stalled" in said
    assert distributed.peer_gone(jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: invalid size")) is None
    assert distributed.peer_gone(ValueError("Connection reset by peer")) is None


def test_describe_exit() -> None:
    assert describe(2) == "exited with code 2"
    assert describe(-signal.SIGKILL) == "was killed by SIGKILL"


def test_a_frozen_process_is_named_by_the_launcher() -> None:
    """SIGSTOP process 1 mid-run: the launcher names process 1 as frozen (before process 0, whose
    heartbeat check aborts it, could be blamed), stops every process, and ends with process 1 as
    the cause. Without --verbose, no JAX runtime log line or Gloo message reaches the terminal."""
    cmd = _launch_cmd("train", "--model", "mlp", "--preset", "tiny", "--layout", "data_parallel", "--steps", "100000")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard = threading.Timer(HANG_GUARD_S, proc.kill)
    guard.start()
    lines: list[str] = []
    pids: list[int] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            pids = pids or _pids(line)
            if len(pids) == 2 and re.match(r"\[p0\] step +1/", line):
                os.kill(pids[1], signal.SIGSTOP)
        code = proc.wait()
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
        _kill_leftovers(pids)
    output = "".join(lines)
    named = output.find("meshdsl launch: process 1 is stopped (frozen: SIGSTOP or a debugger) and no longer answers")
    assert named >= 0, output
    assert "process 0 was killed" not in output[:named] and "stopping the others" not in output, output
    assert re.search(r"meshdsl launch: process 1 froze \(stopped\) and was killed by SIGKILL first", output), output
    assert code == 128 + signal.SIGKILL, output
    assert "[Gloo]" not in output and not re.search(r"\] [IWEF]\d{4} ", output), output
    assert not any(_alive(pid) for pid in pids)


def test_runtime_chatter_is_counted_unless_verbose() -> None:
    """Gloo's connection lines and JAX's absl log lines (with the lines continuing them) are counted,
    not forwarded; the process's own lines around them are forwarded, and --verbose forwards all."""
    stdout = [
        b"[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        b"[Gloo] Rank [Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        b"2 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        b"step 1/9 [##..] loss 1.0\n",
    ]
    stderr = [
        b"E1126 06:40:00.123456   1234 coordination_service.cc:12] tasks are unhealthy (stopped sending heartbeats):\n",
        b"1\n",
        b"RPC: /xla.coordination.CoordinationService/PollForError\n",
        b"\n",
        b"meshdsl train: error: something of ours\n",
    ]
    for verbose, shown in (
        (False, ["[p0] step 1/9 [##..] loss 1.0", "[p0] meshdsl train: error: something of ours"]),
        (True, None),
    ):
        out, err = io.StringIO(), io.StringIO()
        forward = launch_module._Forwarder(out, err, verbose)
        forward.follow(0, io.BytesIO(b"".join(stdout)), out)
        forward.follow(0, io.BytesIO(b"".join(stderr)), err)
        forward.join()
        got = out.getvalue().splitlines() + err.getvalue().splitlines()
        if verbose:
            assert len(got) == len(stdout) + len(stderr) and forward.omitted == {}
        else:
            assert got == shown and forward.omitted == {0: 7}
