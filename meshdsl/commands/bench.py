"""``meshdsl bench``: compare layouts side by side (:func:`meshdsl.bench.run.run`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from meshdsl.commands import Command, flags

if TYPE_CHECKING:
    from meshdsl.bench.run import BenchConfig


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """``bench``'s flags."""
    flags.add_model(bench)
    flags.add_settings(bench, "preset")
    flags.add_init_from_hf(bench)
    bench.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        help="layout TOML files (any path), shipped layout names (dp_tp) or rules ('batch:data'); default: the "
        "model's LAYOUTS",
    )
    bench.add_argument("--rounds", type=int, default=5, help="interleaved rounds (layout A, B, C, A, B, C, ...)")
    bench.add_argument("--steps-per-round", type=int, default=3)
    bench.add_argument("--baseline", choices=["jax"], default=None, help="also time a hand-written plain-JAX version")
    flags.add_settings(bench, "optimizer", "grad_reduce_dtype", "overrides")
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
    bench.add_argument(
        "--out",
        default=None,
        help="folder for JSON, markdown and PNG charts (default: a new bench-results/run-N each run)",
    )
    bench.add_argument("--force", action="store_true", help="replace the results an earlier run left in --out")
    bench.add_argument(
        "--no-gspmd", action="store_true", help="skip compiling each step on XLA's partitioner for the '÷ gspmd' column"
    )
    decode = bench.add_argument_group("decoding (--decode: time prefill and per-token decode instead of training)")
    decode.add_argument("--decode", action="store_true", help="benchmark decoding with the KV cache per layout")
    decode.add_argument("--decode-batch", type=int, default=8, help="rows decoded together")
    decode.add_argument("--prompt-length", type=int, default=8, help="ids per prompt")
    decode.add_argument("--new-tokens", type=int, default=8, help="tokens generated per row")


def config(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` the flags describe."""
    from meshdsl.bench.run import BenchConfig

    return BenchConfig(
        models=args.model if args.init_from_hf is None else [flags.model_spec("", args.init_from_hf)],
        preset=args.preset,
        layouts=args.layouts,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        baseline=args.baseline,
        optimizer=args.optimizer,
        out=args.out,
        force=args.force,
        grad_reduce_dtype=args.grad_reduce_dtype,
        overrides=flags.overrides(args.overrides),
        microbatches=args.microbatches,
        schedules=args.schedule,
        virtual_stages=args.virtual_stages,
        gspmd=not args.no_gspmd,
    )


@dataclasses.dataclass(frozen=True)
class Checked:
    """A checked benchmark and the models checking it built, by name (``run`` then builds none)."""

    bench: BenchConfig
    models: list[tuple[str, Any]]
    decode: Any = None
    """``--decode``: the checked ``meshdsl.decoding.bench.DecodeBench``."""


def check(args: argparse.Namespace, bench: BenchConfig) -> Checked:
    """``bench.run.check``'s mistakes."""
    from meshdsl.bench.run import check as check_bench

    models = check_bench(bench)
    if not args.decode:
        return Checked(bench, models)
    from meshdsl.decoding.bench import DecodeBench, layouts_of
    from meshdsl.decoding.decoder import check_model

    decode = DecodeBench(args.decode_batch, args.prompt_length, args.new_tokens, args.rounds)
    for name, model in models:
        check_model(model)
        decode.check(model.config.length)
        layouts_of(bench.layouts, model, name)
    return Checked(bench, models, decode)


def run(args: argparse.Namespace, checked: Checked) -> None:
    """Benchmark the models the check built; in a multi-process run only process 0 prints and writes."""
    from meshdsl.bench.run import run as run_bench
    from meshdsl.runtime import distributed

    if checked.decode is not None:
        from meshdsl.decoding.bench import bench as bench_decode
        from meshdsl.decoding.bench import layouts_of

        out = print if distributed.is_primary() else lambda line: None
        for name, model in checked.models:
            out(f"meshdsl bench --decode: {name} {args.preset}")
            bench_decode(model, layouts_of(checked.bench.layouts, model, name), checked.decode, out=out)
        return
    if distributed.is_primary():
        run_bench(checked.bench, models=checked.models)
    else:
        run_bench(checked.bench, out=lambda line: None, warn=lambda line: None, models=checked.models)


COMMAND = Command(
    "bench",
    "compare layouts: step time, throughput, memory and communication",
    add_arguments,
    run,
    config=config,
    check=check,
    order=20,
)
