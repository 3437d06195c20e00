"""Faults from outside: checkpoints damaged or shared, disks that fill, outputs that are inputs, bad flags.

Each command case asserts its exit status, a single line ``meshdsl <command>: error: ...`` naming
the problem, no traceback, and that the files around it are exactly as before. The multi-process
faults (a frozen process) are in ``tests/test_multiprocess.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_errors import one_error_line, snapshot

import meshdsl as md
from meshdsl import cli
from meshdsl.train.loop import RunConfig, train

ROOT = Path(__file__).resolve().parents[1]
MLP = ["--model", "mlp", "--preset", "tiny"]
HANG_GUARD_S = 600  # only stops a hung run from stalling CI; never a performance bound


def _state(mesh: md.Mesh, layout: md.Layout) -> dict:
    """Two tensors of one shape (so a swapped pointer would load silently), an array, a None."""
    rng = np.random.default_rng(0)
    shape = md.Shape([md.Dim("d_model", 16), md.Dim("d_ff", 8)])

    def tensor() -> md.Tensor:
        value = rng.standard_normal(shape.sizes).astype(np.float32)
        return md.Tensor(jax.device_put(value, layout.sharding(mesh, shape)), shape)

    return {"mu": {"norm1": tensor(), "norm2": tensor()}, "count": jnp.int32(3), "empty": None}


def _cli_env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_llvm_disable_expensive_passes=true"}


def _meshdsl(*argv: str, cwd: Path, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshdsl.cli", *argv],
        cwd=cwd,
        env=env or _cli_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
        **kwargs,
    )


# ---- checkpoints: the manifest's checksum --------------------------------------------------------------------------


def test_a_changed_array_pointer_in_the_manifest_is_detected(tmp_path: Path) -> None:
    """The issue's case: one digit of a leaf's ``arrays/N`` changed so it names another array of the
    same shape. Before the checksum, mu['norm1'] silently loaded mu['norm2']."""
    mesh, layout = md.Mesh({"data": 8}), md.Layout("d_model:data")
    md.checkpoint.save(tmp_path / "good", _state(mesh, layout))
    manifest = json.loads((tmp_path / "good" / "manifest.json").read_text())
    first, second = (r for r in manifest["leaves"] if r["path"].startswith("['mu']"))
    first["array"] = second["array"]
    (tmp_path / "good" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with pytest.raises(md.DataError, match=r"good' is corrupt: manifest.json does not match its checksum"):
        md.checkpoint.restore(tmp_path / "good", mesh, layout)
    manifest["metadata"]["lr"] = 1.0  # any other edit too
    (tmp_path / "good" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(md.DataError, match="does not match its checksum"):
        md.checkpoint.read_manifest(tmp_path / "good")


def test_none_leaves_survive_a_restore_without_like(tmp_path: Path) -> None:
    mesh, layout = md.Mesh({"data": 8}), md.Layout("d_model:data")
    state = _state(mesh, layout)
    md.checkpoint.save(tmp_path / "c", state)
    got, _ = md.checkpoint.restore(tmp_path / "c", mesh, layout)
    assert got["empty"] is None and set(got) == {"mu", "count", "empty"}
    np.testing.assert_array_equal(np.asarray(got["mu"]["norm2"].array), np.asarray(state["mu"]["norm2"].array))
    liked, _ = md.checkpoint.restore(tmp_path / "c", mesh, layout, like=state)
    assert liked["empty"] is None and int(liked["count"]) == 3


def test_fsdp_parameters_restored_with_the_compute_split_keep_their_split(tmp_path: Path) -> None:
    """FSDP: parameters are stored split by the ``params`` rules. Restoring with the compute layout
    (whose rules do not split d_model) once replicated them: each device held the whole tensor."""
    mesh = md.Mesh({"data": 8})
    fsdp = md.Layout("batch:data", params="d_model:data")
    state = _state(mesh, fsdp.param_layout)
    md.checkpoint.save(tmp_path / "c", state)
    got, _ = md.checkpoint.restore(tmp_path / "c", mesh, fsdp)
    array = got["mu"]["norm1"].array
    assert array.sharding.shard_shape(array.shape) == (2, 8)
    np.testing.assert_array_equal(np.asarray(array), np.asarray(state["mu"]["norm1"].array))


def test_swapped_or_wrong_arguments_are_md_errors(tmp_path: Path) -> None:
    mesh = md.Mesh({"data": 8})
    state = {"x": jnp.ones(3)}
    with pytest.raises(md.ConfigError, match=r"checkpoint.save\(path, state\): path is a dict, not a path .*swapped"):
        md.checkpoint.save(state, tmp_path / "c")
    md.checkpoint.save(tmp_path / "c", state)
    with pytest.raises(md.ConfigError, match=r"path is a Mesh, not a path"):
        md.checkpoint.restore(mesh, tmp_path / "c")
    with pytest.raises(md.ConfigError, match=r"mesh is a str, not an md.Mesh; the path comes first, then the mesh"):
        md.checkpoint.restore(tmp_path / "c", "data=8")
    with pytest.raises(md.ConfigError, match=r"save_every is '5' \(a str\); it must be an integer"):
        md.checkpoint.CheckpointManager(tmp_path / "m", save_every="5")
    manager = md.checkpoint.CheckpointManager(tmp_path / "m")
    with pytest.raises(md.ConfigError, match="step is -1"):
        manager.save(-1, state)
    with pytest.raises(md.ConfigError, match=r"step is 5.0 \(a float\)"):
        manager.save(5.0, state)
    assert not (tmp_path / "m").exists()


# ---- checkpoints: one run per directory ----------------------------------------------------------------------------


def test_a_locked_directory_refuses_a_second_manager_and_a_dead_runs_lock_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from meshdsl.checkpoint.lock import DirLock; DirLock(sys.argv[1]).acquire(); "
                "print('held', flush=True); time.sleep(600)"
            ),
            str(tmp_path / "ck"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        manager = md.checkpoint.CheckpointManager(tmp_path / "ck")
        refused = rf"checkpoint dir '.*ck' is in use by another run \(process {holder.pid} on host "
        with pytest.raises(md.ConfigError, match=refused):
            manager.save(1, {"x": jnp.ones(3)})
        assert manager.steps() == []
    finally:
        holder.kill()
        holder.wait()
    # the dead holder's lock file is left behind; the kernel dropped its flock
    assert str(holder.pid) in (tmp_path / "ck" / ".meshdsl-lock").read_text()
    took = f"took over the lock of '{tmp_path / 'ck'}' left by process {holder.pid}, which no longer runs"
    assert manager.acquire() == took
    manager.save(1, {"x": jnp.ones(3)})
    manager.release()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_1"]


TRAINER = ["train", *MLP, "--steps", "40", "--checkpoint-dir", "ck", "--save-every", "1", "--keep", "50"]


def test_two_trainers_on_one_directory_never_crash_or_overwrite(tmp_path: Path) -> None:
    """The second trainer on a directory in use is refused at its start, in one line; the first
    runs on undisturbed and commits every step's checkpoint, each of its own run."""
    first = subprocess.Popen(
        [sys.executable, "-m", "meshdsl.cli", *TRAINER],
        cwd=tmp_path,
        env=_cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in first.stdout:
            if line.startswith("saved checkpoint"):
                break
        # Paused while the second starts (a loaded machine could otherwise finish all 40 steps first);
        # a stopped process still holds its lock.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = _meshdsl(*TRAINER[:-4], "--resume", "--checkpoint-dir", "ck", cwd=tmp_path)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=HANG_GUARD_S)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr
    one_error_line(second.stderr, "checkpoint dir 'ck' is in use by another run", f"process {first.pid}")
    assert first.returncode == 0 and "Traceback" not in err, err
    assert md.checkpoint.steps(tmp_path / "ck") == list(range(1, 41))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted(f"step_{s}" for s in range(1, 41))


# ---- checkpoints: a save that cannot be written --------------------------------------------------------------------


LIMITED = (
    "import os, resource, signal, sys; limit = int(sys.argv[1]); signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); os.execv(sys.executable, [sys.executable, "
    "*sys.argv[2:]])"
)
"""Runs a command whose files cannot grow past ``argv[1]`` bytes (``ulimit -f``); writing past it is
an error (EFBIG), not the SIGXFSZ that would kill the process."""


def test_a_save_past_the_file_size_limit_says_which_step_why_and_what_is_intact(tmp_path: Path) -> None:
    """``ulimit -f``: the resumed run cannot write step_2. One line names the step, the cause and
    the intact step_1; step_1 still restores; nothing half-written is left."""
    assert _meshdsl("train", *MLP, "--steps", "1", "--checkpoint-dir", "ck", cwd=tmp_path).returncode == 0
    before = snapshot(tmp_path)
    limited = [
        sys.executable,
        "-c",
        LIMITED,
        "200",
        "-m",
        "meshdsl.cli",
        "train",
        *MLP,
        "--steps",
        "2",
        "--checkpoint-dir",
        "ck",
        "--resume",
    ]
    done = subprocess.run(
        limited, cwd=tmp_path, env=_cli_env(), capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert done.returncode == 2, done.stderr
    intact = "the newest intact checkpoint is 'ck/step_1'"
    one_error_line(done.stderr, "checkpoint of step 2 not saved", "File too large", intact)
    assert "step 2/2" in done.stdout  # the step ran; only its save failed
    assert snapshot(tmp_path) == before
    state, metadata = md.checkpoint.restore(tmp_path / "ck" / "step_1", md.Mesh({"data": 8}))
    assert metadata["step"] == 1


# ---- checkpoints: the directory given ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step_1 and step_2 of the tiny MLP."""
    where = tmp_path_factory.mktemp("trained")
    run = RunConfig(model="mlp", preset="tiny", steps=2, checkpoint_dir=str(where / "ckpt"), save_every=1)
    train(run, io.StringIO())
    np.save(where / "tokens.npy", (np.arange(5000) % 64).astype(np.int32))
    return where


def _cli(
    argv: list[str], where: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    monkeypatch.chdir(where)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_checkpoint_given_as_the_checkpoint_dir_is_refused(trained: Path, capsys, monkeypatch) -> None:
    before = snapshot(trained)
    argv = ["train", *MLP, "--steps", "4", "--checkpoint-dir", "ckpt/step_2", "--resume"]
    code, out, err = _cli(argv, trained, capsys, monkeypatch)
    assert code == 2 and out == ""
    one_error_line(
        err, "checkpoint dir 'ckpt/step_2' is itself a checkpoint", "give the directory that holds it, 'ckpt'"
    )
    assert snapshot(trained) == before


CLASHES = {
    "the log overwrites the resumed checkpoint's manifest": (
        ["--checkpoint-dir", "ckpt", "--resume", "--log-json", "ckpt/step_2/manifest.json"],
        ["--log-json 'ckpt/step_2/manifest.json' is inside --checkpoint-dir 'ckpt'", "choose a path outside it"],
    ),
    "TensorBoard writes into the checkpoint dir": (
        ["--checkpoint-dir", "ckpt", "--resume", "--tensorboard", "ckpt"],
        ["--tensorboard 'ckpt' is inside --checkpoint-dir 'ckpt'"],
    ),
    "the log is its own loss curve": (
        ["--log-json", "run.png"],
        ["--log-json 'run.png' and --log-json's loss curve 'run.png' are the same path"],
    ),
    "the log is the TensorBoard folder": (
        ["--log-json", "x", "--tensorboard", "x"],
        ["--log-json 'x' and --tensorboard 'x' are the same path"],
    ),
    "the log is the trace folder": (
        ["--profile-steps", "1:1", "--profile-dir", "x", "--log-json", "x"],
        ["--log-json 'x' and --profile-dir 'x' are the same path"],
    ),
    "the trace folder is inside the log": (
        ["--profile-steps", "1:1", "--profile-dir", "x/trace", "--log-json", "x"],
        ["--profile-dir 'x/trace' is inside --log-json 'x', which is written as a file"],
    ),
    "a user's folder where the last step saves": (
        ["--checkpoint-dir", "user", "--steps", "3"],
        ["checkpoint 'user/step_3' is a directory that holds files but no manifest.json", "save its step 3 there"],
    ),
    "a user's file where a signal could save": (
        ["--checkpoint-dir", "other", "--steps", "5", "--save-every", "5"],
        ["'other/step_4' is a file", "save its step 4 there"],
    ),
}


@pytest.mark.parametrize("argv, expected", list(CLASHES.values()), ids=list(CLASHES))
def test_an_output_in_another_outputs_way_is_refused_before_the_work(
    argv, expected, trained: Path, capsys, monkeypatch
) -> None:
    """Outputs against each other and the checkpoint dir's contents: refused before step 1, nothing changed."""
    (trained / "user" / "step_3").mkdir(parents=True, exist_ok=True)
    (trained / "user" / "step_3" / "notes.txt").write_text("mine")
    (trained / "other").mkdir(exist_ok=True)
    (trained / "other" / "step_4").write_text("mine too")
    before = snapshot(trained)
    code, out, err = _cli(["train", *MLP, "--steps", "4", *argv], trained, capsys, monkeypatch)
    assert code == 2 and out == "", err
    one_error_line(err, *expected)
    assert snapshot(trained) == before


# ---- outputs: checked before the work, never an input, failures in one line ----------------------------------------

LM = ["--model", "transformer", "--preset", "tiny", "--steps", "2"]
SEARCH = ["search", "--model", "mlp", "--preset", "tiny", "--profile", "cpu-sim"]
OUTPUT_CASES = {
    "log-json is the token file": (
        ["train", *LM, "--data", "t.npy", "--log-json", "t.npy"],
        ["--log-json 't.npy' is also the --data input", "would destroy it"],
    ),
    "log-json is the token file by another name": (
        ["train", *LM, "--data", "t.npy", "--log-json", "./sub/../t.npy"],
        ["is also the --data input"],
    ),
    "log-json is the layout file": (
        ["train", *MLP, "--layout", "l.toml", "--log-json", "l.toml"],
        ["is also the --layout input"],
    ),
    "log-json is /dev/full": (
        ["train", *MLP, "--log-json", "/dev/full"],
        ["--log-json '/dev/full' cannot be written: No space left on device"],
    ),
    "log-json under /proc": (
        ["train", *MLP, "--log-json", "/proc/nonexistent/x"],
        ["--log-json '/proc/nonexistent/x'", "directory '/proc'"],
    ),
    "checkpoint dir under /proc": (
        ["train", *MLP, "--checkpoint-dir", "/proc/nonexistent/ck"],
        ["--checkpoint-dir '/proc/nonexistent/ck': no file can be created in directory '/proc'"],
    ),
    "bench out under /proc": (
        ["bench", *MLP, "--rounds", "1", "--out", "/proc/nonexistent/x"],
        ["--out '/proc/nonexistent/x'", "'/proc'"],
    ),
    "search out under /proc": (
        [*SEARCH, "--out", "/proc/nonexistent/x.toml"],
        ["--out '/proc/nonexistent/x.toml'", "'/proc'"],
    ),
    "search out is its profile": (
        [*SEARCH[:-1], "p.json", "--out", "p.json"],
        ["--out 'p.json' is also the --profile input"],
    ),
    "calibrate out is /dev/full": (
        ["calibrate", "--out", "/dev/full"],
        ["--out '/dev/full' cannot be written: No space left on device"],
    ),
}


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A token file, a layout file, a device profile and a folder, made the working directory."""
    from meshdsl.planner.profile import load_profile

    np.save(tmp_path / "t.npy", (np.arange(5000) % 64).astype(np.int32))
    (tmp_path / "l.toml").write_text('[mesh]\ndata = -1\n[rules]\nbatch = "data"\n')
    load_profile("cpu-sim").save(tmp_path / "p.json")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, expected", list(OUTPUT_CASES.values()), ids=list(OUTPUT_CASES))
def test_an_output_that_cannot_be_written_or_is_an_input_is_refused_before_the_work(
    argv, expected, workspace, capsys
) -> None:
    before = snapshot(workspace)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    one_error_line(err, *expected)
    assert out == ""  # refused before any device was used: nothing calibrated, trained or measured
    assert snapshot(workspace) == before


def test_a_log_that_stops_growing_mid_run_is_one_line_naming_the_step(tmp_path: Path) -> None:
    """The log file reaches the file size limit after a few steps: one line names the file, the step
    and the cause; the steps before it are in the log, whole."""
    limited = [
        sys.executable,
        "-c",
        LIMITED,
        "300",
        "-m",
        "meshdsl.cli",
        "train",
        *MLP,
        "--steps",
        "30",
        "--log-json",
        "log.jsonl",
    ]
    done = subprocess.run(
        limited, cwd=tmp_path, env=_cli_env(), capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert done.returncode == 2, done.stderr
    line = one_error_line(
        done.stderr, "--log-json 'log.jsonl' at step", "could not be written: File too large", "steps before it"
    )
    failed = int(re.search(r"at step (\d+)", line).group(1))
    logged = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(text)["step"] for text in logged[: failed - 1]] == list(range(1, failed))


# ---- processes: refused before any starts --------------------------------------------------------------------------

LAUNCH_CASES = {
    "3 processes for a 2-way tensor parallel layout": (
        ["launch", "--local", "3", "--", "train", *MLP, "--layout", "dp_tp"],
        ["--local 3 x 2 devices per process = 6 devices do not fit", "not divisible by 3"],
    ),
    "9 processes for the mlp": (
        ["launch", "--local", "9", "--", "train", *MLP],
        ["--local 9 x 1 devices per process = 9 devices do not fit", "dim batch (size 16)", "mesh axis data (size 9)"],
    ),
    "a fixed mesh of 8 on 4 devices": (
        ["launch", "--local", "2", "--devices-per-process", "2", "--", "train", *MLP, "--layout", "fixed.toml"],
        ["= 4 devices do not fit", "needs 8 devices, but only 4"],
    ),
    "a layout file without a mesh": (
        ["launch", "--local", "2", "--", "train", *MLP, "--layout", "nomesh.toml"],
        ["names no mesh", "[mesh] table"],
    ),
    "coordinator given to launch": (
        ["--coordinator", "127.0.0.1:1234", "launch", "--local", "2", "--", "train", *MLP],
        ["--coordinator: meshdsl launch starts its own processes and coordinator"],
    ),
}


@pytest.mark.parametrize("argv, expected", list(LAUNCH_CASES.values()), ids=list(LAUNCH_CASES))
def test_a_launch_that_cannot_work_starts_no_process(argv, expected, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "fixed.toml").write_text('[mesh]\ndata = 8\n[rules]\nbatch = "data"\n')
    (tmp_path / "nomesh.toml").write_text('[rules]\nbatch = "data"\n')
    monkeypatch.chdir(tmp_path)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    one_error_line(err, *expected)
    assert out == "" and "pid" not in err  # the launcher's first line, listing the processes, never came


# ---- flags and environment: one line, not a traceback nor silence --------------------------------------------------

FLAG_CASES = {
    "seed beyond 64 bits": (
        ["train", *MLP, "--seed", str(10**23)],
        ["--seed 100000000000000000000000: a seed is a 64-bit integer"],
    ),
    "compute dtype fp32": (
        ["train", "--model", "transformer", "--preset", "tiny", "--set", "compute_dtype=fp32"],
        ["--set compute_dtype=fp32: the compute dtype is one of float32, bfloat16"],
    ),
    "schedule without a pipeline": (
        ["train", *MLP, "--schedule", "gpipe"],
        ["--schedule gpipe: layout 'data_parallel' has no pipeline"],
    ),
    "grad reduce dtype under gspmd": (
        ["train", *MLP, "--backend", "gspmd", "--grad-reduce-dtype", "bfloat16"],
        ["--grad-reduce-dtype bfloat16 is for --backend spmd", "under gspmd XLA chooses"],
    ),
    "launch a schedule without a pipeline": (
        ["launch", "--local", "2", "--", "train", *MLP, "--schedule", "1f1b"],
        ["meshdsl train: error: --schedule 1f1b: layout 'data_parallel' has no pipeline"],
    ),
}


@pytest.mark.parametrize("argv, expected", list(FLAG_CASES.values()), ids=list(FLAG_CASES))
def test_a_flag_that_would_overflow_or_be_ignored_is_refused(argv, expected, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    one_error_line(err, *expected)
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["train", *MLP], ["launch", "--local", "2", "--", "train", *MLP]])
def test_a_device_count_in_xla_flags_that_is_no_number_isone_error_line(command, tmp_path, monkeypatch, capsys) -> None:
    """XLA would print its 94-line flag help and abort."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=abc")
    code = cli.main(command)
    _, err = capsys.readouterr()
    assert code == 2
    one_error_line(err, "XLA_FLAGS has --xla_force_host_platform_device_count=abc", "positive integer")


def test_a_platform_that_cannot_start_isone_error_line(tmp_path: Path) -> None:
    """JAX_PLATFORMS=cuda on a machine without a GPU plugin: JAX raises a bare AssertionError."""
    try:
        jax.devices("cuda")
    except RuntimeError:
        pass
    else:
        pytest.skip("this machine has a cuda device")
    done = _meshdsl("train", *MLP, "--steps", "1", cwd=tmp_path, env={**_cli_env(), "JAX_PLATFORMS": "cuda"})
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, "JAX_PLATFORMS='cuda': JAX could not start its devices", "set it to cpu")
    assert list(tmp_path.iterdir()) == []


def test_explain_refuses_an_unknown_platform() -> None:
    mesh = md.Mesh({"data": 8})
    x = md.tensor(np.ones((8, 4), np.float32), "batch d")
    with pytest.raises(md.ConfigError, match=r"platform 'tpu9' is not one of cpu, gpu, cuda, rocm, tpu"):
        md.explain(lambda t: md.reduce_sum(t, "batch"), mesh, "batch:data", x, platform="tpu9")
