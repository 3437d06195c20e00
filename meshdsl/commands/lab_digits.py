"""``meshdsl lab-digits``: the compressed-gradient-sum lab (:mod:`meshdsl.labs.digits`)."""

from __future__ import annotations

import argparse

from meshdsl.commands import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The lab's flags (:func:`meshdsl.labs.digits.add_arguments`)."""
    from meshdsl.labs import digits

    digits.add_arguments(parser)


def check(args: argparse.Namespace, config: None) -> None:
    """Flags out of range, before JAX starts (:func:`meshdsl.labs.digits.check`)."""
    from meshdsl.labs import digits

    digits.check(args)


def run(args: argparse.Namespace, config: None) -> None:
    """Train every run and print the table."""
    from meshdsl.labs import digits

    digits.run(args)


COMMAND = Command(
    "lab-digits",
    "train a small MLP on scikit-learn's 8x8 digits: serial, data-parallel and each compressed gradient sum",
    add_arguments,
    run,
    check=check,
    order=65,
)
