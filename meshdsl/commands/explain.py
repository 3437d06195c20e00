"""``meshdsl explain``: predict one layout (communication per op, memory, FLOPs, step time) with the
planner (:func:`meshdsl.planner.cost.predict`), beside the compiled step's own memory figure."""

from __future__ import annotations

import argparse
import sys

from meshdsl.commands import Command, flags


def add_arguments(explain: argparse.ArgumentParser) -> None:
    """``explain``'s flags."""
    flags.add_settings(explain, "model", "preset")
    flags.add_init_from_hf(explain)
    flags.add_settings(explain, "layout", "optimizer")
    flags.add_profile(explain)
    explain.add_argument("--no-compile", action="store_true", help="skip compiling the step for its own memory figure")
    backend = (
        "spmd: meshdsl's plan, traced; gspmd: the collectives XLA's partitioner chose, measured from the compiled step"
    )
    flags.add_settings(explain, "backend", "overrides", helps={"backend": backend})


def config(args: argparse.Namespace) -> dict[str, object]:
    """The model's ``--set`` overrides (and ``--init-from-hf DIR`` as the model spec ``hf:DIR``)."""
    args.model = flags.model_spec(args.model, args.init_from_hf)
    return flags.overrides(args.overrides)


def check(args: argparse.Namespace, overrides: dict[str, object]) -> None:
    """The model, optimizer, layout and profile load, and ``--backend gspmd`` comes without ``--no-compile``."""
    from meshdsl.errors import ConfigError
    from meshdsl.model.loader import build_model
    from meshdsl.planner.profile import load_profile
    from meshdsl.runtime.layout_spec import load_layout
    from meshdsl.train import optim

    build_model(args.model, args.preset, **overrides)
    optim.make(args.optimizer)
    load_layout(args.layout)
    if args.backend == "gspmd" and args.no_compile:
        raise ConfigError(
            "explain --backend gspmd reads XLA's collectives from the compiled step; it cannot be given --no-compile"
        )
    if args.profile is not None:
        load_profile(args.profile)


def run(args: argparse.Namespace, overrides: dict[str, object]) -> None:
    """Print the report, the planner's table, and warnings (on stderr) for memory that does not fit."""
    import jax

    from meshdsl.explain import report_of_hlo
    from meshdsl.measure import fits
    from meshdsl.measure.timing import compile_abstract, memory_bytes
    from meshdsl.model.loader import build_model
    from meshdsl.planner.cost import predict
    from meshdsl.runtime.layout_spec import load_layout
    from meshdsl.train import optim
    from meshdsl.train.loop import rule_warnings
    from meshdsl.train.step import Trainer

    model = build_model(args.model, args.preset, **overrides)
    layout = load_layout(args.layout)
    for warning in rule_warnings(args.layout, layout, args.model, model):
        print(f"meshdsl explain: warning: {warning}", file=sys.stderr)
    mesh = layout.mesh()
    profile = flags.profile(args.profile)
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
    print(
        f"meshdsl explain: {args.model} {args.preset} on mesh {mesh} under {layout}"
        + (f" | params {layout.params}" if layout.params else "")
    )
    print(f"profile {profile.name} ({profile.source})\n")
    print(str(report) + "\n")
    if args.backend == "gspmd":
        print(
            f"meshdsl's spmd plan moves {prediction.total_bytes:,.0f} bytes per device; below, the planner's "
            "predictions for it beside the gspmd step's compiled memory"
        )
    print(prediction.table(compiled))
    if compiled is not None and profile.platform != jax.default_backend():
        host = jax.default_backend()
        print(f"(compiled: this host's {host} program, not the {profile.platform} one {profile.name} runs)")
    if prediction.memory.total > profile.memory_bytes:
        print(
            f"meshdsl explain: warning: the predicted memory, {fits.readable(prediction.memory.total)} per device, "
            f"exceeds profile {profile.name}'s {fits.readable(profile.memory_bytes)}; "
            f"{fits.remedies(fits.Capacity(int(profile.memory_bytes), profile.name), fits.remats(model))}",
            file=sys.stderr,
        )


COMMAND = Command(
    "explain",
    "predict one layout: communication per op, memory, FLOPs, step time",
    add_arguments,
    run,
    config=config,
    check=check,
    order=30,
)
