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
import re
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

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


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """ConfigError for environment variables JAX would choke on before any message of ours: a device
    count in ``XLA_FLAGS`` that is not a positive integer (XLA prints its whole flag help and aborts)."""
    from meshdsl.errors import ConfigError

    environ = os.environ if environ is None else environ
    for value in re.findall(rf"{DEVICE_FLAG}=(\S*)", environ.get("XLA_FLAGS", "")):
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"XLA_FLAGS has {DEVICE_FLAG}={value}; the simulated device count must be a positive integer"
            )


def start_backend() -> None:
    """Start JAX's devices; ConfigError naming ``JAX_PLATFORMS`` when that platform cannot start
    (``JAX_PLATFORMS=cuda`` without a GPU is a bare AssertionError inside JAX)."""
    import jax

    from meshdsl.errors import ConfigError

    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        platforms = os.environ.get("JAX_PLATFORMS")
        why = str(e).splitlines()[0] if str(e).strip() else "it has no plugin or no device here"
        named = f"JAX_PLATFORMS={platforms!r}: " if platforms else ""
        raise ConfigError(
            f"{named}JAX could not start its devices ({why}); unset JAX_PLATFORMS or set it to cpu"
        ) from None


COMPUTE_DTYPES = ("float32", "bfloat16")
SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds ``jax.random.key`` takes (a 64-bit integer)."""


MODEL_HELP = "a shipped model (mlp, transformer, moe, convnet, llama), a Python file (path/to/my_model.py) or an importable module (mypkg.my_model)"
PRESET_HELP = "a preset of the model's Config.PRESETS (the shipped models: tiny, small, 1b; llama also 8b)"
SET_HELP = "override a field of the model's Config, e.g. --set layers=32 (repeatable)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshdsl", description="Named-tensor models on a device mesh: train and benchmark layouts."
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="simulated CPU devices when no accelerator is present (default 8)"
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-process run: where process 0 listens (or MESHDSL_COORDINATOR)",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="multi-process run: how many processes (or MESHDSL_NUM_PROCESSES)",
    )
    parser.add_argument(
        "--process-id", type=int, default=None, help="multi-process run: this process, 0..N-1 (or MESHDSL_PROCESS_ID)"
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help="multi-process run: seconds of silence after which a process counts as dead and the others stop "
        "(or MESHDSL_HEARTBEAT_TIMEOUT; default 5)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="launch: also show the processes' JAX runtime log lines and Gloo's connection messages "
        "(else only counted)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model under a layout")
    train.add_argument("--model", default="transformer", help=MODEL_HELP)
    train.add_argument("--preset", default="small", help=PRESET_HELP)
    train.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)
    train.add_argument(
        "--layout",
        default="data_parallel",
        help="a layout TOML file, a shipped layout name (dp_tp), or rules such as 'batch:data'",
    )
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--optimizer", default="adamw", help="sgd, adamw or adafactor")
    train.add_argument("--learning-rate", type=float, default=None)
    train.add_argument("--backend", default="spmd", choices=["spmd", "gspmd"])
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--data",
        default=None,
        help="token file (.npy, or raw uint16 .bin/.u16, uint32 .u32) read "
        "into the keys and dims of the model's own batch(key), in a seeded shuffled order; default: the "
        "synthetic task",
    )
    train.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="the tail of the --data file held out for evaluation, never trained on (default 0.05)",
    )
    train.add_argument(
        "--compute-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="compute in bf16 with f32 master parameters; for a model whose Config declares a compute_dtype field",
    )
    train.add_argument(
        "--remat",
        action="store_true",
        help="recompute each layer's activations in the backward pass; for a model whose Config declares a remat field",
    )
    train.add_argument(
        "--grad-reduce-dtype",
        default=None,
        choices=["bfloat16"],
        help="sum gradients across devices in bf16 (half the bytes)",
    )
    train.add_argument(
        "--log-json",
        default=None,
        metavar="FILE",
        help="also write each step's loss and time to FILE, one JSON object a line",
    )
    train.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR", help="save checkpoints step_<N> here (and after the last step)"
    )
    train.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="save a checkpoint every N steps (default: only after the last)",
    )
    train.add_argument("--keep", type=int, default=3, metavar="K", help="keep the newest K checkpoints (default 3)")
    train.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches per step (default: the layout's [pipeline], else 1)",
    )
    train.add_argument(
        "--schedule",
        default=None,
        choices=["gpipe", "1f1b", "interleaved"],
        help="pipeline schedule (default: the layout's [pipeline], else 1f1b)",
    )
    train.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="interleaved schedule: chunks of layers per stage (default: the layout's [pipeline], else 1)",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (any mesh, layout or device count)",
    )
    _add_watch_flags(train)

    bench = sub.add_parser("bench", help="compare layouts: step time, throughput, memory and communication")
    bench.add_argument("--model", nargs="+", default=["transformer"], help="models to benchmark, each " + MODEL_HELP)
    bench.add_argument("--preset", default="small", help=PRESET_HELP)
    bench.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        help="layout TOML files (any path), shipped layout names (dp_tp) or rules ('batch:data'); default: the model's LAYOUTS",
    )
    bench.add_argument("--rounds", type=int, default=5, help="interleaved rounds (layout A, B, C, A, B, C, ...)")
    bench.add_argument("--steps-per-round", type=int, default=3)
    bench.add_argument("--baseline", choices=["jax"], default=None, help="also time a hand-written plain-JAX version")
    bench.add_argument("--optimizer", default="adamw")
    bench.add_argument(
        "--grad-reduce-dtype", default=None, choices=["bfloat16"], help="sum gradients across devices in bf16"
    )
    bench.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)
    bench.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=None,
        help="pipelined layouts: microbatch counts to measure (default: the layout's)",
    )
    bench.add_argument(
        "--schedule",
        nargs="+",
        default=None,
        choices=["gpipe", "1f1b", "interleaved"],
        help="pipelined layouts: schedules to measure (default: the layout's)",
    )
    bench.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="the interleaved schedule's chunks per stage (default: the layout's when it is interleaved, else 2)",
    )
    bench.add_argument("--out", default="bench-results", help="folder for JSON, markdown and PNG charts")
    bench.add_argument(
        "--no-gspmd", action="store_true", help="skip compiling each step on XLA's partitioner for the '÷ gspmd' column"
    )

    from meshdsl.planner.commands import add_parsers

    add_parsers(sub)
    from meshdsl.bench.gpu_check import add_parser as add_gpu_check

    add_gpu_check(sub)

    launch = sub.add_parser("launch", help="run 'train' or 'bench' as several processes on this host")
    launch.add_argument("--local", type=int, required=True, metavar="N", help="number of processes")
    launch.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="D",
        help="simulated CPU devices in each (default 8 // N)",
    )
    launch.add_argument("run", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- train --preset tiny")
    return parser


def _add_watch_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags for the learning-rate schedule, accumulation, evaluation, logs and traces."""
    table = " (default: the layout file's [train] table, else %s)"
    add = train.add_argument
    add(
        "--lr-schedule",
        default=None,
        choices=["constant", "cosine", "linear", "wsd"],
        help="learning-rate schedule" + table % "constant",
    )
    add(
        "--warmup-steps",
        type=int,
        default=None,
        metavar="N",
        help="rise linearly from 0 to the learning rate over N steps" + table % "0",
    )
    add(
        "--min-lr-ratio",
        type=float,
        default=None,
        metavar="R",
        help="cosine/linear/wsd end at R x the learning rate" + table % "0",
    )
    add(
        "--accumulate",
        type=int,
        default=None,
        metavar="N",
        help="cut each step's batch into N microbatches (gradient accumulation)" + table % "1",
    )
    add(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate on held-out batches every N steps and after the last (default 0: never)",
    )
    add("--eval-steps", type=int, default=10, metavar="K", help="batches each evaluation averages over (default 10)")
    add(
        "--log-every", type=int, default=10, metavar="N", help="off a terminal, print a line every N steps (default 10)"
    )
    add(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write TensorBoard scalars (loss, eval loss, learning rate, ...) into DIR",
    )
    add("--profile-steps", default=None, metavar="A:B", help="record a jax.profiler trace of steps A to B")
    add(
        "--profile-dir",
        default=None,
        metavar="DIR",
        help="where the trace goes (default: --tensorboard DIR, else ./profile)",
    )
    add(
        "--allow-nan", action="store_true", help="train on past a NaN or infinite loss (default: stop, naming the step)"
    )


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
        if field == "compute_dtype" and out[field] not in COMPUTE_DTYPES:
            raise ConfigError(f"--set compute_dtype={value}: the compute dtype is one of {', '.join(COMPUTE_DTYPES)}")
    return out


