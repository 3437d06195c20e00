"""Token files (``meshdsl train --data``): batches in the model's own keys and dims, each device reading
only its rows, grain-shuffled windows with a held-out tail, an iterator state a resume continues
from, and ids scanned once before step 1. References: numpy slicing of the token file."""

import io
import json
import subprocess
import sys
import zlib
from pathlib import Path

import harness
import numpy as np
import pytest
from test_cli import meshdsl

import meshdsl as md
from meshdsl.errors import ConfigError, DataError
from meshdsl.model.loader import build_model
from meshdsl.runtime.layout_spec import LAYOUTS
from meshdsl.train import data as data_module
from meshdsl.train.data import TokenFile
from meshdsl.train.loop import RunConfig, build_trainer, check, train
from meshdsl.train.rules import split_warnings
from meshdsl.train.token_batch import TokenBatch, token_batch_of

USER_MODEL = '''
"""A tiny language model of a user's, its dims named the user's way: examples, seq, embed, vocab."""
import dataclasses
import jax
import jax.numpy as jnp
import meshdsl as md


@dataclasses.dataclass(frozen=True)
class Config:
    examples: int = 8
    seq: int = 8
    embed: int = 16
    hidden: int = 256
    vocab: int = 64
    PRESETS = {"tiny": {}}


class Model:
    def __init__(self, config):
        self.config = c = config
        self.examples, self.seq = md.Dim("examples", c.examples), md.Dim("seq", c.seq)
        self.embed, self.vocab = md.Dim("embed", c.embed), md.Dim("vocab", c.vocab)
        self.mlp = md.nn.MLP(self.embed, md.Dim("hidden", c.hidden))

    def init(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {"wte": md.random.normal(k1, [self.vocab, self.embed]) * 0.1, "mlp": self.mlp.init(k3),
                "out": md.random.normal(k2, [self.embed, self.vocab]) * 0.1}

    def batch(self, key):
        tokens = md.cast(md.random.bits(key, [self.examples, self.seq]) % self.config.vocab, jnp.int32)
        return {"tokens": tokens, "labels": tokens}

    def loss(self, params, batch):
        x = md.gather(params["wte"], batch["tokens"], self.vocab)
        x = x + self.mlp(params["mlp"], x)
        logits = md.einsum(x, params["out"], out=[self.examples, self.seq, self.vocab])
        target = md.take_along(logits, batch["labels"], self.vocab)
        return md.reduce_mean(md.logsumexp(logits, self.vocab) - target)

    def examples_per_step(self):
        return self.config.examples * self.config.seq
'''


@pytest.fixture
def user_model(tmp_path: Path) -> str:
    path = tmp_path / "user_lm.py"
    path.write_text(USER_MODEL)
    return str(path)


def _tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _windows(tokens: np.ndarray, starts: list[int], length: int) -> np.ndarray:
    """The reference: numpy slices of the token file."""
    return np.stack([tokens[s : s + length + 1] for s in starts])


def test_the_model_s_own_keys_and_dims_are_read_off_its_batch(user_model):
    model = build_model(user_model, "tiny")
    spec = token_batch_of(model, "--data t.npy: model user_lm.py")
    assert (spec.rows, spec.positions) == (md.Dim("examples", 8), md.Dim("seq", 8))
    assert (spec.inputs, spec.targets) == ("tokens", "labels")
    assert spec.dtype == np.int32
    shipped = token_batch_of(build_model("transformer", "tiny"), "m")
    assert (shipped.rows.name, shipped.positions.name) == ("batch", "length")
    assert (shipped.inputs, shipped.targets) == ("inputs", "targets")


def test_a_batch_without_a_token_pair_is_one_line_saying_what_data_needs(user_model, tmp_path):
    np.save(tmp_path / "t.npy", _tokens(1000, 64))
    needs = r"--data .*model mlp reads no token sequences: its batch key 'x' is .*float32.*--data needs .*TOKEN_KEYS"
    with pytest.raises(ConfigError, match=needs + ".*transformer, moe") as e:
        check(RunConfig(model="mlp", preset="tiny", data=str(tmp_path / "t.npy"), steps=1))
    assert "\n" not in str(e.value)
    model = Renamed(build_model(user_model, "tiny"))
    with pytest.raises(ConfigError, match=r"its batch is \{a: \[examples=8, seq=8\] int32, b: .*\}; --data needs"):
        token_batch_of(model, "--data t.npy: model user_lm.py")
    model.TOKEN_KEYS = ("b", "a")  # a declaration names them
    spec = token_batch_of(model, "m")
    assert (spec.inputs, spec.targets) == ("b", "a")


