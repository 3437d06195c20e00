"""``meshdsl gpu-check``: the prepared check of one GPU (:func:`meshdsl.bench.gpu_check.gpu_check`)."""

from __future__ import annotations

import argparse

from meshdsl.commands import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gpu-check``'s flags."""
    parser.add_argument("--dry", action="store_true", help="the same steps at tiny sizes (runs on a CPU)")
    parser.add_argument("--out", default="gpu-check.md", metavar="FILE", help="the markdown report (a .json beside it)")


def check(args: argparse.Namespace, config: None) -> None:
    """The report's files and folder can be written (``bench.gpu_check.check``)."""
    from meshdsl.bench.gpu_check import check as check_report

    check_report(args)


def run(args: argparse.Namespace, config: None) -> None:
    """Run every step of the check into the report."""
    from meshdsl.bench.gpu_check import gpu_check

    gpu_check(args.out, args.dry)


COMMAND = Command(
    "gpu-check",
    "the prepared GPU check: bench, 1b vs plain JAX, calibrate, explain vs measured",
    add_arguments,
    run,
    check=check,
    order=60,
)
