"""What each dim of a model can be split for: the planner's candidate splits, for any dim names.

:mod:`~meshdsl.planner.search` knows no model's dim names. It asks the model (``Model.DIM_ROLES``),
or infers the roles from how each dim is used in one trace of the loss on global arrays
(:mod:`meshdsl.lowering.recorder`; nothing compiled or computed), which sees the parameters, the
batch and every activation:

* ``batch`` (data parallel, split over ``data``): a dim of every batch tensor and of no
  parameter that is in every activation (a tensor meeting the parameters) holding any such dim.
  The Transformer's ``batch``; not its ``length``, which its keys and values hold as ``memory``.
  Also a dim of no parameter and no batch tensor, of a batch dim's size, that meets parameters but
  never a batch dim: the batch under another name after a reshape (the MoE's ``groups``).
* ``tensor`` (tensor parallel, split over ``model``): a parameter dim that some activation holds
  too, because an op sums it against the weight or makes it from the weight (``heads``, ``d_ff``,
  ``vocab``, ``d_model``); but not a dim that only ever appears beside another such dim, which
  is left to that one: splitting the other splits every tensor it is in, and more (the
  Transformer's ``d_kv`` and ``qkv`` beside ``heads``), unless that other is an expert dim (below),
  which may go on ``data`` and leave ``model`` to it (the MoE's ``d_ff`` beside ``experts``). Nor
  a dim of weights holding under :data:`MIN_TENSOR_SHARE` of the parameter bytes (the MoE's
  router, ``experts_unsplit``): splitting them saves next to nothing. Nor the stacked layer dim
  (``model.layers``), which a pipelined model's stages split (its ``stage``).
* ``fsdp`` (parameters stored split over ``data``, gathered where used): every parameter dim.

Declared roles replace the inferred ones: ``DIM_ROLES = {"rows": "batch", "hidden": "tensor",
"features": ("tensor", "fsdp")}`` on the ``Model`` class (or instance); each value a role or a
tuple of roles from :data:`ROLES`. Either way, which dims meet in one tensor comes from the trace,
and gives two more things: Megatron groups (tensor dims no tensor holds two of, split together
over ``model``) and expert dims (tensor dims that never meet a batch dim, which may share
``data`` with it: the MoE's ``experts``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax

import meshdsl as md
from meshdsl.errors import ConfigError
from meshdsl.lowering.recorder import recorded_shapes
from meshdsl.model import protocol as model_protocol
from meshdsl.model.protocol import Model
from meshdsl.tensor import is_tensor

ROLES = ("batch", "tensor", "fsdp")
"""The roles ``DIM_ROLES`` may give a dim."""
MAX_GROUPS = 8
"""At most this many Megatron groups (the largest first): each is a candidate to trace."""
MIN_TENSOR_SHARE = 0.01
"""An inferred tensor-parallel dim is held by weights of at least this share of the parameter bytes."""


@dataclasses.dataclass(frozen=True)
class DimRoles:
    """The splits worth trying for one model (dim names), and what they come from."""

    sizes: Mapping[str, int]
    """Every dim of the parameters, batch and activations, with its size."""
    batch: tuple[str, ...]
    """Split over ``data`` together: data parallelism."""
    tensor: tuple[str, ...]
    """Split over ``model``: tensor parallelism, each alone or in a group."""
    fsdp: tuple[str, ...]
    """Parameter dims, most parameter bytes first: where parameters may be stored split."""
    groups: tuple[tuple[str, ...], ...]
    """Sets of two or more tensor dims no tensor holds two of (Megatron: split together)."""
    expert: tuple[str, ...]
    """Tensor dims that never meet a batch dim, so they may share ``data`` with the batch (expert parallelism)."""
    stage: str | None
    """The layer dim a pipelined model's stages split, or None."""
    coverage: Mapping[str, int]
    """Parameter bytes holding each parameter dim (how much of the state FSDP along it splits)."""
    pairs: frozenset[frozenset[str]] = dataclasses.field(repr=False)
    """Every two dims that some tensor holds both of."""
    declared: bool = False
    """Whether the model declared ``batch``, ``tensor`` and ``fsdp`` (``DIM_ROLES``)."""

    def meet(self, a: str, b: str) -> bool:
        """Whether some tensor of the model holds both dims."""
        return frozenset((a, b)) in self.pairs

    def best_fsdp(self, taken: Iterable[str] = (), divisor: int = 1) -> list[str]:
        """The parameter dims outside ``taken``, of a size ``divisor`` divides, that the most parameter
        bytes hold (several when tied)."""
        free = [d for d in self.fsdp if d not in set(taken) and self.sizes[d] % divisor == 0]
        if not free:
            return []
        most = max(self.coverage[d] for d in free)
        return [d for d in free if self.coverage[d] == most]


