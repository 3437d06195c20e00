"""What a person watching ``meshdsl train`` reads: the compile time, a progress bar or plain lines,
evaluations, and the end-of-run summary.

On a terminal a tqdm bar shows the step, loss, throughput, MFU and ETA, and other messages
(evaluations, saved checkpoints) print above it. Off a terminal (a log file, CI) a plain line is
printed for the first step, every ``log_every`` steps, every step that evaluated, and the last.
The ETA is the wall time per step since the first step (which may include compiling) times the
steps left, so it counts evaluation and checkpoint time too.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from typing import Any, TextIO

from meshdsl.runtime.waiting import duration


def memory(nbytes: float) -> str:
    """A byte count in KiB, MiB or GiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


@dataclasses.dataclass
class Step:
    """One step's figures, as shown."""

    step: int
    loss: float
    seconds: float
    learning_rate: float | None = None
    throughput: float | None = None
    """Tokens (or examples) per second; None for a model without ``examples_per_step``."""
    mfu: float | None = None
    eval_loss: float | None = None
    eval_perplexity: float | None = None


class Progress:
    """The live view of steps ``first + 1 .. total``: a bar on a terminal, plain lines elsewhere."""

    def __init__(self, first: int, total: int, unit: str, out: TextIO, log_every: int = 10, live: bool | None = None):
        self.first, self.total, self.unit, self.out, self.log_every = first, total, unit, out, log_every
        self.live = out.isatty() if live is None else live
        self.bar = None
        self.after_first: tuple[float, int] | None = None
        if self.live:
            from tqdm import tqdm

            # the terminal's size, 80 x 24 where it reports none (a pty of size 0 x 0, where tqdm draws nothing)
            size = shutil.get_terminal_size()
            self.bar = tqdm(
                total=total,
                initial=first,
                file=out,
                unit="step",
                ncols=size.columns or 80,
                nrows=size.lines or 24,
                leave=True,
            )

    def note(self, line: str) -> None:
        """A message line (a saved checkpoint), printed above the bar on a terminal."""
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def eta(self, step: int) -> float | None:
        """Seconds left after ``step``: wall time per step since the first step of this run, times the steps left."""
        now = time.perf_counter()
        if self.after_first is None:
            self.after_first = (now, step)
            return None
        since, at = self.after_first
        return None if step == at else (now - since) / (step - at) * (self.total - step)

    def update(self, s: Step) -> None:
        """Show step ``s``."""
        eta = self.eta(s.step)
        throughput = "" if s.throughput is None else f"  {s.throughput:,.0f} {self.unit}/s"
        mfu = "" if s.mfu is None else f"  MFU {100 * s.mfu:.1f}%"
        lr = "" if s.learning_rate is None or math.isnan(s.learning_rate) else f"  lr {s.learning_rate:.2e}"
        evaluated = (
            ""
            if s.eval_loss is None
            else f"  eval loss {s.eval_loss:.4f}"
            + ("" if s.eval_perplexity is None else f" (perplexity {s.eval_perplexity:,.2f})")
        )
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {s.loss:.4f}{throughput}{mfu}", refresh=False)
            self.bar.update(1)
            if evaluated:
                self.bar.write(f"step {s.step}:{evaluated}", file=self.out)
            if s.step == self.total:
                self.bar.close()
            return
        if s.step in (self.first + 1, self.total) or s.step % self.log_every == 0 or evaluated:
            width = len(str(self.total))
            done = int(20 * s.step / self.total)
            left = "" if eta is None else f"  ETA {duration(eta)}"
            self.out.write(
                f"step {s.step:>{width}}/{self.total} [{'#' * done}{'.' * (20 - done)}] loss {s.loss:.4f}  "
                f"step {s.seconds * 1e3:7.1f} ms{throughput}{mfu}{lr}{left}{evaluated}\n"
            )
            self.out.flush()

    def close(self) -> None:
        """End the bar early (a run stopped before its last step)."""
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class Summary:
    """The end-of-run figures :func:`summary` prints."""

    steps: int
    seconds: float
    compile_seconds: float
    step_seconds: list[float]
    unit: str
    per_step: int | None
    """Tokens (or examples) in one step; None: no throughput."""
    final_eval: tuple[int, float] | None = None
    best_eval: tuple[int, float] | None = None
    perplexity: bool = False
    peak_bytes: int | None = None
    compiled_bytes: int | None = None
    """What XLA's ``memory_analysis()`` says the compiled step needs on one device (arguments, outputs and
    temporaries, less the donated state's aliases): known on every platform, CPU included."""
    platform: str = "cpu"
    checkpoint: str | None = None
    logs: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        """The summary as lines of text."""
        later = self.step_seconds[1:] or self.step_seconds
        mean = sum(later) / len(later)
        rate = "" if self.per_step is None else f", {self.per_step / mean:,.0f} {self.unit}/s"
        out = [
            f"done: {self.steps} step{'s' if self.steps != 1 else ''} in {duration(self.seconds)} "
            f"(compiling {self.compile_seconds:.1f} s); step {mean * 1e3:.1f} ms mean after the first{rate}"
        ]
        if self.final_eval is not None and self.best_eval is not None:
            ppl = (lambda x: f" (perplexity {math.exp(x):,.2f})") if self.perplexity else (lambda x: "")
            (fs, fl), (bs, bl) = self.final_eval, self.best_eval
            out.append(f"eval loss: final {fl:.4f}{ppl(fl)} at step {fs}, best {bl:.4f}{ppl(bl)} at step {bs}")
        kept = (
            f"{memory(self.peak_bytes)} on one device"
            if self.peak_bytes is not None
            else f"not kept by {self.platform} devices"
        )
        needed = (
            "" if self.compiled_bytes is None else f"; the compiled step needs {memory(self.compiled_bytes)} a device"
        )
        out.append(f"peak memory: {kept}{needed}")
        if self.checkpoint is not None:
            out.append(f"checkpoints: {self.checkpoint}")
        out.extend(self.logs)
        return out


def peak_bytes(device: Any) -> int | None:
    """The most memory ``device`` has held (``memory_stats()['peak_bytes_in_use']``); None where it
    keeps no count (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])
