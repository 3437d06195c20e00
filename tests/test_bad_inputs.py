"""Bad inputs, as a new user makes them: each is caught before the work starts, as one line.

Every case runs ``meshdsl.cli.main`` in this process (or calls the API) in a folder of prepared
files: a file where a directory belongs, empty and binary files, broken layout and profile files,
and a trained checkpoint. Each case asserts exit status 2 (or the md error), a single line
``meshdsl <command>: error: ...`` naming the thing and the numbers, no traceback, that nothing was
trained (nothing printed at all when the mistake shows before any device is used), and that
every file and directory in the folder is exactly as before: nothing lost, nothing half-written.
API mistakes in ``md.Mesh``, ``md.cast`` and friends are in ``tests/test_api_errors.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_errors import one_error_line, snapshot

import meshdsl as md
from meshdsl import cli
from meshdsl.planner.profile import load_profile
from meshdsl.runtime.layout_spec import LAYOUTS, load_layout
from meshdsl.train import optim, rules
from meshdsl.train.data import TokenFile
from meshdsl.train.loop import RunConfig, build_model, rule_warnings, train
from meshdsl.train.step import Trainer
from meshdsl.train.token_batch import TokenBatch

ROOT = Path(__file__).resolve().parents[1]
MLP = ["--model", "mlp", "--preset", "tiny", "--steps", "1"]
LM = ["--model", "transformer", "--preset", "tiny", "--steps", "1"]
BENCH = ["bench", "--model", "mlp", "--preset", "tiny", "--rounds", "1", "--steps-per-round", "1"]
SEARCH = ["search", "--model", "mlp", "--preset", "tiny", "--profile", "cpu-sim"]

LAYOUT_FILES = {
    "empty.toml": "",
    "bad.toml": "this is not = toml [",
    "unknown_table.toml": '[mesh]\ndata = -1\n[rulez]\nbatch = "data"\n',
    "bad_mesh.toml": '[mesh]\ndata = "x"\n[rules]\nbatch = "data"\n',
    "zero_mesh.toml": '[mesh]\ndata = 0\n[rules]\nbatch = "data"\n',
    "mesh3.toml": '[mesh]\ndata = 3\n[rules]\nbatch = "data"\n',
    "noaxis.toml": '[mesh]\ndata = -1\n[rules]\nbatch = "model"\n',
    "badpipe.toml": '[mesh]\ndata = -1\n[rules]\nbatch = "data"\n[pipeline]\nmicrobatches = 0\n',
    "stage.toml": '[mesh]\nstage = 2\ndata = -1\n[rules]\nbatch = "data"\nlayers = "stage"\n',
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints step_1 and step_2 of the tiny MLP under data parallelism."""
    where = tmp_path_factory.mktemp("trained") / "ckpt"
    train(
        RunConfig(model="mlp", preset="tiny", layout="data_parallel", steps=2, checkpoint_dir=str(where), save_every=1),
        io.StringIO(),
    )
    return where


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: Path) -> Path:
    """A folder of bad and good inputs, made the working directory."""
    (tmp_path / "afile").write_text("keep me\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep.txt").write_text("keep me too\n")
    (tmp_path / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    for name in ("empty.npy", "empty.bin"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "binary.json").write_bytes(bytes([0x97, 0x00, 0xFF, 0x13]) * 16)
    (tmp_path / "corpus.txt").write_text("the quick brown fox\n" * 100)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03\x04\x05")
    np.save(tmp_path / "tokens.npy", (np.arange(5000) % 64).astype(np.int32))
    np.save(tmp_path / "f32.npy", np.ones(100, np.float32))
    np.save(tmp_path / "two_d.npy", np.ones((10, 10), np.int32))
    np.save(tmp_path / "short.npy", np.arange(10, dtype=np.int32))
    for name, text in LAYOUT_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "badprofile.json").write_text(json.dumps({"name": 1}))
    negative = load_profile("h100").to_json()
    negative["inter"]["all-reduce"]["bandwidth"] = -1.0
    (tmp_path / "negative.json").write_text(json.dumps(negative))
    shutil.copytree(trained, tmp_path / "ckpt")
    shutil.copytree(trained / "step_2", tmp_path / "renamed" / "step_9")
    shutil.copytree(trained / "step_2", tmp_path / "corrupt" / "step_2")
    shutil.rmtree(tmp_path / "corrupt" / "step_2" / "arrays" / "0")
    (tmp_path / "foreign" / "step_3").mkdir(parents=True)
    (tmp_path / "foreign" / "step_3" / "manifest.json").write_text("not json")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# (argv, texts the error line must hold, whether it shows before any device is used)
