"""The planner's commands: ``meshdsl explain``, ``meshdsl calibrate`` and ``meshdsl search``.

Imports of JAX and the planner happen inside the handlers, after the CLI has chosen the devices.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMANDS = ("explain", "calibrate", "search")


def add_parsers(sub: Any) -> None:
    """Add the planner's subcommands to the ``meshdsl`` parser's subparsers."""
    from meshdsl.cli import MODEL_HELP, PRESET_HELP, SET_HELP

    explain = sub.add_parser("explain", help="predict one layout: communication per op, memory, FLOPs, step time")
    explain.add_argument("--model", default="transformer", help=MODEL_HELP)
    explain.add_argument("--preset", default="small", help=PRESET_HELP)
    explain.add_argument(
        "--layout", default="data_parallel", help="a layout TOML file, a shipped layout name, or rules"
    )
    explain.add_argument("--optimizer", default="adamw")
    explain.add_argument(
        "--profile", default=None, help="device profile (shipped name or JSON file; default: the devices at hand)"
    )
    explain.add_argument("--no-compile", action="store_true", help="skip compiling the step for its own memory figure")
    explain.add_argument(
        "--backend",
        default="spmd",
        choices=["spmd", "gspmd"],
        help="spmd: meshdsl's plan, traced; gspmd: the collectives XLA's partitioner chose, measured from the compiled step",
    )
    explain.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)

    calibrate = sub.add_parser("calibrate", help="measure the devices at hand into a device profile (JSON)")
    calibrate.add_argument("--name", default=None, help="the profile's name (default: from the device)")
    calibrate.add_argument("--out", default=None, help="where to write it (default: <name>.json)")

    search = sub.add_parser("search", help="rank meshes and layouts of a model by predicted step time")
    search.add_argument("--model", default="transformer", help=MODEL_HELP)
    search.add_argument("--preset", default="small", help=PRESET_HELP)
    search.add_argument(
        "--devices", dest="plan_devices", type=int, default=None, help="devices to plan for (default: those at hand)"
    )
    search.add_argument(
        "--memory-gb", type=float, default=None, help="memory per device in GB (default: the profile's)"
    )
    search.add_argument(
        "--profile", default=None, help="device profile (shipped name or JSON file; default: the devices at hand)"
    )
    search.add_argument("--optimizer", default="adamw")
    search.add_argument("--top", type=int, default=5, help="candidates to print")
    search.add_argument("--out", default=None, metavar="FILE", help="write the best layout as a TOML file")
    search.add_argument(
        "--measure", type=int, default=0, metavar="K", help="compile and time the top K on the devices at hand"
    )
    search.add_argument(
        "--rounds", type=int, default=5, help="with --measure: interleaved timing rounds (2 steps each)"
    )
    search.add_argument("--no-pipeline", action="store_true", help="leave out pipelined (layers: stage) candidates")
    search.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)


def run(args: argparse.Namespace, overrides: dict[str, object], out: Callable[[str], None] = print) -> None:
    """Run the planner command ``args.command`` (after :func:`check`)."""
    check(args, overrides)
    {"explain": _explain, "calibrate": _calibrate, "search": _search}[args.command](args, overrides, out)


def check(args: argparse.Namespace, overrides: dict[str, object]) -> None:
    """Raise the md error for each mistake in the planner command ``args`` that shows before any
    device is used: numbers, model, optimizer, layout, profile file, and the file to write."""
    import math

    from meshdsl import outputs
    from meshdsl.errors import ConfigError
    from meshdsl.layout_spec import load_layout
    from meshdsl.model_loader import build_model
    from meshdsl.planner.profile import load_profile
    from meshdsl.train import optim

    if args.command == "calibrate":
        if args.out is not None:
            outputs.check_file(args.out, "--out")
        return
    if args.command == "search":
        limits = [
            ("--devices", args.plan_devices, 1),
            ("--top", args.top, 1),
            ("--rounds", args.rounds, 1),
            ("--measure", args.measure, 0),
        ]
        for flag, value, least in limits:
            if value is not None and value < least:
                raise ConfigError(f"{flag} {value}: it must be at least {least}")
        gb = args.memory_gb
        if gb is not None and not (math.isfinite(gb) and gb > 0):
            raise ConfigError(f"--memory-gb {gb}: the memory per device must be a positive number of GB")
        if args.out is not None:
            outputs.check_file(args.out, "--out")
            outputs.check_not_input(args.out, "--out", {"--profile": args.profile})
    build_model(args.model, args.preset, **overrides)
    optim.make(args.optimizer)
    if args.command == "explain":
        load_layout(args.layout)
        if args.backend == "gspmd" and args.no_compile:
            raise ConfigError(
                "explain --backend gspmd reads XLA's collectives from the compiled step; it cannot be given --no-compile"
            )
    if args.profile is not None:
        load_profile(args.profile)


def _profile(spec: str | None) -> Any:
    from meshdsl.planner.profile import default_profile, load_profile

    return default_profile() if spec is None else load_profile(spec)


def _explain(args: argparse.Namespace, overrides: dict[str, object], out: Callable[[str], None]) -> None:
    import jax

    from meshdsl.explain import report_of_hlo
    from meshdsl.layout_spec import load_layout
    from meshdsl.measure import fits
    from meshdsl.measure.timing import compile_abstract, memory_bytes
    from meshdsl.model_loader import build_model
    from meshdsl.planner.cost import predict
    from meshdsl.train import optim
    from meshdsl.train.loop import rule_warnings
    from meshdsl.train.step import Trainer

    model = build_model(args.model, args.preset, **overrides)
    layout = load_layout(args.layout)
    for warning in rule_warnings(args.layout, layout, args.model, model):
        print(f"meshdsl explain: warning: {warning}", file=sys.stderr)
    mesh = layout.mesh()
    profile = _profile(args.profile)
    optimizer = optim.make(args.optimizer)
    prediction = predict(model, optimizer, mesh.axis_sizes, layout, profile)
    compiled = None
    report = prediction.report
    if not args.no_compile:
        trainer = Trainer(model, optimizer, mesh, layout, backend=args.backend)
        step = compile_abstract(trainer, jax.random.key_data(jax.random.key(0)))
        needed = memory_bytes(step)
        compiled = needed["total"]
        try:
            fits.check("the compiled step", needed)
        except fits.DoesNotFit as e:
            print(f"meshdsl explain: warning: {e}", file=sys.stderr)
        if args.backend == "gspmd":
            report = report_of_hlo(step.as_text(), mesh)
    out(
        f"meshdsl explain: {args.model} {args.preset} on mesh {mesh} under {layout}"
        + (f" | params {layout.params}" if layout.params else "")
    )
    out(f"profile {profile.name} ({profile.source})\n")
    out(str(report) + "\n")
    if args.backend == "gspmd":
        out(
            f"meshdsl's spmd plan moves {prediction.total_bytes:,.0f} bytes per device; below, the planner's predictions for it beside the gspmd step's compiled memory"
        )
    out(prediction.table(compiled))
    if prediction.memory.total > profile.memory_bytes:
        print(
            f"meshdsl explain: warning: the predicted memory, {fits.readable(prediction.memory.total)} per device, exceeds "
            f"profile {profile.name}'s {fits.readable(profile.memory_bytes)}; "
            f"{fits.remedies(fits.Capacity(int(profile.memory_bytes), profile.name))}",
            file=sys.stderr,
        )


def _calibrate(args: argparse.Namespace, overrides: dict[str, object], out: Callable[[str], None]) -> None:
    import jax

    from meshdsl import outputs
    from meshdsl.planner.calibrate import calibrate

    device = jax.devices()[0]
    name = args.name or ("cpu-sim" if device.platform == "cpu" else device.device_kind.lower().replace(" ", "-"))
    path = Path(args.out or f"{name}.json")
    outputs.check_file(path, "--out")
    out(f"meshdsl calibrate: {len(jax.devices())} x {device.device_kind} ({device.platform})")
    profile, raw = calibrate(name, out)
    lost = "the measurements above were not saved; calibrate again with another --out"
    with outputs.writing(f"--out {str(path)!r}", lost):
        profile.save(path, measurements=raw)
    out(f"wrote {path}")


def _search(args: argparse.Namespace, overrides: dict[str, object], out: Callable[[str], None]) -> None:
    import time

    import jax

    from meshdsl import outputs
    from meshdsl.errors import ConfigError
    from meshdsl.measure.fits import readable
    from meshdsl.model_loader import build_model
    from meshdsl.planner.measure import measure, verdict
    from meshdsl.planner.search import search, write_layout
    from meshdsl.train import optim

    devices = args.plan_devices or jax.device_count()
    profile = _profile(args.profile)
    model = build_model(args.model, args.preset, **overrides)
    optimizer = optim.make(args.optimizer)
    limit = None if args.memory_gb is None else args.memory_gb * 1e9
    start = time.perf_counter()
    result = search(model, optimizer, devices, profile, limit, pipeline=not args.no_pipeline, name=args.model)
    seconds = time.perf_counter() - start
    counts = result.dropped_by_reason()
    reasons = f" ({', '.join(f'{n} {why}' for why, n in counts.items())})" if counts else ""
    out(
        f"meshdsl search: {args.model} {args.preset} on {devices} devices, profile {profile.name}, "
        f"{readable(limit or profile.memory_bytes)} per device: {len(result.ranked)} fit, {len(result.dropped)} dropped{reasons}, "
        f"{result.traced} traced, nothing compiled, {seconds:.1f} s"
    )
    if result.failures:
        first = result.failures[0]
        print(
            f"meshdsl search: warning: meshdsl failed to trace {len(result.failures)} candidate(s), left out; a bug to report, "
            f"e.g. {first.candidate.name}: {first.reason}",
            file=sys.stderr,
        )
    top = result.ranked[: args.top]
    measured: list[float | None] = [None] * len(top)
    if args.measure:
        if devices != jax.device_count():
            raise ConfigError(
                f"--measure times layouts on the devices at hand ({jax.device_count()}), but the search planned for {devices}"
            )
        k = min(args.measure, len(result.ranked))
        times = measure(model, optimizer, [c for c, _ in result.ranked[:k]], rounds=args.rounds)
        top = result.ranked[: max(k, len(top))]
        measured = times + [None] * (len(top) - k)
    header = f"{'#':>3}  {'predicted ms':>12}  {'measured ms':>11}  {'memory':>10}  {'moved':>10}  layout"
    out(header)
    for i, ((cand, pred), meas) in enumerate(zip(top, measured), 1):
        m = "" if meas is None else f"{meas * 1e3:.2f}"
        memory, moved = readable(pred.memory.total), readable(pred.total_bytes)
        out(f"{i:>3}  {pred.step_s * 1e3:12.2f}  {m:>11}  {memory:>10}  {moved:>10}  {cand.name}")
    if args.measure and len(times) > 1:
        out(verdict([p.step_s for _, p in result.ranked[:k]], times))
    if args.out:
        with outputs.writing(f"--out {args.out!r}", "the ranking above is the search's result"):
            write_layout(*result.best, outputs.parent(args.out), profile)
        out(f"wrote the best layout to {args.out}")
