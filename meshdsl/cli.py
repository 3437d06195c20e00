"""The ``meshdsl`` command: ``train``, ``bench``, and ``launch`` (several processes of either).

``--coordinator``, ``--num-processes`` and ``--process-id`` (or the ``MESHDSL_*`` variables, or a
detected cluster) make ``train`` and ``bench`` one process of a multi-process run: see
:mod:`meshdsl.distributed`.

On a machine without an accelerator and without a device count in ``XLA_FLAGS``, the command
simulates ``--devices`` CPU devices (8 by default) so layouts can be compared on a laptop; on a
GPU or TPU host it uses the accelerators as they are.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Sequence

DEVICE_FLAG = "--xla_force_host_platform_device_count"
MAX_SIMULATED_DEVICES = 2048
"""The most CPU devices one process can simulate. JAX numbers process ``p``'s CPU devices from
``p * 2048`` (device ids of process 1 start at 2048), so with more, the devices from id 2048 on
count as another process's and every computation over them fails ("Multiprocess computations
aren't implemented on the CPU backend", checked with JAX 0.10.2); far more (``--devices 1000000``)
only fills memory for minutes before that. More devices: ``meshdsl launch --local N``."""


def simulate_devices(count: int | None) -> None:
    """Ask for ``count`` CPU devices (None: 8) before JAX starts, unless ``count`` is None and the
    user's XLA_FLAGS already chose. ConfigError for a count below 1 or above ``MAX_SIMULATED_DEVICES``."""
    from meshdsl.errors import ConfigError

    if count is not None and count < 1:
        raise ConfigError(f"--devices {count}: simulate at least 1 device")
    if count is not None and count > MAX_SIMULATED_DEVICES:
        raise ConfigError(
            f"--devices {count}: one process simulates at most {MAX_SIMULATED_DEVICES} CPU devices (JAX numbers the next "
            f"process's devices from {MAX_SIMULATED_DEVICES}); spread more over processes with meshdsl launch --local N"
        )
    if DEVICE_FLAG in os.environ.get("XLA_FLAGS", "") and count is None:
        return
    import jax

    jax.config.update("jax_num_cpu_devices", count or 8)


