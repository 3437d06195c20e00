"""The jaxpr walker reads each primitive's params on the JAX at hand (0.10 to 0.12): one test per
primitive, checked against the program it was traced from; and a layout it does not know is an
``md.UnsupportedJaxError`` naming the primitive and the JAX version, never a ``KeyError``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import PartitionSpec as P

import meshdsl as md
from meshdsl.analysis import jaxpr_walk
from meshdsl.planner.memory import carried
from meshdsl.planner.program import block


def _eqn(jaxpr, name):
    found = [e for e, _ in jaxpr_walk.walk(jaxpr) if e.primitive.name == name]
    assert found, f"no {name} equation"
    return found[0]


def _names(jaxpr) -> list[str]:
    return [e.primitive.name for e, _ in jaxpr_walk.walk(jaxpr)]


def _same_value(f, *args) -> None:
    """The walker's rewrite of ``f`` 's program computes what ``f`` does."""
    closed = jax.make_jaxpr(f)(*args)
    rewritten = closed.replace(jaxpr=jaxpr_walk.as_compiled(closed.jaxpr))
    np.testing.assert_allclose(jaxpr_as_fun(rewritten)(*args)[0], f(*args), rtol=1e-6)


def test_scan_constants_and_carries() -> None:
    k = jnp.arange(3.0)

    def f(a, b, xs):
        def step(c, x):
            return (c[0] * k + x, c[1] + c[0].sum()), c[1]

        return lax.scan(step, (a, b), xs)

    closed = jax.make_jaxpr(f)(jnp.ones(3), 2.0, jnp.ones((5, 3)))
    scan = _eqn(closed.jaxpr, "scan")
    consts, carries = jaxpr_walk.scan_counts(scan.params)
    assert carries == 2 and consts + carries + 1 == len(scan.invars)
    a, b, xs = closed.jaxpr.invars
    assert [scan.invars[i] for i in jaxpr_walk.loop_carries("scan", scan.params, len(scan.invars))] == [a, b]
    assert scan.invars[-1] is xs and jaxpr_walk.trip_count(scan) == 5
    step = next(s for s in block(closed.jaxpr).steps if s.name == "scan")
    assert [init for _, init in carried(step)] == step.ins[consts : consts + 2]


def test_one_trip_scan_is_inlined() -> None:
    def f(c, xs):
        return lax.scan(lambda c, x: (c * x + 1.0, c), c, xs)[0]

    args = (jnp.ones(3), jnp.full((1, 3), 2.0))
    assert "scan" not in _names(jaxpr_walk.as_compiled(jax.make_jaxpr(f)(*args).jaxpr))
    _same_value(f, *args)


def test_while_constants_and_carries() -> None:
    def f(limit, step, x):
        return lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + step, c[1] * 2.0), (0.0, x))

    closed = jax.make_jaxpr(f)(3.0, 1.0, jnp.ones(2))
    loop = _eqn(closed.jaxpr, "while")
    assert jaxpr_walk.while_counts(loop.params) == (1, 1)
    carries = [loop.invars[i] for i in jaxpr_walk.loop_carries("while", loop.params, len(loop.invars))]
    assert carries[1] is closed.jaxpr.invars[2] and jaxpr_walk.trip_count(loop) is None


def test_cond_branches() -> None:
    def f(p, x):
        return lax.cond(p, lambda x: jnp.sin(x), lambda x: jnp.cos(x), x)

    cond = _eqn(jax.make_jaxpr(f)(True, 1.0).jaxpr, "cond")
    branches = jaxpr_walk.cond_branches(cond.params)
    assert sorted(e.primitive.name for b in branches for e in b.jaxpr.eqns) == ["cos", "sin"]
    assert jaxpr_walk.trip_count(cond) == 1


def test_jit_is_inlined() -> None:
    f = jax.jit(lambda x: jnp.sin(x) * 2.0)
    closed = jax.make_jaxpr(lambda x: f(x) + 1.0)(jnp.ones(3))
    call = next(e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit"))
    assert [e.primitive.name for e in jaxpr_walk.called(call.primitive.name, call.params).eqns] == ["sin", "mul"]
    assert not {"jit", "pjit"} & set(_names(jaxpr_walk.as_compiled(closed.jaxpr)))
    _same_value(lambda x: f(x) + 1.0, jnp.ones(3))


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_checkpoint_barrier(prevent_cse) -> None:
    f = jax.grad(lambda x: jax.checkpoint(lambda x: jnp.sin(x) * x, prevent_cse=prevent_cse)(x).sum())
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    remat = next(e for e, _ in jaxpr_walk.walk(closed.jaxpr) if e.primitive.name in jaxpr_walk._REMATS)
    assert bool(jaxpr_walk.remat_barrier(remat.params, len(remat.invars))) == prevent_cse
    inlined = _names(jaxpr_walk._rewritten(closed.jaxpr, jaxpr_walk._inline_eqns, {}))  # before the barriers expand
    assert inlined.count("optimization_barrier") == int(prevent_cse) and not set(jaxpr_walk._REMATS) & set(inlined)
    x = jnp.linspace(0.1, 1.0, 3)
    rewritten = closed.replace(jaxpr=jaxpr_walk.as_compiled(closed.jaxpr))
    np.testing.assert_allclose(jaxpr_as_fun(rewritten)(x)[0], jnp.cos(x) * x + jnp.sin(x), rtol=1e-6)


def test_custom_jvp_is_inlined() -> None:
    closed = jax.make_jaxpr(jax.nn.relu)(jnp.ones(3))
    call = _eqn(closed.jaxpr, "custom_jvp_call")
    assert "max" in [
        e.primitive.name for e, _ in jaxpr_walk.walk(jaxpr_walk.called("custom_jvp_call", call.params).jaxpr)
    ]
    assert "custom_jvp_call" not in _names(jaxpr_walk.as_compiled(closed.jaxpr))
    _same_value(jax.nn.relu, jnp.array([-1.0, 0.5, 2.0]))


def test_custom_vjp_is_inlined() -> None:
    @jax.custom_vjp
    def double(x):
        return x * 2.0

    double.defvjp(lambda x: (x * 2.0, None), lambda _, ct: (ct * 2.0,))
    closed = jax.make_jaxpr(double)(jnp.ones(3))
    call = next(e for e in closed.jaxpr.eqns if e.primitive.name.startswith("custom_vjp_call"))
    assert [e.primitive.name for e in jaxpr_walk.called(call.primitive.name, call.params).eqns] == ["mul"]
    assert not any(n.startswith("custom_vjp_call") for n in _names(jaxpr_walk.as_compiled(closed.jaxpr)))
    _same_value(double, jnp.array([1.0, -3.0, 0.5]))


def test_shard_map_specs_and_markers() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    f = jax.shard_map(lambda x: lax.psum(x, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a"))
    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)))
    sm = _eqn(closed.jaxpr, "shard_map")
    got_mesh, in_specs, out_specs = jaxpr_walk.shard_map_specs(sm.params)
    assert (
        dict(got_mesh.shape) == {"a": 2, "b": 2} and tuple(in_specs) == (P("a", "b"),) and tuple(out_specs) == (P("a"),)
    )
    psum = [e.primitive.name for e in jaxpr_walk.called("shard_map", sm.params).eqns]
    assert len(psum) == 1 and psum[0].startswith("psum")
    rewritten = jaxpr_walk.as_compiled(closed.jaxpr)
    names = [e.primitive.name for e in rewritten.eqns]
    assert names == ["enter_shard_map", psum[0], "leave_shard_map"]
    assert [e.params["spec"] for e in rewritten.eqns if e.primitive.name.endswith("shard_map")] == [P("a", "b"), P("a")]


@pytest.mark.parametrize(
    "name, dropped",
    [
        ("scan", ("num_consts", "num_carry", "ft_in")),
        ("while", ("body_nconsts",)),
        ("cond", ("branches",)),
        ("shard_map", ("in_specs",)),
    ],
)
def test_unknown_params_are_a_clear_error(name, dropped) -> None:
    params = {
        "length": 3,
        "num_consts": 0,
        "num_carry": 1,
        "ft_in": None,
        "cond_nconsts": 0,
        "body_nconsts": 0,
        "branches": (),
        "mesh": None,
        "in_specs": (),
        "out_specs": (),
    }
    params = {k: v for k, v in params.items() if k not in dropped}
    read = {
        "scan": jaxpr_walk.scan_counts,
        "while": jaxpr_walk.while_counts,
        "cond": jaxpr_walk.cond_branches,
        "shard_map": jaxpr_walk.shard_map_specs,
    }[name]
    with pytest.raises(
        md.UnsupportedJaxError, match=rf"'{name}' equation on JAX {jax.__version__}.*meshdsl reads JAX 0.10 to 0.12"
    ):
        read(params)


def test_reading_the_carries_of_an_unknown_scan_is_a_clear_error() -> None:
    """The planner's memory walk asks the walker for a loop's carries: a scan whose counts it cannot
    find is the clear error, not a ``KeyError``."""
    closed = jax.make_jaxpr(lambda c, xs: lax.scan(lambda c, x: (c * x, c), c, xs)[0])(1.0, jnp.ones(4))
    step = next(s for s in block(closed.jaxpr).steps if s.name == "scan")
    step = dataclasses.replace(step, params={"length": 4, "jaxpr": step.params["jaxpr"]})
    with pytest.raises(md.UnsupportedJaxError, match=rf"'scan' equation on JAX {jax.__version__}: no count"):
        carried(step)


def test_report_of_an_optax_step_around_a_compiled_function_with_a_number() -> None:
    """A Python number passed to an ``md.compile`` 'd function enters its ``shard_map`` as a literal,
    unhashable on JAX 0.12: the walker read it as a variable (``TypeError: unhashable type: 'Literal'``,
    issue 24). The report of the whole optax step equals the compiled program's collectives."""
    import optax

    from meshdsl.analysis import hlo
    from meshdsl.explain import report_of_jaxpr

    mesh = md.Mesh({"data": 4, "model": 2})
    batch, d, f = md.Dim("batch", 8), md.Dim("d", 4), md.Dim("f", 6)
    loss = md.compile(
        lambda w, x, k: md.reduce_mean(md.square(md.einsum(x, w, out=[batch, f]) * k)).array,
        mesh,
        "batch:data; f:model",
    )
    rng = np.random.default_rng(0)
    w = md.tensor(rng.standard_normal((4, 6)).astype(np.float32), [d, f])
    x = md.tensor(rng.standard_normal((8, 4)).astype(np.float32), [batch, d])
    opt = optax.adam(1e-3)

    def train_step(w, state, x):
        value, grads = jax.value_and_grad(loss)(w, x, 2.0)
        updates, state = opt.update(grads, state, w)
        return optax.apply_updates(w, updates), state, value

    traced = jax.make_jaxpr(train_step)(w, opt.init(w), x)
    compiled = jax.jit(train_step).lower(w, opt.init(w), x).compile().as_text()
    assert report_of_jaxpr(traced.jaxpr, mesh.axis_sizes, True).summary() == hlo.summary(compiled)


