"""``Decoder``: a model's prefill and decode steps compiled for a mesh and layout, with its KV cache.

One compiled function, ``model.decode(params, tokens, cache, step)``, serves both: over the
prompt (``tokens[batch, length=P]`` written at slot 0) and over one token per row (``length=1``
at slot ``index``); the two shapes compile once each. The cache ``{"keys", "values"}`` is laid
out by the layout like any tensor and donated to each call, so XLA writes the step's keys and
values into its buffers. :meth:`Decoder.advance` wraps a step and the choice of the next tokens
in one jitted call (one dispatch per token).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from meshdsl.compile import Compiled
from meshdsl.compile import compile as md_compile
from meshdsl.decoding.sampling import Sampling, choose
from meshdsl.dims import Dim
from meshdsl.errors import ConfigError
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh
from meshdsl.model.protocol import Decoding, Model
from meshdsl.model.user import describe_model
from meshdsl.ops.creation import zeros as md_zeros
from meshdsl.tensor import Tensor, tensor


def check_model(model: Model) -> None:
    """ConfigError unless ``model`` can decode (a ``decode`` and ``cache_shape``, as the shipped decoders)."""
    missing = [name for name in ("decode", "cache_shape") if not callable(getattr(model, name, None))]
    if not missing and not getattr(model, "decodes", True):
        raise ConfigError(f"{describe_model(model)} cannot decode: its forward pass is not the one decode runs")
    if missing:
        raise ConfigError(
            f"{describe_model(model)} cannot decode: it has no {' or '.join(missing)} "
            "(the shipped transformer and llama do; see models/transformer.py)"
        )


@dataclasses.dataclass
class Decoder:
    """``model`` decoding on ``mesh`` under ``layout`` (``backend`` "spmd" or "gspmd"): :meth:`cache`,
    :meth:`advance`; ``step`` is the compiled ``model.decode`` (for ``md.explain`` and cost analysis)."""

    model: Decoding
    mesh: Mesh
    layout: Layout | str
    backend: str = "spmd"
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        check_model(self.model)
        self.layout = self.layout if isinstance(self.layout, Layout) else Layout(self.layout)
        stored = self.layout.param_layout
        self.step = md_compile(
            self.model.decode,
            self.mesh,
            self.layout,
            self.backend,
            in_layouts=(stored, None, None, None),
            donate_argnums=(2,),
        )
        self.place = md_compile(lambda params: params, self.mesh, self.layout, self.backend, out_layouts=stored)
        """``place(params)``: the parameters laid out as the layout stores them (call once before decoding)."""
        self._advance = jax.jit(self._advance_fn, donate_argnums=(1,))
        self._zeros: dict[tuple[int, int], Compiled] = {}

    @property
    def dtype(self) -> Any:
        return getattr(self.model, "dtype", jnp.float32)

    def cache(self, batch: int, memory: int) -> dict[str, Tensor]:
        """Zeroed keys and values for ``batch`` sequences of ``memory`` positions, laid out by the layout."""
        if (batch, memory) not in self._zeros:  # compiled once per size: each run donates its cache
            shape = self.model.cache_shape(Dim("batch", batch), Dim("memory", memory))

            def zeros() -> dict[str, Tensor]:
                return {"keys": md_zeros(shape, self.dtype), "values": md_zeros(shape, self.dtype)}

            self._zeros[batch, memory] = md_compile(zeros, self.mesh, self.layout, self.backend)
        return self._zeros[batch, memory]()

    def step_inputs(
        self, tokens: jax.Array, index: Any, positions: jax.Array, valid: jax.Array
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The md tensors of one step: ``tokens[batch, length]``, and ``index`` (0-d), ``positions[batch,
        length]`` and ``valid[batch, memory]`` as ``md.nn.KVCache`` takes them."""
        batch, length = Dim("batch", tokens.shape[0]), Dim("length", tokens.shape[1])
        memory = Dim("memory", valid.shape[1])
        step = {
            "index": tensor(jnp.asarray(index, jnp.int32), []),
            "positions": tensor(positions.astype(jnp.int32), [batch, length]),
            "valid": tensor(valid, [batch, memory]),
        }
        return tensor(tokens.astype(jnp.int32), [batch, length]), step

    def _advance_fn(
        self,
        params: Any,
        cache: dict[str, Tensor],
        tokens: jax.Array,
        index: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        key: jax.Array,
        done: jax.Array,
    ) -> tuple[dict[str, Tensor], jax.Array, jax.Array]:
        token_tensor, step = self.step_inputs(tokens, index, positions, valid)
        logits, cache = self.step(params, token_tensor, cache, step)
        new = choose(logits.array, key, self.sampling)
        if self.eos_token_id is not None:
            new = jnp.where(done, self.eos_token_id, new)
            done = done | (new == self.eos_token_id)
        return cache, new, done

    def advance(
        self,
        params: Any,
        cache: dict[str, Tensor],
        tokens: jax.Array,
        index: Any,
        positions: jax.Array,
        valid: jax.Array,
        key: jax.Array,
        done: jax.Array,
    ) -> tuple[dict[str, Tensor], jax.Array, jax.Array]:
        """One step (``cache`` is donated: use the returned one): ``(cache, next tokens [batch], done [batch])``.
        A row already ``done`` (it produced ``eos_token_id``) gets ``eos_token_id`` again."""
        return self._advance(params, cache, tokens, jnp.asarray(index, jnp.int32), positions, valid, key, done)
