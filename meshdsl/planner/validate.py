"""Check the planner against the compiled program, layout by layout.

``python -m meshdsl.planner.validate --models mlp transformer moe [--preset tiny] [--devices 8]``

``python -m meshdsl.planner.validate --models transformer --preset 1b --devices 64 --ranked
--profile h100 --memory-gb 80``

``python -m meshdsl.planner.validate --models transformer --set batch=16 --set layers=4 --only layers:stage``

For every legal candidate of each model (the search's enumeration), or with ``--ranked`` the
layouts ``meshdsl search`` ranks under that profile, memory limit and ``--set`` values (its first
``--top``), predict the step on the ``cpu-sim`` profile and compile it on the simulated devices;
print one markdown table row per layout (predicted collective bytes per device and whether they
equal the compiled HLO's, the predicted and the compiled memory per device, and the memory
error), then a summary line. The references are the compiler's own: the HLO's collectives
(:mod:`meshdsl.analysis.hlo`) and ``compiled.memory_analysis()``
(:func:`~meshdsl.measure.timing.memory_bytes`). Exits 1 when a row misses (bytes unequal, or
memory off by more than 10%). ``--only SUBSTRING`` (repeatable) keeps the layouts whose name contains one.

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
        """The table row; both memories in the unit that keeps the compiled one under 10,000 (KiB, MiB, GiB)."""
        power = next((p for p in (1, 2) if self.compiled_memory < 10_000 * 2.0 ** (10 * p)), 3)
        unit, scale = ("KiB", "MiB", "GiB")[power - 1], 2.0 ** (10 * power)
        return (
            f"| {self.model} | {self.cell} | {self.predicted_bytes:,.0f} | {'yes' if self.bytes_equal else 'NO'} | "
            f"{self.predicted_memory / scale:,.1f} {unit} | {self.compiled_memory / scale:,.1f} {unit} | "
            f"{self.memory_error:+.1%} |"
        )


def check(name: str, model: Model, optimizer: Any, candidate: Any, devices: int) -> Check | None:
    """Predict ``candidate`` of ``model`` (profile cpu-sim) and compare it with its compiled step;
    None when tracing it raises a layout or shape error (the search drops it as illegal)."""
    import jax

    import meshdsl as md
    from meshdsl.analysis import hlo
    from meshdsl.measure.timing import compile_abstract, memory_bytes
    from meshdsl.planner.cost import predict
    from meshdsl.planner.profile import load_profile
    from meshdsl.train.step import Trainer

    try:
        prediction = predict(model, optimizer, candidate.axis_sizes, candidate.layout, load_profile("cpu-sim"))
    except (md.LayoutError, md.ShapeError):
        return None
    trainer = Trainer(model, optimizer, md.Mesh(candidate.axis_sizes), candidate.layout)
    # compiled for the state's shapes, nothing allocated: a 1B step's state does not fit the host 64 times
    compiled = compile_abstract(trainer, jax.random.key_data(jax.random.key(0)))
    equal = prediction.report.summary() == hlo.summary(compiled.as_text(), num_devices=devices)
    return Check(
        name, candidate.name, prediction.total_bytes, equal, prediction.memory.total, memory_bytes(compiled)["total"]
    )


@dataclasses.dataclass(frozen=True)
class Ranked:
    """Check the layouts ``meshdsl search`` ranks (its first ``top``) under ``profile`` and ``memory_limit``
    bytes per device (None: the profile's), not every legal one."""

    profile: str = "cpu-sim"
    memory_limit: float | None = None
    top: int | None = None


def _ranked(model: Model, optimizer: Any, devices: int, ranked: Ranked) -> list[Any]:
    """The candidates search ranks (fastest first), at most ``ranked.top``."""
    from meshdsl.planner.profile import load_profile
    from meshdsl.planner.search import search

    result = search(model, optimizer, devices, load_profile(ranked.profile), ranked.memory_limit)
    return [c for c, _ in result.ranked[: ranked.top]]


def validate(
    models: Sequence[str],
    preset: str,
    devices: int,
    out: Callable[[str], None] = print,
    overrides: dict[str, object] | None = None,
    ranked: Ranked | None = None,
    only: Sequence[str] = (),
) -> list[Check]:
    """Check every legal layout of ``models`` on ``devices`` devices (with ``ranked``, those search ranks),
    the models built with the ``--set`` values ``overrides``, printing a table row for each; with ``only``,
    just the layouts whose name contains one of those substrings (``--only``)."""
    from meshdsl.model.loader import build_model
    from meshdsl.planner.search import legal_candidates
    from meshdsl.train import optim

    optimizer = optim.make("adamw")
    chosen = []
    for name in models:
        model = build_model(name, preset, **(overrides or {}))
        every = (
            legal_candidates(model, optimizer, devices)
            if ranked is None
            else _ranked(model, optimizer, devices, ranked)
        )
        chosen += [(name, model, c) for c in every if not only or any(part in c.name for part in only)]
    matched = {part for part in only if any(part in c.name for _, _, c in chosen)}
    if unmatched := [part for part in only if part not in matched]:
        raise ConfigError(
            f"--only {unmatched[0]!r} matches none of the layouts of {', '.join(models)} at preset {preset!r} on "
            f"{devices} devices (a layout is named like '[data=4 model=2] batch:data; d_ff:model')"
        )
    out(HEADER)
    checks = []
    for name, model, candidate in chosen:
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
    parser.add_argument("--ranked", action="store_true", help="check the layouts search ranks, not every legal one")
    parser.add_argument("--profile", default="cpu-sim", help="with --ranked: the profile search plans for")
    parser.add_argument("--memory-gb", type=float, default=None, help="with --ranked: search's memory per device")
    parser.add_argument("--top", type=int, default=None, help="with --ranked: check the first TOP only")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SUBSTRING",
        help="check only the layouts whose name contains SUBSTRING (repeatable: any of them), e.g. 'layers:stage'",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        simulate_devices(args.devices)
    except ConfigError as e:
        parser.error(str(e))
    import jax

    from meshdsl.train.config import overrides

    gb = args.memory_gb
    ranked = Ranked(args.profile, None if gb is None else gb * 1e9, args.top) if args.ranked else None
    try:
        settings = overrides(args.overrides)
    except ConfigError as e:
        parser.error(str(e))
    try:
        checks = validate(
            args.models,
            args.preset,
            jax.device_count(),
            lambda line: print(line, flush=True),
            settings,
            ranked,
            args.only,
        )
    except ConfigError as e:  # an unknown model, preset or --set field, an --only that matches nothing
        parser.error(str(e))
    print(f"\n{summary(checks)}")
    return 0 if all(c.bytes_equal and c.memory_close for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
