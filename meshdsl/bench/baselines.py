"""Hand-written plain-JAX versions of the MLP and the Transformer: the ``--baseline jax`` of the benchmark.

The same program as the meshdsl step, written as an expert would without meshdsl: global arrays,
``jnp.einsum``, ``jax.nn.dot_product_attention`` (with the kernel meshdsl's attention chooses),
``jax.jit`` with ``NamedSharding`` for every
parameter, optimizer state and batch array (from the same layout), and a sharding constraint on
the residual stream; XLA's partitioner chooses the collectives. The same program means the same
data and initial state, the model's ``compute_dtype`` casts (f32 master weights cast where they
are used, logits back to f32), its ``remat`` (``jax.checkpoint`` of the layer), gradients summed
in ``grad_reduce_dtype`` (data parallelism written out: :func:`_shard_grads`), and meshdsl's own
optimizer (:mod:`meshdsl.train.optim`) run on the global arrays, where its md ops are the jnp calls
they wrap: clipping, decay and Adafactor's factoring are meshdsl's by construction, not by copy.

:func:`baseline` runs both steps three steps from the same state, on copies, before anything is
timed, and times the plain-JAX one only when its losses equal meshdsl's. Where no faithful
plain-JAX version exists, none is timed and a one-line note says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import meshdsl as md
from meshdsl import compression, relayout
from meshdsl.measure import fits
from meshdsl.measure.timing import CompiledStep, losses_from, memory_bytes
from meshdsl.model import protocol as model_protocol
from meshdsl.model.loader import shipped_name
from meshdsl.model.protocol import Model
from meshdsl.models.transformer import task_terms
from meshdsl.nn.attention_impl import implementation_here
from meshdsl.ops.scan import REMAT_POLICIES
from meshdsl.runtime.compiler_options import compiler_options
from meshdsl.tensor import is_tensor
from meshdsl.train.optim import Optimizer
from meshdsl.train.rules import model_dims
from meshdsl.train.step import Trainer

CHECKED_STEPS = 3
"""Steps whose losses must agree before the baseline is timed."""
RTOL = {"float32": 1e-5, "bfloat16": 1e-3}
"""Relative tolerance of that agreement, by the step's compute dtype. The check tells a faithful
baseline from another computation (a loss twice as large, another norm); two faithful programs
still round differently where XLA fuses or orders their element-wise work differently, which in
bfloat16 (8 bits of mantissa: a relative step of 2**-8) shows in the loss: 1.5e-4 relative, measured
with bf16 compute, remat and LayerNorm on JAX 0.12 (0 on JAX 0.10)."""

Constrain = Callable[[jax.Array, str], jax.Array]
"""``constrain(x, "batch length d_model")``: ``x`` with the sharding the layout gives those dims."""


def _sharding(mesh: md.Mesh, layout: md.Layout, names: str) -> NamedSharding:
    """The sharding the layout's rules give an array whose axes are called ``names``."""
    return NamedSharding(mesh.jax_mesh, layout.spec_of(names.split()))


def _mlp_batch(key: jax.Array, c: Any) -> dict[str, jax.Array]:
    x = jax.random.normal(key, (c.batch, c.d_io))
    rotated = jnp.roll(x, 1, axis=1)
    return {"x": x, "y": rotated - 2 * jax.nn.relu(rotated)}


def _mlp_loss(p: dict, batch: dict[str, jax.Array], c: Any, constrain: Constrain) -> jax.Array:
    x = constrain(batch["x"], "batch d_io")
    y = jnp.einsum("bf,fi->bi", jax.nn.relu(jnp.einsum("bi,if->bf", x, p["w1"])), p["w2"])
    return jnp.mean(jnp.square(y - batch["y"]))


