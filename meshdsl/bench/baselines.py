"""Hand-written plain-JAX versions of the MLP and the Transformer: the ``--baseline jax`` of the benchmark.

The same model, data and optimizer as the meshdsl step, written as an expert would without
meshdsl: global arrays, ``jnp.einsum``, ``jax.jit`` with ``NamedSharding`` for every parameter
and batch array (from the same layout), and a sharding constraint on the residual stream; XLA's
partitioner chooses the collectives. The benchmark reports meshdsl's step time over this one's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import meshdsl as md
from meshdsl.model_loader import shipped_name


def _sharding(mesh: md.Mesh, layout: md.Layout, names: str) -> NamedSharding:
    """The sharding the layout's rules give an array whose axes are called ``names``."""
    entries = [layout.axes_of(n) for n in names.split()]
    return NamedSharding(mesh.jax_mesh, PartitionSpec(*[None if not a else a[0] if len(a) == 1 else a for a in entries]))


def _optimizer(name: str) -> optax.GradientTransformation:
    if name == "adamw":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4))
    if name == "sgd":
        return optax.sgd(0.1)
    return optax.adafactor()


def _mlp_loss(p: dict, key: jax.Array, config: Any, mesh: md.Mesh, layout: md.Layout) -> jax.Array:
    x = jax.lax.with_sharding_constraint(jax.random.normal(key, (config.batch, config.d_io)), _sharding(mesh, layout, "batch d_io"))
    rotated = jnp.roll(x, 1, axis=1)
    y = jnp.einsum("bf,fi->bi", jax.nn.relu(jnp.einsum("bi,if->bf", x, p["w1"])), p["w2"])
    return jnp.mean(jnp.square(y - (rotated - 2 * jax.nn.relu(rotated))))


def _transformer_loss(p: dict, key: jax.Array, config: Any, mesh: md.Mesh, layout: md.Layout) -> jax.Array:
    c = config
    start = (jax.random.bits(key, (c.batch,)) % c.vocab).astype(jnp.int32)
    powers = jnp.asarray([pow(5, k, c.vocab) for k in range(c.length + 1)], jnp.int32)
    offsets = jnp.asarray([3 * sum(pow(5, j, c.vocab) for j in range(k)) % c.vocab for k in range(c.length + 1)], jnp.int32)
    tokens = (start[:, None] * powers[None, :] + offsets[None, :]) % c.vocab
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    residual = _sharding(mesh, layout, "batch length d_model")

    def norm(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * scale

    def layer(x, w):
        h = norm(x, w["norm1"])
        q, k, v = jnp.einsum("bld,dshk->sbhlk", h, w["wqkv"])
        scores = jnp.einsum("bhlk,bhmk->bhlm", q * c.d_kv**-0.5, k)
        causal = jnp.arange(c.length)[:, None] >= jnp.arange(c.length)[None, :]
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + jnp.einsum("bhlk,hkd->bld", jnp.einsum("bhlm,bhmk->bhlk", probs, v), w["wo"])
        hidden = jax.nn.gelu(jnp.einsum("bld,df->blf", norm(x, w["norm2"]), w["w_in"]))
        x = x + jnp.einsum("blf,fd->bld", hidden, w["w_out"])
        return jax.lax.with_sharding_constraint(x, residual), None

    x = jax.lax.with_sharding_constraint(p["embed"][inputs], residual)
    x, _ = jax.lax.scan(layer, x, p["layers"])
    logits = jnp.einsum("bld,dv->blv", norm(x, p["final_norm"]), p["unembed"])
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


_LOSSES = {"mlp": _mlp_loss, "transformer": _transformer_loss}


def _like_params(state: Any, params: dict, shardings: dict, other: NamedSharding) -> Any:
    """Shardings for optimizer ``state``: a leaf that mirrors a parameter (its path ends with the
    parameter's, same shape: Adam's moments) is split as that parameter is, as meshdsl stores it;
    the rest (step counts) get ``other``. ``tx.init``'s zeros carry no sharding of their own."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    mirrors = [(jax.tree_util.keystr(p), x.shape, s) for (p, x), s in zip(flat, jax.tree_util.tree_leaves(shardings))]

    def pick(path: Any, leaf: Any) -> NamedSharding:
        key = jax.tree_util.keystr(path)
        return next((s for name, shape, s in mirrors if key.endswith(name) and leaf.shape == shape), other)

    return jax.tree_util.tree_map_with_path(pick, state)


def make_step(model: Any, layout: md.Layout, mesh: md.Mesh, state: dict, data: jax.Array, optimizer: str) -> Callable[[], None] | None:
    """A timed step of the plain-JAX version of ``model`` (None if there is none), starting from ``state``'s parameters."""
    kind = shipped_name(model)
    if kind not in _LOSSES:
        return None
    loss_fn, config = _LOSSES[kind], model.config
    stored = layout.param_layout
    is_tensor = lambda x: isinstance(x, md.Tensor)  # noqa: E731
    params = jax.tree_util.tree_map(lambda t: t.array, state["params"], is_leaf=is_tensor)
    shardings = jax.tree_util.tree_map(
        lambda t: _sharding(mesh, stored, " ".join(t.shape.names)), state["params"], is_leaf=is_tensor
    )
    params = jax.tree_util.tree_map(jnp.copy, jax.device_put(params, shardings))  # its own buffers: both steps donate
    tx = _optimizer(optimizer)
    scalar = NamedSharding(mesh.jax_mesh, PartitionSpec())
    opt_shardings = _like_params(jax.eval_shape(tx.init, params), params, shardings, scalar)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

    def step(params, opt_state, count):
        key = jax.random.wrap_key_data(data)
        loss, grads = jax.value_and_grad(loss_fn)(params, jax.random.fold_in(key, count), config, mesh, layout)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, count + 1, loss

    # Every argument's sharding is fixed, so the first call compiles the program the timed calls run.
    state_shardings = (shardings, opt_shardings, scalar)
    compiled = jax.jit(step, in_shardings=state_shardings, out_shardings=(*state_shardings, scalar), donate_argnums=(0, 1, 2))
    holder = {"state": (params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), scalar))}

    def run() -> None:
        p, o, n = holder["state"]
        p, o, n, loss = compiled(p, o, n)
        holder["state"] = (p, o, n)
        jax.block_until_ready(loss)

    return run
