"""The ``meshdsl`` command: parse, check, choose the devices, run. The commands themselves are the
modules of :mod:`meshdsl.commands` (one file each: ``train``, ``bench``, ``explain``, ...), found there.

Every command goes the same way (:func:`main`): its config from the flags, its check (every
mistake that shows before a device is used), then the devices (:mod:`meshdsl.runtime.devices`: ``--devices``
simulated CPU devices on a machine without an accelerator, 8 by default, unless XLA_FLAGS chose)
and the multi-process run (``--coordinator``, ``--num-processes``, ``--process-id``, or the
``MESHDSL_*`` variables, or a detected cluster: :mod:`meshdsl.runtime.distributed`), then its run. An md
error from any of them is one line, ``meshdsl <command>: error: ...``, and exit status 2. A run that
a signal stopped (:class:`meshdsl.errors.Interrupted`; Ctrl-C anywhere) is one line too, and exit
status ``128 + signal``; after a bare Ctrl-C the process ends without the interpreter's teardown
(``os._exit``), where JAX's threads, cut off mid-compile, could crash it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from meshdsl import commands
from meshdsl.commands import flags
from meshdsl.runtime.devices import check_environment, simulate_devices, start_backend


def _parser() -> argparse.ArgumentParser:
    """The ``meshdsl`` parser (:func:`meshdsl.commands.parser`)."""
    return commands.parser()


def _config(args: argparse.Namespace) -> Any:
    """What the command ``args`` runs, unchecked: a RunConfig, a BenchConfig, the model's overrides, ..."""
    return commands.config(args)


def check(args: argparse.Namespace) -> Any:
    """The config of the command ``args``, after raising the md error for each mistake in it that
    shows before any device is used (the command's ``check``: ``train.loop.check``, ``bench.run.check``, ...)."""
    return commands.check(args)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing what is left for a closed pipe raises nothing."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """``meshdsl argv``; the exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    hint = flags.misplaced(parser, args.command, extra) if extra else None
    if hint is not None:
        print(f"meshdsl {args.command}: error: {hint}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    command = commands.commands()[args.command]
    from meshdsl.errors import Interrupted, MeshDslError
    from meshdsl.runtime import distributed

    try:
        check_environment()
        config = check(args)
        if command.uses_devices:
            planned = command.devices(args)
            simulate_devices(planned if args.devices is None else args.devices)
            distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
            start_backend()
        code = command.run(args, config)
    except MeshDslError as e:
        print(f"meshdsl {args.command}: error: {e}", file=sys.stderr)
        if distributed.joined():
            distributed.exit_now(2)
        return 2
    except Interrupted as e:  # every process stopped after the same step: they leave together, as after the last
        print(f"meshdsl {args.command}: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print(f"meshdsl {args.command}: Ctrl-C (SIGINT): stopped", file=sys.stderr)
        distributed.exit_now(130)
    except BrokenPipeError:  # ``meshdsl train ... | head``: what a shell reports for SIGPIPE, without a traceback
        _quiet_stdout()
        with contextlib.suppress(OSError):
            print(f"meshdsl {args.command}: stopped: the reader of its output closed the pipe", file=sys.stderr)
        distributed.exit_now(141)
    except Exception as e:
        if distributed.joined():
            gone = distributed.peer_gone(e)
            if gone is None:
                traceback.print_exc()
            else:
                print(f"meshdsl {args.command}: stopped: {gone}", file=sys.stderr)
            distributed.exit_now(1)
        raise
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
