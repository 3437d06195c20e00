"""``meshdsl lab-digits``: what a compressed gradient sum costs in accuracy, on real handwritten digits.

A two-layer MLP written in the DSL (64 pixels -> ``hidden`` -> 10 classes, ``md.nn.Linear``,
cross-entropy) is trained with plain SGD on scikit-learn's 8x8 digits (1,797 images shipped inside
the package: nothing is downloaded), serially on one device, data-parallel on 2 and 4 devices, and
data-parallel with each compressed gradient sum (``grad_reduce_dtype``), without and with error
feedback. Every run has the same
seed: the same initial weights, the same held-out split (a fifth of the images) and the same
batches in the same order, so uncompressed data parallelism computes the serial run's math and
the compressed runs differ from it only by their sums. The table gives per run the devices, the
training time (steps after the first, which compiles), the bytes one device sends per step
(``md.explain`` priced as on a GPU, where a 16-bit sum moves 2 bytes an element; on a CPU XLA
widens a bfloat16 all-reduce to 4) and the test accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

from meshdsl.collectives import GRAD_REDUCE_DTYPES
from meshdsl.errors import ConfigError
from meshdsl.runtime.waiting import Waiting

HELP = "train a small MLP on scikit-learn's 8x8 digits: serial, data-parallel and each compressed gradient sum"
CLASSES = 10
PIXELS = 64


@dataclasses.dataclass(frozen=True)
class Run:
    """One row of the table: ``devices`` devices, gradients summed in ``dtype`` (None: float32)."""

    devices: int
    dtype: str | None = None
    feedback: bool = False

    @property
    def name(self) -> str:
        if self.devices == 1:
            return "serial"
        return f"data-parallel, {self.dtype or 'float32'} sum" + (" + error feedback" if self.feedback else "")


@dataclasses.dataclass(frozen=True)
class Result:
    run: Run
    seconds: float
    bytes_per_step: float
    accuracy: float
    params: dict[str, np.ndarray]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The lab's flags."""
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training images (default 20)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (a multiple of 4; default 64)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP (default 64)")
    parser.add_argument("--learning-rate", type=float, default=0.5, help="SGD step size (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights, held-out split and batch order")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=list(GRAD_REDUCE_DTYPES),
        choices=GRAD_REDUCE_DTYPES,
        help="compressed sums to compare (default: all)",
    )
    parser.add_argument(
        "--data-parallel", nargs="+", type=int, default=[2, 4], help="device counts of the data-parallel runs"
    )
    parser.add_argument(
        "--error-feedback",
        choices=["without", "with", "both"],
        default="both",
        help="compressed runs without error feedback, with it, or both (default)",
    )