class Renamed:
    """A model whose batch keys are ``a`` and ``b``: names that say nothing of inputs and targets."""

    def __init__(self, model):
        self.model = model

    def batch(self, key):
        b = self.model.batch(key)
        return {"a": b["tokens"], "b": b["labels"]}


def test_each_device_reads_only_the_rows_of_the_model_s_batch_dim_it_holds(user_model, tmp_path, monkeypatch):
    tokens = _tokens(3000, 64)
    np.save(tmp_path / "t.npy", tokens)
    spec = token_batch_of(build_model(user_model, "tiny"), "m")
    data = TokenFile(tmp_path / "t.npy", spec, 64, seed=7)
    reads: list[list[int]] = []
    read = TokenFile._read
    monkeypatch.setattr(TokenFile, "_read", lambda self, starts: (reads.append(starts), read(self, starts))[1])
    mesh = md.Mesh({"data": 4, "model": 2})
    batch = data.batch_at(5, mesh, md.Layout("examples:data"))
    assert set(batch) == {"tokens", "labels"}
    starts = [data.window_of(5 * 8 + r) * 8 for r in range(8)]
    expected = _windows(tokens, starts, 8)
    assert batch["tokens"].shape == md.Shape([md.Dim("examples", 8), md.Dim("seq", 8)])
    np.testing.assert_array_equal(batch["tokens"].numpy(), expected[:, :8])
    np.testing.assert_array_equal(batch["labels"].numpy(), expected[:, 1:])
    # Four row blocks of two rows (one per data index; both model replicas share it): each read once.
    assert sorted(reads) == sorted(starts[i : i + 2] for i in range(0, 8, 2))
    for shard in batch["tokens"].array.addressable_shards:
        rows = range(*shard.index[0].indices(8))
        np.testing.assert_array_equal(np.asarray(shard.data), expected[rows.start : rows.stop, :8])


def test_training_windows_are_a_seeded_permutation_each_epoch_and_never_the_tail(tmp_path):
    tokens = _tokens(2000, 64)
    np.save(tmp_path / "t.npy", tokens)
    spec = TokenBatch(md.Dim("batch", 4), md.Dim("length", 16))
    data = TokenFile(tmp_path / "t.npy", spec, 64, seed=3, eval_fraction=0.1)
    assert data.train_tokens == 1800 and data.windows == (1800 - 1) // 16 and data.eval_windows == (200 - 1) // 16
    epoch = [data.window_of(i) for i in range(data.windows)]
    assert sorted(epoch) == list(range(data.windows)) and epoch != sorted(epoch)
    second = [data.window_of(data.windows + i) for i in range(data.windows)]
    assert sorted(second) == list(range(data.windows)) and second != epoch
    assert max(epoch) * 16 + 17 <= data.train_tokens  # no training window reaches the tail
    for seed, same in ((3, True), (4, False)):
        other = TokenFile(tmp_path / "t.npy", spec, 64, seed=seed, eval_fraction=0.1)
        assert ([other.window_of(i) for i in range(data.windows)] == epoch) == same


def test_eval_batches_read_the_held_out_tail(tmp_path):
    tokens = _tokens(2000, 64)
    np.save(tmp_path / "t.npy", tokens)
    spec = TokenBatch(md.Dim("batch", 4), md.Dim("length", 16))
    data = TokenFile(tmp_path / "t.npy", spec, 64, eval_fraction=0.1)
    mesh, layout = md.Mesh({"data": 4}), md.Layout("batch:data")
    for index in (0, 3):  # 12 windows in the tail: batch 3 wraps to its first windows
        starts = [1800 + (index * 4 + r) % 12 * 16 for r in range(4)]
        batch = data.eval_batch_at(index, mesh, layout)
        np.testing.assert_array_equal(batch["inputs"].numpy(), _windows(tokens, starts, 16)[:, :16])
        np.testing.assert_array_equal(batch["targets"].numpy(), _windows(tokens, starts, 16)[:, 1:])
    none = TokenFile(tmp_path / "t.npy", spec, 64, eval_fraction=0.0)
    assert none.windows == 1999 // 16
    with pytest.raises(DataError, match="held-out tail of 0 tokens holds no window of 17"):
        none.eval_batch_at(0, mesh, layout)


