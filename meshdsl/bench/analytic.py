"""The collectives a layout's rules cannot avoid under the ring model: bench's consistency anchor.

For the shipped MLP and Transformer, each term below is read off the rules themselves (which dims
are split over which mesh axes; not the layout file's name) and priced in the dtypes the step
uses, by the ring model (``meshdsl.collectives.bytes_moved``, in exact fractions; ``AR``, ``AG``
and ``RS`` below are its all-reduce, all-gather and reduce-scatter of a buffer ``S`` over ``n``
devices). It is a floor for these rules, not a proof that no other program could move less;
bench reports the step's bytes over it (``bytes_over_minimum``). docs/performance.md writes the
terms out. It is priced from the rules and the config, not from the step's trace, on purpose: the
traced step is what it checks.

* ``batch`` split over axes D (size d): every parameter's gradient summed over D (``AR`` of its
  shard under the compute rules, in ``grad_reduce_dtype`` where narrower than the parameter),
  and the loss, ``AR(4, d)``.
* a parameter stored split (``layout.param_layout``) over axes A that the compute rules leave whole
  (FSDP / ZeRO-3): gathered where used, ``AG(S, a)``, and once more for the backward pass if it is
  one of the layer loop's (stacked along ``layers``: meshdsl holds one layer's gathered weights
  at a time); its gradient reduce-scattered over A's batch axes and all-reduced over D's others.
* ``heads`` split (size h): per layer, the attention output forward and its input's gradient
  backward, ``AR(act B L D, h) + AR(grad B L D, h)`` (``act``: bytes of the compute dtype,
  ``grad``: of the gradients' sums, ``grad_reduce_dtype`` where narrower; ``B`` the local batch,
  ``L`` length, ``D`` d_model), and with ``remat`` the attention's forward sum once more (the
  recomputed feed-forward needs it); ``d_ff`` split (f): the same two for the feed-forward.
  ``vocab`` split (v): the embedding lookup forward and the unembedding's input gradient
  backward, the same two, and the loss's max, sum of exponentials and target logit,
  ``3 AR(4 B L, v)`` (float32 logits). MLP with ``d_ff`` split: its output's partial sums,
  ``AR(4 B d_io, f)``.
* an optimizer that clips by global norm: one scalar ``AR(4)`` over the axes that split parameters.

Gradients summed scaled (``grad_reduce_dtype`` float16 or 8-bit, :mod:`meshdsl.compression`): each
parameter's sum over D is the scale's ``AR(4, d)`` plus an all-to-all and an all-gather of its
shard in the format, padded to a multiple of ``d`` elements; no minimum where such a sum is a
reduce-scatter (FSDP) or sums activation gradients (the transformer's ``heads``, ``d_ff``, ``vocab``).

No minimum (None) for a model of the user's, rules that split another dim of the model (or
pipeline it), a parameter whose stored split moves to another dim, or an optimizer that is not
element-wise (Adafactor's statistics over named dims are collectives of their own).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp

import meshdsl as md
from meshdsl import compression, relayout
from meshdsl.collectives import Collective, bytes_moved
from meshdsl.measure.sizes import local_bytes
from meshdsl.model.loader import shipped_name
from meshdsl.model.protocol import Model
from meshdsl.tensor import is_tensor
from meshdsl.train.optim import OptaxOptimizer
from meshdsl.train.rules import model_dims

_MODELLED = {"mlp": {"batch", "d_ff"}, "transformer": {"batch", "heads", "d_ff", "vocab"}}
"""The dims whose splits the terms cover, per shipped model."""


def _ar(buffer: int | Fraction, n: int) -> Fraction:
    return bytes_moved(Collective.ALL_REDUCE, buffer, buffer, n)


def _size(axes: set[str], mesh: md.Mesh) -> int:
    return math.prod(mesh.axis_sizes[a] for a in axes)


def _split_axes(t: md.Tensor, layout: md.Layout) -> dict[str, set[str]]:
    return {d.name: set(layout.axes_of(d.name)) for d in t.shape}


def _itemsize(dtype: Any, grad_reduce_dtype: Any) -> int:
    """Bytes of a gradient of a ``dtype`` value as meshdsl sums it: in ``grad_reduce_dtype`` where narrower."""
    return jnp.dtype(grad_reduce_dtype if relayout.narrower(dtype, grad_reduce_dtype) else dtype).itemsize


def _scaled(dtype: Any, grad_reduce_dtype: Any) -> bool:
    """Whether gradients of a ``dtype`` value are summed scaled (:mod:`meshdsl.compression`)."""
    return relayout.narrower(dtype, grad_reduce_dtype) and compression.scaled(grad_reduce_dtype)


def _parameter(t: md.Tensor, layout: md.Layout, mesh: md.Mesh, grad_reduce_dtype: Any) -> dict[str, Fraction] | None:
    """Gathers and gradient sums of one parameter (None: its stored split moves to another dim)."""
    stored, compute = _split_axes(t, layout.param_layout), _split_axes(t, layout)
    gathered = set().union(*(stored[d] - compute[d] for d in stored))
    if gathered & set().union(*compute.values()):
        return None
    shard = local_bytes([t], layout, mesh)
    grad = Fraction(shard * _itemsize(t.dtype, grad_reduce_dtype), t.dtype.itemsize)
    batch = set(layout.axes_of("batch"))
    if _scaled(t.dtype, grad_reduce_dtype):
        if gathered:
            return None
        compressed = compression.sum_bytes(shard // t.dtype.itemsize, _size(batch, mesh), grad_reduce_dtype)
        return {"parameter gathers": Fraction(0), "gradient sums": Fraction(compressed)}
    a, scattered = _size(gathered, mesh), gathered & batch
    gathers = bytes_moved(Collective.ALL_GATHER, Fraction(shard, a), shard, a) * (2 if "layers" in t.shape else 1)
    summed, s = grad / _size(gathered - batch, mesh), _size(scattered, mesh)
    sums = bytes_moved(Collective.REDUCE_SCATTER, summed, summed / s, s)
    return {"parameter gathers": gathers, "gradient sums": sums + _ar(grad / a, _size(batch - gathered, mesh))}


def _activations(
    kind: str, config: Any, layout: md.Layout, mesh: md.Mesh, grad_reduce_dtype: Any
) -> dict[str, Fraction]:
    """The tensor-parallel sums of activations (forward) and of their gradients (backward), and the split vocab's
    loss."""
    sizes = {d: _size(set(layout.axes_of(d)), mesh) for d in _MODELLED[kind]}
    batch = config.batch // sizes["batch"]
    if kind == "mlp":
        return {"activations": _ar(4 * batch * config.d_io, sizes["d_ff"]), "loss": Fraction(0)}
    dtype = jnp.dtype(config.compute_dtype)
    tokens = batch * config.length
    forward, backward = (tokens * config.d_model * n for n in (dtype.itemsize, _itemsize(dtype, grad_reduce_dtype)))
    recomputed = config.remat * _ar(forward, sizes["heads"])  # the attention's sum: the feed-forward's input
    layer = sum(_ar(forward, sizes[d]) + _ar(backward, sizes[d]) for d in ("heads", "d_ff")) + recomputed
    vocab = _ar(forward, sizes["vocab"]) + _ar(backward, sizes["vocab"])
    return {"activations": config.layers * layer + vocab, "loss": 3 * _ar(4 * tokens, sizes["vocab"])}


def terms(
    model: Model, params: Any, mesh: md.Mesh, layout: md.Layout, optimizer: Any, grad_reduce_dtype: Any = None
) -> dict[str, float] | None:
    """Least bytes per device of one training step under ``layout``'s rules, term by term
    (parameter gathers, gradient sums, activations, loss, clipping); None where there is no formula."""
    kind = shipped_name(model)
    if kind not in _MODELLED or not isinstance(optimizer, OptaxOptimizer) or layout.pipeline.microbatches > 1:
        return None
    if any(layout.axes_of(d) for d in model_dims(model) - _MODELLED[kind]):
        return None
    if kind == "transformer" and _scaled(jnp.float32, grad_reduce_dtype):
        if any(layout.axes_of(d) for d in ("heads", "d_ff", "vocab")):
            return None
    tensors = [t for t in jax.tree_util.tree_leaves(params, is_leaf=is_tensor) if is_tensor(t)]
    priced = [_parameter(t, layout, mesh, grad_reduce_dtype) for t in tensors]
    per_parameter = [p for p in priced if p is not None]
    if len(per_parameter) < len(priced):
        return None
    out = {k: sum((p[k] for p in per_parameter), Fraction(0)) for k in ("parameter gathers", "gradient sums")}
    out.update(_activations(kind, model.config, layout, mesh, grad_reduce_dtype))
    out["loss"] += _ar(4, _size(set(layout.axes_of("batch")), mesh))
    splitting = set().union(*(a for t in tensors for a in _split_axes(t, layout.param_layout).values()))
    out["clipping"] = _ar(4, _size(splitting, mesh)) if optimizer.clip_norm is not None else Fraction(0)
    return {k: float(v) for k, v in out.items()}


def minimum_bytes(
    model: Model, params: Any, mesh: md.Mesh, layout: md.Layout, optimizer: Any, grad_reduce_dtype: Any = None
) -> float | None:
    """The sum of :func:`terms`: least bytes per device one step moves under these rules; None if no formula."""
    parts = terms(model, params, mesh, layout, optimizer, grad_reduce_dtype)
    return None if parts is None else sum(parts.values())
