"""Layouts: which tensor dim is split over which mesh axes.

A layout is a set of rules ``dim name -> mesh axes``, written as in Mesh-TF
(``"batch:data; d_ff:model"``), as a dict (``{"batch": "data", "d_model": ("data", "model")}``)
or in a TOML file. A tensor's dim is split over its rule's axes, major to minor; a dim without a
rule is replicated. The layout of every tensor follows from its shape alone, so the same program
runs under any layout, and only the collectives change.

Worked example, mesh ``data=4 model=2`` and rules ``batch:data; d_ff:model``:

=========================  ======================  ===================
tensor                     per-dim axes            local shard
=========================  ======================  ===================
``[batch=32, d_model=64]``  ``(data,), ()``         ``[8, 64]``
``[d_model=64, d_ff=256]``  ``(), (model,)``        ``[64, 128]``
``[batch=32, d_ff=256]``    ``(data,), (model,)``   ``[8, 128]``
=========================  ======================  ===================

A split must divide the dim's size, and no tensor may split two dims over one mesh axis.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from meshdsl.dims import ShapeLike, as_shape
from meshdsl.errors import ConfigError, LayoutError
from meshdsl.mesh import Mesh
from meshdsl.pipeline.config import PipelineConfig

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RuleValue = str | tuple[str, ...] | list[str]
ATTENTION_STRATEGIES = ("all_gather", "ring", "all_to_all")
"""How attention runs where the keys' ``memory`` is split over a mesh axis (``[attention]``): gather the
keys and values whole (the default), pass their blocks around a ring, or move the split to the heads
(DeepSpeed-Ulysses). See :mod:`meshdsl.nn.context_attention`."""


def _parse_attention(value: Any) -> dict[str, str]:
    """``{mesh axis: strategy}`` from ``attention=`` or an ``[attention]`` table; LayoutError naming a bad entry."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise LayoutError(
            f"attention must map mesh axes to strategies, e.g. {{'context': 'ring'}}, got {type(value).__name__}"
        )
    out: dict[str, str] = {}
    for axis, strategy in value.items():
        if not isinstance(axis, str) or not _NAME.match(axis):
            raise LayoutError(f"attention: {axis!r} is not a mesh axis name")
        if strategy not in ATTENTION_STRATEGIES:
            raise LayoutError(
                f"attention: strategy {strategy!r} for mesh axis {axis!r} is not one of "
                f"{', '.join(ATTENTION_STRATEGIES)}"
            )
        out[axis] = strategy
    return out


Split = tuple[tuple[str, ...], ...]
"""How one tensor is split: per dim, the mesh axes splitting it, major to minor; ``()`` means replicated.
A :class:`Layout` (the rules) gives every tensor its split; ``Tensor.split`` records the one it has now."""