def _transformer_batch(key: jax.Array, c: Any) -> dict[str, jax.Array]:
    start = (jax.random.bits(key, (c.batch,)) % c.vocab).astype(jnp.int32)
    powers, offsets = (jnp.asarray(t, jnp.int32) for t in task_terms(c.vocab, c.length + 1))
    tokens = (start[:, None] * powers[None, :] + offsets[None, :]) % c.vocab
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _norm(kind: str, x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm or bias-free LayerNorm over the last axis, in ``x``'s dtype as md.nn computes them
    (a mean is a sum over the count: ``jnp.mean`` would divide in float32 for a bf16 ``x``)."""

    def mean(a: jax.Array) -> jax.Array:
        return jnp.sum(a, axis=-1, keepdims=True) / a.shape[-1]

    if kind == "layer":
        x = x - mean(x)
    return x * jax.lax.rsqrt(mean(jnp.square(x)) + 1e-6) * scale


def _transformer_head(p: dict, c: Any) -> dict:
    """``p`` with the head's weights in the compute dtype: the model casts them once, before use,
    and the layers' weights inside each layer."""
    dtype = jnp.dtype(c.compute_dtype)
    return {**p, "final_norm": p["final_norm"].astype(dtype), "unembed": p["unembed"].astype(dtype)}


def _transformer_loss(p: dict, batch: dict[str, jax.Array], c: Any, constrain: Constrain) -> jax.Array:
    dtype = jnp.dtype(c.compute_dtype)

    def layer(x: jax.Array, w: dict) -> tuple[jax.Array, None]:
        w = {k: v.astype(dtype) for k, v in w.items()}
        q, k, v = jnp.einsum("bld,dshk->sblhk", _norm(c.norm, x, w["norm1"]), w["wqkv"])
        kernel = implementation_here(dtype, c.d_kv, "causal")  # the kernel meshdsl's attention chooses
        attended = jax.nn.dot_product_attention(q, k, v, scale=c.d_kv**-0.5, is_causal=True, implementation=kernel)
        x = x + jnp.einsum("blhk,hkd->bld", attended, w["wo"])
        hidden = jax.nn.gelu(jnp.einsum("bld,df->blf", _norm(c.norm, x, w["norm2"]), w["w_in"]))
        return constrain(x + jnp.einsum("blf,fd->bld", hidden, w["w_out"]), "batch length d_model"), None

    x = constrain(p["embed"][batch["inputs"]].astype(dtype), "batch length d_model")
    policy = REMAT_POLICIES[getattr(c, "remat_policy", "full")]
    x, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy) if c.remat else layer, x, p["layers"])
    logits = jnp.einsum("bld,dv->blv", _norm(c.norm, x, p["final_norm"]), p["unembed"]).astype(jnp.float32)
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


def _uncast(p: dict, c: Any) -> dict:
    """The MLP computes in float32: no weight is cast."""
    return p


_MODELS = {
    "mlp": (_mlp_batch, _uncast, _mlp_loss),
    "transformer": (_transformer_batch, _transformer_head, _transformer_loss),
}
"""Per model: its batch from a key, the casts of weights made once before use, and the loss of the cast weights."""


def unfaithful(trainer: Trainer) -> str | None:
    """Why no plain-JAX version here would run meshdsl's step (None: one does).

    A model of the user's has none; a pipelined step's schedule has none; gradients summed in a
    narrower dtype are reproduced only where every cross-device gradient sum is a parameter's over
    the batch (the compute rules split ``batch`` alone): under tensor parallelism meshdsl also sums
    activation gradients in that dtype, inside collectives XLA's partitioner picks in plain JAX.
    """
    kind = shipped_name(trainer.model)
    if kind not in _MODELS:
        return "no hand-written plain-JAX version of this model (only the shipped mlp and transformer have one)"
    if trainer.pipelined:
        p = trainer.pipeline
        assert p is not None  # the trainer set it (to the layout's when not given)
        return f"pipelined ({p.schedule}, {p.microbatches} microbatches): plain JAX has no version of the schedule"
    if compression.scaled(trainer.grad_reduce_dtype):
        return f"gradients summed in {trainer.grad_reduce_dtype} with a per-tensor scale: plain JAX has no such sum"
    model = cast(Model, trainer.model)  # a shipped model (checked above): the whole protocol
    split = sorted(d for d in model_dims(model) - {"batch"} if trainer.layout.axes_of(d))
    if split and relayout.narrower(jnp.float32, trainer.grad_reduce_dtype):
        return (
            f"gradients summed in {trainer.grad_reduce_dtype} with {', '.join(split)} split: meshdsl sums activation "
            "gradients in it too, in collectives XLA chooses in plain JAX"
        )
    return None