CLI_CASES = {
    # paths a command will write, checked before anything is compiled
    "checkpoint-dir is a file": (
        ["train", *MLP, "--checkpoint-dir", "afile"],
        ["--checkpoint-dir 'afile'", "'afile' is a file"],
        True,
    ),
    "checkpoint-dir below a file": (
        ["train", *MLP, "--checkpoint-dir", "afile/sub"],
        ["--checkpoint-dir 'afile/sub'", "'afile' is a file"],
        True,
    ),
    "checkpoint-dir empty": (["train", *MLP, "--checkpoint-dir", ""], ["--checkpoint-dir is empty"], True),
    "bench out is a file": ([*BENCH, "--out", "afile"], ["--out 'afile'", "'afile' is a file"], True),
    "bench out below a file": (
        [*BENCH, "--out", "afile/reports"],
        ["--out 'afile/reports'", "'afile' is a file"],
        True,
    ),
    "bench out empty": ([*BENCH, "--out", ""], ["--out is empty"], True),
    "calibrate out is a directory": (["calibrate", "--out", "adir"], ["--out 'adir' is a directory"], True),
    "calibrate out below a file": (
        ["calibrate", "--out", "afile/p.json"],
        ["--out 'afile/p.json'", "'afile' is a file"],
        True,
    ),
    "search out is a directory": ([*SEARCH, "--out", "adir"], ["--out 'adir' is a directory"], True),
    "search out below a file": (
        [*SEARCH, "--out", "afile/best.toml"],
        ["--out 'afile/best.toml'", "'afile' is a file"],
        True,
    ),
    "log-json is a directory": (["train", *MLP, "--log-json", "adir"], ["--log-json 'adir' is a directory"], True),
    "log-json below a file": (
        ["train", *MLP, "--log-json", "afile/log.jsonl"],
        ["--log-json 'afile/log.jsonl'", "'afile' is a file"],
        True,
    ),
    "log-json empty": (["train", *MLP, "--log-json", ""], ["--log-json is empty"], True),
    "log-json kept when steps is 0": (
        ["train", "--model", "mlp", "--preset", "tiny", "--steps", "0", "--log-json", "log.jsonl"],
        ["--steps 0"],
        True,
    ),
    # once raw tracebacks
    "empty npy token file": (
        ["train", *LM, "--data", "empty.npy"],
        ["token file 'empty.npy' is empty (0 bytes)", "at least 17 tokens"],
        True,
    ),
    "empty bin token file": (
        ["train", *LM, "--data", "empty.bin"],
        ["token file 'empty.bin' is empty (0 bytes)"],
        True,
    ),
    "data for a model without a sequence": (
        ["train", *MLP, "--data", "tokens.npy"],
        ["--data 'tokens.npy'", "model mlp reads no token sequences", "transformer, moe"],
        True,
    ),
    "bench rounds 0": ([*BENCH, "--rounds", "0"], ["--rounds 0", "at least 1"], True),
    "bench steps-per-round 0": ([*BENCH, "--steps-per-round", "0"], ["--steps-per-round 0", "at least 1"], True),
    "bench rounds negative": ([*BENCH, "--rounds", "-2"], ["--rounds -2"], True),
    "binary profile": (
        [*SEARCH[:-2], "--profile", "binary.json"],
        ["device profile 'binary.json' is not a JSON text file"],
        True,
    ),
    "devices 4096": (["--devices", "4096", "train", *MLP], ["--devices 4096", "at most 2048"], True),
    "devices 1000000": (
        ["--devices", "1000000", "train", *MLP],
        ["--devices 1000000", "at most 2048", "meshdsl launch --local N"],
        True,
    ),
    "devices negative": (["--devices", "-1", "train", *MLP], ["--devices -1", "at least 1"], True),
    # once silent
    "steps 0": (
        ["train", "--model", "mlp", "--preset", "tiny", "--steps", "0"],
        ["--steps 0", "at least 1 step"],
        True,
    ),
    "steps negative": (["train", "--model", "mlp", "--preset", "tiny", "--steps", "-3"], ["--steps -3"], True),
    "learning rate nan": (["train", *MLP, "--learning-rate", "nan"], ["--learning-rate nan", "positive, finite"], True),
    "learning rate negative": (["train", *MLP, "--learning-rate", "-1"], ["--learning-rate -1.0"], True),
    "learning rate inf": (["train", *MLP, "--learning-rate", "inf"], ["--learning-rate inf"], True),
    "learning rate 0": (["train", *MLP, "--learning-rate", "0"], ["--learning-rate 0.0"], True),
    "mlp under layers:stage": (
        ["train", *MLP, "--layout", "stage.toml"],
        ["layers split over stage, 1 microbatch", "models.mlp.Model cannot be pipelined"],
        True,
    ),
    "mlp under the pipeline layout": (
        ["train", *MLP, "--layout", "pipeline"],
        ["4 microbatches", "cannot be pipelined"],
        True,
    ),
    "unknown token file suffix": (
        ["train", *LM, "--data", "corpus.txt"],
        ["token file 'corpus.txt' has suffix '.txt'", ".npy", ".bin", ".u16", ".u32"],
        True,
    ),
    "search devices 0": ([*SEARCH, "--devices", "0"], ["--devices 0: it must be at least 1"], True),
    "search devices negative": ([*SEARCH, "--devices", "-4"], ["--devices -4"], True),
    "search top 0": ([*SEARCH, "--top", "0"], ["--top 0: it must be at least 1"], True),
    "search top negative": ([*SEARCH, "--top", "-5"], ["--top -5"], True),
    "bench with every layout skipped": (
        [*BENCH, "--layouts", "pipeline"],
        ["nothing to measure", "mlp x pipeline"],
        False,
    ),
    "step dir renamed": (
        ["train", *MLP, "--checkpoint-dir", "renamed", "--resume"],
        ["step_9", "records step 2", "renamed"],
        False,
    ),
    # once poor messages
    "layout empty": (["train", *MLP, "--layout", ""], ["layout '' is empty", "data_parallel", "batch:data"], True),
    "data is a directory": (["train", *LM, "--data", "adir"], ["token file 'adir' is a directory"], True),
    "data is a device": (["train", *LM, "--data", "/dev/null"], ["token file '/dev/null' is not a regular file"], True),
    "search memory negative": ([*SEARCH, "--memory-gb", "-1"], ["--memory-gb -1.0", "positive"], True),
    "empty layout file": (
        ["train", *MLP, "--layout", "empty.toml"],
        ["layout file 'empty.toml' has neither a [mesh] table nor [rules]"],
        True,
    ),
    "corrupt checkpoint array": (
        ["train", *MLP, "--steps", "3", "--checkpoint-dir", "corrupt", "--resume"],
        ["leaf ['data_key']", "arrays/0 is missing", "zarr.json"],
        False,
    ),
    # the launcher checks its processes' command before starting them
    "launch a child with an unknown model": (
        ["launch", "--local", "2", "--", "train", "--model", "nosuch"],
        ["meshdsl train: error: unknown model 'nosuch'"],
        True,
    ),
    "launch a child with steps 0": (
        ["launch", "--local", "2", "--", "train", "--model", "mlp", "--steps", "0"],
        ["meshdsl train: error: --steps 0"],
        True,
    ),
    "launch a bench with rounds 0": (
        ["launch", "--local", "2", "--", "bench", "--rounds", "0"],
        ["meshdsl bench: error: --rounds 0"],
        True,
    ),
    "launch 0 processes": (["launch", "--local", "0", "--", "train"], ["--local 0"], True),
    "launch another command": (
        ["launch", "--local", "2", "--", "explain"],
        ["runs train or bench", "got 'explain'"],
        True,
    ),
    "launch 0 devices per process": (
        ["launch", "--local", "2", "--devices-per-process", "0", "--", "train"],
        ["--devices-per-process 0"],
        True,
    ),
    "launch 5000 devices per process": (
        ["launch", "--local", "2", "--devices-per-process", "5000", "--", "train"],
        ["--devices-per-process 5000", "1 to 2048"],
        True,
    ),
    # more of each class
    "unknown model": (
        ["train", "--model", "nosuch"],
        ["unknown model 'nosuch'", "mlp, transformer, moe, convnet"],
        True,
    ),
    "unknown preset": (
        ["train", "--model", "mlp", "--preset", "huge"],
        ["unknown preset 'huge' for mlp", "tiny, small, 1b"],
        True,
    ),
    "unknown optimizer": (
        ["train", *MLP, "--optimizer", "adam"],
        ["unknown optimizer 'adam'", "sgd, adamw, adafactor"],
        True,
    ),
    "save-every without a checkpoint dir": (
        ["train", *MLP, "--save-every", "1"],
        ["--save-every need --checkpoint-dir"],
        True,
    ),
    "resume without a checkpoint dir": (
        ["train", *MLP, "--resume"],
        ["--resume and --save-every need --checkpoint-dir"],
        True,
    ),
    "keep 0": (["train", *MLP, "--checkpoint-dir", "new", "--keep", "0"], ["keep is 0"], True),
    "save-every negative": (
        ["train", *MLP, "--checkpoint-dir", "new", "--save-every", "-1"],
        ["save_every is -1"],
        True,
    ),
    "microbatches 0": (
        ["train", *MLP, "--microbatches", "0"],
        ["microbatches must be a positive integer, got 0"],
        True,
    ),
    "unknown layout name": (
        ["train", *MLP, "--layout", "dataparallel"],
        ["layout 'dataparallel' is neither a file, a shipped layout"],
        True,
    ),
    "layout is a directory": (["train", *MLP, "--layout", "adir"], ["layout file 'adir' is a directory"], True),
    "layout file missing": (
        ["train", *MLP, "--layout", "nowhere.toml"],
        ["layout file 'nowhere.toml' not found"],
        True,
    ),
    "layout file not TOML": (
        ["train", *MLP, "--layout", "bad.toml"],
        ["layout file 'bad.toml' is not valid TOML", "line 1"],
        True,
    ),
    "layout file unknown table": (
        ["train", *MLP, "--layout", "unknown_table.toml"],
        ["unknown table(s) ['rulez']"],
        True,
    ),
    "layout file mesh size a string": (
        ["train", *MLP, "--layout", "bad_mesh.toml"],
        ["layout file 'bad_mesh.toml'", "axis data has size 'x'"],
        True,
    ),
    "layout file mesh size 0": (
        ["train", *MLP, "--layout", "zero_mesh.toml"],
        ["layout file 'zero_mesh.toml'", "axis data has size 0"],
        True,
    ),
    "layout file bad pipeline": (
        ["train", *MLP, "--layout", "badpipe.toml"],
        ["layout file 'badpipe.toml'", "microbatches", "got 0"],
        True,
    ),
    "layout names an axis the mesh lacks": (
        ["train", *MLP, "--layout", "noaxis.toml"],
        ["batch:model names mesh axis 'model'", "data=8"],
        False,
    ),
    "layout split does not divide": (
        ["train", *MLP, "--layout", "mesh3.toml"],
        ["dim batch (size 16)", "data (size 3)", "not divisible by 3"],
        False,
    ),
    "float token file": (["train", *LM, "--data", "f32.npy"], ["holds float32[100]", "integer token ids"], True),
    "2-d token file": (["train", *LM, "--data", "two_d.npy"], ["holds int32[10, 10]"], True),
    "odd-sized raw token file": (
        ["train", *LM, "--data", "odd.bin"],
        ["has 5 bytes, not a whole number of uint16 tokens"],
        True,
    ),
    "token file too short": (
        ["train", *LM, "--data", "short.npy"],
        ["has 10 tokens; a window needs at least 17"],
        True,
    ),
    "token file missing": (["train", *LM, "--data", "missing.npy"], ["token file 'missing.npy' not found"], True),
    "checkpoint dir without resume": (
        ["train", *MLP, "--checkpoint-dir", "ckpt"],
        ["already holds step_2", "--resume"],
        False,
    ),
    "resume past steps": (
        ["train", *MLP, "--checkpoint-dir", "ckpt", "--resume"],
        ["at step 2, past --steps 1"],
        False,
    ),
    "resume another model": (
        ["train", *LM, "--checkpoint-dir", "ckpt", "--resume"],
        ["holds model 'mlp'", "model 'transformer'"],
        False,
    ),
    "resume a foreign checkpoint": (
        ["train", *MLP, "--checkpoint-dir", "foreign", "--resume"],
        ["'foreign/step_3' is not a meshdsl checkpoint", "not JSON"],
        False,
    ),
    "bench unknown model": (["bench", "--model", "nosuch"], ["unknown model 'nosuch'"], True),
    "bench missing layout": ([*BENCH, "--layouts", "nowhere.toml"], ["layout file 'nowhere.toml' not found"], True),
    "bench unknown field": ([*BENCH, "--set", "depth=3"], ["model mlp has no option depth"], True),
    "bench set without a value": ([*BENCH, "--set", "layers"], ["--set 'layers': expected FIELD=VALUE"], True),
    "bench set a size to 0": ([*BENCH, "--set", "d_ff=0"], ["model mlp: d_ff=0", "integer of at least 1"], True),
    "bench set a size to text": ([*BENCH, "--set", "d_ff=wide"], ["model mlp: d_ff='wide'"], True),
    "bench microbatches 0": ([*BENCH, "--microbatches", "0"], ["got 0"], True),
    "bench unknown optimizer": ([*BENCH, "--optimizer", "lion"], ["unknown optimizer 'lion'"], True),
    "explain set a flag to text": (
        ["explain", "--model", "transformer", "--preset", "tiny", "--set", "remat=yes"],
        ["remat='yes'", "bool"],
        True,
    ),
    "explain set a factor to nan": (
        ["explain", "--model", "moe", "--preset", "tiny", "--set", "capacity_factor=nan"],
        ["capacity_factor=nan", "finite"],
        True,
    ),
    "explain unknown profile": (
        ["explain", "--model", "mlp", "--preset", "tiny", "--profile", "h1000"],
        ["device profile 'h1000' is neither a file nor a shipped profile", "h100"],
        True,
    ),
    "explain profile missing a field": (
        ["explain", "--model", "mlp", "--preset", "tiny", "--profile", "badprofile.json"],
        ["device profile 'badprofile.json'", "'intra'"],
        True,
    ),
    "explain profile negative bandwidth": (
        ["explain", "--model", "mlp", "--preset", "tiny", "--profile", "negative.json"],
        ["inter.all-reduce.bandwidth is -1.0", "positive"],
        True,
    ),
    "explain profile is a directory": (
        ["explain", "--model", "mlp", "--preset", "tiny", "--profile", "adir"],
        ["device profile 'adir' is a directory"],
        True,
    ),
    "explain gspmd without compiling": (
        ["explain", "--model", "mlp", "--preset", "tiny", "--backend", "gspmd", "--no-compile"],
        ["--backend gspmd reads XLA's collectives from the compiled step", "--no-compile"],
        True,
    ),
    "explain unknown layout": (
        ["explain", "--model", "mlp", "--preset", "tiny", "--layout", "megatrom"],
        ["layout 'megatrom' is neither"],
        True,
    ),
    "search rounds 0": ([*SEARCH, "--rounds", "0"], ["--rounds 0"], True),
    "search measure negative": ([*SEARCH, "--measure", "-1"], ["--measure -1: it must be at least 0"], True),
    "search memory nan": ([*SEARCH, "--memory-gb", "nan"], ["--memory-gb nan"], True),
    "search memory 0": ([*SEARCH, "--memory-gb", "0"], ["--memory-gb 0.0"], True),
    "heartbeat timeout 0": (
        ["--heartbeat-timeout", "0", "train", *MLP],
        ["--heartbeat-timeout 0", "at least 1 second"],
        True,
    ),
    "process id outside the run": (
        ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5", "train", *MLP],
        ["--process-id 5 is outside 0..1 for --num-processes 2"],
        True,
    ),
    "coordinator without a port": (
        ["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0", "train", *MLP],
        ["coordinator '127.0.0.1' is not HOST:PORT"],
        True,
    ),
}


