"""``meshdsl search``: rank meshes and layouts of a model by predicted step time
(:func:`meshdsl.planner.search.search`), optionally timing the best on the devices at hand."""

from __future__ import annotations

import argparse
import sys

from meshdsl.commands import Command, flags


def add_arguments(search: argparse.ArgumentParser) -> None:
    """``search``'s flags (its ``--devices``, the count to plan for, is ``args.plan_devices``)."""
    flags.add_settings(search, "model", "preset")
    flags.add_init_from_hf(search)
    search.add_argument(
        "--devices", dest="plan_devices", type=int, default=None, help="devices to plan for (default: those at hand)"
    )
    search.add_argument(
        "--memory-gb", type=float, default=None, help="memory per device in GB (default: the profile's)"
    )
    flags.add_profile(search)
    flags.add_settings(search, "optimizer")
    search.add_argument("--top", type=int, default=5, help="candidates to print")
    search.add_argument("--out", default=None, metavar="FILE", help="write the best layout as a TOML file")
    search.add_argument(
        "--measure", type=int, default=0, metavar="K", help="compile and time the top K on the devices at hand"
    )
    search.add_argument(
        "--rounds", type=int, default=5, help="with --measure: interleaved timing rounds (2 steps each)"
    )
    search.add_argument("--no-pipeline", action="store_true", help="leave out pipelined (layers: stage) candidates")
    search.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that trace and price candidates, this one included; workers start only when the "
        "candidates left would take longer than a worker's start-up (default: the CPUs at hand, at most 8)",
    )
    flags.add_settings(search, "overrides")


def config(args: argparse.Namespace) -> dict[str, object]:
    """The model's ``--set`` overrides (and ``--init-from-hf DIR`` as the model spec ``hf:DIR``)."""
    args.model = flags.model_spec(args.model, args.init_from_hf)
    return flags.overrides(args.overrides)


def devices(args: argparse.Namespace) -> int | None:
    """With ``--measure``, simulate the devices planned for (the layouts are timed on them)."""
    return args.plan_devices if args.measure else None


def check(args: argparse.Namespace, overrides: dict[str, object]) -> None:
    """The counts and memory are in range, ``--out`` can be written, the model, optimizer and profile load."""
    import math

    from meshdsl.errors import ConfigError
    from meshdsl.model.loader import build_model
    from meshdsl.planner.profile import load_profile
    from meshdsl.runtime import output_paths
    from meshdsl.train import optim

    limits = [
        ("--devices", args.plan_devices, 1),
        ("--top", args.top, 1),
        ("--rounds", args.rounds, 1),
        ("--measure", args.measure, 0),
        ("--workers", args.workers, 1),
    ]
    for flag, value, least in limits:
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value}: it must be at least {least}")
    gb = args.memory_gb
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        raise ConfigError(f"--memory-gb {gb}: the memory per device must be a positive number of GB")
    if args.out is not None:
        output_paths.check_file(args.out, "--out")
        output_paths.check_not_input(args.out, "--out", {"--profile": args.profile})
    build_model(args.model, args.preset, **overrides)
    optim.make(args.optimizer)
    if args.profile is not None:
        load_profile(args.profile)


def run(args: argparse.Namespace, overrides: dict[str, object]) -> None:
    """Search, print the ranking (with ``--measure``, the measured times and the verdict), write ``--out``."""
    import functools
    import time

    import jax

    from meshdsl.errors import ConfigError
    from meshdsl.measure.fits import readable, remats
    from meshdsl.model.loader import build_model
    from meshdsl.planner.measure import measure, verdict
    from meshdsl.planner.search import loaded, memory_caveat, search, write_layout
    from meshdsl.planner.workers import default_workers
    from meshdsl.runtime import output_paths
    from meshdsl.train import optim

    devices = args.plan_devices or jax.device_count()
    profile = flags.profile(args.profile)
    model = build_model(args.model, args.preset, **overrides)
    optimizer = optim.make(args.optimizer)
    limit = None if args.memory_gb is None else args.memory_gb * 1e9
    start = time.perf_counter()
    result = search(
        model,
        optimizer,
        devices,
        profile,
        limit,
        pipeline=not args.no_pipeline,
        name=args.model,
        status=sys.stderr,
        rebuild=functools.partial(loaded, args.model, args.preset, overrides, args.optimizer),
        workers=args.workers or default_workers(),
    )
    seconds = time.perf_counter() - start
    counts = result.dropped_by_reason()
    reasons = f" ({', '.join(f'{n} {why}' for why, n in counts.items())})" if counts else ""
    print(
        f"meshdsl search: {args.model} {args.preset} on {devices} devices, profile {profile.name}, "
        f"memory limit {readable(limit or profile.memory_bytes)} per device: {len(result.ranked)} fit, "
        f"{len(result.dropped)} dropped{reasons}, {result.traced} traced, nothing compiled, {seconds:.1f} s"
    )
    if result.failures:
        first = result.failures[0]
        print(
            f"meshdsl search: warning: meshdsl failed to trace {len(result.failures)} candidate(s), left out; a bug "
            f"to report, e.g. {first.candidate.name}: {first.reason}",
            file=sys.stderr,
        )
    top = result.ranked[: args.top]
    measured: list[float | None] = [None] * len(top)
    if args.measure:
        if devices != jax.device_count():
            raise ConfigError(
                f"--measure times layouts on the devices at hand ({jax.device_count()}), but the search planned for "
                f"{devices}"
            )
        k = min(args.measure, len(result.ranked))
        times = measure(model, optimizer, [c for c, _ in result.ranked[:k]], rounds=args.rounds)
        top = result.ranked[: max(k, len(top))]
        measured = times + [None] * (len(top) - k)
    header = f"{'#':>3}  {'predicted ms':>12}  {'measured ms':>11}  {'memory':>10}  {'moved':>10}  layout"
    print(header)
    for i, ((cand, pred), meas) in enumerate(zip(top, measured, strict=True), 1):
        m = "" if meas is None else f"{meas * 1e3:.2f}"
        memory, moved = readable(pred.memory.total), readable(pred.total_bytes)
        print(f"{i:>3}  {pred.step_s * 1e3:12.2f}  {m:>11}  {memory:>10}  {moved:>10}  {cand.name}")
    notes: dict[str, list[int]] = {}  # why a shown row's memory is not to be trusted as it is -> those rows
    for i, (cand, _) in enumerate(top, 1):
        if (why := memory_caveat(cand, remats(model))) is not None:
            notes.setdefault(why, []).append(i)
    for why, rows in notes.items():
        print(f"meshdsl search: note: row(s) {', '.join(map(str, rows))}: {why}", file=sys.stderr)
    if args.measure and len(times) > 1:
        print(verdict([p.step_s for _, p in result.ranked[:k]], times))
    if args.out:
        with output_paths.writing(f"--out {args.out!r}", "the ranking above is the search's result"):
            write_layout(*result.best, output_paths.parent(args.out), profile, model)
        print(f"wrote the best layout to {args.out}")


COMMAND = Command(
    "search",
    "rank meshes and layouts of a model by predicted step time",
    add_arguments,
    run,
    config=config,
    check=check,
    devices=devices,
    order=50,
)