def _shard_grads(
    loss: Callable, params: dict, batch: dict, axes: tuple[str, ...], n: int, grad_dtype: Any
) -> tuple[jax.Array, dict]:
    """Loss and gradients with the ``n`` batch shards' gradients summed across them as meshdsl sums
    them: each in ``grad_dtype`` where narrower than its own dtype, else in its own. The shards are
    a leading axis split over the batch's mesh ``axes`` (``vmap``'s ``spmd_axis_name``), each
    shard's loss a ``1/n`` part of the mean, the sum a reduction over that axis."""
    shards = jax.tree_util.tree_map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), batch)
    part = jax.value_and_grad(lambda p, b: loss(p, b) / n)
    losses, grads = jax.vmap(part, in_axes=(None, 0), spmd_axis_name=axes)(params, shards)

    def total(g: jax.Array) -> jax.Array:
        dtype = jnp.dtype(grad_dtype) if relayout.narrower(g.dtype, grad_dtype) else g.dtype
        return jax.lax.reduce(g.astype(dtype), jnp.zeros((), dtype), jax.lax.add, (0,)).astype(g.dtype)

    return jnp.sum(losses), jax.tree_util.tree_map(total, grads)


def _loss_and_grads(
    kind: str, config: Any, mesh: md.Mesh, layout: md.Layout, grad_dtype: Any
) -> Callable[[dict, dict], tuple[jax.Array, dict]]:
    """``(params, batch) -> (loss, grads)`` of the model ``kind``.

    ``jax.value_and_grad``, where XLA's partitioner sums gradients over the batch's devices as
    meshdsl does. It does not where meshdsl sums in a narrower ``grad_dtype``, nor with a narrower
    ``compute_dtype``: meshdsl sums the float32 gradient of each layer's weights (cast inside the
    layer) and the bf16 one of the head's (cast before use), XLA each where its matmul leaves it,
    in bf16. There the sum over batch shards is written out (:func:`_shard_grads`), of the
    gradients of the weights as cast before use, whose cast then takes them back to float32."""
    _, head, loss_fn = _MODELS[kind]
    axes = layout.axes_of("batch")

    def loss(rules: md.Layout) -> Callable[[dict, dict], jax.Array]:
        return lambda p, b: loss_fn(
            p, b, config, lambda x, names: jax.lax.with_sharding_constraint(x, _sharding(mesh, rules, names))
        )

    narrow = relayout.narrower(jnp.float32, grad_dtype) or relayout.narrower(
        jnp.float32, getattr(config, "compute_dtype", "float32")
    )
    if not axes or not narrow:
        return jax.value_and_grad(lambda p, b: loss(layout)(head(p, config), b))
    within = md.Layout({d: a for d, a in layout.rules.items() if d != "batch"})  # inside a shard: its rows whole
    n = relayout.group_size(axes, mesh.axis_sizes)

    def loss_and_grads(p: dict, b: dict) -> tuple[jax.Array, dict]:
        cast, back = jax.vjp(lambda p: head(p, config), p)
        value, grads = _shard_grads(loss(within), cast, b, axes, n, grad_dtype)
        return value, back(grads)[0]

    return loss_and_grads


def _whole(tree: Any) -> Any:
    """``tree`` with every md tensor rebuilt as a global one (no layout, no pending sums): one pytree
    structure for the state in and out of the step, whatever the optimizer's ops record."""
    return jax.tree_util.tree_map(lambda t: md.Tensor(t.array, t.shape) if is_tensor(t) else t, tree, is_leaf=is_tensor)


def _state_shardings(tree: Any, mesh: md.Mesh, stored: md.Layout) -> Any:
    """Shardings of the parameters and optimizer state: each md tensor split by its dims under the
    stored rules, as meshdsl stores it (a prefix of the pytree); the rest (step counts) replicated."""
    scalar = NamedSharding(mesh.jax_mesh, PartitionSpec())
    return jax.tree_util.tree_map(
        lambda t: _sharding(mesh, stored, " ".join(t.names)) if is_tensor(t) else scalar, tree, is_leaf=is_tensor
    )


@dataclasses.dataclass
class PlainStep:
    """The plain-JAX step compiled for fixed shardings, with its state ``(params, opt, count)``; call it to run one
    step."""

    compiled: Any
    state: Any

    def __call__(self) -> None:
        self.state, loss = self.compiled(self.state)
        jax.block_until_ready(loss)

    def losses(self, steps: int) -> list[float]:
        """The first ``steps`` losses from the current state, run on a copy of it."""
        return losses_from(self.state, self.compiled, steps)