@pytest.mark.parametrize("argv, expected, early", list(CLI_CASES.values()), ids=list(CLI_CASES))
def test_cli_mistake_is_one_line_before_the_work(
    argv: list[str], expected: list[str], early: bool, workspace: Path, capsys
) -> None:
    before = snapshot(workspace)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    one_error_line(err, *expected)
    assert not re.search(r"^step +\d", out, re.M), out  # nothing trained
    if early:
        assert out == "", out  # nothing started: the mistake showed before any device was used
    assert snapshot(workspace) == before


@pytest.fixture
def read_only(workspace: Path) -> Iterator[Callable[[Path], None]]:
    """Makes a directory read-only for this process: chmod for a user; for root, whom permissions
    do not stop, the immutable flag (skipped where chattr is not allowed)."""
    made: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o555)
        elif subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
            pytest.skip("running as root and chattr +i is not allowed here: no directory is read-only")
        made.append(path)

    yield make
    for path in made:
        if os.geteuid() != 0:
            path.chmod(0o755)
        else:
            subprocess.run(["chattr", "-i", str(path)], check=True)


READ_ONLY_CASES = {
    "resume into a read-only checkpoint dir": (
        "ckpt",
        ["train", *MLP, "--steps", "3", "--checkpoint-dir", "ckpt", "--resume"],
        "--checkpoint-dir 'ckpt'",
    ),
    "new checkpoint dir in a read-only folder": (
        "adir",
        ["train", *MLP, "--checkpoint-dir", "adir/ckpt"],
        "--checkpoint-dir 'adir/ckpt'",
    ),
    "log-json in a read-only folder": (
        "adir",
        ["train", *MLP, "--log-json", "adir/log.jsonl"],
        "--log-json 'adir/log.jsonl'",
    ),
    "bench reports in a read-only folder": ("adir", [*BENCH, "--out", "adir/reports"], "--out 'adir/reports'"),
    "calibrate profile in a read-only folder": ("adir", ["calibrate", "--out", "adir/p.json"], "--out 'adir/p.json'"),
    "search layout in a read-only folder": ("adir", [*SEARCH, "--out", "adir/best.toml"], "--out 'adir/best.toml'"),
}