@pytest.mark.parametrize(
    "dtype, bad, shown",
    [
        (np.int32, 70, "holds id 70 at position 1234, outside the model's vocab of 64 (ids 0 to 63)"),
        (np.int64, -3, "holds negative id -3 at position 1234"),
        (np.uint64, 2**32 + 5, f"holds id {2**32 + 5} at position 1234"),  # not wrapped to 5
    ],
)
def test_ids_are_scanned_once_before_any_batch(tmp_path, monkeypatch, dtype, bad, shown):
    monkeypatch.setattr(data_module, "CHUNK", 1000)  # the bad id lies in the second chunk
    tokens = _tokens(5000, 64).astype(dtype)
    tokens[1234] = bad
    tokens[4000] = 65  # a later bad id is not the one reported
    np.save(tmp_path / "t.npy", tokens)
    with pytest.raises(DataError, match=f"^token file .*t.npy' {shown.replace('(', '.').replace(')', '.')}"):
        TokenFile(tmp_path / "t.npy", TokenBatch(md.Dim("batch", 2), md.Dim("length", 16)), 64)


def test_a_file_is_scanned_once_per_process(tmp_path, monkeypatch):
    np.save(tmp_path / "t.npy", _tokens(5000, 64))
    spec = TokenBatch(md.Dim("batch", 2), md.Dim("length", 16))
    first = TokenFile(tmp_path / "t.npy", spec, 64)
    assert first.crc32 == zlib.crc32(np.load(tmp_path / "t.npy").tobytes())
    monkeypatch.setattr(data_module.zlib, "crc32", lambda *a: pytest.fail("scanned twice"))
    assert TokenFile(tmp_path / "t.npy", spec, 64).crc32 == first.crc32


def test_an_out_of_range_id_stops_train_before_step_1(tmp_path):
    tokens = np.zeros(20000, np.uint64)
    tokens[19000] = 2**40
    np.save(tmp_path / "t.npy", tokens)
    result = meshdsl(
        "train", "--model", "transformer", "--preset", "tiny", "--data", "t.npy", "--steps", "3", cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"meshdsl train: error: token file 't.npy' holds id {2**40} at position 19000, "
        "outside the model's vocab of 64 (ids 0 to 63)"
    )
    assert "step" not in result.stdout


def test_compute_dtype_and_remat_need_the_model_s_config_field(user_model):
    for flags, field in (({"compute_dtype": "bfloat16"}, "compute_dtype"), ({"remat": True}, "remat")):
        flag = "--" + field.replace("_", "-")
        refused = f"^{flag}: model .*user_lm.py cannot take it: its Config has no {field} field"
        with pytest.raises(ConfigError, match=refused):
            check(RunConfig(model=user_model, preset="tiny", steps=1, **flags))
    declares = Path(user_model).with_name("declares.py")
    declares.write_text(
        USER_MODEL.replace(
            "    vocab: int = 64\n",
            "    vocab: int = 64\n    compute_dtype: str = 'float32'\n    remat: bool = False\n",
        )
    )
    model = build_trainer(RunConfig(model=str(declares), preset="tiny", compute_dtype="bfloat16", remat=True)).model
    assert (model.config.compute_dtype, model.config.remat) == ("bfloat16", True)
    help_text = " ".join(meshdsl("train", "--help").stdout.split())
    assert "Config declares a compute_dtype field" in help_text and "Config declares a remat" in help_text


def test_a_layout_splitting_almost_nothing_of_the_model_is_warned_about(user_model):
    model = build_model(user_model, "tiny")
    mesh = md.Mesh({"data": 4, "model": 2})
    (warning,) = split_warnings(md.Layout.load(LAYOUTS / "dp_tp.toml"), mesh, model, "user_lm.py")
    vocab, hidden = 2 * 64 * 16, 2 * 16 * 256  # parameters with vocab; the MLP's two weights
    assert warning == (
        "layout batch:data; groups:data; heads:model; kv_heads:model; d_ff:model; vocab:model splits only vocab of "
        f"model user_lm.py: {vocab / (vocab + hidden):.0%} of its parameters and none of its batch's "
        "dims (examples, seq), so most of the step runs replicated on each of the 8 devices"
    )
    (nothing,) = split_warnings(md.Layout("batch:data; d_ff:model"), mesh, model, "user_lm.py")
    assert nothing == (
        "layout batch:data; d_ff:model splits no dim of model user_lm.py "
        "(its dims: embed, examples, hidden, seq, vocab), "
        "so each of the 8 devices holds and computes everything"
    )
    assert split_warnings(md.Layout("examples:data"), mesh, model, "user_lm.py") == []
    assert split_warnings(md.Layout("batch:data"), md.Mesh({"data": 1}), model, "user_lm.py") == []


