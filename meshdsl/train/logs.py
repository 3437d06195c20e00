"""Where a training run's numbers go beside the terminal: ``--log-json`` lines, TensorBoard event
files (``--tensorboard``, written by tensorboardX: no TensorFlow needed) and a loss-curve PNG beside
the JSON log.

Each step is one record of scalars (``loss``, ``learning_rate``, ``grad_norm``, ``seconds``,
``tokens_per_second`` or ``examples_per_second``, ``mfu``, and after an evaluation ``eval_loss`` and
``eval_perplexity``); a scalar that is unknown (no peak FLOP/s for MFU on a CPU) is left out.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from meshdsl.errors import ConfigError
from meshdsl.runtime import output_paths

TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "seconds": "perf/step_seconds",
    "tokens_per_second": "perf/tokens_per_second",
    "examples_per_second": "perf/examples_per_second",
    "mfu": "perf/mfu",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}
"""TensorBoard tag of each scalar."""


def loss_curve_path(log_json: str | Path) -> Path | None:
    """The PNG written beside ``log_json`` (``run.jsonl``: ``run.png``); None for a log that is not a
    regular file's name (``/dev/null``)."""
    path = Path(log_json)
    if path.exists() and not path.is_file():
        return None
    return path.with_suffix(".png")


def check(log_json: str | None, tensorboard: str | None) -> None:
    """ConfigError (naming the flag) unless the JSON log, its PNG and the TensorBoard folder can be written."""
    if log_json is not None:
        output_paths.check_file(log_json, "--log-json")
        png = loss_curve_path(log_json)
        if png is not None:
            output_paths.check_file(png, "--log-json's loss curve")
    if tensorboard is not None:
        output_paths.check_dir(tensorboard, "--tensorboard")


def earlier_records(log_json: str | Path, first: int) -> list[dict[str, Any]]:
    """The records of steps 1 to ``first`` in the JSON log a resumed run continues; the lines of a killed
    run's later steps (which the resumed run trains again) and a line the kill cut short are dropped.
    [] when there is no such file or it cannot be read."""
    path = Path(log_json)
    try:
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    except OSError:
        return []
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "loss" in record:
            if record["step"] <= first:
                kept.append(record)
    return kept


class Logs:
    """The sinks a run writes: open them, :meth:`write` each step's record, :meth:`close` at the end.

    ``first``: the step a resumed run starts after. Its JSON log keeps the lines of steps 1 to ``first``
    already in the file (:func:`earlier_records`), so the log and its loss curve hold the whole run.
    Its TensorBoard events start with a purge at step
    ``first + 1``, so a killed run's events past its checkpoint (steps it trains again) are dropped
    from the curves instead of drawn twice. The event file's name ends in the process id and ``first``:
    tensorboardX names it by the second it was opened, and a run resumed within that second would
    otherwise write over the killed run's file.
    """

    def __init__(self, log_json: str | None = None, tensorboard: str | None = None, first: int = 0):
        self.log_json, self.png = log_json, None if log_json is None else loss_curve_path(log_json)
        kept = earlier_records(log_json, first) if log_json is not None and first else []
        try:
            self.json = open(output_paths.parent(log_json), "w") if log_json is not None else None
            if self.json is not None and kept:
                self.json.write("".join(json.dumps(r) + "\n" for r in kept))
                self.json.flush()
        except OSError as e:
            raise ConfigError(f"--log-json {log_json}: cannot write it: {e.strerror}") from None
        self.board = None
        if tensorboard is not None:
            from tensorboardX import SummaryWriter

            self.board = SummaryWriter(
                str(tensorboard), purge_step=first + 1 if first else None, filename_suffix=f".{os.getpid()}.{first}"
            )
        self.curve: list[tuple[int, float]] = [(r["step"], r["loss"]) for r in kept]
        self.eval_curve: list[tuple[int, float]] = [(r["step"], r["eval_loss"]) for r in kept if "eval_loss" in r]

    def write(self, step: int, record: dict[str, Any]) -> None:
        """Step ``step``'s scalars (None values are left out) to every sink."""
        record = {k: v for k, v in record.items() if v is not None}
        self.curve.append((step, record["loss"]))
        if "eval_loss" in record:
            self.eval_curve.append((step, record["eval_loss"]))
        intact = "the lines of the steps before it are in it"
        if self.json is not None:
            with output_paths.writing(f"--log-json {self.log_json!r} at step {step}", intact):
                try:
                    self.json.write(json.dumps({"step": step, **record}) + "\n")
                    self.json.flush()
                except OSError:
                    self._drop_json()
                    raise
        if self.board is not None:
            with output_paths.writing(f"--tensorboard event file at step {step}", "the steps before it are in it"):
                for key, value in record.items():
                    if key in TAGS and math.isfinite(value):
                        self.board.add_scalar(TAGS[key], value, step)
                self.board.flush()

    def _drop_json(self) -> None:
        """Stop writing the JSON log (and drawing its curve) after a failed write: reported once, its
        buffer cannot be flushed."""
        try:
            if self.json is not None:
                self.json.close()
        except OSError:
            pass
        self.json = self.png = None

    def close(self) -> Path | None:
        """Close the sinks and draw the loss curve (when there is a JSON log); the PNG's path, or None."""
        if self.json is not None:
            with output_paths.writing(
                f"--log-json {self.log_json!r} at the end", "the lines of the steps before it are in it"
            ):
                try:
                    self.json.close()
                finally:
                    self.json = None
        if self.board is not None:
            self.board.close()
        if self.png is None or not self.curve:
            return None
        with output_paths.writing(
            f"the loss curve {str(self.png)!r}", f"--log-json {self.log_json!r} holds every step"
        ):
            return loss_curve(self.curve, self.eval_curve, output_paths.parent(self.png))


def loss_curve(train: list[tuple[int, float]], evaluation: list[tuple[int, float]], path: Path) -> Path:
    """A PNG of the training loss per step and the eval loss at each evaluation (matplotlib, no pyplot state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evaluation:
        ax.plot(*zip(*evaluation), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