@pytest.mark.parametrize("folder, argv, expected", list(READ_ONLY_CASES.values()), ids=list(READ_ONLY_CASES))
def test_read_only_output_is_refused_before_the_work(
    folder: str, argv: list[str], expected: str, workspace: Path, read_only, capsys
) -> None:
    read_only(workspace / folder)
    before = snapshot(workspace)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    one_error_line(err, expected, f"directory '{folder}' is not writable")
    assert snapshot(workspace) == before


def _state() -> dict[str, Any]:
    return {"w": md.Tensor(jnp.arange(8.0), md.Shape([md.Dim("batch", 8)])), "n": 3}


def _save_onto_a_file() -> None:
    md.checkpoint.save(Path("afile"), _state())


def _save_onto_a_foreign_dir() -> None:
    md.checkpoint.save(Path("adir"), _state())


def _save_below_a_file() -> None:
    md.checkpoint.save(Path("afile/ck"), _state())


def _save_non_json_metadata() -> None:
    md.checkpoint.save(Path("new"), _state(), metadata={"when": object()})


def _save_a_typed_key() -> None:
    md.checkpoint.save(Path("new"), {"key": jax.random.key(0)})


def _restore_missing() -> None:
    md.checkpoint.restore(Path("nowhere"), md.Mesh({"data": 8}))


