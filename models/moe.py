"""Mixture-of-experts Transformer: models/transformer.py with GShard / Mesh-TF top-2 MoE feed-forwards.

Every ``moe_every``-th layer (all of them by default) replaces the feed-forward by ``experts``
feed-forwards and a router (``md.nn.MoE``), as in Mesh-TensorFlow's ``moe.py``
(``transformer_moe_layer_v1``, ``_top_2_gating``) and GShard. Attention, norms, embedding,
cross-entropy and the synthetic task are the base model's.

Dims, beyond the Transformer's:

* ``experts``: the expert dim of the expert weights and of the expert-side activations. A layout
  splits it for expert parallelism (``layouts/moe_expert.toml``: ``batch:data; experts:data``).
* ``experts_unsplit``: the same experts on the token side (router logits, dispatch and combine
  tensors). Those tensors also have ``batch``, and under ``moe_expert`` a tensor cannot split both
  ``batch`` and ``experts`` over ``data`` (Mesh-TF's ``experts_dim_unsplit`` exists for the same
  reason).
* ``groups``: the expert-side copy of ``batch``. Tokens are routed in groups, one per batch row
  (Mesh-TF's ``group``), so the position-in-expert ``cumsum`` runs along ``length`` and stays
  local when ``batch`` is split.
* ``expert_capacity``: slots per expert per group, ``ceil(capacity_factor * length / experts)``
  (at most ``length``). With top-2 and ``capacity_factor=2`` this is GShard's ``2 S / E``.
* ``top``: the two choices of the router; ``sublayers``: dense layers in a block when
  ``moe_every > 1``.

Routing (per group, GShard's top-2 with Mesh-TF's ``second_policy="all"``): ``probs =
softmax(h w_gate)`` over experts; the two largest probabilities and their experts (``md.top_k``);
gates normalised to sum to 1; each choice gets a position in its expert's buffer, all first
choices before all second choices, in token order (exclusive ``md.cumsum`` along ``length``);
choices at a position ``>= expert_capacity`` are dropped (their ``one_hot`` is all zeros).
``dispatch[batch, length, experts_unsplit, expert_capacity]`` is 1 where a token sits,
``combine`` the same times its gate.

The expert computation::

    x = einsum(dispatch, h -> [experts_unsplit, batch, expert_capacity, d_model])   # local
    x = reshape(x -> [experts, groups, expert_capacity, d_model])                    # dispatch
    y = expert FFN of x (w_in [experts, d_model, d_ff], w_out [experts, d_ff, d_model])
    y = reshape(y -> [experts_unsplit, batch, expert_capacity, d_model])             # combine
    out = einsum(combine, y -> [batch, length, d_model])                             # local

Each reshape renames both dims at once, so under ``moe_expert`` the ``data`` split moves from
``batch`` to ``experts`` (and back): one ``all_to_all`` each way (two more in the backward pass).
Under a layout that does not split ``experts`` (``data_parallel``, ``dp_tp``) the expert side is
not split over ``data``: the dispatch is an ``all_gather`` and every data shard computes every
expert for every group (the combine is a local slice). Use an expert-parallel layout for MoE, or
add ``groups = "data"`` to such a layout: the reshapes then keep the split on ``batch``/``groups``
and cost nothing, and the experts run data-parallel.

Load balancing (Mesh-TF / Switch normalisation, 1 for uniform routing): per group,
``experts * sum_e f_e P_e`` with ``f_e`` the fraction of the group's tokens whose first choice is
``e`` (before capacity) and ``P_e`` the mean router probability of ``e`` (Mesh-TF's
``experts^2 * mean over groups and experts of f P``); averaged over groups and MoE layers, added to
the LM loss times ``aux_loss_weight``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from meshdsl.models import transformer

import meshdsl as md
from meshdsl.errors import ConfigError
from meshdsl.planner.flops import attention_flops


@dataclasses.dataclass(frozen=True)
class Config(transformer.Config):
    experts: int = 8
    capacity_factor: float = 2.0
    moe_every: int = 1
    aux_loss_weight: float = 0.01

    PRESETS = {
        "tiny": dict(
            batch=8, length=16, d_model=32, heads=8, d_kv=4, d_ff=64, vocab=64, layers=2, experts=8, capacity_factor=2.0
        ),
        # The Transformer's benchmark scale, every layer MoE.
        "small": {**transformer.Config.PRESETS["small"], "experts": 8, "capacity_factor": 2.0},
        # ~0.97e9 parameters: 6 MoE layers of 16 experts (805M), 6 dense layers, 67M of embeddings.
        "1b": dict(
            batch=256,
            length=2048,
            d_model=1024,
            heads=16,
            d_kv=64,
            d_ff=4096,
            vocab=32768,
            layers=12,
            experts=16,
            capacity_factor=2.0,
            moe_every=2,
        ),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts < 2:
            raise ConfigError(f"top-2 routing needs at least 2 experts, got experts={self.experts}")
        if self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor must be positive, got {self.capacity_factor}")
        if self.moe_every < 1 or self.layers % self.moe_every:
            raise ConfigError(f"layers ({self.layers}) must be a positive multiple of moe_every ({self.moe_every})")

    @property
    def expert_capacity(self) -> int:
        """Slots per expert per group (batch row): ``ceil(capacity_factor * length / experts)``, at most ``length``."""
        return max(1, min(self.length, math.ceil(self.capacity_factor * self.length / self.experts)))

    def transformer_config(self, **overrides: Any) -> transformer.Config:
        """The base Transformer's config with these fields (for the dense layers)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(transformer.Config)}
        return transformer.Config(**{**fields, **overrides})