def _affine(n: int, vocab: int) -> np.ndarray:
    out = np.zeros(n, np.int32)
    for i in range(1, n):
        out[i] = (5 * int(out[i - 1]) + 3) % vocab
    return out


def test_a_resumed_run_reads_the_batches_and_gets_the_losses_of_an_uninterrupted_one(user_model, tmp_path, monkeypatch):
    np.save(tmp_path / "t.npy", _tokens(4000, 64))
    seen: dict[str, list] = {}
    batch_at = TokenFile.batch_at

    def recorded(self, step, mesh, layout):
        batch = batch_at(self, step, mesh, layout)
        seen[run_name].append((step, batch["tokens"].numpy()))
        return batch

    monkeypatch.setattr(TokenFile, "batch_at", recorded)
    base = dict(
        model=user_model,
        preset="tiny",
        layout="examples:data",
        data=str(tmp_path / "t.npy"),
        seed=5,
        learning_rate=0.05,
    )
    run_name, seen["whole"] = "whole", []
    whole = train(RunConfig(**base, steps=5), out=io.StringIO())
    run_name, seen["parts"] = "parts", []
    ckpt = str(tmp_path / "ckpt")
    first = train(RunConfig(**base, steps=2, checkpoint_dir=ckpt, save_every=2), out=io.StringIO())
    second = train(RunConfig(**base, steps=5, checkpoint_dir=ckpt, save_every=2, resume=True), out=io.StringIO())
    assert first + second == whole  # bit-exact
    assert [s for s, _ in seen["parts"]] == [0, 1, 2, 3, 4]
    for (_, a), (_, b) in zip(seen["whole"], seen["parts"]):
        np.testing.assert_array_equal(a, b)
    state = md.checkpoint.read_manifest(Path(ckpt) / "step_4")["metadata"]["data_state"]
    data = TokenFile(tmp_path / "t.npy", token_batch_of(build_model(user_model, "tiny"), "m"), 64, seed=5)
    assert state["next_example"] == 32 and state["next_windows"] == [data.window_of(32 + r) for r in range(8)]
    with pytest.raises(ConfigError, match=r"step_5 was trained on other data .*: seed 5 \(this run: 6\), next_windows"):
        train(RunConfig(**{**base, "seed": 6}, steps=6, checkpoint_dir=ckpt, resume=True), out=io.StringIO())


def test_train_reads_a_token_file_into_a_user_model_s_own_names(user_model, tmp_path):
    np.save(tmp_path / "t.npy", _affine(20000, 64))
    result = meshdsl(
        "train",
        "--model",
        user_model,
        "--preset",
        "tiny",
        "--layout",
        "examples:data",
        "--data",
        "t.npy",
        "--steps",
        "20",
        "--learning-rate",
        "0.05",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if " loss " in line]
    assert losses[-1] < 0.5 * losses[0]


RECORDING = """
import json, os
import jax
from meshdsl.train.data import TokenFile

_read = TokenFile._read


def _recorded(self, starts):
    with open(os.path.join(os.environ["READS_DIR"], f"p{jax.process_index()}.jsonl"), "a") as f:
        f.write(json.dumps(starts) + "\\n")
    return _read(self, starts)


TokenFile._read = _recorded
"""


