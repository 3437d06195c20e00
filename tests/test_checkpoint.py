"""Checkpoints: bitwise round trips, resharding on load, atomic saves, and clear errors.

The issue's proof: the tiny transformer trains 10 steps under ``dp_tp`` on 8 devices, saving at
step 5, and is SIGKILLed while committing step 10; resumed from step 5 under ``fsdp`` on 4
devices, steps 6-10 have the losses the killed run logged for them (its log covers all 10 steps:
the kill comes after the last one, during the save).
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from meshdsl.checkpoint import store
from meshdsl.runtime.layout_spec import load_layout
from meshdsl.train.loop import RunConfig, train

ROOT = Path(__file__).resolve().parents[1]
DP_TP = md.Layout("batch:data; d_ff:model; heads:model")
FSDP = md.Layout("batch:data", params="d_model:data")


def _tensor(rng: np.random.Generator, dims: dict[str, int], dtype, mesh: md.Mesh, layout: md.Layout) -> md.Tensor:
    shape = md.Shape([md.Dim(n, s) for n, s in dims.items()])
    value = rng.standard_normal(shape.sizes).astype(dtype)
    return md.Tensor(jax.device_put(value, layout.sharding(mesh, shape)), shape)


def _state(mesh: md.Mesh, layout: md.Layout) -> dict:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": _tensor(rng, {"d_model": 16, "d_ff": 8}, np.float32, mesh, layout),
            "wo": _tensor(rng, {"heads": 4, "d_model": 16}, jnp.bfloat16, mesh, layout),
        },
        "moments": [_tensor(rng, {"d_ff": 8}, np.float32, mesh, layout), {"count": jnp.int32(7)}],
        "table": np.arange(6, dtype=np.int64).reshape(2, 3),
        "lr": 0.25,
    }


def _tensors(tree) -> dict[str, md.Tensor]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, md.Tensor))[0]
    return {jax.tree_util.keystr(p): t for p, t in flat if isinstance(t, md.Tensor)}


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.ndim else x.reshape(1).view(np.uint8)


def test_round_trip_is_bitwise_and_keeps_named_dims(tmp_path):
    mesh = md.Mesh({"data": 4, "model": 2})
    state = _state(mesh, DP_TP)
    path = md.checkpoint.save(tmp_path / "ckpt", state, metadata={"step": 3, "note": "hi"})
    assert path == tmp_path / "ckpt" and os.listdir(tmp_path) == ["ckpt"]
    manifest = md.checkpoint.read_manifest(path)
    dims = {r["path"]: r.get("dims") for r in manifest["leaves"]}
    assert dims["['params']['w']"] == [["d_model", 16], ["d_ff", 8]]
    assert dims["['params']['wo']"] == [["heads", 4], ["d_model", 16]]

    for like in (None, state):
        restored, metadata = md.checkpoint.restore(path, mesh, DP_TP, like=like)
        assert metadata == {"step": 3, "note": "hi"}
        assert jax.tree_util.tree_structure(
            restored, is_leaf=lambda x: isinstance(x, md.Tensor)
        ) == jax.tree_util.tree_structure(state, is_leaf=lambda x: isinstance(x, md.Tensor))
        for where, want in _tensors(state).items():
            got = _tensors(restored)[where]
            assert got.shape == want.shape and got.dtype == want.dtype
            assert got.array.sharding.is_equivalent_to(want.array.sharding, got.shape.rank)
            np.testing.assert_array_equal(_bits(got.numpy()), _bits(want.numpy()), err_msg=where)
        assert isinstance(restored["table"], np.ndarray) and np.array_equal(restored["table"], state["table"])
        assert restored["table"].dtype == np.int64 and restored["lr"] == 0.25
        assert int(restored["moments"][1]["count"]) == 7 and restored["moments"][1]["count"].dtype == jnp.int32


@pytest.mark.parametrize("devices, given", [(4, "params"), (1, "params"), (4, "compute")])
def test_restore_reshards_onto_another_mesh_and_layout(tmp_path, devices, given):
    """Restored under FSDP's parameter layout, or under the FSDP layout itself (its compute rules
    would replicate the parameters: restore takes the layout's parameter rules, issue 24)."""
    saved = _state(md.Mesh({"data": 4, "model": 2}), DP_TP)
    md.checkpoint.save(tmp_path / "ckpt", saved)
    mesh = md.Mesh({"data": devices}, jax.devices()[:devices])
    layout = FSDP.param_layout if given == "params" else FSDP
    restored, _ = md.checkpoint.restore(tmp_path / "ckpt", mesh, layout, like=saved)
    for where, want in _tensors(saved).items():
        got = _tensors(restored)[where]
        assert got.array.sharding.mesh == mesh.jax_mesh
        assert got.array.sharding.spec == FSDP.param_layout.spec(got.shape), where
        reference = want.numpy()
        np.testing.assert_array_equal(_bits(got.numpy()), _bits(reference), err_msg=where)
        for shard in got.array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index], err_msg=where)


