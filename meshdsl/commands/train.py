"""``meshdsl train``: train a model under a layout (:func:`meshdsl.train.loop.train`).

Its flags are the fields of :class:`meshdsl.train.config.RunConfig`, each defined there once.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from meshdsl.commands import Command, flags

if TYPE_CHECKING:
    from meshdsl.train.config import RunConfig
    from meshdsl.train.loop import Prepared


def add_arguments(train: argparse.ArgumentParser) -> None:
    """``train``'s flags: one for each :class:`RunConfig` field; a flag not given leaves its field unset."""
    flags.add_settings(train, given_only=True)


def config(args: argparse.Namespace) -> RunConfig:
    """The ``RunConfig`` of the flags given (``given``: their fields, so the others may come from the
    layout file or a resumed checkpoint)."""
    from meshdsl.train.config import RunConfig

    given = flags.settings_given(args)
    if "init_from_hf" in given:  # the model is the folder's: hf:DIR
        given["model"] = flags.model_spec(given.get("model", ""), given["init_from_hf"])
    return RunConfig(**given, given=frozenset(given))


def check(args: argparse.Namespace, run: RunConfig) -> Prepared:
    """``train.loop.prepare``: every setting decided and checked, the model built."""
    from meshdsl.train.loop import prepare

    return prepare(run)


def run(args: argparse.Namespace, prepared: Prepared) -> None:
    """Train (its lines on stdout, warnings on stderr) the run the check prepared; SIGTERM or Ctrl-C
    stops it after its step, saved (:mod:`meshdsl.train.signals`)."""
    from meshdsl.train.loop import train

    train(prepared.settled.asked, sys.stdout, err=sys.stderr, model=prepared.model, signals=True)


COMMAND = Command("train", "train a model under a layout", add_arguments, run, config=config, check=check, order=10)
