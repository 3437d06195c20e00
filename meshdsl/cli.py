"""The ``meshdsl`` command: ``train`` and ``bench``.

On a machine without an accelerator and without a device count in ``XLA_FLAGS``, the command
simulates ``--devices`` CPU devices (8 by default) so layouts can be compared on a laptop; on a
GPU or TPU host it uses the accelerators as they are.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _simulate_devices(count: int | None) -> None:
    """Ask for ``count`` CPU devices before JAX starts, unless the user's XLA_FLAGS already chose."""
    if DEVICE_FLAG in os.environ.get("XLA_FLAGS", "") and count is None:
        return
    import jax

    jax.config.update("jax_num_cpu_devices", count or 8)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshdsl", description="Named-tensor models on a device mesh: train and benchmark layouts.")
    parser.add_argument("--devices", type=int, default=None, help="simulated CPU devices when no accelerator is present (default 8)")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model under a layout")
    train.add_argument("--model", default="transformer", help="mlp, transformer, moe or convnet")
    train.add_argument("--preset", default="small", help="tiny, small or 1b")
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

    bench = sub.add_parser("bench", help="compare layouts: step time, throughput, memory and communication")
    bench.add_argument("--model", nargs="+", default=["transformer"], help="models to benchmark")
    bench.add_argument("--preset", default="small")
    bench.add_argument("--layouts", nargs="+", default=None, help="layout TOML files (default: those in layouts/ that fit the model)")
    bench.add_argument("--rounds", type=int, default=5, help="interleaved rounds (layout A, B, C, A, B, C, ...)")
    bench.add_argument("--steps-per-round", type=int, default=3)
    bench.add_argument("--baseline", choices=["jax"], default=None, help="also time a hand-written plain-JAX version")
    bench.add_argument("--optimizer", default="adamw")
    bench.add_argument("--grad-reduce-dtype", default=None, choices=["bfloat16"], help="sum gradients across devices in bf16")
    bench.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a model config field, e.g. --set layers=32")
    bench.add_argument("--out", default="bench-results", help="folder for JSON, markdown and PNG charts")
    return parser


def _overrides(items: Sequence[str]) -> dict[str, object]:
    """``["layers=32", "norm=layer"]`` as ``{"layers": 32, "norm": "layer"}`` (numbers parsed)."""
    from meshdsl.errors import ConfigError

    out: dict[str, object] = {}
    for item in items:
        field, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. layers=32")
        for cast in (int, float):
            try:
                out[field] = cast(value)
                break
            except ValueError:
                out[field] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _simulate_devices(args.devices)
    from meshdsl.errors import MeshDslError

    try:
        overrides = _overrides(getattr(args, "set", []))
        if args.command == "train":
            from meshdsl.train.loop import RunConfig, train

            train(RunConfig(
                model=args.model, preset=args.preset, layout=args.layout, steps=args.steps, optimizer=args.optimizer,
                learning_rate=args.learning_rate, backend=args.backend, seed=args.seed, data=args.data,
                compute_dtype=args.compute_dtype, remat=args.remat, grad_reduce_dtype=args.grad_reduce_dtype,
            ))
        else:
            from meshdsl.bench.run import BenchConfig, run

            run(BenchConfig(
                models=args.model, preset=args.preset, layouts=args.layouts, rounds=args.rounds,
                steps_per_round=args.steps_per_round, baseline=args.baseline, optimizer=args.optimizer, out=args.out,
                grad_reduce_dtype=args.grad_reduce_dtype, overrides=overrides,
            ))
    except MeshDslError as e:
        print(f"meshdsl {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