_LOOP_COLLECTIVES = {
    "psum": lambda w: lax.psum(w, "x"),
    "pmax": lambda w: lax.pmax(w, "x"),
    "all_gather": lambda w: lax.all_gather(w, "x", tiled=True)[: w.shape[0]],
    "psum_scatter": lambda w: jnp.tile(lax.psum_scatter(w, "x", tiled=True), 8),
    "all_to_all": lambda w: lax.all_to_all(w, "x", 0, 0, tiled=True),
    "ppermute": lambda w: lax.ppermute(w, "x", [(i, (i + 1) % 8) for i in range(8)]),
}


@pytest.mark.parametrize("kind", sorted(_LOOP_COLLECTIVES))
def test_a_collective_of_loop_constants_runs_once_as_xla_hoists_it(kind) -> None:
    """A scan body's collective of a constant the body closes over runs once (XLA's loop-invariant
    code motion moves it before the loop); the same collective of the carry runs once per step.
    The walker's counts are checked against the compiled HLO's."""
    from meshdsl.analysis import hlo
    from meshdsl.explain import report_of_jaxpr

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    collective = _LOOP_COLLECTIVES[kind]

    def program(of_carry: bool):
        def f(xs, w):
            def step(c, x):
                return c + x * collective(w + c if of_carry else w), None

            return lax.scan(step, jnp.zeros_like(w), xs)[0]

        return jax.shard_map(f, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"), check_vma=False)

    xs, w = jnp.ones((5, 64)), jnp.arange(64.0)
    for of_carry, steps in [(False, 1), (True, 5)]:
        f = program(of_carry)
        compiled = hlo.summary(jax.jit(f).lower(xs, w).compile().as_text())
        walked = report_of_jaxpr(jax.make_jaxpr(f)(xs, w).jaxpr, {"x": 8}, cpu=True).summary()
        assert walked == compiled and next(iter(walked.values()))["count"] == steps, (kind, of_carry, walked)
