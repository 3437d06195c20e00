"""What meshdsl asks of a model, written once: a required core and optional capabilities.

Every model, shipped or the user's, is ``Model(config)`` with the core of :class:`Model`:
``init(key) -> params``, ``batch(key) -> batch`` and ``loss(params, batch) -> scalar md.Tensor``
(params and batch pytrees of md tensors). The rest is optional, and each command that uses a part
says in one line what it cannot do without it:

===========================  =====================================================================
``flops_per_step()``         FLOP/s and MFU (bench, train): :class:`Counted`
``examples_per_step()``      throughput, in tokens when the config has ``length`` (bench, train)
``LAYOUTS``                  the shipped layouts bench runs when ``--layouts`` names none
``DIM_ROLES``                what search may split each dim for (:mod:`meshdsl.planner.roles`)
``TOKEN_KEYS``               the batch keys ``--data`` fills (:mod:`meshdsl.train.token_batch`)
pipeline parts               ``pipelined``, ``layers``, ``batch_dim``, ``pre``, ``layer``, ``post``,
                             ``with_batch``: :class:`Pipelined` (:mod:`meshdsl.pipeline`)
===========================  =====================================================================

The functions below are the only places that probe a model for these parts, so the commands ask
:func:`step_counts`, :func:`layouts` or :func:`has_pipeline_parts` instead of ``hasattr``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import jax

from meshdsl.dims import Dim
from meshdsl.errors import ConfigError

if TYPE_CHECKING:
    from meshdsl.tensor import Tensor

__all__ = [
    "OPTIONAL",
    "PIPELINE_PARTS",
    "REQUIRED",
    "Counted",
    "Decoding",
    "HuggingFaceMapped",
    "Model",
    "Pipelined",
    "StepCounts",
    "Trainable",
    "batch_dim",
    "capabilities",
    "check",
    "compute_dtype",
    "config_field",
    "dim_roles",
    "has_pipeline_parts",
    "layouts",
    "missing",
    "stacked_layers",
    "step_counts",
    "token_keys",
    "with_batch",
]

M = TypeVar("M")

REQUIRED = ("init", "batch", "loss")
"""The methods every model has."""

PIPELINE_PARTS = ("pre", "layer", "post", "with_batch", "layers", "batch_dim")
"""What a model needs besides ``pipelined`` to run as a pipeline."""

OPTIONAL = ("flops_per_step", "examples_per_step", "LAYOUTS", "DIM_ROLES", "TOKEN_KEYS", *PIPELINE_PARTS)
"""The optional parts, by name (:func:`capabilities`)."""


class Trainable(Protocol):
    """What a ``Trainer`` fed its batches needs of a model: parameters and a loss (no ``batch``, no ``config``)."""

    def init(self, key: jax.Array) -> Any:
        """The parameters: a pytree of md tensors, made from ``key`` (a threefry key's data, uint32[2])."""
        ...

    def loss(self, params: Any, batch: Any) -> Tensor:
        """The mean loss of ``batch``: a scalar float md tensor."""
        ...


@runtime_checkable
class Model(Trainable, Protocol):
    """The core every model has; ``config`` is the ``Config`` it was built from (set by the loader if absent)."""

    config: Any

    def batch(self, key: jax.Array) -> Any:
        """A training batch: a pytree of md tensors, made from ``key``."""
        ...


class HuggingFaceMapped(Model, Protocol):
    """A model whose parameters map to a Hugging Face checkpoint's tensors (``--init-from-hf``, ``md.hf``)."""

    def hf_names(self) -> Mapping[str, Any]:
        """Parameter path -> where its tensor is in the files (:class:`md.checkpoint.Source`)."""
        ...


class Decoding(Model, Protocol):
    """A model that decodes with a KV cache (``md.generate``, ``meshdsl generate``): the shipped decoders."""

    def cache_shape(self, batch: Dim, memory: Dim) -> list[Dim]:
        """The dims of one cached keys (or values) tensor of ``batch`` sequences of ``memory`` positions."""
        ...

    def decode(self, params: Any, tokens: Tensor, cache: Any, step: Any) -> tuple[Tensor, Any]:
        """The last position's logits and the cache with ``tokens``' keys and values written in."""
        ...


class Counted(Protocol):
    """Optional: the work and the examples of one training step, for FLOP/s, MFU and throughput."""

    def flops_per_step(self) -> float: ...

    def examples_per_step(self) -> int: ...


class Pipelined(Model, Protocol):
    """Optional: a model whose loss is ``post(layers(pre))`` over a stack of layers, which a pipeline cuts."""

    pipelined: bool
    layers: Dim
    batch_dim: Dim

    def pre(self, params: Any, batch: Any) -> Tensor: ...

    def layer(self, x: Tensor, layer_params: Any) -> Tensor: ...

    def post(self, params: Any, x: Tensor, batch: Any) -> Tensor: ...

    def with_batch(self, size: int) -> Pipelined: ...


def missing(model: object, needed: Sequence[str] = REQUIRED) -> list[str]:
    """The methods of ``needed`` (the core, :data:`REQUIRED`) that ``model`` (an instance or a class)
    lacks or cannot call."""
    return [name for name in needed if not callable(getattr(model, name, None))]


def check(model: object, name: str, needed: Sequence[str] = REQUIRED) -> None:
    """ConfigError, in one line naming the model ``name`` (its file, module or class) and the methods,
    unless ``model`` has the methods ``needed`` of :class:`Model`'s core (a ``Trainer`` fed batches
    needs no ``batch``)."""
    lacking = missing(model, needed)
    if lacking:
        raise ConfigError(
            f"model {name} has no {', '.join(f'{m}()' for m in lacking)}: every model defines "
            "init(key), batch(key) and loss(params, batch) (meshdsl.model.protocol.Model)"
        )


def capabilities(model: object) -> frozenset[str]:
    """The optional parts (:data:`OPTIONAL`) ``model`` has."""
    return frozenset(part for part in OPTIONAL if getattr(model, part, None) is not None)


def has_pipeline_parts(model: object) -> bool:
    """Whether ``model`` can run as a pipeline: it says ``pipelined`` and has every part of :class:`Pipelined`."""
    return bool(getattr(model, "pipelined", False)) and all(hasattr(model, p) for p in PIPELINE_PARTS)


def stacked_layers(model: object) -> Dim | None:
    """The dim of the model's stacked layers (``layers``, pipelined or not), or None where it has none."""
    layers = getattr(model, "layers", None)
    return layers if isinstance(layers, Dim) else None


def batch_dim(model: object) -> Dim | None:
    """The dim the model's batch is cut along (its ``batch_dim``), or None where it names none."""
    dim = getattr(model, "batch_dim", None)
    return dim if isinstance(dim, Dim) else None


def with_batch(model: M, size: int) -> M:
    """``model`` for batches of ``size`` rows where it has ``with_batch``, else ``model`` itself."""
    resize = getattr(model, "with_batch", None)
    return model if resize is None else resize(size)


def layouts(model: object) -> tuple[str, ...] | None:
    """The layouts the model lists in ``LAYOUTS`` (bench's default), or None."""
    listed = getattr(model, "LAYOUTS", None)
    return None if listed is None else tuple(listed)


def dim_roles(model: object) -> Any:
    """The model's ``DIM_ROLES`` as it declares it (checked by :mod:`meshdsl.planner.roles`), or None."""
    return getattr(model, "DIM_ROLES", None)


def token_keys(model: object) -> Any:
    """The model's ``TOKEN_KEYS`` as it declares it (checked by :mod:`meshdsl.train.token_batch`), or None."""
    return getattr(model, "TOKEN_KEYS", None)


def config_field(model: object, field: str, default: Any = None) -> Any:
    """The field ``field`` of the model's config, or ``default`` where the config has no such field."""
    return getattr(getattr(model, "config", None), field, default)


def compute_dtype(model: object) -> str:
    """The dtype the model computes in: its config's ``compute_dtype``, else float32."""
    return str(config_field(model, "compute_dtype") or "float32")


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What one training step of a model does, for rates: FLOPs and examples (None where the model does
    not say), and the examples' unit (``tokens`` for a model whose config has ``length``)."""

    flops: float | None
    examples: int | None
    unit: str

    def notes(self, name: str) -> list[str]:
        """What cannot be reported of the model ``name`` for lack of a count (one line each)."""
        lacking = [("flops_per_step", self.flops, "no FLOP/s or MFU is reported")]
        lacking.append(("examples_per_step", self.examples, "no throughput is reported"))
        return [f"model {name} has no {part}(), so {what}" for part, value, what in lacking if value is None]


def step_counts(model: object) -> StepCounts:
    """The :class:`StepCounts` of ``model``: what train and bench divide by the step time."""
    flops = model.flops_per_step() if hasattr(model, "flops_per_step") else None
    examples = model.examples_per_step() if hasattr(model, "examples_per_step") else None
    unit = "tokens" if hasattr(getattr(model, "config", None), "length") else "examples"
    return StepCounts(flops, examples, unit)
