"""The commands wing: every ``meshdsl`` subcommand is one module of this package, found by looking.

A command is a :class:`Command`: a name, a line of help, and the functions the command line calls
in order (``meshdsl.cli.main``):

1. ``add_arguments(parser)``: its flags on its own subparser; flags that several commands take
   (``--model``, ``--preset``, ``--set``, ``--layout``, ``--optimizer``, ...) come from
   :mod:`meshdsl.commands.flags`, where each is defined once;
2. ``config(args)``: what it runs, built from the parsed flags (a ``RunConfig``, a dict of
   ``--set`` overrides, or nothing);
3. ``check(args, config)``: every mistake that shows before a device is used, raised as an md
   error (:mod:`meshdsl.errors`), so nothing has run and no file is touched; it may return what
   ``run`` is given instead of the config (``train`` returns the config with the model it built);
4. the devices are chosen (``--devices``, or the command's own ``devices(args)``) and started,
   and the multi-process run joined, unless ``uses_devices`` is False;
5. ``run(args, config)``: the work; its exit status, or None for 0.

An md error from steps 2 to 5 is the one line ``meshdsl <name>: error: ...`` on stderr, exit status 2.

Adding a command is one file. Every module here that defines ``COMMAND`` is a command, listed in
``meshdsl --help`` by its ``order``. The file ``meshdsl/commands/hello.py``::

    import argparse

    from meshdsl.commands import Command
    from meshdsl.errors import ConfigError


    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--times", type=int, default=1, help="how often to greet")


    def check(args: argparse.Namespace, config: None) -> None:
        if args.times < 1:
            raise ConfigError(f"--times {args.times}: greet at least once")


    def run(args: argparse.Namespace, config: None) -> None:
        import jax

        for _ in range(args.times):
            print(f"hello from {jax.device_count()} devices")


    COMMAND = Command("hello", "greet the devices", add_arguments, run, check=check)

is the whole of ``meshdsl hello``::

    $ meshdsl hello --times 2
    hello from 8 devices
    hello from 8 devices
    $ meshdsl hello --times 0
    meshdsl hello: error: --times 0: greet at least once

(the second with exit status 2, before JAX starts its devices). ``meshdsl --devices 4 hello``
greets from 4, and ``meshdsl hello --help`` lists ``--times``. Every module of the wing is imported
to build the parser, before ``--devices`` is applied: a command touches JAX's devices only in
``run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any


def _nothing(args: argparse.Namespace) -> None:
    """No config, or no device count of the command's own."""


def _no_check(args: argparse.Namespace, config: Any) -> None:
    """Nothing to check."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``meshdsl`` subcommand: what the command line needs to parse, check and run it."""

    name: str
    """``meshdsl <name>``."""
    help: str
    """Its line in ``meshdsl --help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds its flags to its subparser."""
    run: Callable[[argparse.Namespace, Any], int | None]
    """Does the work (after ``check``, on started devices); the exit status, or None for 0."""
    config: Callable[[argparse.Namespace], Any] = _nothing
    """What it runs, from the parsed flags; passed to ``check`` and ``run``."""
    check: Callable[[argparse.Namespace, Any], Any] = _no_check
    """Raises the md error for each mistake that shows before any device is used; returns what ``run``
    is given instead of the config (what checking built, e.g. the model, so ``run`` builds it once),
    or None for the config itself."""
    devices: Callable[[argparse.Namespace], int | None] = _nothing
    """CPU devices to simulate when ``--devices`` is not given (None: XLA_FLAGS' count, else 8)."""
    uses_devices: bool = True
    """False: ``run`` is called without choosing or starting JAX's devices (``launch``: its processes do)."""
    order: int = 100
    """Its place in ``meshdsl --help`` (ties: by name)."""


def commands() -> dict[str, Command]:
    """Every command of the wing by name, in ``meshdsl --help``'s order: the ``COMMAND`` of each module
    of this package (its ``__path__``). TypeError for two modules giving one name."""
    found: dict[str, Command] = {}
    for info in pkgutil.iter_modules(__path__):
        command = getattr(importlib.import_module(f"{__name__}.{info.name}"), "COMMAND", None)
        if not isinstance(command, Command):
            continue
        if command.name in found:
            raise TypeError(f"two modules of {__name__} define the command {command.name!r}")
        found[command.name] = command
    return dict(sorted(found.items(), key=lambda item: (item[1].order, item[0])))


def parser() -> argparse.ArgumentParser:
    """The ``meshdsl`` parser: the run's flags, then one subparser per command of :func:`commands`."""
    top = argparse.ArgumentParser(
        prog="meshdsl", description="Named-tensor models on a device mesh: train and benchmark layouts."
    )
    from meshdsl.commands import flags

    flags.add_run_flags(top)
    sub = top.add_subparsers(dest="command", required=True)
    for command in commands().values():
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return top


def config(args: argparse.Namespace) -> Any:
    """What the command ``args`` names runs (its ``config(args)``), unchecked."""
    return commands()[args.command].config(args)


def check(args: argparse.Namespace) -> Any:
    """The config of the command ``args`` names, after its check: the md error for each mistake that
    shows before any device is used."""
    command = commands()[args.command]
    built = command.config(args)
    checked = command.check(args, built)
    return built if checked is None else checked