def test_manager_keeps_the_newest_and_clears_crashed_saves(tmp_path):
    mesh = md.Mesh({"x": 1}, jax.devices()[:1])
    manager = md.checkpoint.CheckpointManager(tmp_path, save_every=2, keep=2)
    (tmp_path / "step_9.partial-0123456789ab").mkdir()
    (tmp_path / "notes").mkdir()
    assert manager.latest() is None and [manager.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    for step in (2, 4, 6):
        manager.save(step, {"x": jnp.full((3,), step, jnp.float32)})
    assert manager.steps() == [4, 6] and md.checkpoint.latest(tmp_path) == tmp_path / "step_6"
    manager.release()  # the first save locked the directory for this manager
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_4", "step_6"]
    state, metadata = md.checkpoint.restore(manager.latest(), mesh)
    assert metadata == {"step": 6} and np.array_equal(state["x"], np.full(3, 6.0))
    with pytest.raises(md.ConfigError, match="keep is 0"):
        md.checkpoint.CheckpointManager(tmp_path, keep=0)


CRASH = """
import os, signal, sys
from meshdsl import cli
from meshdsl.checkpoint import store as checkpoint
commit = checkpoint._commit
def crash(tmp, path):
    if path.name == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)
    commit(tmp, path)
checkpoint._commit = crash
sys.exit(cli.main(sys.argv[2:]))
"""


def _env() -> dict[str, str]:
    return harness.subprocess_env(PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A 10-step dp_tp run on 8 devices saving every 5 steps, SIGKILLed while committing step 10."""
    where = tmp_path_factory.mktemp("killed")
    (where / "crash.py").write_text(CRASH)
    args = [
        "--devices",
        "8",
        "train",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--layout",
        "dp_tp",
        "--steps",
        "10",
        "--checkpoint-dir",
        str(where / "ckpt"),
        "--save-every",
        "5",
        "--log-json",
        str(where / "log.jsonl"),
    ]
    result = subprocess.run(
        [sys.executable, str(where / "crash.py"), "step_10", *args],
        cwd=where,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = [json.loads(line) for line in (where / "log.jsonl").read_text().splitlines()]
    return where / "ckpt", result, {row["step"]: row["loss"] for row in log}


def test_a_save_killed_before_its_commit_leaves_the_last_checkpoint(killed_run):
    directory, result, losses = killed_run
    assert result.returncode == -9, result.stderr
    assert sorted(losses) == list(range(1, 11)) and f"saved checkpoint {directory / 'step_5'}" in result.stdout
    partial = [p for p in directory.iterdir() if p.name.startswith("step_10.partial-")]
    assert len(partial) == 1 and (partial[0] / store.MANIFEST).is_file()
    assert md.checkpoint.latest(directory) == directory / "step_5" and md.checkpoint.steps(directory) == [5]
    state, metadata = md.checkpoint.restore(directory / "step_5", md.Mesh({"data": 8}), "d_model:data")
    assert metadata["step"] == 5 and metadata["model"] == "transformer" and metadata["config"]["d_model"] == 32
    assert int(state["step"]) == 5 and state["params"]["layers"]["wqkv"].names == (
        "layers",
        "d_model",
        "qkv",
        "heads",
        "d_kv",
    )


def test_resumed_under_fsdp_on_4_devices_it_continues_the_killed_run(killed_run, tmp_path):
    saved, _, losses = killed_run
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    run = RunConfig(
        model="transformer", preset="tiny", layout="fsdp", steps=10, checkpoint_dir=str(directory), resume=True
    )
    log = io.StringIO()
    resumed = train(run, log, mesh=load_layout("fsdp").mesh(jax.devices()[:4]))
    out = log.getvalue()
    assert f"resuming from {directory / 'step_5'} at step 5" in out and "on mesh data=4 (cpu)" in out
    np.testing.assert_allclose(resumed, [losses[s] for s in range(6, 11)], rtol=1e-5)
    assert md.checkpoint.steps(directory) == [5, 10] and sorted(p.name for p in directory.iterdir()) == [
        "step_10",
        "step_5",
    ]
    with pytest.raises(md.ConfigError, match=r"different transformer config: .*d_model=32 \(this run: 128\)"):
        train(
            RunConfig(
                model="transformer", preset="small", layout="fsdp", steps=12, checkpoint_dir=str(directory), resume=True
            ),
            log,
        )
    with pytest.raises(md.ConfigError, match="already holds step_10; pass --resume"):
        train(
            RunConfig(model="transformer", preset="tiny", layout="fsdp", steps=12, checkpoint_dir=str(directory)), log
        )


PRUNE_KILL = """
import os, signal, sys
from pathlib import Path
from meshdsl import cli
from meshdsl.checkpoint import store as checkpoint
rmtree = checkpoint.shutil.rmtree
def dying(path, *args, **kwargs):
    path = Path(path)
    if path.name.split(".")[0] == sys.argv[1]:  # the pruned checkpoint, whatever it was renamed to
        arrays = sorted((path / "arrays").iterdir())
        for array in arrays[: len(arrays) // 2 + 1]:
            rmtree(array)
        os.kill(os.getpid(), signal.SIGKILL)
    rmtree(path, *args, **kwargs)
checkpoint.shutil.rmtree = dying
sys.exit(cli.main(sys.argv[2:]))
"""


def test_a_kill_while_pruning_leaves_only_restorable_checkpoints(tmp_path):
    """``--save-every 1 --keep 3``: after committing step 4 the manager prunes step 1, and the process
    is SIGKILLed halfway through deleting its arrays. ``steps()`` lists only complete checkpoints
    (2, 3, 4), each restores, and the resumed run's steps 5-6 are bit for bit an uninterrupted run's."""
    (tmp_path / "prune_kill.py").write_text(PRUNE_KILL)
    ckpt = tmp_path / "ckpt"
    args = [
        "--devices",
        "8",
        "train",
        "--model",
        "mlp",
        "--preset",
        "tiny",
        "--layout",
        "data_parallel",
        "--steps",
        "4",
        "--checkpoint-dir",
        str(ckpt),
        "--save-every",
        "1",
        "--keep",
        "3",
        "--log-json",
        str(tmp_path / "log.jsonl"),
    ]
    killed = subprocess.run(
        [sys.executable, str(tmp_path / "prune_kill.py"), "step_1", *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr
    assert (
        f"saved checkpoint {ckpt / 'step_3'}" in killed.stdout and "step 4/4" in killed.stdout
    )  # killed in step 4's save
    assert md.checkpoint.steps(ckpt) == [2, 3, 4]
    leftovers = sorted(p.name.split("-")[0] for p in ckpt.iterdir() if not store._STEP.match(p.name))
    assert leftovers == [
        ".meshdsl",
        "step_1.deleted",
    ]  # the killed run's lock file (its flock died with it) and its half prune
    mesh = md.Mesh({"data": 8})
    for step in md.checkpoint.steps(ckpt):
        _, metadata = md.checkpoint.restore(ckpt / f"step_{step}", mesh)
        assert metadata["step"] == step

    run = dict(model="mlp", preset="tiny", layout="data_parallel", steps=6)
    reference = train(RunConfig(**run), io.StringIO())
    logged = [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged == reference[:4]  # the killed run is the reference run up to its kill, bit for bit
    resumed = train(RunConfig(**run, checkpoint_dir=str(ckpt), save_every=1, keep=3, resume=True), io.StringIO())
    assert resumed == reference[4:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_4", "step_5", "step_6"]  # the leftover is gone too


@pytest.fixture
def checkpoint(tmp_path):
    mesh = md.Mesh({"data": 4, "model": 2})
    md.checkpoint.save(tmp_path / "good", _state(mesh, DP_TP))
    return tmp_path / "good", mesh


def _damaged(source: Path, name: str) -> Path:
    target = source.with_name(name)
    shutil.copytree(source, target)
    return target


def _array_of(path: Path, leaf: str) -> Path:
    record = next(r for r in md.checkpoint.read_manifest(path)["leaves"] if r["path"] == leaf)
    return path / record["array"]


def test_corrupt_and_foreign_checkpoints_raise_data_errors(checkpoint):
    good, mesh = checkpoint

    def restore(path, **kw):
        return md.checkpoint.restore(path, mesh, DP_TP, **kw)

    with pytest.raises(md.DataError, match="checkpoint '.*nowhere' not found"):
        restore(good.with_name("nowhere"))
    foreign = good.with_name("foreign")
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(md.DataError, match="is not a meshdsl checkpoint \\(foreign directory: no manifest.json\\)"):
        restore(foreign)
    (foreign / "manifest.json").write_text("{garbage")
    with pytest.raises(md.DataError, match="foreign directory: manifest.json is not JSON"):
        restore(foreign)

    missing = _damaged(good, "missing")
    shutil.rmtree(_array_of(missing, "['params']['w']"))
    with pytest.raises(md.DataError, match=r"leaf \['params'\]\['w'\]: array arrays/\d+ is missing"):
        restore(missing)
    truncated = _damaged(good, "truncated")
    chunk = next(p for p in (_array_of(truncated, "['params']['w']") / "c").rglob("*") if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(md.DataError, match=r"leaf \['params'\]\['w'\]: array arrays/\d+ is corrupt"):
        restore(truncated)
    lost = _damaged(good, "lost")
    next(p for p in (_array_of(lost, "['params']['wo']") / "c").rglob("*") if p.is_file()).unlink()
    with pytest.raises(md.DataError, match=r"leaf \['params'\]\['wo'\]: .* is corrupt: .*missing"):
        restore(lost)
    altered = _damaged(good, "altered")
    manifest = json.loads((altered / "manifest.json").read_text())
    record = next(r for r in manifest["leaves"] if r["path"] == "['params']['w']")
    record["shape"], record["dims"] = [16, 4], [["d_model", 16], ["d_ff", 4]]
    manifest["checksum"] = store._checksum(manifest)  # a consistent manifest whose arrays differ
    (altered / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(md.DataError, match=r"holds float32\[16, 8\], but the manifest says float32\[16, 4\]"):
        restore(altered)
    del record["dtype"]
    manifest["checksum"] = store._checksum(manifest)
    (altered / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        md.DataError, match=r"is corrupt: malformed leaf record in manifest.json: .*\['params'\]\['w'\]"
    ):
        restore(altered)

    like = _state(mesh, DP_TP)
    like["params"]["w"] = md.Tensor(
        jax.ShapeDtypeStruct((16, 4), jnp.float32), md.Shape([md.Dim("d_model", 16), md.Dim("d_ff", 4)])
    )
    with pytest.raises(
        md.DataError,
        match=r"leaf \['params'\]\['w'\] is \[d_model=16, d_ff=8\], but the expected state has \[d_model=16, d_ff=4\]",
    ):
        restore(good, like=like)
    with pytest.raises(
        md.LayoutError,
        match=r"leaf \['params'\]\['wo'\] \[heads=4, d_model=16\]: dim heads \(size 4\) .* not divisible by 8",
    ):
        md.checkpoint.restore(good, md.Mesh({"x": 8}), "heads:x")


def test_the_command_reports_a_bad_checkpoint_in_one_line(tmp_path):
    (tmp_path / "ckpt" / "step_3").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_3" / "manifest.json").write_text("not json")
    base = [
        sys.executable,
        "-m",
        "meshdsl.cli",
        "train",
        "--model",
        "mlp",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--checkpoint-dir",
        "ckpt",
    ]
    result = subprocess.run(
        [*base, "--resume"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        (
            "meshdsl train: error: 'ckpt/step_3' is not a meshdsl checkpoint (foreign directory: manifest.json is not "
            "JSON: "
            "Expecting value: line 1 column 1 (char 0))"
        )
    ]


# ---- md.checkpoint.load_safetensors: files it must refuse rather than load silently ----


def _load_one(path: Path, dtype=jnp.float32):
    """``load_safetensors`` of one [2, 3] parameter ``w`` from the tensor ``w`` at ``path``."""
    like = {"w": md.tensor(jnp.zeros((2, 3), dtype), [md.Dim("a", 2), md.Dim("b", 3)])}
    return md.checkpoint.load_safetensors(path, like=like, names={"w": ("w", "a b")}, mesh=harness.mesh("x8"))


def test_safetensors_tensor_in_two_files_of_a_folder_is_a_data_error(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"w": np.zeros((2, 3), np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(md.DataError, match=r"tensor 'w' is in both .*00001-of-00002.* and .*00002-of-00002"):
        _load_one(tmp_path)


@pytest.mark.parametrize(
    "values, match",
    [
        (np.arange(6, dtype=np.int8).reshape(2, 3), r"tensor 'w' .* is int8; the parameter w is float32"),
        (np.full((2, 3), 1e39, np.float64), r"tensor 'w' .* holds 1e\+39, beyond float32's range"),
        (np.full((2, 3), -1e300, np.float64), r"holds -1e\+300, beyond float32's range"),
    ],
)
def test_safetensors_values_a_float_leaf_cannot_hold_are_a_data_error(tmp_path, values, match):
    from safetensors.numpy import save_file

    save_file({"w": values}, str(tmp_path / "m.safetensors"))
    with pytest.raises(md.DataError, match=match):
        _load_one(tmp_path / "m.safetensors")


def test_safetensors_float64_in_range_and_non_finite_values_load(tmp_path):
    # Values float32 holds (NaN and inf included: the file's own) load as they are.
    from safetensors.numpy import save_file

    values = np.array([[1.5, -2.0, np.nan], [np.inf, 0.0, 3e38]], np.float64)
    save_file({"w": values}, str(tmp_path / "m.safetensors"))
    np.testing.assert_array_equal(_load_one(tmp_path / "m.safetensors")["w"].numpy(), values.astype(np.float32))