def _restore_corrupt() -> None:
    md.checkpoint.restore(Path("corrupt/step_2"), md.Mesh({"data": 8}), "batch:data")


def _restore_onto_a_misfit() -> None:
    md.checkpoint.restore(Path("ckpt/step_2"), md.Mesh({"data": 8}), "d_io:data; batch:data; d_ff:data")


def _manager_keep_0() -> None:
    md.checkpoint.CheckpointManager(Path("new"), keep=0)


def _load_empty_layout() -> None:
    md.Layout.load(Path("empty.toml"))


def _mesh_of_a_layout_without_rules() -> None:
    md.Layout().mesh()


def _token_file_unknown_suffix() -> None:
    TokenFile(Path("corpus.txt"), TokenBatch(md.Dim("batch", 8), md.Dim("length", 16)), 64)


def _trainer_mlp_under_stage() -> None:
    Trainer(
        build_model("mlp", "tiny"),
        optim.adamw(),
        md.Mesh({"stage": 2, "data": 4}),
        md.Layout("layers:stage; batch:data"),
    )


API_CASES = {
    "save onto a regular file": (_save_onto_a_file, md.ConfigError, ["checkpoint 'afile'", "is a file"]),
    "save onto a directory that is no checkpoint": (
        _save_onto_a_foreign_dir,
        md.ConfigError,
        ["'adir' is a directory that holds files but no manifest.json"],
    ),
    "save below a file": (_save_below_a_file, md.ConfigError, ["'afile' is a file"]),
    "save metadata that is not JSON": (_save_non_json_metadata, md.DataError, ["metadata is not plain JSON"]),
    "save a typed PRNG key": (_save_a_typed_key, md.DataError, ["typed PRNG key", "key_data"]),
    "restore a missing checkpoint": (_restore_missing, md.DataError, ["'nowhere' not found"]),
    "restore a corrupt checkpoint": (
        _restore_corrupt,
        md.DataError,
        ["leaf ['data_key']", "arrays/0 is missing", "zarr.json"],
    ),
    "restore onto a layout that does not fit": (
        _restore_onto_a_misfit,
        md.LayoutError,
        ["step_2", "both split over mesh axis data"],
    ),
    "manager keeping 0": (_manager_keep_0, md.ConfigError, ["keep is 0"]),
    "load an empty layout file": (_load_empty_layout, md.LayoutError, ["has neither a [mesh] table nor [rules]"]),
    "mesh of a layout without rules": (
        _mesh_of_a_layout_without_rules,
        md.LayoutError,
        ["a layout without rules names no mesh"],
    ),
    "token file of an unknown suffix": (_token_file_unknown_suffix, md.DataError, ["suffix '.txt'", ".u32"]),
    "trainer of the mlp under layers:stage": (
        _trainer_mlp_under_stage,
        md.ConfigError,
        ["layers split over stage", "cannot be pipelined"],
    ),
}