def load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as float32 pixels in [0, 1] and integer labels, split 4:1 into train and test by ``seed``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "the digits lab needs scikit-learn (its 8x8 digits ship inside it); pip install 'meshdsl[lab]'"
        ) from None
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    test = order[: len(x) // 5]
    train = order[len(x) // 5 :]
    return x[train], y[train], x[test], y[test]


class Model:
    """The MLP in the DSL: ``init``, ``loss`` (mean cross-entropy of a batch ``{"x", "y"}``, ``y`` one-hot)."""

    def __init__(self, hidden: int):
        import meshdsl as md

        self.hidden = md.nn.Linear(md.Dim("pixels", PIXELS), md.Dim("hidden", hidden), bias=True, init_scale=2**0.5)
        self.output = md.nn.Linear(md.Dim("hidden", hidden), md.Dim("classes", CLASSES), bias=True)

    def init(self, key: Any) -> dict[str, Any]:
        import jax

        k1, k2 = jax.random.split(key)
        return {"hidden": self.hidden.init(k1), "output": self.output.init(k2)}

    def loss(self, params: dict[str, Any], batch: dict[str, Any]) -> Any:
        import meshdsl as md

        logits = self.output(params["output"], md.relu(self.hidden(params["hidden"], batch["x"])))
        return -md.reduce_mean(md.reduce_sum(batch["y"] * md.log_softmax(logits, "classes"), "classes"))


def predict(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Class of each row of ``x`` under ``params`` (numpy: the held-out check runs outside the DSL)."""
    h = np.maximum(x @ params["hidden/kernel"] + params["hidden/bias"], 0)
    return np.argmax(h @ params["output/kernel"] + params["output/bias"], axis=1)


def batches(x: np.ndarray, y: np.ndarray, batch: int, epochs: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every step's batch: each epoch a fresh permutation (by ``seed``) cut into whole batches."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(len(x) // batch):
            rows = order[i * batch : (i + 1) * batch]
            out.append((x[rows], np.eye(CLASSES, dtype=np.float32)[y[rows]]))
    return out


def train(run: Run, args: argparse.Namespace) -> Result:
    """One run of the table."""
    import jax

    import meshdsl as md
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    x, y, x_test, y_test = load(args.seed)
    layout = md.Layout("batch:data", mesh_axes={"data": run.devices})
    mesh = layout.mesh(jax.devices()[: run.devices])
    trainer = Trainer(
        Model(args.hidden),
        optim.sgd(args.learning_rate),
        mesh,
        layout,
        grad_reduce_dtype=run.dtype,
        error_feedback=run.feedback,
    )
    state = trainer.init(jax.random.key_data(jax.random.key(args.seed)))
    steps = [_batch(md, bx, by) for bx, by in batches(x, y, args.batch, args.epochs, args.seed)]
    sent = trainer.explain(state, steps[0], platform="gpu").total_bytes
    state, loss = trainer.step(state, steps[0])
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for b in steps[1:]:
        state, loss = trainer.step(state, b)
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - start
    params = flat_params(state["params"])
    accuracy = float(np.mean(predict(params, x_test) == y_test))
    return Result(run, seconds, sent, accuracy, params)


def _batch(md: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    return {"x": md.tensor(x, ["batch", "pixels"]), "y": md.tensor(y, ["batch", "classes"])}


def flat_params(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """``{"hidden/kernel": ..., ...}``: the parameters as global numpy arrays."""
    return {f"{layer}/{part}": np.asarray(t.numpy()) for layer, parts in params.items() for part, t in parts.items()}


def runs(args: argparse.Namespace) -> list[Run]:
    """The table's rows: serial, data-parallel on each device count, then each compressed sum on each."""
    out = [Run(1)]
    out += [Run(n) for n in args.data_parallel]
    feedback = {"without": [False], "with": [True], "both": [False, True]}[args.error_feedback]
    out += [Run(n, d, f) for d in args.dtypes for f in feedback for n in args.data_parallel]
    return out


def drift(params: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    """How far ``params`` ended from ``reference``: the norm of the difference over the reference's norm."""
    diff = np.sqrt(sum(float(np.sum((params[k] - v) ** 2)) for k, v in reference.items()))
    return diff / np.sqrt(sum(float(np.sum(v**2)) for v in reference.values()))


def table(results: Sequence[Result]) -> str:
    """The results as a markdown table: accuracy also as the difference from the serial run's, and
    how far each run's weights ended from the serial run's."""
    serial = results[0]
    lines = [
        "| configuration | devices | training time (s) | bytes per step per device | test accuracy | vs serial "
        "| weights vs serial |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.run.name} | {r.run.devices} | {r.seconds:.2f} | {r.bytes_per_step:,.0f} | "
            f"{100 * r.accuracy:.2f}% | {100 * (r.accuracy - serial.accuracy):+.2f} | "
            f"{drift(r.params, serial.params):.1e} |"
        )
    return "\n".join(lines)


def check(args: argparse.Namespace) -> None:
    """ConfigError for a flag out of range, before anything runs."""
    for flag, value in (("--epochs", args.epochs), ("--batch", args.batch), ("--hidden", args.hidden)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    for n in args.data_parallel:
        if n < 2 or args.batch % n:
            raise ConfigError(f"--data-parallel {n}: needs at least 2 devices dividing --batch {args.batch}")
    if not args.learning_rate > 0:
        raise ConfigError(f"--learning-rate {args.learning_rate}: must be above 0")


def run(args: argparse.Namespace, out: Callable[[str], None] = print, status: TextIO | None = None) -> list[Result]:
    """Train every run of :func:`runs` and print the table; ``status``: where the progress lines go (stderr when
    it is a terminal, :class:`~meshdsl.runtime.waiting.Waiting`)."""
    import jax

    check(args)
    load(args.seed)  # scikit-learn missing: one line before anything compiles
    here = len(jax.devices())
    if max(args.data_parallel) > here:
        raise ConfigError(
            f"--data-parallel {max(args.data_parallel)}: only {here} devices here; simulate more with "
            f"meshdsl --devices {max(args.data_parallel)} lab-digits"
        )
    results = []
    todo = runs(args)
    began = time.perf_counter()
    waiting = Waiting("meshdsl lab-digits", "runs trained", len(todo), every=0, out=status)
    for r in todo:
        waiting.show(f"next: {r.name} on {r.devices}: compiling its step, then training")
        results.append(train(r, args))
        waiting.done += 1
        out(f"{r.name} on {r.devices}: {100 * results[-1].accuracy:.2f}% in {results[-1].seconds:.2f} s")
    out(table(results))
    out(time_note(sum(r.seconds for r in results), time.perf_counter() - began))
    return results


def time_note(training: float, total: float) -> str:
    """What the table's training times leave out of the command's time: each run's compile (its first
    step, untimed), the explain of its collectives and the held-out check."""
    return (
        f"training time counts each run's steps after its first: {training:.1f} s of the {total:.1f} s the runs took; "
        "the rest compiled each run's step (its first step), explained its collectives and checked its accuracy"
    )