MODEL_HELP = "a shipped model (mlp, transformer, moe, convnet), a Python file (path/to/my_model.py) or an importable module (mypkg.my_model)"
PRESET_HELP = "a preset of the model's Config.PRESETS (the shipped models: tiny, small, 1b)"
SET_HELP = "override a field of the model's Config, e.g. --set layers=32 (repeatable)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshdsl", description="Named-tensor models on a device mesh: train and benchmark layouts.")
    parser.add_argument("--devices", type=int, default=None, help="simulated CPU devices when no accelerator is present (default 8)")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="multi-process run: where process 0 listens (or MESHDSL_COORDINATOR)")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-process run: how many processes (or MESHDSL_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None, help="multi-process run: this process, 0..N-1 (or MESHDSL_PROCESS_ID)")
    parser.add_argument(
        "--heartbeat-timeout", type=int, default=None, metavar="S",
        help="multi-process run: seconds of silence after which a process counts as dead and the others stop "
        "(or MESHDSL_HEARTBEAT_TIMEOUT; default 5)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model under a layout")
    train.add_argument("--model", default="transformer", help=MODEL_HELP)
    train.add_argument("--preset", default="small", help=PRESET_HELP)
    train.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)
    train.add_argument("--layout", default="data_parallel", help="a layout TOML file, a shipped layout name (dp_tp), or rules such as 'batch:data'")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--optimizer", default="adamw", help="sgd, adamw or adafactor")
    train.add_argument("--learning-rate", type=float, default=None)
    train.add_argument("--backend", default="spmd", choices=["spmd", "gspmd"])
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", default=None, help="token file (.npy, or raw uint16 .bin/.u16, uint32 .u32); default: the synthetic task")
    train.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16"], help="compute in bf16 with f32 master parameters")
    train.add_argument("--remat", action="store_true", help="recompute each layer's activations in the backward pass")
    train.add_argument("--grad-reduce-dtype", default=None, choices=["bfloat16"], help="sum gradients across devices in bf16 (half the bytes)")
    train.add_argument("--log-json", default=None, metavar="FILE", help="also write each step's loss and time to FILE, one JSON object a line")
    train.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="save checkpoints step_<N> here (and after the last step)")
    train.add_argument("--save-every", type=int, default=0, metavar="N", help="save a checkpoint every N steps (default: only after the last)")
    train.add_argument("--keep", type=int, default=3, metavar="K", help="keep the newest K checkpoints (default 3)")
    train.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches per step (default: the layout's [pipeline], else 1)")
    train.add_argument("--schedule", default=None, choices=["gpipe", "1f1b", "interleaved"], help="pipeline schedule (default: the layout's [pipeline], else 1f1b)")
    train.add_argument(
        "--virtual-stages", type=int, default=None, metavar="V",
        help="interleaved schedule: chunks of layers per stage (default: the layout's [pipeline], else 1)",
    )
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir (any mesh, layout or device count)")

    bench = sub.add_parser("bench", help="compare layouts: step time, throughput, memory and communication")
    bench.add_argument("--model", nargs="+", default=["transformer"], help="models to benchmark, each " + MODEL_HELP)
    bench.add_argument("--preset", default="small", help=PRESET_HELP)
    bench.add_argument(
        "--layouts", nargs="+", default=None,
        help="layout TOML files (any path), shipped layout names (dp_tp) or rules ('batch:data'); default: the model's LAYOUTS",
    )
    bench.add_argument("--rounds", type=int, default=5, help="interleaved rounds (layout A, B, C, A, B, C, ...)")
    bench.add_argument("--steps-per-round", type=int, default=3)
    bench.add_argument("--baseline", choices=["jax"], default=None, help="also time a hand-written plain-JAX version")
    bench.add_argument("--optimizer", default="adamw")
    bench.add_argument("--grad-reduce-dtype", default=None, choices=["bfloat16"], help="sum gradients across devices in bf16")
    bench.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)
    bench.add_argument("--microbatches", type=int, nargs="+", default=None, help="pipelined layouts: microbatch counts to measure (default: the layout's)")
    bench.add_argument("--schedule", nargs="+", default=None, choices=["gpipe", "1f1b", "interleaved"], help="pipelined layouts: schedules to measure (default: the layout's)")
    bench.add_argument(
        "--virtual-stages", type=int, default=None, metavar="V",
        help="the interleaved schedule's chunks per stage (default: the layout's when it is interleaved, else 2)",
    )
    bench.add_argument("--out", default="bench-results", help="folder for JSON, markdown and PNG charts")
    bench.add_argument("--no-gspmd", action="store_true", help="skip compiling each step on XLA's partitioner for the '÷ gspmd' column")

    from meshdsl.planner.commands import add_parsers

    add_parsers(sub)

    launch = sub.add_parser("launch", help="run 'train' or 'bench' as several processes on this host")
    launch.add_argument("--local", type=int, required=True, metavar="N", help="number of processes")
    launch.add_argument("--devices-per-process", type=int, default=None, metavar="D", help="simulated CPU devices in each (default 8 // N)")
    launch.add_argument("run", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- train --preset tiny")
    return parser


def _overrides(items: Sequence[str]) -> dict[str, object]:
    """``["layers=32", "norm=layer", "remat=true"]`` as ``{"layers": 32, "norm": "layer", "remat": True}``."""
    from meshdsl.errors import ConfigError

    out: dict[str, object] = {}
    for item in items:
        field, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. layers=32")
        out[field] = {"true": True, "false": False}.get(value.lower(), value)
        for cast in (int, float):
            try:
                out[field] = cast(value)
                break
            except ValueError:
                pass
    return out


def _config(args: argparse.Namespace) -> object:
    """What the command ``args`` runs: a RunConfig, a BenchConfig, or the planner's own arguments."""
    overrides = _overrides(getattr(args, "set", []))
    if args.command == "train":
        from meshdsl.train.loop import RunConfig

        return RunConfig(
            model=args.model, preset=args.preset, overrides=overrides, layout=args.layout, steps=args.steps, optimizer=args.optimizer,
            learning_rate=args.learning_rate, backend=args.backend, seed=args.seed, data=args.data,
            compute_dtype=args.compute_dtype, remat=args.remat, grad_reduce_dtype=args.grad_reduce_dtype,
            log_json=args.log_json, checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, keep=args.keep,
            resume=args.resume, microbatches=args.microbatches, schedule=args.schedule, virtual_stages=args.virtual_stages,
        )
    if args.command == "bench":
        from meshdsl.bench.run import BenchConfig

        return BenchConfig(
            models=args.model, preset=args.preset, layouts=args.layouts, rounds=args.rounds,
            steps_per_round=args.steps_per_round, baseline=args.baseline, optimizer=args.optimizer, out=args.out,
            grad_reduce_dtype=args.grad_reduce_dtype, overrides=overrides, microbatches=args.microbatches, schedules=args.schedule,
            virtual_stages=args.virtual_stages, gspmd=not args.no_gspmd,
        )
    return overrides


def check(args: argparse.Namespace) -> None:
    """Raise the md error for each mistake in the command ``args`` that shows before any device is
    used (see ``train.loop.check``, ``bench.run.check``, ``planner.commands.check``)."""
    config = _config(args)
    if args.command == "train":
        from meshdsl.train.loop import check as check_train

        check_train(config)
    elif args.command == "bench":
        from meshdsl.bench.run import check as check_bench

        check_bench(config)
    else:
        from meshdsl.planner import commands

        commands.check(args, config)


def _launch(args: argparse.Namespace) -> int:
    """``meshdsl launch``: the processes' command is parsed and checked here first, so a mistake in it
    is one line and exit status 2 before any process starts."""
    from meshdsl.errors import MeshDslError
    from meshdsl.launch import child_command, launch

    command = child_command(args.run)
    child = _parser().parse_args(command)
    try:
        check(child)
    except MeshDslError as e:
        print(f"meshdsl {child.command}: error: {e}", file=sys.stderr)
        return 2
    return launch(command, args.local, args.devices_per_process, heartbeat=args.heartbeat_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from meshdsl.errors import MeshDslError

    if args.command == "launch":
        try:
            return _launch(args)
        except MeshDslError as e:
            print(f"meshdsl launch: error: {e}", file=sys.stderr)
            return 2
    from meshdsl import distributed

    try:
        check(args)
        planned = getattr(args, "plan_devices", None) if getattr(args, "measure", 0) else None
        simulate_devices(planned if args.devices is None else args.devices)
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
        config = _config(args)
        if args.command == "train":
            from meshdsl.train.loop import train

            train(config, sys.stdout, err=sys.stderr)
        elif args.command in ("explain", "calibrate", "search"):
            from meshdsl.planner import commands

            commands.run(args, config)
        else:
            from meshdsl.bench.run import run

            if distributed.is_primary():
                run(config)
            else:
                run(config, out=lambda line: None, warn=lambda line: None)
    except MeshDslError as e:
        print(f"meshdsl {args.command}: error: {e}", file=sys.stderr)
        if distributed.joined():
            distributed.exit_now(2)
        return 2
    except (Exception, KeyboardInterrupt) as e:
        if distributed.joined():
            traceback.print_exc()
            distributed.exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
