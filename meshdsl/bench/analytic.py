"""The least communication a training step needs, per device, for the standard layouts.

Each formula is the ring-model cost (``meshdsl.collectives.bytes_moved``) of the collectives the
layout cannot avoid; docs/performance.md writes them out. ``n`` is the size of the split axis,
``P`` the parameter count (4-byte f32), ``B, L, D`` batch, length and d_model.

* data_parallel: all-reduce of every gradient, plus the loss: ``AR(4P) + AR(4)``.
* fsdp (ZeRO-3): all-gather of every parameter forward, reduce-scatter of every gradient, and a
  second all-gather of the layer loop's parameters in the backward pass (so a device holds one
  layer's gathered weights at a time, never all layers'), plus the loss:
  ``AG(4P) + RS(4P) + AG(4 P_loop) + AR(4)``. ``P_loop``: the parameters stacked along
  ``layers`` (the transformer's layers; the MLP has none).
* megatron (transformer): per layer, the attention and feed-forward outputs are all-reduced
  forward and their inputs' gradients backward: ``4 L_layers AR(4BLD)``; the vocab-parallel
  embedding's lookup and the unembedding's input gradient: ``2 AR(4BLD)``; the loss's max, sum of
  exponentials and target logit over the split vocab: ``3 AR(4BL)``. MLP: ``AR(4 B d_io)``, the
  output's partial sums over ``d_ff``.
* with a clipping optimizer (AdamW's default), the global norm's scalar all-reduce over each axis
  that splits parameters: ``AR(4)`` for fsdp, megatron and dp_tp.
* dp_tp: megatron's activation terms on the ``model`` axis with ``B`` the local batch, plus data
  parallel's gradient all-reduce on the ``data`` axis of each parameter's local shard (the
  ``model``-split ones are 1/m the size), plus the loss over ``data``.
"""

from __future__ import annotations

from typing import Any

import jax

import meshdsl as md
from meshdsl.collectives import Collective, bytes_moved
from meshdsl.model_loader import shipped_name
from meshdsl.planner.memory import local_bytes


def _ar(buffer: float, n: int) -> float:
    return bytes_moved(Collective.ALL_REDUCE, buffer, n)


def _loop_params(params: Any) -> Any:
    """The parameters of the layer loop: those stacked along ``layers``."""
    return [t for t in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, md.Tensor)) if "layers" in t.shape]


def minimum_bytes(name: str, model: Any, params: Any, mesh: md.Mesh, layout: md.Layout, clips: bool) -> float | None:
    """Least bytes per device one training step moves under the shipped layout ``name``; None if no formula.

    ``clips``: the optimizer clips by global norm.
    """
    sizes = mesh.axis_sizes
    config = model.config
    kind = shipped_name(model)
    if kind not in ("mlp", "transformer"):
        return None
    if name == "data_parallel":
        n = sizes["data"]
        return _ar(local_bytes(params, layout, mesh), n) + _ar(4, n)
    if name == "fsdp":
        n = sizes["data"]
        stored = local_bytes(params, layout.param_layout, mesh) * n
        regathered = local_bytes(_loop_params(params), layout.param_layout, mesh) * n
        gathers = bytes_moved(Collective.ALL_GATHER, stored + regathered, n)
        return gathers + bytes_moved(Collective.REDUCE_SCATTER, stored, n) + _ar(4, n) + clips * _ar(4, n)
    if name not in ("megatron", "dp_tp"):
        return None
    m = sizes["model"]
    d = sizes.get("data", 1)
    batch = config.batch // d
    if kind == "mlp":
        activations = _ar(4 * batch * config.d_io, m)
    else:
        tokens = batch * config.length
        activations = (4 * config.layers + 2) * _ar(4 * tokens * config.d_model, m) + 3 * _ar(4 * tokens, m)
    activations += clips * _ar(4, m)
    if d == 1:
        return activations
    return activations + _ar(local_bytes(params, layout, mesh), d) + _ar(4, d)
