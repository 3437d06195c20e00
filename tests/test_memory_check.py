"""A step that does not fit a device's memory is one clear line before it runs (meshdsl.measure.fits).

The device's capacity is faked with ``MESHDSL_DEVICE_MEMORY_BYTES``; the step's memory the check
compares with it is checked against XLA's own ``memory_analysis()`` of the step compiled as
bench compiles it, with its state allocated.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import jax
import pytest

from meshdsl import cli
from meshdsl.bench.run import BenchConfig, run
from meshdsl.errors import ConfigError
from meshdsl.measure import fits
from meshdsl.measure.timing import compile_abstract, interleaved_rounds, memory_bytes
from meshdsl.model.loader import build_model
from meshdsl.runtime.layout_spec import load_layout
from meshdsl.train import optim
from meshdsl.train.step import Trainer


def _trainer(layout: str, model: str = "mlp") -> Trainer:
    spec = load_layout(layout)
    return Trainer(build_model(model, "tiny"), optim.make("adamw"), spec.mesh(), spec)


def _needed(layout: str, model: str = "mlp") -> dict[str, int]:
    """XLA's figure for the step compiled from an allocated state (as before this check existed)."""
    trainer = _trainer(layout, model)
    key = jax.random.key(0)
    state = trainer.init(jax.random.key_data(key))
    return memory_bytes(trainer.step.lower(state, jax.random.key_data(jax.random.fold_in(key, 1))).compile())


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _mib(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.,]+) (B|KiB|MiB|GiB|TiB)", text).groups()
    return float(number.replace(",", "")) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


def test_capacity_comes_from_the_variable_the_device_or_the_hosts_available_memory(monkeypatch):
    monkeypatch.setenv(fits.ENV, "3e9")
    assert fits.capacity() == fits.Capacity(3_000_000_000, fits.ENV)
    for bad in ("lots", "-5", "nan", "inf", "0"):
        monkeypatch.setenv(fits.ENV, bad)
        with pytest.raises(ConfigError, match=fits.ENV):
            fits.capacity()
    monkeypatch.delenv(fits.ENV)

    def available() -> int:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024

    before, cap, after = available(), fits.capacity(), available()
    share = [b // jax.local_device_count() for b in (before, after)]
    assert min(share) * 0.9 <= cap.bytes <= max(share) * 1.1 and "shared by 8 simulated" in cap.source

    class Gpu:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 0}

    assert fits.capacity(Gpu()) == fits.Capacity(80 * 2**30, "the gpu allocator's limit")


def test_readable_sizes_never_read_as_zero():
    assert [fits.readable(n) for n in (512, 1536, 3 * 2**20, 1000 * 2**30, 682_084 * 2**20)] == [
        "512 B",
        "1.5 KiB",
        "3 MiB",
        "1,000 GiB",
        "666 GiB",
    ]


def test_the_check_compares_the_compiled_total_with_the_capacity():
    needed = _needed("data_parallel")
    abstract = memory_bytes(compile_abstract(_trainer("data_parallel"), jax.random.key_data(jax.random.key(1))))
    assert abstract == needed  # compiled from shapes alone, nothing allocated: the same program
    fits.check("s", needed, fits.Capacity(needed["total"], "x"))
    with pytest.raises(fits.DoesNotFit) as e:
        fits.check("the step", needed, fits.Capacity(needed["total"] - 1, "a test"))
    assert e.value.needed == needed["total"] and "\n" not in str(e.value)
    assert all(remedy in str(e.value) for remedy in ("remat=true", "smaller batch", "meshdsl search --memory-gb"))


def test_train_that_does_not_fit_exits_2_before_step_1_with_both_numbers(monkeypatch, tmp_path):
    needed = _needed("data_parallel", "transformer")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(fits.ENV, str(needed["total"] // 2))
    code, out, err = _main("train", "--model", "transformer", "--preset", "tiny", "--steps", "2")
    assert code == 2 and "step 1" not in out and len(err.strip().splitlines()) == 1
    found = re.search(r"needs (.+?) per device .* a device has (.+?) \(MESHDSL_DEVICE_MEMORY_BYTES\)", err)
    assert found, err
    assert _mib(found[1]) == pytest.approx(needed["total"], rel=0.01)
    assert _mib(found[2]) == pytest.approx(needed["total"] // 2, rel=0.01)
    monkeypatch.setenv(fits.ENV, str(needed["total"]))
    code, out, err = _main("train", "--model", "transformer", "--preset", "tiny", "--steps", "2")
    assert code == 0 and "step 2/2" in out, err


def test_bench_marks_the_entry_that_does_not_fit_and_measures_the_others(monkeypatch, tmp_path):
    small, large = sorted((_needed(x)["total"], x) for x in ("fsdp", "data_parallel"))
    assert small[0] < large[0]
    monkeypatch.setenv(fits.ENV, str((small[0] + large[0]) // 2))
    lines: list[str] = []
    cfg = BenchConfig(
        models=["mlp"],
        preset="tiny",
        layouts=["data_parallel", "fsdp"],
        rounds=1,
        steps_per_round=1,
        out=str(tmp_path / "out"),
        gspmd=False,
    )
    summaries = run(cfg, out=lines.append, warn=lines.append)
    assert [s["layout"] for s in summaries] == [small[1]]
    assert any(f"mlp x {large[1]}: skipped, the step does not fit" in line for line in lines), lines
    assert (
        f"- mlp x {large[1]}: skipped, the step does not fit: it needs" in (tmp_path / "out" / "results.md").read_text()
    )


def test_an_out_of_memory_error_at_run_time_loses_only_that_entry():
    calls = {"a": 0, "b": 0}

    def fine() -> None:
        calls["a"] += 1

    def exhausted() -> None:
        calls["b"] += 1
        if calls["b"] > 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB")

    failed: dict[int, BaseException] = {}
    samples = interleaved_rounds([fine, exhausted], [[0, 1], [1, 0], [0, 1]], 1, failed)
    assert list(failed) == [1] and calls == {"a": 4, "b": 2}
    assert len(samples[0]) == 3 and samples[1] == []
    with pytest.raises(ValueError):  # anything else is not swallowed
        interleaved_rounds([lambda: (_ for _ in ()).throw(ValueError("bug"))], [[0]], 1, {})
    assert "ran out of memory at run time" in fits.run_time_message("x", failed[1], fits.Capacity(2**30, "t"))


def test_explain_warns_when_the_prediction_exceeds_the_profiles_memory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = _main(
        "explain",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--profile",
        "h100",
        "--no-compile",
        "--set",
        "batch=8388608",
    )
    assert code == 0, err
    warning = [line for line in err.splitlines() if "exceeds profile h100" in line]
    assert len(warning) == 1 and "meshdsl search --memory-gb" in warning[0]
    code, out, err = _main("explain", "--model", "transformer", "--preset", "tiny", "--profile", "h100", "--no-compile")
    assert code == 0 and "exceeds" not in err
