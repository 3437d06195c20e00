"""``MoE``: a mixture-of-experts feed-forward with top-k routing, expert capacity and a balancing loss."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from meshdsl.arguments import number
from meshdsl.dims import Dim
from meshdsl.errors import ConfigError, ShapeError
from meshdsl.nn.linear import Linear
from meshdsl.nn.params import Stack, check_float, check_sizes
from meshdsl.ops.einsum import einsum
from meshdsl.ops.elementwise import cast, equal, gelu
from meshdsl.ops.indexing import cumsum, one_hot, top_k
from meshdsl.ops.indexing import range as md_range
from meshdsl.ops.reduction import reduce_mean, reduce_sum, softmax
from meshdsl.ops.reshape import reshape
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class MoE:
    """Experts' feed-forwards and a router, as GShard and Mesh-TensorFlow's ``moe.py``.

    ``y, aux = moe(params, x)`` for ``x[group, tokens, model]`` (any order): tokens are routed
    within their group (one per ``group`` row; Mesh-TF's ``group``). The router
    (``w_gate[model, experts_unsplit]``, run in float32) gives each token's probabilities over the
    experts; its ``top`` largest are its choices, with gates normalised to sum to 1 (``top`` 1:
    the probability itself, as Switch). Each choice gets a slot in its expert's buffer of
    ``capacity = ceil(capacity_factor * tokens / experts)`` (at most ``tokens``), all first choices
    before all second choices, in token order (an exclusive ``cumsum`` along ``tokens``); a choice
    past the capacity is dropped. Then::

        x = einsum(dispatch, x -> [experts_unsplit, group, capacity, model])
        x = reshape(x -> [experts, groups, capacity, model])     # the dispatch
        y = expert feed-forwards of x (w_in [experts, model, hidden], w_out [experts, hidden, model])
        y = reshape(y -> [experts_unsplit, group, capacity, model])   # the combine
        y = einsum(combine, y -> x's shape)

    The reshapes rename two dims at once, so when a layout splits ``group`` and ``experts`` over
    the same axes (expert parallelism) each is one ``all_to_all``; when it splits ``group`` and
    ``groups`` alike they cost nothing and every device computes every expert for its groups.
    ``experts_unsplit`` is the token side's copy of ``experts`` (the token side also has ``group``,
    and one tensor cannot split two dims over one axis); ``groups`` the expert side's copy of
    ``group``.

    ``aux[group]`` is the load-balancing loss of each group, ``experts * sum_e f_e P_e`` with
    ``f_e`` the fraction of its tokens whose first choice is ``e`` (before capacity) and ``P_e``
    the mean router probability of ``e``: 1 for uniform routing. Add its mean, weighted, to the loss.

    Params: ``{"w_gate": router's, "w_in": expert_input's, "w_out": expert_output's}``, the
    experts' weights stacked along ``experts`` (LeCun normal).
    """

    model: Dim
    hidden: Dim
    experts: Dim
    _: dataclasses.KW_ONLY
    group: str = "batch"
    tokens: str = "length"
    capacity_factor: float = 2.0
    top: int = 2
    activation: Callable[[Tensor], Tensor] = gelu
    experts_unsplit: str = "experts_unsplit"
    groups: str = "groups"
    capacity: str = "expert_capacity"
    choices: str = "top"

    def __post_init__(self) -> None:
        check_sizes("MoE", [self.model, self.hidden, self.experts])
        if isinstance(self.top, bool) or not isinstance(self.top, int) or not 1 <= self.top <= self.experts.size:
            raise ShapeError(f"MoE: top {self.top!r} must be an int between 1 and {self.experts}", op="MoE")
        number(self.capacity_factor, "MoE: capacity_factor", above=0.0, op="MoE")
        if not callable(self.activation):
            raise ConfigError(
                f"MoE: activation must be a function of an md tensor (e.g. md.gelu), got {self.activation!r}", op="MoE"
            )
        names = [
            self.model.name,
            self.hidden.name,
            self.experts.name,
            self.group,
            self.tokens,
            self.experts_unsplit,
            self.groups,
            self.capacity,
            self.choices,
        ]
        if len(set(names)) != len(names):
            raise ShapeError(f"MoE: dim names {names} must be distinct", op="MoE")

    @property
    def router(self) -> Linear:
        return Linear(self.model, Dim(self.experts_unsplit, self.experts.size))

    @property
    def expert_input(self) -> Linear:
        return Linear(self.model, self.hidden)

    @property
    def expert_output(self) -> Linear:
        return Linear(self.hidden, self.model)

    def capacity_size(self, tokens: int) -> int:
        """Slots per expert per group for groups of ``tokens`` tokens."""
        return max(1, min(tokens, math.ceil(self.capacity_factor * tokens / self.experts.size)))

    def init(self, key: jax.Array, stack: Stack = ()) -> dict[str, Tensor]:
        k_gate, k_in, k_out = jax.random.split(key, 3)
        experts = [*stack, self.experts]
        return {
            "w_gate": self.router.init(k_gate, stack),
            "w_in": self.expert_input.init(k_in, experts),
            "w_out": self.expert_output.init(k_out, experts),
        }

    def route(self, probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``dispatch`` and ``combine`` ``[group, tokens, experts_unsplit, capacity]`` and ``aux[group]``
        from router probabilities ``probs[group, tokens, experts_unsplit]`` (float32)."""
        Eu, top = probs.shape[self.experts_unsplit], Dim(self.choices, self.top)
        tokens = probs.shape[self.tokens]
        C = Dim(self.capacity, self.capacity_size(tokens.size))
        rest = [d for d in probs.shape if d.name != Eu.name]
        gate, index = top_k(probs, Eu, top)  # first choice first
        choice = one_hot(index, Eu, dtype=jnp.int32)  # [.., top, experts_unsplit]
        # Slot in the expert's buffer: earlier tokens of this group with the same choice rank, plus
        # every token that chose the expert at a better rank (first choices fill buffers first).
        within = cumsum(choice, tokens, exclusive=True)
        before = cumsum(reduce_sum(choice, tokens), top, exclusive=True)
        position = reduce_sum((within + before) * choice, Eu)
        slot = one_hot(position, C)  # all zeros past capacity: the choice is dropped
        if self.top > 1:
            gate = gate / (reduce_sum(gate, top) + 1e-9)
        chosen = cast(choice, jnp.float32)
        dispatch = einsum(chosen, slot, out=[*rest, Eu, C])
        combine = einsum(chosen, slot, gate, out=[*rest, Eu, C])
        first = cast(equal(md_range(top), 0), jnp.float32)
        fraction = reduce_mean(reduce_sum(chosen * first, top), tokens)  # first choices, before capacity
        aux = reduce_sum(fraction * reduce_mean(probs, tokens), Eu) * float(Eu.size)
        return dispatch, combine, aux

    def __call__(self, params: dict[str, Any], x: Tensor) -> tuple[Tensor, Tensor]:
        check_float("MoE", x)
        if (
            sorted(x.names) != sorted([self.group, self.tokens, self.model.name])
            or x.shape[self.model.name] != self.model
        ):
            raise ShapeError(
                f"MoE: input {x.shape} must have exactly the dims {self.group}, {self.tokens} and {self.model}",
                op="MoE",
            )
        b, dm, E = x.shape[self.group], self.model, self.experts
        Eu, G = Dim(self.experts_unsplit, E.size), Dim(self.groups, b.size)
        C = Dim(self.capacity, self.capacity_size(x.shape[self.tokens].size))
        h32 = x if x.dtype == jnp.float32 else cast(x, jnp.float32)
        dispatch, combine, aux = self.route(softmax(self.router(params["w_gate"], h32), Eu))
        expert_x = reshape(einsum(cast(dispatch, x.dtype), x, out=[Eu, b, C, dm]), [E, G, C, dm])  # the dispatch
        hidden = self.activation(self.expert_input(params["w_in"], expert_x))
        y = reshape(self.expert_output(params["w_out"], hidden), [Eu, b, C, dm])  # the combine
        return einsum(cast(combine, x.dtype), y, out=x.shape), aux