def _check_flags(args: argparse.Namespace) -> None:
    """ConfigError for flags that would be ignored or overflow: ``--seed`` beyond 64 bits, ``--schedule``
    for a layout without a pipeline, ``--grad-reduce-dtype`` under ``--backend gspmd``."""
    from meshdsl.errors import ConfigError

    if args.command != "train":
        return
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed {args.seed}: a seed is a 64-bit integer, from -2**63 to 2**63 - 1")
    if args.backend == "gspmd" and args.grad_reduce_dtype is not None:
        raise ConfigError(
            f"--grad-reduce-dtype {args.grad_reduce_dtype} is for --backend spmd: under gspmd XLA chooses the "
            "collectives and sums gradients in their own dtype"
        )
    if args.schedule is not None:
        from meshdsl.train.loop import load_layout

        if not load_layout(args.layout).axes_of("layers"):
            raise ConfigError(
                f"--schedule {args.schedule}: layout {args.layout!r} has no pipeline (no rule splits layers over a "
                "stage axis), so there is no schedule to choose"
            )


def _config(args: argparse.Namespace) -> Any:
    """What the command ``args`` runs: a RunConfig, a BenchConfig, or the planner's own arguments."""
    overrides = _overrides(getattr(args, "set", []))
    if args.command == "train":
        from meshdsl.train.loop import RunConfig

        return RunConfig(
            model=args.model,
            preset=args.preset,
            overrides=overrides,
            layout=args.layout,
            steps=args.steps,
            optimizer=args.optimizer,
            learning_rate=args.learning_rate,
            backend=args.backend,
            seed=args.seed,
            data=args.data,
            eval_fraction=args.eval_fraction,
            compute_dtype=args.compute_dtype,
            remat=args.remat,
            grad_reduce_dtype=args.grad_reduce_dtype,
            log_json=args.log_json,
            checkpoint_dir=args.checkpoint_dir,
            save_every=args.save_every,
            keep=args.keep,
            resume=args.resume,
            microbatches=args.microbatches,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
            lr_schedule=args.lr_schedule,
            warmup_steps=args.warmup_steps,
            min_lr_ratio=args.min_lr_ratio,
            accumulate=args.accumulate,
            eval_every=args.eval_every,
            eval_steps=args.eval_steps,
            log_every=args.log_every,
            tensorboard=args.tensorboard,
            profile_steps=args.profile_steps,
            profile_dir=args.profile_dir,
            allow_nan=args.allow_nan,
        )
    if args.command == "bench":
        from meshdsl.bench.run import BenchConfig

        return BenchConfig(
            models=args.model,
            preset=args.preset,
            layouts=args.layouts,
            rounds=args.rounds,
            steps_per_round=args.steps_per_round,
            baseline=args.baseline,
            optimizer=args.optimizer,
            out=args.out,
            grad_reduce_dtype=args.grad_reduce_dtype,
            overrides=overrides,
            microbatches=args.microbatches,
            schedules=args.schedule,
            virtual_stages=args.virtual_stages,
            gspmd=not args.no_gspmd,
        )
    return overrides


