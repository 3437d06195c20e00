"""``meshdsl train``: train a model under a layout (:func:`meshdsl.train.loop.train`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from meshdsl.commands import Command, flags

if TYPE_CHECKING:
    from meshdsl.train.loop import RunConfig

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds ``jax.random.key`` takes (a 64-bit integer)."""


def add_arguments(train: argparse.ArgumentParser) -> None:
    """``train``'s flags."""
    flags.add_model(train)
    flags.add_preset(train)
    flags.add_init_from_hf(train, weights=True)
    flags.add_set(train)
    flags.add_layout(train)
    train.add_argument("--steps", type=int, default=200)
    flags.add_optimizer(train)
    train.add_argument("--learning-rate", type=float, default=None)
    flags.add_backend(train)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--data",
        default=None,
        help="token file (.npy, or raw uint16 .bin/.u16, uint32 .u32) read "
        "into the keys and dims of the model's own batch(key), in a seeded shuffled order, or an .npz of "
        "padded examples (input_ids [N, T], optional labels with -100); default: the synthetic task",
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
        choices=list(flags.COMPUTE_DTYPES),
        help="compute in bf16 with f32 master parameters; for a model whose Config declares a compute_dtype field",
    )
    train.add_argument(
        "--remat",
        action="store_true",
        help="recompute each layer's activations in the backward pass; for a model whose Config declares a remat field",
    )
    flags.add_grad_reduce_dtype(train)
    train.add_argument(
        "--grad-error-feedback",
        action="store_true",
        help="keep each device's rounding error of the compressed sum and add it to the next step's gradient",
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


def config(args: argparse.Namespace) -> RunConfig:
    """The ``RunConfig`` the flags describe."""
    from meshdsl.train.loop import RunConfig

    return RunConfig(
        model=flags.model_spec(args.model, args.init_from_hf),
        preset=args.preset,
        overrides=flags.overrides(args.set),
        init_from_hf=args.init_from_hf,
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
        grad_error_feedback=args.grad_error_feedback,
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


@dataclasses.dataclass(frozen=True)
class Checked:
    """A checked run and the model checking it built (``train`` then builds none)."""

    run: RunConfig
    model: Any


def check(args: argparse.Namespace, run: RunConfig) -> Checked:
    """ConfigError for flags that would be ignored or overflow (``--seed`` beyond 64 bits, ``--schedule``
    for a layout without a pipeline, ``--grad-reduce-dtype`` under ``--backend gspmd``), then
    ``train.loop.check``'s mistakes."""
    from meshdsl.errors import ConfigError
    from meshdsl.runtime.layout_spec import load_layout
    from meshdsl.train.loop import check as check_run

    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed {args.seed}: a seed is a 64-bit integer, from -2**63 to 2**63 - 1")
    if args.backend == "gspmd" and args.grad_reduce_dtype is not None:
        raise ConfigError(
            f"--grad-reduce-dtype {args.grad_reduce_dtype} is for --backend spmd: under gspmd XLA chooses the "
            "collectives and sums gradients in their own dtype"
        )
    if args.schedule is not None and not load_layout(args.layout).axes_of("layers"):
        raise ConfigError(
            f"--schedule {args.schedule}: layout {args.layout!r} has no pipeline (no rule splits layers over a "
            "stage axis), so there is no schedule to choose"
        )
    return Checked(run, check_run(run))


def run(args: argparse.Namespace, checked: Checked) -> None:
    """Train (its lines on stdout, warnings on stderr) the model the check built; SIGTERM or Ctrl-C
    stops it after its step, saved (:mod:`meshdsl.train.signals`)."""
    from meshdsl.train.loop import train

    train(checked.run, sys.stdout, err=sys.stderr, model=checked.model, signals=True)


COMMAND = Command("train", "train a model under a layout", add_arguments, run, config=config, check=check, order=10)