def _split_rules(text: str) -> list[str]:
    """Split on ';' or ',' outside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch in ";," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _parse_string(text: str) -> dict[str, tuple[str, ...]]:
    rules: dict[str, tuple[str, ...]] = {}
    for part in _split_rules(text):
        dim, colon, value = part.partition(":")
        if not colon:
            raise LayoutError(
                f"malformed layout rule {part!r} in {text!r}: expected 'dim:axis' or 'dim:(axis1, axis2)'"
            )
        value = value.strip()
        if value.startswith("(") and value.endswith(")"):
            value = value[1:-1]
        axes = tuple(a.strip() for a in re.split(r"[,\s]+", value) if a.strip())
        _add_rule(rules, dim.strip(), axes, text)
    return rules


def _add_rule(rules: dict[str, tuple[str, ...]], dim: str, value: Any, source: Any) -> None:
    axes = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
    where = f" in {source!r}" if source is not None else ""
    if axes is None or not all(isinstance(a, str) for a in axes):
        raise LayoutError(f"layout rule for dim {dim!r}{where}: {value!r} is not a mesh axis name or a tuple of them")
    if not _NAME.match(dim):
        raise LayoutError(f"malformed layout rule{where}: dim name {dim!r} is not an identifier")
    bad = [a for a in axes if not _NAME.match(a)]
    if not axes or bad:
        raise LayoutError(f"malformed layout rule {dim}:{value!r}{where}: mesh axis names must be identifiers")
    if len(set(axes)) != len(axes):
        raise LayoutError(f"layout rule {dim}:{axes}{where} repeats a mesh axis")
    if dim in rules:
        raise LayoutError(f"layout{where} has two rules for dim {dim!r}")
    rules[dim] = axes


def _parse(rules: str | Mapping[str, RuleValue] | Layout | None) -> dict[str, tuple[str, ...]]:
    if rules is None:
        return {}
    if isinstance(rules, Layout):
        return dict(rules.rules)
    if isinstance(rules, str):
        return _parse_string(rules)
    if isinstance(rules, Mapping):
        out: dict[str, tuple[str, ...]] = {}
        for dim, value in rules.items():
            _add_rule(out, str(dim), value, None)
        return out
    raise LayoutError(f"a layout is a rule string, a dict or md.Layout, got {type(rules).__name__}")


class FrozenMap(Mapping[str, Any]):
    """A read-only mapping that keeps its insertion order (for printing) and hashes over its items.

    What a :class:`Layout` holds instead of a dict: it cannot change after the layout is built,
    and two equal maps (in any order) hash alike.
    """

    __slots__ = ("_items",)
    _items: Mapping[str, Any]

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()):
        object.__setattr__(self, "_items", MappingProxyType(dict(items)))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __repr__(self) -> str:
        return repr(dict(self._items))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (dict(self._items),))


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Layout:
    """Rules that map dim names to mesh axes: ``Layout("batch:data; d_ff:model")``. Immutable.

    ``params``: optional separate rules for parameters and optimizer state (FSDP / ZeRO-3: stored
    split, gathered for compute). ``mesh_axes``: the mesh a layout file asks for, if any.
    ``pipeline``: microbatches and schedule (:class:`meshdsl.pipeline.config.PipelineConfig`, or a
    ``[pipeline]`` table) for a layout that splits ``layers`` into pipeline stages.
    ``attention``: ``{mesh axis: strategy}`` (:data:`ATTENTION_STRATEGIES`), how attention runs where
    the keys' ``memory`` is split over that axis; an axis not named gathers them (``all_gather``).

    A frozen dataclass: equality and hash are over every field, so a field added later counts
    without touching them; the maps it holds are :class:`FrozenMap`.
    """

    rules: FrozenMap
    params: Layout | None
    mesh_axes: FrozenMap | None
    pipeline: PipelineConfig
    attention: FrozenMap

    def __init__(
        self,
        rules: str | Mapping[str, RuleValue] | Layout | None = None,
        params: str | Mapping[str, RuleValue] | Layout | None = None,
        mesh_axes: Mapping[str, int] | None = None,
        pipeline: Any = None,
        attention: Mapping[str, str] | None = None,
    ):
        own_params = None if params is None else Layout(params)
        own_mesh = None if mesh_axes is None else FrozenMap(mesh_axes)
        own_pipeline = PipelineConfig.of(pipeline)
        own_attention = FrozenMap(_parse_attention(attention))
        if isinstance(rules, Layout):
            own_params = own_params or rules.params
            own_mesh = own_mesh or rules.mesh_axes
            own_pipeline = rules.pipeline if pipeline is None else own_pipeline
            own_attention = rules.attention if attention is None else own_attention
        for name, value in (
            ("rules", FrozenMap(_parse(rules))),
            ("params", own_params),
            ("mesh_axes", own_mesh),
            ("pipeline", own_pipeline),
            ("attention", own_attention),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def load(cls, path: str | Path) -> Layout:
        """Read a TOML layout file: ``[mesh]`` axis sizes, ``[rules]``, optional ``[params]``, ``[pipeline]`` and
        ``[attention]`` (see ``layouts/``)."""
        path = Path(path)
        if path.is_dir():
            raise LayoutError(f"layout file {str(path)!r} is a directory; give a .toml file")
        if not path.is_file():
            raise LayoutError(f"layout file {str(path)!r} not found")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise LayoutError(f"layout file {str(path)!r} is not valid TOML: {e}") from None
        # [train]: settings for meshdsl train (meshdsl.train.settings reads it), not part of the layout
        unknown = set(data) - {"mesh", "rules", "params", "pipeline", "attention", "train", "description"}
        if unknown:
            raise LayoutError(
                f"layout file {str(path)!r}: unknown table(s) {sorted(unknown)}; expected [mesh], [rules], [params], "
                "[pipeline], [attention], [train]"
            )
        for table in ("mesh", "rules", "params", "pipeline", "attention", "train"):
            if not isinstance(data.get(table, {}), dict):
                raise LayoutError(f"layout file {str(path)!r}: [{table}] must be a table")
        for axis, size in data.get("mesh", {}).items():
            if isinstance(size, bool) or not isinstance(size, int) or not (size >= 1 or size == -1):
                raise LayoutError(
                    f"layout file {str(path)!r}: [mesh] axis {axis} has size {size!r}; a size is a positive integer "
                    "or -1 (the remaining devices)"
                )
        if not data.get("mesh") and not data.get("rules"):
            raise LayoutError(
                f"layout file {str(path)!r} has neither a [mesh] table nor [rules], so it lays nothing out (an empty "
                "file?)"
            )
        try:
            return cls(
                data.get("rules", {}), data.get("params"), data.get("mesh"), data.get("pipeline"), data.get("attention")
            )
        except (LayoutError, ConfigError) as e:
            raise type(e)(f"layout file {str(path)!r}: {e}") from None

    @property
    def param_layout(self) -> Layout:
        """The rules parameters and optimizer state are stored under: ``params`` if given, else these."""
        return self.params if self.params is not None else Layout(self.rules)

    def mesh(self, devices=None) -> Mesh:
        """The mesh a layout file names (``[mesh]``), on ``devices`` (default ``jax.devices()``)."""
        if self.mesh_axes is None:
            named = f"layout {str(self)!r}" if self.rules else "a layout without rules"
            raise LayoutError(f"{named} names no mesh; give one with md.Mesh(...) or a [mesh] table")
        return Mesh(self.mesh_axes, devices)

    def axes_of(self, name: str) -> tuple[str, ...]:
        """Mesh axes the dim called ``name`` is split over (``()``: replicated)."""
        return self.rules.get(name, ())

    def check_mesh(self, mesh: Mesh) -> None:
        """LayoutError if a rule names an axis the mesh lacks."""
        if self.params is not None:
            self.params.check_mesh(mesh)
        for dim, axes in self.rules.items():
            for a in axes:
                if a not in mesh.axis_sizes:
                    raise LayoutError(f"layout rule {dim}:{a} names mesh axis {a!r}, but the mesh has axes {mesh}")
        for a, strategy in self.attention.items():
            if a not in mesh.axis_sizes:
                raise LayoutError(
                    f"layout attention {a} = {strategy!r} names mesh axis {a!r}, but the mesh has axes {mesh}"
                )

    def attention_strategy(self, axes: Sequence[str]) -> str:
        """The attention strategy for keys whose ``memory`` is split over ``axes`` (``all_gather`` where
        none is named); LayoutError when the axes name different ones."""
        chosen = {self.attention.get(a, "all_gather") for a in axes}
        if len(chosen) > 1:
            named = ", ".join(f"{a} = {self.attention.get(a, 'all_gather')!r}" for a in axes)
            raise LayoutError(
                f"attention: memory is split over mesh axes {tuple(axes)} whose strategies differ ({named})"
            )
        return chosen.pop() if chosen else "all_gather"

    def axes(self, shape: ShapeLike, mesh: Mesh, tensor: str = "tensor") -> Split:
        """Per-dim split axes of a tensor of ``shape``; LayoutError if they do not fit ``mesh``."""
        shape = as_shape(shape)
        self.check_mesh(mesh)
        out = []
        owner: dict[str, str] = {}
        for d in shape:
            axes = self.axes_of(d.name)
            n = math.prod(mesh.axis_sizes[a] for a in axes)
            if d.size % n:
                split = " x ".join(f"{a} (size {mesh.axis_sizes[a]})" for a in axes)
                raise LayoutError(
                    f"{tensor} {shape}: dim {d.name} (size {d.size}) is split over mesh axis {split} "
                    f"by rule {d.name}:{','.join(axes)}, but {d.size} is not divisible by {n}"
                )
            for a in axes:
                if a in owner:
                    raise LayoutError(
                        f"{tensor} {shape}: dims {owner[a]} and {d.name} are both split over mesh axis "
                        f"{a} (size {mesh.axis_sizes[a]}); a mesh axis can split only one dim of a tensor"
                    )
                owner[a] = d.name
            out.append(axes)
        return tuple(out)

    def spec(self, shape: ShapeLike) -> PartitionSpec:
        """The ``PartitionSpec`` of a tensor of ``shape`` under this layout."""
        return self.spec_of(d.name for d in as_shape(shape))

    def spec_of(self, names: Iterable[str], whole: Collection[str] = ()) -> PartitionSpec:
        """The ``PartitionSpec`` of an array whose dims are called ``names`` under this layout, the
        dims in ``whole`` unsplit; the one place a layout becomes a ``PartitionSpec`` (a dim over one
        axis by its name, over several by the tuple, a whole dim as None)."""
        axes = [() if n in whole else self.axes_of(n) for n in names]
        return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else a for a in axes])

    def sharding(self, mesh: Mesh, shape: ShapeLike) -> NamedSharding:
        """The ``NamedSharding`` of a tensor of ``shape`` on ``mesh`` (checked: LayoutError if it does not fit)."""
        self.axes(shape, mesh)
        return NamedSharding(mesh.jax_mesh, self.spec(shape))

    def __str__(self) -> str:
        return "; ".join(f"{d}:{a[0]}" if len(a) == 1 else f"{d}:({', '.join(a)})" for d, a in self.rules.items())

    def shown(self) -> str:
        """The rules as messages name them: ``str(self)``, or ``no rules (everything replicated)`` for none."""
        return str(self) or "no rules (everything replicated)"

    def __repr__(self) -> str:
        params = "" if self.params is None else f", params={str(self.params)!r}"
        attention = f", attention={self.attention!r}" if self.attention else ""
        return f"Layout({str(self)!r}{params}{attention})"