def check(args: argparse.Namespace) -> None:
    """Raise the md error for each mistake in the command ``args`` that shows before any device is
    used (see ``train.loop.check``, ``bench.run.check``, ``planner.commands.check``)."""
    _check_flags(args)
    config = _config(args)
    if args.command == "train":
        from meshdsl.train.loop import check as check_train

        check_train(config)
    elif args.command == "bench":
        from meshdsl.bench.run import check as check_bench

        check_bench(config)
    elif args.command == "gpu-check":
        from meshdsl.bench.gpu_check import check as check_gpu

        check_gpu(args)
    else:
        from meshdsl.planner import commands

        commands.check(args, config)


def _launch(args: argparse.Namespace) -> int:
    """``meshdsl launch``: the processes' command is parsed and checked here first, so a mistake in it
    (or a device split its layout cannot use) is one line and exit status 2 before any process starts."""
    from meshdsl.errors import ConfigError, MeshDslError
    from meshdsl.launch import check_fits, child_command, launch, split_devices

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
    child = _parser().parse_args(command)
    try:
        check(child)
    except MeshDslError as e:
        print(f"meshdsl {child.command}: error: {e}", file=sys.stderr)
        return 2
    if args.local >= 1 and child.command == "train":
        check_fits(_config(child), args.local, split_devices(args.local, args.devices_per_process))
    return launch(command, args.local, args.devices_per_process, heartbeat=args.heartbeat_timeout, verbose=args.verbose)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from meshdsl.errors import MeshDslError

    if args.command == "launch":
        try:
            check_environment()
            return _launch(args)
        except MeshDslError as e:
            print(f"meshdsl launch: error: {e}", file=sys.stderr)
            return 2
    from meshdsl import distributed

    try:
        check_environment()
        check(args)
        planned = getattr(args, "plan_devices", None) if getattr(args, "measure", 0) else None
        simulate_devices(planned if args.devices is None else args.devices)
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
        start_backend()
        config = _config(args)
        if args.command == "train":
            from meshdsl.train.loop import train

            train(config, sys.stdout, err=sys.stderr)
        elif args.command == "gpu-check":
            from meshdsl.bench.gpu_check import gpu_check

            gpu_check(args.out, args.dry)
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