def make_step(
    model: Model,
    layout: md.Layout,
    mesh: md.Mesh,
    state: dict,
    data: jax.Array,
    optimizer: Optimizer,
    grad_reduce_dtype: Any = None,
) -> PlainStep | None:
    """The plain-JAX step of ``model`` (None for a model without one), starting from ``state``'s
    parameters with ``optimizer`` freshly initialised, its batches drawn from the key ``data``."""
    kind = shipped_name(model)
    if kind not in _MODELS:
        return None

    def init(params: Any) -> tuple:
        return params, _whole(optimizer.init(params)), jnp.zeros((), jnp.int32)

    params = _whole(state["params"])
    shardings = _state_shardings(jax.eval_shape(init, params), mesh, layout.param_layout)
    options = compiler_options(mesh.devices.flat[0].platform)  # meshdsl's: the two steps compile alike
    start = jax.jit(init, out_shardings=shardings, compiler_options=options)(params)  # its own buffers (both donate)
    make_batch, config = _MODELS[kind][0], model.config
    loss_and_grads = _loss_and_grads(kind, config, mesh, layout, grad_reduce_dtype)

    def step(s: tuple) -> tuple[tuple, jax.Array]:
        params, opt, count = s
        batch = make_batch(jax.random.fold_in(jax.random.wrap_key_data(data), count), config)
        arrays = jax.tree_util.tree_map(lambda t: t.array, params, is_leaf=is_tensor)
        loss, grads = loss_and_grads(arrays, batch)
        grads = jax.tree_util.tree_map(lambda t, g: md.Tensor(g, t.shape), params, grads, is_leaf=is_tensor)
        params, opt = optimizer.update(grads, opt, params, count)
        return (_whole(params), _whole(opt), count + 1), loss

    scalar = NamedSharding(mesh.jax_mesh, PartitionSpec())
    compiled = (
        jax.jit(
            step,
            in_shardings=(shardings,),
            out_shardings=(shardings, scalar),
            donate_argnums=0,
            compiler_options=options,
        )
        .lower(start)
        .compile()
    )
    fits.check("the plain-JAX step", memory_bytes(compiled))
    return PlainStep(compiled, start)


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The plain-JAX baseline of one entry: the step to time (None: not timed), whether its first
    losses equal meshdsl's (None: none was run), and why it is not timed."""

    step: PlainStep | None
    losses_match: bool | None
    note: str | None


def _agree(ours: list[float], theirs: list[float], compute_dtype: str) -> bool:
    rtol = RTOL.get(compute_dtype, RTOL["float32"])
    return all(abs(a - b) <= rtol * abs(a) for a, b in zip(ours, theirs, strict=True))


def _listed(losses: list[float]) -> str:
    return "[" + ", ".join(f"{x:.6g}" for x in losses) + "]"


def baseline(step: CompiledStep) -> Baseline:
    """The baseline of meshdsl's ``step`` (not yet run: its state is the initial one), checked
    against it over :data:`CHECKED_STEPS` steps on copies of both states."""
    t = step.trainer
    why = unfaithful(t)
    if why is not None:
        return Baseline(None, None, why)
    try:
        plain = make_step(
            cast(Model, t.model), t.layout, t.mesh, step.state, step.data, t.optimizer, t.grad_reduce_dtype
        )
        assert plain is not None  # unfaithful() ruled out the models without a plain-JAX step
        ours, theirs = step.losses(CHECKED_STEPS), plain.losses(CHECKED_STEPS)
    except fits.DoesNotFit as e:
        return Baseline(None, None, f"not timed: {e}")
    except Exception as e:  # XLA's runtime error class; only running out of memory is a note
        if not fits.is_out_of_memory(e):
            raise
        return Baseline(None, None, f"not timed: {fits.run_time_message('checking the plain-JAX step', e)}")
    if not _agree(ours, theirs, model_protocol.compute_dtype(t.model)):
        return Baseline(None, False, f"losses differ, not timed: meshdsl {_listed(ours)}, plain JAX {_listed(theirs)}")
    return Baseline(plain, True, None)