def roles(model: Model, params: Any, batch: Any) -> DimRoles:
    """The roles of ``model``'s dims, from ``params`` and ``batch`` (pytrees of md tensors, abstract
    values are enough) and one trace of ``model.loss`` on them. ConfigError for ``DIM_ROLES`` that
    name a dim the model lacks or a role not in :data:`ROLES`."""
    weights = [t for t in jax.tree_util.tree_leaves(params, is_leaf=is_tensor) if is_tensor(t)]
    inputs = [t.shape for t in jax.tree_util.tree_leaves(batch, is_leaf=is_tensor) if is_tensor(t)]
    seen = recorded_shapes(lambda p, b: model.loss(p, b).array, params, batch)
    shapes = [set(s.names) for s in [*(w.shape for w in weights), *inputs, *seen]]
    sizes = {d.name: d.size for s in [*(w.shape for w in weights), *inputs, *seen] for d in s}
    coverage: dict[str, int] = {}
    for w in weights:
        for name in w.shape.names:
            coverage[name] = coverage.get(name, 0) + w.shape.size * w.dtype.itemsize
    stacked = model_protocol.stacked_layers(model)  # pipelined or not: never a tensor-parallel dim
    layers = None if stacked is None else stacked.name
    stage = layers if model_protocol.has_pipeline_parts(model) else None
    declared = _declared(model, sizes)
    pairs = frozenset(frozenset(p) for s in shapes for p in itertools.combinations(sorted(s), 2))
    meet = lambda a, b: frozenset((a, b)) in pairs  # noqa: E731
    if declared is None:
        batch_dims, tensor = _inferred(shapes, set(coverage), inputs, sizes)
        total = sum(w.shape.size * w.dtype.itemsize for w in weights)
        tensor = [d for d in tensor if d != layers and coverage[d] >= MIN_TENSOR_SHARE * total]
        fsdp = list(coverage)
    else:
        batch_dims, tensor, fsdp = ([d for d, r in declared.items() if role in r] for role in ROLES)
    from_batch = [d for d in batch_dims if any(d in s.names for s in inputs)]
    expert = [d for d in tensor if d not in batch_dims and not any(meet(d, b) for b in from_batch)]
    if declared is None:
        tensor = _undominated(tensor, shapes, [d for d in tensor if d not in expert])
        expert = _undominated(expert, shapes, expert)
    return DimRoles(
        sizes=sizes,
        batch=tuple(batch_dims),
        tensor=tuple(tensor),
        fsdp=tuple(sorted(fsdp, key=lambda d: -coverage.get(d, 0))),
        groups=_groups(tensor, meet, sizes),
        expert=tuple(expert),
        stage=stage,
        coverage={d: coverage.get(d, 0) for d in fsdp},
        pairs=pairs,
        declared=declared is not None,
    )


def _inferred(
    shapes: list[set[str]], weight_dims: set[str], inputs: list[md.Shape], sizes: Mapping[str, int]
) -> tuple[list[str], list[str]]:
    """The batch and tensor dims, inferred as the module docstring says."""
    every_input = set.intersection(*(set(s.names) for s in inputs)) if inputs else set()
    candidates = [d for d in sizes if d in every_input and d not in weight_dims]
    activations = [s for s in shapes if s & weight_dims and s & set(candidates)]
    batch = [d for d in candidates if all(d in s for s in activations)]
    if candidates and not batch:  # no dim is in every activation: the one in the most
        batch = [max(candidates, key=lambda d: sum(d in s for s in activations))]
    in_inputs = {n for s in inputs for n in s.names}
    renamed = [
        d
        for d in sizes
        if d not in weight_dims
        and d not in in_inputs
        and any(sizes[d] == sizes[b] for b in batch)
        and any(d in s and s & weight_dims for s in shapes)
        and not any(d in s and s & set(batch) for s in shapes)
    ]
    tensor = [d for d in sizes if d in weight_dims and any(d in s and s - weight_dims for s in shapes)]
    return batch + renamed, tensor


def _undominated(dims: list[str], shapes: list[set[str]], by: list[str]) -> list[str]:
    """``dims`` without those that appear only in tensors holding a dim of ``by`` (of two dims
    always together, the first is kept)."""
    holding = {d: {i for i, s in enumerate(shapes) if d in s} for d in {*dims, *by}}
    order = {d: i for i, d in reversed(list(enumerate([*dims, *by])))}

    def dominated(d: str) -> bool:
        return any(holding[d] <= holding[e] and (holding[d] != holding[e] or order[e] < order[d]) for e in by if e != d)

    return [d for d in dims if not dominated(d)]


def _declared(model: Model, sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]] | None:
    """``model.DIM_ROLES`` as ``{dim: roles}``, checked; None when the model declares none."""
    table = model_protocol.dim_roles(model)
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"DIM_ROLES must be a dict of dim name -> role or tuple of roles ({', '.join(ROLES)}), got {table!r}"
        )
    out = {}
    for dim, given in table.items():
        given = (given,) if isinstance(given, str) else tuple(given)
        unknown = [r for r in given if r not in ROLES]
        if unknown:
            raise ConfigError(
                f"DIM_ROLES[{dim!r}]: unknown role {', '.join(map(repr, unknown))}; the roles are {', '.join(ROLES)}"
            )
        if dim not in sizes:
            raise ConfigError(
                f"DIM_ROLES names {dim!r}, which no tensor of the model has (its dims: {', '.join(sorted(sizes))})"
            )
        out[dim] = given
    return out


def _groups(tensor: list[str], meet: Any, sizes: Mapping[str, int]) -> tuple[tuple[str, ...], ...]:
    """The maximal sets of two or more ``tensor`` dims no two of which meet, largest first (at most
    :data:`MAX_GROUPS`)."""
    found: list[tuple[str, ...]] = []

    def grow(chosen: list[str], rest: list[str], skipped: list[str]) -> None:  # Bron-Kerbosch on the "never meet" graph
        if not rest and not skipped:
            if len(chosen) > 1:
                found.append(tuple(d for d in tensor if d in chosen))
            return
        for d in list(rest):
            apart = lambda ds, d=d: [e for e in ds if e != d and not meet(d, e)]  # noqa: E731
            grow(chosen + [d], apart(rest), apart(skipped))
            rest.remove(d)
            skipped.append(d)

    grow([], list(tensor), [])
    found.sort(key=lambda g: (-len(g), -math.prod(sizes[d] for d in g)))
    return tuple(found[:MAX_GROUPS])
