"""``meshdsl launch --local N -- train ...``: run ``train`` or ``bench`` as several processes on this
host (:func:`meshdsl.runtime.launch.launch`).

The processes' command is parsed and checked here first, so a mistake in it (or a device split its
layout cannot use) is one line and exit status 2 before any process starts. The launcher itself
uses no devices: each process chooses and starts its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshdsl.commands import Command
from meshdsl.errors import ConfigError


def add_arguments(launch: argparse.ArgumentParser) -> None:
    """``launch``'s flags; ``-v`` and ``--heartbeat-timeout`` are the run's, before the command."""
    launch.add_argument("--local", type=int, required=True, metavar="N", help="number of processes")
    launch.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="D",
        help="simulated CPU devices in each (default 8 // N)",
    )
    launch.add_argument("run", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- train --preset tiny")


def check_fits(run: Any, processes: int, devices: int) -> None:
    """ConfigError, before any process starts, when the ``train`` run ``run`` (a ``RunConfig``)
    cannot run on ``processes`` x ``devices`` devices: its layout's mesh does not fit that many,
    or a dim does not divide over it. The step is traced on an abstract mesh of that size (nothing
    compiled, no devices needed); a pipelined layout's mesh is checked, its stages are not traced."""
    from meshdsl.errors import MeshDslError
    from meshdsl.mesh import axis_sizes
    from meshdsl.planner.trace import trace_step
    from meshdsl.runtime.layout_spec import load_layout
    from meshdsl.train.loop import _model, _optimizer

    total = processes * devices
    layout = load_layout(run.layout)
    if layout.mesh_axes is None:
        raise ConfigError(f"layout {run.layout!r} names no mesh; give it a [mesh] table to spread over {total} devices")
    try:
        sizes = axis_sizes(layout.mesh_axes, total)
        if not layout.axes_of("layers"):
            trace_step(_model(run), _optimizer(run), sizes, layout, run.grad_reduce_dtype)
    except MeshDslError as e:
        split = f"--local {processes} x {devices} devices per process = {total} devices"
        raise ConfigError(f"{split} do not fit: {e}") from None


def run(args: argparse.Namespace, config: None) -> int:
    """Check the processes' command as ``meshdsl`` would, then start them; their exit status."""
    from meshdsl import commands
    from meshdsl.errors import MeshDslError
    from meshdsl.runtime.launch import child_command, launch, split_devices

    given = [
        flag
        for flag, value in (
            ("--coordinator", args.coordinator),
            ("--num-processes", args.num_processes),
            ("--process-id", args.process_id),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: meshdsl launch starts its own processes and coordinator; "
            "these flags are for one process of a run started by hand"
        )
    command = child_command(args.run)
    child = commands.parser().parse_args(command)
    try:
        commands.check(child)
    except MeshDslError as e:
        print(f"meshdsl {child.command}: error: {e}", file=sys.stderr)
        return 2
    if args.local >= 1 and child.command == "train":
        check_fits(commands.config(child), args.local, split_devices(args.local, args.devices_per_process))
    return launch(command, args.local, args.devices_per_process, heartbeat=args.heartbeat_timeout, verbose=args.verbose)


COMMAND = Command(
    "launch",
    "run 'train' or 'bench' as several processes on this host",
    add_arguments,
    run,
    uses_devices=False,
    order=70,
)
