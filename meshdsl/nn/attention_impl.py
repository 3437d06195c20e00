"""Which kernel runs attention: cuDNN's fused attention where it can, XLA's formula otherwise.

``jax.nn.dot_product_attention(implementation=None)`` runs XLA's formula on every backend (JAX
0.10 to 0.12: "defaults to `None`, which currently falls back to `xla`"), which keeps the
``[batch, heads, length, memory]`` logits and probabilities: at length 2048 that is out of
memory for a 1b model on one GPU. cuDNN's fused (flash) attention keeps no such buffer. It takes
what JAX's ``check_is_flash_attention`` accepts for 16-bit inputs: bfloat16 or float16 queries,
keys and values, a head size that is a multiple of 8 and at most 128 (256 from compute
capability 9.0, Hopper, on); and here only the masks it runs without a mask tensor (none, or
causal from position 0). Anything else (a CPU or TPU, float32, a mask tensor: a padding mask, or
causal rows of a split query length) goes to XLA. An explicit ``implementation=`` always wins.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp

from meshdsl.errors import ConfigError

Implementation = Literal["xla", "cudnn"]
IMPLEMENTATIONS = ("xla", "cudnn")
MASKS = ("none", "causal", "tensor")
"""``mask_kind``: no mask, causal from position 0 (``is_causal``), or a boolean mask tensor."""
FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
GPU_PLATFORMS = ("gpu", "cuda")


def max_head_dim(device: Any = None) -> int:
    """The largest head size cuDNN's fused attention takes on ``device`` (default: the first):
    256 from compute capability 9.0 on, else 128 (JAX's ``check_is_flash_attention``)."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return 128
    return 256 if major >= 9 else 128


def choose_implementation(
    platform: str, dtype: Any, head_dim: int, mask_kind: str, explicit: str | None = None, head_dim_limit: int = 128
) -> Implementation:
    """``"cudnn"`` or ``"xla"`` for attention on ``platform`` ("cpu", "gpu", "tpu") of ``dtype``
    inputs with heads of ``head_dim`` and mask ``mask_kind`` (:data:`MASKS`); ``explicit`` (not
    None) is returned as given. ``head_dim_limit``: :func:`max_head_dim` of the device."""
    if explicit is not None:
        if explicit not in IMPLEMENTATIONS:
            known = ", ".join(IMPLEMENTATIONS)
            raise ConfigError(f"attention implementation {explicit!r} is not one of {known} (or None: chosen)")
        return "cudnn" if explicit == "cudnn" else "xla"
    if mask_kind not in MASKS:
        raise ConfigError(f"attention mask kind {mask_kind!r} is not one of {', '.join(MASKS)}")
    fused = (
        platform in GPU_PLATFORMS
        and jnp.dtype(dtype) in FUSED_DTYPES
        and head_dim % 8 == 0
        and head_dim <= head_dim_limit
        and mask_kind != "tensor"
    )
    return "cudnn" if fused else "xla"


_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshdsl_traced_for", default=None)


@contextlib.contextmanager
def traced_for(platform: str | None) -> Iterator[None]:
    """Attention chosen as on ``platform`` (a device profile's: "gpu", "cpu", "tpu") while tracing a
    step to price it, not as on the host's backend; None: the host's. On a host without cuDNN a
    fused choice traces as :mod:`meshdsl.nn.fused_attention_standin` (shapes only, never compiled)."""
    token = _TRACED_FOR.set(platform)
    try:
        yield
    finally:
        _TRACED_FOR.reset(token)


def target_platform() -> str:
    """The platform a step is being traced for: :func:`traced_for`'s, else ``jax.default_backend()``."""
    return _TRACED_FOR.get() or jax.default_backend()


def needs_standin(implementation: str) -> bool:
    """Whether ``implementation`` is cuDNN's while the host cannot trace it (no GPU backend here)."""
    return implementation == "cudnn" and jax.default_backend() not in GPU_PLATFORMS and _TRACED_FOR.get() is not None


def implementation_here(dtype: Any, head_dim: int, mask_kind: str, explicit: str | None = None) -> Implementation:
    """:func:`choose_implementation` for the platform being traced for (:func:`target_platform`); the
    head-size limit of this host's GPU, or 128 for a GPU traced for elsewhere."""
    if explicit is not None:
        return choose_implementation("", dtype, head_dim, mask_kind, explicit)
    platform = target_platform()
    limit = max_head_dim() if jax.default_backend() in GPU_PLATFORMS else 128
    return choose_implementation(platform, dtype, head_dim, mask_kind, head_dim_limit=limit)
