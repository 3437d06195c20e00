"""Check the planner against the compiled program, layout by layout.

``python -m meshdsl.planner.validate --models mlp transformer moe [--preset tiny] [--devices 8]``

For every legal candidate of each model (the search's enumeration), predict the step on the
``cpu-sim`` profile and compile it on the simulated devices; print one markdown table row per
layout (predicted collective bytes per device and whether they equal the compiled HLO's, the
predicted and the compiled memory per device, and the memory error), then a summary line. The
references are the compiler's own: the HLO's collectives (:mod:`meshdsl.analysis.hlo`) and
``compiled.memory_analysis()`` (:func:`~meshdsl.measure.timing.memory_bytes`). Exits 1 when
a row misses (bytes unequal, or memory off by more than 10%).

The devices are chosen (``meshdsl.runtime.devices.simulate_devices``) before JAX runs anything, as the
``meshdsl`` command does; ``--devices`` defaults to XLA_FLAGS' count, else 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from meshdsl.errors import ConfigError
from meshdsl.model.protocol import Model
from meshdsl.runtime.devices import simulate_devices

MEMORY_TOLERANCE = 0.10
"""The issue's bound on the predicted peak memory's relative error."""

HEADER = (
    "| model | layout | predicted bytes/device | equals HLO | predicted memory | compiled memory | error |\n"
    "|---|---|---:|:---:|---:|---:|---:|"
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One layout's prediction beside its compiled program."""

    model: str
    layout: str
    predicted_bytes: float
    bytes_equal: bool
    predicted_memory: int
    compiled_memory: int

    @property
    def memory_error(self) -> float:
        return self.predicted_memory / self.compiled_memory - 1

    @property
    def memory_close(self) -> bool:
        return abs(self.memory_error) <= MEMORY_TOLERANCE

    @property
    def cell(self) -> str:
        """The layout's name as a markdown table cell (its ``|`` escaped)."""
        return f"`{self.layout}`".replace("|", "\\|")

    def row(self) -> str:
        kib = 2.0**10
        return (
            f"| {self.model} | {self.cell} | {self.predicted_bytes:,.0f} | {'yes' if self.bytes_equal else 'NO'} | "
            f"{self.predicted_memory / kib:,.1f} KiB | {self.compiled_memory / kib:,.1f} KiB | "
            f"{self.memory_error:+.1%} |"
        )


def check(name: str, model: Model, optimizer: Any, candidate: Any, devices: int) -> Check | None:
    """Predict ``candidate`` of ``model`` (profile cpu-sim) and compare it with its compiled step;
    None when tracing it raises a layout or shape error (the search drops it as illegal)."""
    import meshdsl as md
    from meshdsl.analysis import hlo
    from meshdsl.measure.timing import compile_step, memory_bytes
    from meshdsl.planner.cost import predict
    from meshdsl.planner.profile import load_profile
    from meshdsl.train.step import Trainer

    try:
        prediction = predict(model, optimizer, candidate.axis_sizes, candidate.layout, load_profile("cpu-sim"))
    except (md.LayoutError, md.ShapeError):
        return None
    compiled = compile_step(Trainer(model, optimizer, md.Mesh(candidate.axis_sizes), candidate.layout), 0).compiled
    equal = prediction.report.summary() == hlo.summary(compiled.as_text(), num_devices=devices)
    return Check(
        name, candidate.name, prediction.total_bytes, equal, prediction.memory.total, memory_bytes(compiled)["total"]
    )


def validate(models: Sequence[str], preset: str, devices: int, out: Callable[[str], None] = print) -> list[Check]:
    """Check every legal layout of ``models`` on ``devices`` devices, printing a table row for each."""
    from meshdsl.model.loader import build_model
    from meshdsl.planner.search import legal_candidates
    from meshdsl.train import optim

    optimizer = optim.make("adamw")
    out(HEADER)
    checks = []
    for name in models:
        model = build_model(name, preset)
        for candidate in legal_candidates(model, optimizer, devices):
            result = check(name, model, optimizer, candidate, devices)
            if result is not None:
                checks.append(result)
                out(result.row())
    return checks


def summary(checks: Sequence[Check]) -> str:
    """How many layouts' bytes equal the HLO's and how many memory predictions are within tolerance."""
    equal = sum(c.bytes_equal for c in checks)
    close = sum(c.memory_close for c in checks)
    return f"bytes equal {equal}/{len(checks)}; memory within {MEMORY_TOLERANCE:.0%} {close}/{len(checks)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the validation from the command line; the exit status says whether every row is within bounds."""
    parser = argparse.ArgumentParser(prog="python -m meshdsl.planner.validate", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer", "moe"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--devices", type=int, default=None, help="simulated CPU devices (default: XLA_FLAGS' count, else 8)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        simulate_devices(args.devices)
    except ConfigError as e:
        parser.error(str(e))
    import jax

    checks = validate(args.models, args.preset, jax.device_count(), lambda line: print(line, flush=True))
    print(f"\n{summary(checks)}")
    return 0 if all(c.bytes_equal and c.memory_close for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