class Model(transformer.Model):
    """The MoE Transformer for ``config``: ``init``, ``batch``, ``loss`` (LM loss + weighted load-balancing loss).

    The scanned ``layers`` dim has ``layers // moe_every`` entries (blocks); a block is
    ``moe_every - 1`` dense Transformer layers (stacked along ``sublayers``) then one MoE layer.
    """

    LAYOUTS = ("moe_expert", "data_parallel", "dp_tp", "megatron", "fsdp")

    def __init__(self, config: Config):
        if not isinstance(config, Config):
            raise TypeError(f"models.moe.Model needs a models.moe.Config, got {type(config).__name__}")
        super().__init__(config)
        c = config
        D = md.Dim
        self.layers = D("layers", c.layers // c.moe_every)
        self.sublayers = D("sublayers", c.moe_every - 1) if c.moe_every > 1 else None
        self.experts = D("experts", c.experts)
        self.experts_unsplit = D("experts_unsplit", c.experts)
        self.groups = D("groups", c.batch)
        self.capacity = D("expert_capacity", c.expert_capacity)
        self.top = D("top", 2)
        self.moe = md.nn.MoE(self.d_model, self.d_ff, self.experts, capacity_factor=c.capacity_factor)

    # ---- parameters -------------------------------------------------------------------------

    def init(self, key: jax.Array) -> dict[str, Any]:
        """The base Transformer's parameters, with each block's feed-forward replaced by the MoE's."""
        k_base, k_gate, k_in, k_out, k_dense = jax.random.split(key, 5)
        params = super().init(k_base)  # embed, unembed, final norm, attention and norms stacked along `layers`
        layer = {k: v for k, v in params["layers"].items() if k not in ("w_in", "w_out")}
        L, E = self.layers, self.experts
        layer["w_gate"] = self.moe.router.init(k_gate, [L])
        layer["w_in"] = self.moe.expert_input.init(k_in, [L, E])
        layer["w_out"] = self.moe.expert_output.init(k_out, [L, E])
        if self.sublayers is not None:
            S = self.sublayers
            dense = transformer.Model(self.config.transformer_config(layers=L.size * S.size)).init(k_dense)["layers"]
            layer["dense"] = {k: md.replace_dimensions(v, "layers", [L, S]) for k, v in dense.items()}
        return {**params, "layers": layer}

    def num_parameters(self) -> int:
        """Parameter count (from shapes only)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return sum(t.shape.size for t in jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, md.Tensor)))

    # ---- the layers -------------------------------------------------------------------------

    def route(self, probs: md.Tensor) -> tuple[md.Tensor, md.Tensor, md.Tensor]:
        """Top-2 routing with capacity, per group (batch row): ``md.nn.MoE.route``.

        ``probs``: router probabilities ``[batch, length, experts_unsplit]`` (float32). Returns
        ``dispatch`` and ``combine`` ``[batch, length, experts_unsplit, expert_capacity]`` and the
        load-balancing loss of each group ``[batch]``.
        """
        return self.moe.route(probs)

    def _moe_layer(self, x: md.Tensor, p: dict[str, md.Tensor]) -> tuple[md.Tensor, md.Tensor]:
        w = self._weights(p)
        x = self._attention(x, w)
        # The router runs in float32 from the float32 masters, as in Mesh-TF.
        y, aux = self.moe({"w_gate": p["w_gate"], "w_in": w["w_in"], "w_out": w["w_out"]}, self.norm(w["norm2"], x))
        return x + y, aux

    def _block(self, x: md.Tensor, p: dict[str, Any]) -> tuple[md.Tensor, md.Tensor]:
        """``moe_every - 1`` dense layers (the base ``_layer``), then one MoE layer."""
        if self.sublayers is not None:
            x, _ = md.scan(lambda x, q: (super(Model, self)._layer(x, q), None), x, p["dense"], self.sublayers)
        return self._moe_layer(x, p)

    # ---- the model --------------------------------------------------------------------------

    def trunk(self, params: dict[str, Any], tokens: md.Tensor) -> tuple[md.Tensor, md.Tensor]:
        """The residual stream leaving the last layer and the load-balancing loss (scalar)."""
        x, aux = md.scan(self._block, self.embed(params, tokens), params["layers"], self.layers, remat=self.remat)
        return x, md.reduce_mean(aux)

    def forward(self, params: dict[str, Any], tokens: md.Tensor) -> tuple[md.Tensor, md.Tensor]:
        """Logits ``[batch, length, vocab]`` (float32) and the load-balancing loss (scalar)."""
        x, aux = self.trunk(params, tokens)
        return self.head(params, x), aux

    def logits(self, params: dict[str, Any], tokens: md.Tensor) -> md.Tensor:
        return self.forward(params, tokens)[0]

    def losses(self, params: dict[str, Any], batch: dict[str, md.Tensor]) -> dict[str, md.Tensor]:
        """``{"lm": mean next-token cross-entropy, "aux": load-balancing loss}``."""
        x, aux = self.trunk(params, batch["inputs"])
        return {"lm": self.post(params, x, batch), "aux": aux}

    def loss(self, params: dict[str, Any], batch: dict[str, md.Tensor]) -> md.Tensor:
        """LM loss + ``aux_loss_weight`` x load-balancing loss."""
        parts = self.losses(params, batch)
        return parts["lm"] + self.config.aux_loss_weight * parts["aux"]

    def flops_per_step(self) -> float:
        """Model FLOPs of a training step (3 x forward).

        6 x tokens x (attention, router, dense feed-forward and embedding parameters), plus the
        experts' 6 x 2 d_model d_ff for every slot they compute (``experts x batch x
        expert_capacity`` per MoE layer, used or not, not the tokens routed), plus attention
        causal attention (6 x L x B x T^2 x H x d_kv, half of full attention's:
        :func:`meshdsl.planner.flops.attention_flops`). The dispatch and combine einsums are not counted.
        """
        c = self.config
        moe_layers = c.layers // c.moe_every
        per_token = (
            c.layers * 4 * c.d_model * c.heads * c.d_kv
            + (c.layers - moe_layers) * 2 * c.d_model * c.d_ff
            + moe_layers * c.d_model * c.experts
            + c.d_model * c.vocab
        )
        slots = moe_layers * c.experts * c.batch * c.expert_capacity
        tokens = c.batch * c.length
        return (
            6 * per_token * tokens
            + 6 * 2 * c.d_model * c.d_ff * slots
            + c.layers * attention_flops(c.batch, c.heads, c.length, c.length, c.d_kv, causal=True)
        )
