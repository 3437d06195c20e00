"""``meshdsl lab-digits``: the MLP in the DSL trained on scikit-learn's digits, checked against the
same training written in plain JAX on global arrays; compressed sums' accuracy within a bound."""

from __future__ import annotations

import argparse
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("sklearn")

from meshdsl import cli  # noqa: E402
from meshdsl.labs import digits  # noqa: E402

COMPRESSED_BOUND = 0.03
"""After three epochs, a compressed sum's test accuracy is within 3 points of the serial run's."""


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    digits.add_arguments(parser)
    args = parser.parse_args(["--epochs", "3", "--hidden", "16", "--data-parallel", "4"])
    return argparse.Namespace(**{**vars(args), **overrides})


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def lab() -> tuple[dict[str, digits.Result], list[str], str]:
    """One run of the lab: its results, the lines it printed, and its progress lines (as a terminal gets them)."""
    lines: list[str] = []
    status = _Terminal()
    done = digits.run(_args(), out=lines.append, status=status)
    return {f"{r.run.name}/{r.run.devices}": r for r in done}, lines, status.getvalue()


@pytest.fixture(scope="module")
def results(lab) -> dict[str, digits.Result]:
    return lab[0]


def test_the_lab_says_which_run_it_compiles_and_where_the_time_went(lab) -> None:
    """A progress line before each run (its compile was a silent 10 s), and a note after the table saying what
    the training times leave out."""
    results, lines, status = lab
    runs = list(results.values())
    shown = status.splitlines()
    assert len(shown) == len(runs)
    assert shown[0].startswith(f"meshdsl lab-digits: 0/{len(runs)} runs trained (next: serial on 1: compiling")
    assert shown[-1].startswith(f"meshdsl lab-digits: {len(runs) - 1}/{len(runs)} runs trained")
    training = sum(r.seconds for r in runs)
    assert lines[-1].startswith(f"training time counts each run's steps after its first: {training:.1f} s of the ")


def _plain_jax(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """The same SGD training in plain JAX on global arrays, from the serial run's initial weights."""
    import meshdsl as md
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    layout = md.Layout("batch:data", mesh_axes={"data": 1})
    trainer = Trainer(digits.Model(args.hidden), optim.sgd(1.0), layout.mesh(jax.devices()[:1]), layout)
    params = digits.flat_params(trainer.init(jax.random.key_data(jax.random.key(args.seed)))["params"])
    x, y, _, _ = digits.load(args.seed)

    def loss(p, bx, by):
        h = jax.nn.relu(bx @ p["hidden/kernel"] + p["hidden/bias"])
        logits = h @ p["output/kernel"] + p["output/bias"]
        return -jnp.mean(jnp.sum(by * jax.nn.log_softmax(logits, axis=1), axis=1))

    step = jax.jit(
        lambda p, bx, by: jax.tree.map(lambda a, g: a - args.learning_rate * g, p, jax.grad(loss)(p, bx, by))
    )
    p = {k: jnp.asarray(v) for k, v in params.items()}
    for bx, by in digits.batches(x, y, args.batch, args.epochs, args.seed):
        p = step(p, bx, by)
    return {k: np.asarray(v) for k, v in p.items()}


def test_serial_and_data_parallel_train_as_plain_jax(results):
    """Serial and uncompressed data-parallel runs end at plain JAX's weights, so they reach the same
    accuracy (up to one held-out image, for float32 rounding at a tie of two classes)."""
    want = _plain_jax(_args())
    _, _, _, y_test = digits.load(0)
    serial, parallel = results["serial/1"], results["data-parallel, float32 sum/4"]
    for r in (serial, parallel):
        for k, v in want.items():
            np.testing.assert_allclose(r.params[k], v, rtol=1e-4, atol=1e-5, err_msg=f"{r.run.name}: {k}")
    assert abs(parallel.accuracy - serial.accuracy) <= 1 / len(y_test)
    assert serial.accuracy > 0.8  # three epochs learn the digits: the check is not of an untrained model
    assert serial.bytes_per_step == 0 and parallel.bytes_per_step > 0


def test_compressed_sums_cost_little_accuracy_and_fewer_bytes(results):
    """Each compressed sum: accuracy within the bound of the serial run's, bytes as its width says."""
    serial = results["serial/1"].accuracy
    full = results["data-parallel, float32 sum/4"].bytes_per_step
    weights = results["data-parallel, float32 sum/4"].params["hidden/kernel"]
    for dtype, width in (("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1)):
        for suffix in ("", " + error feedback"):
            r = results[f"data-parallel, {dtype} sum{suffix}/4"]
            assert abs(r.accuracy - serial) <= COMPRESSED_BOUND, (r.run.name, r.accuracy, serial)
            assert r.bytes_per_step < full * width / 4 + 200, (r.run.name, r.bytes_per_step, full)
            assert not np.array_equal(r.params["hidden/kernel"], weights), f"{r.run.name}: nothing was compressed"
    assert "| serial | 1 |" in digits.table(list(results.values()))


def test_missing_scikit_learn_is_one_line(monkeypatch, capsys):
    """Without scikit-learn: one line naming it and the extra to install, exit status 2."""
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert cli.main(["lab-digits", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshdsl lab-digits: error: the digits lab needs scikit-learn") and "\n" not in err


def test_bad_flags_are_one_line(capsys):
    """A compressed dtype not offered, or a device count not dividing the batch: one line each, status 2."""
    with pytest.raises(SystemExit) as e:
        cli.main(["lab-digits", "--dtypes", "float9"])
    assert e.value.code == 2
    assert "invalid choice: 'float9' (choose from 'float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2')" in (
        capsys.readouterr().err
    )
    assert cli.main(["lab-digits", "--batch", "6", "--data-parallel", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshdsl lab-digits: error: --data-parallel 4: needs at least 2 devices dividing --batch 6"
    )


def test_more_devices_than_here_is_one_line(capsys):
    """--data-parallel beyond the devices at hand: one line naming both counts, before any run."""
    assert cli.main(["lab-digits", "--data-parallel", "2", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshdsl lab-digits: error: --data-parallel 64: only 8 devices here") and "\n" not in err