@pytest.mark.parametrize("call, error, expected", list(API_CASES.values()), ids=list(API_CASES))
def test_api_mistake_is_one_md_error_and_changes_nothing(
    call: Callable[[], None], error: type, expected: list[str], workspace: Path
) -> None:
    before = snapshot(workspace)
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message and "tensorstore_spec" not in message, message
    for text in expected:
        assert text in message, (text, message)
    assert snapshot(workspace) == before  # no *.partial-*, no *.old-*, nothing replaced


def test_a_rule_naming_no_dim_of_the_model_is_warned_about(workspace: Path, capsys) -> None:
    """A typo trains replicated, but not silently: one warning names the model's dims and a guess.
    A shipped layout naming dims this model lacks (dp_tp's heads, for the MLP) says nothing, nor
    does a user's rule that matches; a [params] rule is checked too."""
    assert cli.main(["train", *MLP, "--layout", "bacth:data"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "meshdsl train: warning: layout rule bacth:data names no dim of model mlp (its dims: batch, d_ff, d_io), "
        "so it splits nothing; did you mean batch?"
    ]
    mlp = build_model("mlp", "tiny")
    assert rule_warnings("dp_tp", load_layout("dp_tp"), "mlp", mlp) == []
    assert rule_warnings("batch:data; d_ff:data", load_layout("batch:data; d_ff:data"), "mlp", mlp) == []
    layout = md.Layout("batch:data", params="d_modle:data")
    assert rule_warnings("batch:data", layout, "transformer", build_model("transformer", "tiny")) == [
        "layout [params] rule d_modle:data names no dim of model transformer (its dims: batch, d_ff, d_kv, d_model, "
        "heads, "
        "layers, length, memory, position, qkv, vocab), so it splits nothing; did you mean d_model?"
    ]


def test_every_shipped_rule_names_a_dim_of_some_shipped_model() -> None:
    """Why shipped layouts never warn: each of their rules splits a dim that some shipped model has."""
    from meshdsl import models

    dims = set().union(*(rules.model_dims(build_model(name, "tiny")) for name in models.NAMES))
    for path in sorted(LAYOUTS.glob("*.toml")):
        layout = md.Layout.load(path)
        named = set(layout.rules) | set(layout.params.rules if layout.params else {})
        assert named <= dims, (path.name, named - dims)
