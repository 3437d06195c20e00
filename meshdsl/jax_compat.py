"""Every difference between the JAX releases meshdsl supports (0.10 to 0.12), in one module.

The rest of meshdsl asks these functions instead of probing JAX itself, so a new JAX release that
renames something is fixed here. (How each release lays out the params of the equations meshdsl
reads inside a jaxpr is :mod:`meshdsl.analysis.jaxpr_walk`'s ``param`` and its neighbours.)

* :func:`varying_axes`: the mesh axes ``shard_map`` tracks a value as varying along. JAX 0.10 and
  later keep them in an aval's ``manual_axis_type.varying``; earlier releases called it ``vma``.
* :func:`jaxlib_version`: the XLA at hand, for behaviour that changed between releases.
* :func:`dce_jaxpr`: dead-code elimination of a jaxpr, which JAX exports only from ``jax._src``.
* :func:`at_top_level`: whether no JAX transformation is tracing the caller, which JAX also exports only
  from ``jax._src`` (a ``jax.jit`` given ``compiler_options`` refuses to be traced inside another).
"""

from __future__ import annotations

from typing import Any

import jax
import jaxlib
from jax._src import core as _core  # with partial_eval below, the only imports of JAX's private modules
from jax._src.interpreters import partial_eval as _pe


def aval_varying(aval: Any) -> frozenset[str]:
    """Mesh axes along which an abstract value (``jax.typeof(x)``) is varying under ``shard_map``."""
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes along which JAX tracks ``x`` as varying (``shard_map``'s ``check_vma`` types)."""
    return aval_varying(jax.typeof(x))


def jaxlib_version() -> tuple[int, ...]:
    """jaxlib's ``(major, minor)`` (``(0, 10)`` for 0.10.2)."""
    return tuple(int(p) for p in jaxlib.__version__.split(".")[:2] if p.isdigit())


def dce_jaxpr(jaxpr: Any) -> Any:
    """``jaxpr`` without the equations no output depends on (what XLA would drop as dead)."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def at_top_level() -> bool:
    """Whether the caller runs outside every JAX trace (not inside ``jax.jit``, ``jax.grad``, ``jax.vmap``)."""
    return bool(_core.trace_state_clean())