def test_each_of_two_processes_reads_only_its_rows_and_they_train_as_one(user_model, tmp_path):
    """2 processes x 4 devices under examples:data: each reads the windows of its own 4 rows of every step
    (the user's model file records every read), together every row once, and the losses are one process's."""
    from test_multiprocess import HANG_GUARD_S, _env, _launch_cmd

    np.save(tmp_path / "t.npy", _affine(5000, 64))
    recording = tmp_path / "recording_lm.py"
    recording.write_text(USER_MODEL + RECORDING)
    run = dict(model=user_model, preset="tiny", layout="examples:data", data=str(tmp_path / "t.npy"), steps=3)
    cmd = _launch_cmd(
        "train",
        "--model",
        str(recording),
        "--preset",
        "tiny",
        "--layout",
        "examples:data",
        "--data",
        "t.npy",
        "--steps",
        "3",
        "--log-json",
        "losses.jsonl",
    )
    result = subprocess.run(
        cmd, cwd=tmp_path, env=_env(READS_DIR=str(tmp_path)), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reference = train(RunConfig(**run), out=io.StringIO())
    got = [json.loads(line)["loss"] for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    data = TokenFile(tmp_path / "t.npy", token_batch_of(build_model(user_model, "tiny"), "m"), 64)
    reads = [[json.loads(line) for line in (tmp_path / f"p{p}.jsonl").read_text().splitlines()] for p in (0, 1)]
    for mine in reads:  # one read of one device's row per device, 4 devices, 3 steps
        assert len(mine) == 4 * 3 and all(len(starts) == 1 for starts in mine)
    for step in range(3):
        every = sorted(data.window_of(step * 8 + r) * 8 for r in range(8))
        both = [sorted(s[0] for s in mine[4 * step : 4 * step + 4]) for mine in reads]
        assert sorted(both[0] + both[1]) == every and not set(both[0]) & set(both[1])


KILL_AFTER_LOGGING = """
import os, signal, sys
from meshdsl import cli
from meshdsl.train import logs
write = logs.Logs.write
def write_then_die(self, step, record):
    write(self, step, record)
    if step == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
logs.Logs.write = write_then_die
sys.exit(cli.main(sys.argv[2:]))
"""


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_killed_mid_way_and_resumed_has_the_batches_and_losses_of_an_uninterrupted_one(tmp_path):
    """``train --data`` with a cosine schedule, 2 microbatches and evaluation, SIGKILLed right after
    logging step 3 (its checkpoint: step 2), then resumed: the resumed run trains steps 3-6, and every
    loss, learning rate and eval loss it logs is bit for bit the uninterrupted run's (so it read the
    same batches: grain's iterator state came back from the checkpoint)."""
    np.save(tmp_path / "t.npy", _tokens(4000, 64))
    (tmp_path / "kill.py").write_text(KILL_AFTER_LOGGING)
    # The user's model, its batch dim named for --accumulate and its loss sized by its batch.
    user_model = str(tmp_path / "user_lm.py")
    named = "        self.batch_dim = self.examples\n        self.mlp = md.nn.MLP("
    text = USER_MODEL.replace("        self.mlp = md.nn.MLP(", named, 1)
    text = text.replace("out=[self.examples, self.seq, self.vocab]", 'out=["examples", "seq", "vocab"]', 1)
    Path(user_model).write_text(text)
    flags = dict(
        model=user_model,
        preset="tiny",
        layout="examples:data",
        data=str(tmp_path / "t.npy"),
        overrides={"examples": 16},
        steps=6,
        lr_schedule="cosine",
        warmup_steps=2,
        accumulate=2,
        eval_every=2,
        eval_steps=1,
        save_every=2,
    )
    args = ["train", "--model", user_model, "--preset", "tiny", "--layout", "examples:data", "--set", "examples=16"]
    args += ["--data", str(tmp_path / "t.npy"), "--steps", "6", "--lr-schedule", "cosine", "--warmup-steps", "2"]
    args += ["--accumulate", "2", "--eval-every", "2", "--eval-steps", "1", "--save-every", "2"]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--log-json", str(tmp_path / "killed.jsonl")]
    killed = subprocess.run(
        [sys.executable, str(tmp_path / "kill.py"), "3", *args],
        cwd=tmp_path,
        env=harness.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr
    assert md.checkpoint.steps(tmp_path / "ck") == [2]
    train(
        RunConfig(**flags, checkpoint_dir=str(tmp_path / "ck"), resume=True, log_json=str(tmp_path / "resumed.jsonl")),
        out=io.StringIO(),
    )
    train(
        RunConfig(**flags, checkpoint_dir=str(tmp_path / "ck_whole"), log_json=str(tmp_path / "whole.jsonl")),
        out=io.StringIO(),
    )
    whole, before, after = (_records(tmp_path / f"{n}.jsonl") for n in ("whole", "killed", "resumed"))
    assert [r["step"] for r in before] == [1, 2, 3] and [r["step"] for r in after] == [3, 4, 5, 6]
    assert [r["step"] for r in whole if "eval_loss" in r] == [2, 4, 6]
    keys = ("loss", "learning_rate", "eval_loss")
    for r in before + after:
        assert {k: r.get(k) for k in keys} == {k: whole[r["step"] - 1].get(k) for k in keys}, r
