"""Compiled memory and FLOPs of one attention layer over a split sequence, per strategy (docs/performance.md).

``python -m meshdsl.measure.context_attention`` (8 devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
on a CPU) prints, for one attention layer's forward and backward pass (``jax.grad`` of the summed
output over queries, keys and values) at ``--length`` tokens, per device: XLA's temporaries
(``memory_analysis().temp_size_in_bytes``) and FLOPs (``cost_analysis()["flops"]``) under each
strategy and context split. Nothing runs: each program is only compiled.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import meshdsl as md


def attention_layer_costs(
    strategy: str, context: int, length: int, causal: bool, heads: int = 8, d_kv: int = 64, batch: int = 1
) -> dict[str, float]:
    """``{"temp_bytes", "flops"}`` per device of one attention layer's forward and backward pass (float32
    queries ``[batch, heads, length, d_kv]``) with ``length`` and ``memory`` split over ``context`` devices."""
    mesh = md.Mesh({"context": context}, jax.devices()[:context])
    layout = md.Layout("length:context; memory:context", attention={"context": strategy})
    q = md.zeros(_dims(batch, heads, length, d_kv), jnp.float32)
    k = md.zeros(_dims(batch, heads, length, d_kv, "memory"), jnp.float32)

    def step(q: md.Tensor, k: md.Tensor, v: md.Tensor) -> Any:
        def loss(arrays: Sequence[md.Tensor]) -> jax.Array:
            out = md.nn.dot_product_attention(*arrays, causal=causal)
            return md.reduce_sum(out).array

        return jax.grad(loss)((q, k, v))

    compiled = md.compile(step, mesh, layout).lower(q, k, k).compile()
    cost: Any = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory: Any = compiled.memory_analysis()
    return {"temp_bytes": float(memory.temp_size_in_bytes), "flops": float(cost["flops"])}


def _dims(batch: int, heads: int, length: int, d_kv: int, position: str = "length") -> list[md.Dim]:
    return [md.Dim("batch", batch), md.Dim("heads", heads), md.Dim(position, length), md.Dim("d_kv", d_kv)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    print("strategy    context  causal  temp MiB/device  GFLOP/device")
    for context in args.contexts:
        for strategy in ("all_gather", "ring", "all_to_all"):
            for causal in (False, True):
                c = attention_layer_costs(strategy, context, args.length, causal)
                mib, gflop = c["temp_bytes"] / 2**20, c["flops"] / 1e9
                print(f"{strategy:<11} {context:>7}  {causal!s:<6}  {mib:>15.1f}  {gflop:>12.2f}")


if __name__ == "__main__":
    main()
