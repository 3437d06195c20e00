"""``meshdsl calibrate``: measure the devices at hand into a device profile
(:func:`meshdsl.planner.calibrate.calibrate`), written as JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshdsl.commands import Command


def add_arguments(calibrate: argparse.ArgumentParser) -> None:
    """``calibrate``'s flags."""
    calibrate.add_argument("--name", default=None, help="the profile's name (default: from the device)")
    calibrate.add_argument("--out", default=None, help="where to write it (default: <name>.json)")


def check(args: argparse.Namespace, config: None) -> None:
    """``--out`` can be written (the default's name needs the device: checked again in :func:`run`)."""
    from meshdsl.runtime import output_paths

    if args.out is not None:
        output_paths.check_file(args.out, "--out")


def run(args: argparse.Namespace, config: None) -> None:
    """Measure, print each measurement, write the profile."""
    import jax

    from meshdsl.planner.calibrate import calibrate
    from meshdsl.runtime import output_paths
    from meshdsl.runtime.waiting import heartbeat

    device = jax.devices()[0]
    name = args.name or ("cpu-sim" if device.platform == "cpu" else device.device_kind.lower().replace(" ", "-"))
    path = Path(args.out or f"{name}.json")
    output_paths.check_file(path, "--out")
    print(f"meshdsl calibrate: {len(jax.devices())} x {device.device_kind} ({device.platform})")
    what = "measuring (matmuls, memory bandwidth, attention, then each collective kind)"
    with heartbeat("meshdsl calibrate", what):
        profile, raw = calibrate(name, print)
    lost = "the measurements above were not saved; calibrate again with another --out"
    with output_paths.writing(f"--out {str(path)!r}", lost):
        profile.save(path, measurements=raw)
    print(f"wrote {path}")


COMMAND = Command(
    "calibrate", "measure the devices at hand into a device profile (JSON)", add_arguments, run, check=check, order=40
)
