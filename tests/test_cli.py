"""The ``meshdsl`` command as a user runs it (a subprocess), the benchmark's report, and token files."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import meshdsl as md
from meshdsl.bench.run import BenchConfig, run
from meshdsl.errors import DataError
from meshdsl.train.data import TokenFile
from meshdsl.models import transformer

ROOT = Path(__file__).resolve().parents[1]


def meshdsl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "meshdsl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_train_runs_and_learns_as_a_user_runs_it(tmp_path):
    result = meshdsl("train", "--model", "transformer", "--preset", "tiny", "--layout", "dp_tp", "--steps", "12", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "on mesh data=4 model=2 (cpu)" in result.stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0]


def test_train_reports_user_mistakes_without_a_traceback(tmp_path):
    missing = meshdsl("train", "--model", "mlp", "--preset", "tiny", "--layout", "nowhere.toml", "--steps", "1", cwd=tmp_path)
    assert missing.returncode == 2 and "layout file 'nowhere.toml' not found" in missing.stderr
    assert "Traceback" not in missing.stderr
    misfit = meshdsl("train", "--model", "transformer", "--preset", "tiny", "--layout", "d_kv:data", "--steps", "1", cwd=tmp_path)
    assert misfit.returncode == 2 and "Traceback" not in misfit.stderr
    assert "dim d_kv (size 4)" in misfit.stderr and "data (size 8)" in misfit.stderr
    preset = meshdsl("train", "--model", "mlp", "--preset", "huge", "--steps", "1", cwd=tmp_path)
    assert preset.returncode == 2 and "unknown preset 'huge'" in preset.stderr
    no_devices = meshdsl("--devices", "0", "train", "--model", "mlp", "--preset", "tiny", "--steps", "1", cwd=tmp_path)
    assert no_devices.returncode == 2 and "Traceback" not in no_devices.stderr
    assert "--devices 0: simulate at least 1 device" in no_devices.stderr


def test_bench_command_writes_every_report(tmp_path):
    result = meshdsl("bench", "--model", "mlp", "--preset", "tiny", "--rounds", "2", "--steps-per-round", "1",
                     "--baseline", "jax", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ["results.json", "results.md", "step_time.png", "bytes.png"]:
        assert (tmp_path / "out" / name).stat().st_size > 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["layout"] for r in rows] == ["data_parallel", "megatron", "dp_tp", "fsdp"]
    assert all(r["overhead_vs_jax"] > 0 for r in rows)


FIELDS = {
    "model", "preset", "layout", "mesh", "devices", "compile_s", "step_s_median", "step_s_spread", "step_times_s",
    "tokens_per_s", "flops_per_step", "flops_per_s", "mfu", "memory_bytes_per_device", "collectives_measured",
    "collectives_predicted", "collective_count", "collective_bytes_per_device", "predicted_bytes_per_device",
    "predicted_bytes_per_device_on_accelerator",
    "bytes_match_prediction", "analytic_minimum_bytes", "bytes_over_minimum", "baseline_jax_step_s", "overhead_vs_jax",
}


def test_bench_measures_what_explain_predicts(tmp_path):
    rows = run(BenchConfig(models=["transformer"], preset="tiny", rounds=2, steps_per_round=1, out=str(tmp_path)), out=lambda s: None)
    assert {r["layout"] for r in rows} == {"data_parallel", "megatron", "dp_tp", "fsdp"}
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["collectives_measured"] == r["collectives_predicted"], r["layout"]
        assert r["bytes_over_minimum"] == pytest.approx(1.0), r["layout"]
        assert r["mfu"] is None  # CPU: no known peak
        assert r["memory_bytes_per_device"]["total"] > 0 and len(r["step_times_s"]) == 2
    by = {r["layout"]: r for r in rows}
    # fsdp stores parameters split: less memory than data parallel; it moves data parallel's bytes
    # (gather + reduce-scatter = all-reduce) plus a second gather of each layer's parameters.
    assert by["fsdp"]["memory_bytes_per_device"]["arguments"] < by["data_parallel"]["memory_bytes_per_device"]["arguments"]
    c = transformer.Config.preset("tiny")
    per_layer = c.d_model * 3 * c.heads * c.d_kv + c.heads * c.d_kv * c.d_model + 2 * c.d_model * c.d_ff + 2 * c.d_model
    extra = by["fsdp"]["collective_bytes_per_device"] - by["data_parallel"]["collective_bytes_per_device"]
    assert extra == pytest.approx(4 * c.layers * per_layer * 7 / 8, rel=1e-3)


def _affine_tokens(n: int, vocab: int) -> np.ndarray:
    out = np.zeros(n, np.uint16)
    for i in range(1, n):
        out[i] = (5 * int(out[i - 1]) + 3) % vocab
    return out


def test_token_file_batches_read_only_the_rows_each_device_holds(tmp_path):
    tokens = _affine_tokens(5000, 64)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    data = TokenFile(path, batch=8, length=16, vocab=64)
    mesh, layout = md.Mesh({"data": 4, "model": 2}), md.Layout("batch:data")
    batch = data.batch_at(3, mesh, layout)
    starts = ((3 * 8 + np.arange(8)) * 16) % (5000 - 17)
    expected = np.stack([tokens[s : s + 17] for s in starts]).astype(np.int32)
    np.testing.assert_array_equal(batch["inputs"].numpy(), expected[:, :16])
    np.testing.assert_array_equal(batch["targets"].numpy(), expected[:, 1:])
    for shard in batch["inputs"].array.addressable_shards:
        assert shard.data.shape == (2, 16)


def test_token_file_mistakes_are_named(tmp_path):
    with pytest.raises(DataError, match="not found"):
        TokenFile(tmp_path / "none.npy", 8, 16, 64)
    np.save(tmp_path / "short.npy", np.arange(10, dtype=np.int32))
    with pytest.raises(DataError, match="has 10 tokens; a window needs at least 18"):
        TokenFile(tmp_path / "short.npy", 8, 16, 64)
    np.save(tmp_path / "big.npy", np.full(100, 70, np.int32))
    with pytest.raises(DataError, match="holds id 70, outside the model's vocab of 64"):
        TokenFile(tmp_path / "big.npy", 2, 16, 64).batch_at(0, md.Mesh({"data": 2}), md.Layout("batch:data"))["inputs"].numpy()


def test_training_on_a_token_file_learns(tmp_path):
    np.save(tmp_path / "tokens.npy", _affine_tokens(20000, 64).astype(np.int32))
    result = meshdsl("train", "--model", "transformer", "--preset", "tiny", "--layout", "data_parallel",
                     "--data", str(tmp_path / "tokens.npy"), "--steps", "15", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if " loss " in line]
    assert losses[-1] < 0.8 * losses[0]


def test_bench_shows_bf16_gradient_reduction_halving_the_bytes(tmp_path):
    """The gradient all-reduce in bf16 moves half the bytes on an accelerator; XLA on CPU widens it
    to f32, so the CPU's HLO moves what f32 does, and the bench reports both."""
    cfg = dict(models=["transformer"], preset="tiny", layouts=["data_parallel"], rounds=1, steps_per_round=1, out=str(tmp_path))
    (f32,) = run(BenchConfig(**cfg), out=lambda s: None)
    (bf16,) = run(BenchConfig(**cfg, grad_reduce_dtype="bfloat16"), out=lambda s: None)
    loss = 2 * 7 / 8 * 4  # the f32 loss all-reduce, the one sum left in f32
    assert f32["predicted_bytes_per_device_on_accelerator"] == f32["collective_bytes_per_device"]
    assert bf16["collective_bytes_per_device"] == f32["collective_bytes_per_device"]
    assert bf16["predicted_bytes_per_device_on_accelerator"] == pytest.approx((f32["collective_bytes_per_device"] - loss) / 2 + loss)
    assert "(accel. " in (tmp_path / "results.md").read_text()


def test_bf16_gradient_reduction_trains():
    """``--grad-reduce-dtype bfloat16``: gradients are summed in bf16 (XLA on CPU widens them to f32)."""
    import meshdsl.models.transformer as transformer
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    layout = md.Layout.load(ROOT / "layouts" / "data_parallel.toml")
    model = transformer.Model(transformer.Config.preset("tiny"))
    trainer = Trainer(model, optim.adamw(1e-2), layout.mesh(), layout, grad_reduce_dtype="bfloat16")
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    key = jax.random.key_data(jax.random.key(1))
    jaxpr = str(jax.make_jaxpr(trainer.step.spmd_function)(state, key))
    # Every gradient sum is in bf16; the one f32 sum left is the loss.
    assert len(re.findall(r"bf16\[[\d,]*\] = psum", jaxpr)) == 9
    assert len(re.findall(r"f32\[[\d,]*\] = psum", jaxpr)) == 1
    losses = []
    for _ in range(10):
        state, loss = trainer.step(state, key)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
