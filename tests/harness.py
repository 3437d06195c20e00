"""The checks every op test runs: ``check(fn, args, reference, mesh, layout)``.

For a meshdsl function ``fn`` of md tensors, its reference (see :mod:`reference`), a mesh and a
layout, :func:`check` proves:

1. *Forward*: ``md.compile(fn, mesh, layout, backend=b)(*args)`` for b in spmd and gspmd equals
   the numpy reference run in float64: same dim names in the same order, same dtype kind, and
   ``max|out - ref| <= tol * max(1, max|ref|)`` per result (booleans and ints: exactly equal).
   Each result is sharded as the layout says.
2. *Gradient*: with ``loss = sum over float results of sum(out * cotangent)`` (fixed random
   cotangents), ``jax.grad`` taken inside the compiled function, for both backends, equals
   ``jax.grad`` of the same loss built from the reference in jax.numpy on one device in float64,
   for every float input; each gradient is sharded like its input. (A float32 reference would
   add its own rounding to meshdsl's: a saturated sigmoid's derivative, 1 - s with s near 1,
   differs by 1e-5 between two equally valid float32 formulas.) With ``around=True``, also
   ``jax.grad`` taken *around* the compiled function (a plain jitted function that calls it and
   sums its results times the same cotangents), for every backend, equals the same reference.
3. *Communication*: ``md.explain(...).summary()`` equals :func:`meshdsl.analysis.hlo.summary` of the
   compiled spmd program (counts and bytes exactly).

The forward results and the inside gradient come from one program per backend (the gradient
function returns the results beside the gradients, as a training step returns its loss), so
explain is compared with the program that computes both; the around gradients of every backend
come from one jitted program; the reference gradient from one more. XLA compiles these with
:data:`FAST_COMPILE` (CPU code generation options: the HLO, and so the collectives, are XLA's
usual ones; values differ only by float32 rounding), which cuts compile time about fourfold.

Float32 noise: where meshdsl misses the tolerance, the reference is run again in float32 (only
then: it costs another compile for the gradient), and each element may also differ by
:data:`NOISE` times ``|ref32 - ref64|`` there. Cancellation that float32 cannot avoid passes;
an error beyond what float32 rounding explains still fails.

A reference that is not finite in float32 (forward or gradient) is not compared against: inside
a hypothesis test the draw is rejected (the generator drew inputs the function is not defined
on, or values float32 cannot hold), elsewhere the test fails saying so. Except where an input
holds NaN or +-inf (:func:`sprinkle`): then only the forward results are checked, against the
reference with its non-finite values: NaN exactly where the reference has NaN, the same infinities,
the finite values within the tolerance (:func:`assert_values_close` with ``nonfinite``). A layout
must not change a NaN into a number (a ``pmax`` that drops NaN did).

If the layout cannot apply to some tensor of the program (a split that does not divide a dim,
or two dims of one tensor on one mesh axis: found from the reference's own shapes, not from
meshdsl), ``check`` instead asserts that ``md.compile(...)(*args)`` raises ``md.LayoutError`` on
both backends and returns False, so a hypothesis test writes ``assume(check(...))``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import currently_in_test_context, reject
from jax.sharding import NamedSharding, PartitionSpec
from reference import Named, recording

import meshdsl as md
from meshdsl.analysis import hlo

BACKENDS = ("spmd", "gspmd")
TOL = 1e-5
"""Forward tolerance, relative to ``max(1, max|ref|)`` (the worst case drawn so far is 2.5e-6)."""
GRAD_TOL = 1e-5
"""Gradient tolerance, the same measure: float32 meshdsl against a float64 jax.numpy reference."""
NOISE = 4.0
"""Where a value misses the tolerance, it may still differ from the float64 reference by ``NOISE``
times the error float32 itself makes there: ``|ref32 - ref64|``, the reference run again in
float32 (a float32 cancellation, e.g. a gradient summed from large terms of opposite sign, is
float32's, not meshdsl's)."""

MESHES: dict[str, dict[str, int]] = {
    "x8": {"x": 8},
    "data4_model2": {"data": 4, "model": 2},
    "data2_model4": {"data": 2, "model": 4},
    "a2_b2_c2": {"a": 2, "b": 2, "c": 2},
}


@functools.cache
def mesh(name: str) -> md.Mesh:
    """The md.Mesh called ``name`` in :data:`MESHES`, built once per session."""
    return md.Mesh(MESHES[name])


def all_meshes() -> list[md.Mesh]:
    return [mesh(name) for name in MESHES]


# ---- inputs ------------------------------------------------------------------------------------


def dims(spec: Mapping[str, int] | Sequence[tuple[str, int]]) -> list[md.Dim]:
    items = spec.items() if isinstance(spec, Mapping) else spec
    return [md.Dim(n, s) for n, s in items]


def rand(
    rng: np.random.Generator, spec: Mapping[str, int] | Sequence[tuple[str, int]], kind: str = "normal"
) -> md.Tensor:
    """A float32 md tensor of dims ``spec`` (``{"batch": 8, "d": 4}``).

    ``kind``: ``normal``; ``positive`` (in [0.5, 2]); ``int`` (float32 holding small integers,
    so equality comparisons hit); ``int32``.
    """
    ds = dims(spec)
    shape = [d.size for d in ds]
    if kind == "normal":
        a = rng.standard_normal(shape)
    elif kind == "positive":
        a = rng.uniform(0.5, 2.0, shape)
    elif kind == "int":
        a = rng.integers(-2, 3, shape)
    elif kind == "int32":
        return from_numpy(rng.integers(-5, 6, shape).astype(np.int32), ds)
    else:
        raise ValueError(kind)
    return from_numpy(np.asarray(a, np.float32), ds)


SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)
"""The values :func:`sprinkle` puts into inputs."""


def sprinkle(rng: np.random.Generator, args: Sequence[md.Tensor], share: float) -> list[md.Tensor]:
    """``args`` with about ``share`` of each float input's entries replaced by NaN, +inf, -inf or -0.0
    (at least one entry of one input when ``share`` > 0): the values a layout must carry as the
    global ``jnp`` computation does."""
    if share <= 0:
        return list(args)
    out = []
    for t in args:
        a = t.numpy()
        if _is_float(a.dtype) and a.size:
            hit = rng.random(a.shape) < share
            hit.flat[rng.integers(a.size)] = True
            a = np.where(hit, rng.choice(SPECIALS, a.shape), a).astype(a.dtype)
            t = from_numpy(a, t.shape.dims)
        out.append(t)
    return out


def has_nonfinite(args: Sequence[Any]) -> bool:
    """Whether a float input holds NaN or +-inf."""
    return any(_is_float(np.asarray(a.numpy()).dtype) and not np.all(np.isfinite(a.numpy())) for a in args)


def from_numpy(a: np.ndarray, ds: Sequence[md.Dim], sharding: Any = None) -> md.Tensor:
    """``md.tensor`` of a host array, put on the default device uncommitted (or on ``sharding``).

    (``md.tensor`` of a numpy array goes through ``jnp.asarray``, which compiles a small program
    per shape; tests make thousands of inputs, so they skip that.)
    """
    return md.tensor(jax.device_put(a) if sharding is None else jax.device_put(a, sharding), list(ds))


# ---- layouts, independently of meshdsl ---------------------------------------------------------


def layout_problem(layout: md.Layout, mesh_: md.Mesh, shapes: Sequence[Mapping[str, int]]) -> str | None:
    """Why ``layout`` cannot apply to some tensor of ``shapes`` on ``mesh_`` (None: it can).

    Re-derived from the rule table: every axis exists, the product of a dim's axes divides
    its size, and no mesh axis splits two dims of one tensor.
    """
    for shape in shapes:
        owner: dict[str, str] = {}
        for name, size in shape.items():
            axes = layout.rules.get(name, ())
            if any(a not in mesh_.axis_sizes for a in axes):
                return f"{name}: unknown axis in {axes}"
            if size % math.prod(mesh_.axis_sizes[a] for a in axes):
                return f"{name}={size} is not divisible by {axes}"
            for a in axes:
                if a in owner:
                    return f"{owner[a]} and {name} both split over {a} in {shape}"
                owner[a] = name
    return None


def expected_sharding(layout: md.Layout, mesh_: md.Mesh, names: Sequence[str]) -> NamedSharding:
    """The sharding a tensor with dims ``names`` must have, from the rule table."""
    entries = []
    for n in names:
        axes = layout.rules.get(n, ())
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return NamedSharding(mesh_.jax_mesh, PartitionSpec(*entries))


def assert_laid_out(t: md.Tensor, layout: md.Layout, mesh_: md.Mesh, what: str) -> None:
    """``t``'s array is sharded as the rule table says, which is also what ``layout.sharding`` says."""
    want = expected_sharding(layout, mesh_, t.names)
    got = t.array.sharding
    assert got.is_equivalent_to(want, len(t.names)), f"{what} {t.shape}: sharding {got}, layout wants {want}"
    assert got.is_equivalent_to(layout.sharding(mesh_, t.shape), len(t.names)), f"{what}: layout.sharding disagrees"


# ---- comparisons -------------------------------------------------------------------------------


def _is_tensor(x: Any) -> bool:
    return isinstance(x, md.Tensor)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def assert_close(actual: md.Tensor, expected: Named, tol: float, what: str, nonfinite: bool = False) -> None:
    """Names, order and sizes equal; values within ``tol * max(1, max|expected|)`` (exact for non-floats)."""
    assert isinstance(actual, md.Tensor), f"{what}: expected an md tensor, got {type(actual).__name__}"
    assert actual.names == expected.names, f"{what}: dims {actual.names}, reference {expected.names}"
    assert_values_close(actual.numpy(), expected.array, tol, what, nonfinite=nonfinite)


def assert_values_close(
    got: Any, want: Any, tol: float = TOL, what: str = "value", floor: Any = None, nonfinite: bool = False
) -> None:
    """Same shape; floats within ``tol * max(1, max|want|)`` (plus ``floor``, per element, where
    given), anything else exactly equal. ``nonfinite``: ``want`` may hold NaN and +-inf, which
    ``got`` must hold at the same places (the rest compared as above); else ``got`` must be finite."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    if _is_float(want.dtype):
        assert _is_float(got.dtype), f"{what}: dtype {got.dtype}, reference is float"
        if nonfinite:
            special = ~np.isfinite(want)
            differ = special & ~((got == want) | (np.isnan(got) & np.isnan(want)))
            differ |= ~special & ~np.isfinite(got)
            if np.any(differ):
                at = [tuple(map(int, i)) for i in np.argwhere(differ)[:4]]
                raise AssertionError(
                    f"{what}: NaN/inf places differ at {int(differ.sum())} of {differ.size} entries, e.g. "
                    + ", ".join(f"{i}: got {got[i]}, reference {want[i]}" for i in at)
                )
            got, want = np.where(special, 0, got), np.where(special, 0, want)
            floor = None if floor is None else np.where(special, 0, floor)
        assert np.all(np.isfinite(got)), f"{what}: non-finite values where the reference is finite\n got {got}"
        diff = np.abs(got.astype(np.float64) - want)
        scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
        excess = diff - tol * scale - (0.0 if floor is None else floor)
        if excess.size and not float(np.max(excess)) <= 0.0:
            worst = np.unravel_index(np.argmax(excess), excess.shape)
            extra = "" if floor is None else f" + float32 noise {float(np.asarray(floor)[worst]):.3g}"
            raise AssertionError(
                f"{what}: abs error {float(diff[worst]):.3g} at {tuple(map(int, worst))} > {tol:g} * {scale:.3g}{extra}"
                f"\n got {got}\n want {want}"
            )
    else:
        assert got.dtype.kind == want.dtype.kind, f"{what}: dtype {got.dtype}, reference {want.dtype}"
        np.testing.assert_array_equal(got, want, err_msg=what)


def assert_tree_close(
    actual: Any, expected: Any, tol: float, what: str, noisy: Callable[[], Any] | None = None, nonfinite: bool = False
) -> None:
    """Each leaf as :func:`assert_close`. ``noisy``: the reference computed in float32 (called only
    if a leaf misses the tolerance); each element may then also differ by ``NOISE * |ref32 - ref64|``."""
    got, got_tree = jax.tree_util.tree_flatten(actual, is_leaf=_is_tensor)
    want, want_tree = jax.tree_util.tree_flatten(expected)
    assert got_tree == want_tree, f"{what}: result structure {got_tree}, reference {want_tree}"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
    for i, (g, w, p) in enumerate(zip(got, want, paths)):
        try:
            assert_close(g, w, tol, f"{what}{p}", nonfinite)
        except AssertionError:
            if noisy is None or not _is_float(np.asarray(w.array).dtype):
                raise
            w32 = np.asarray(jax.tree_util.tree_leaves(noisy())[i].array, np.float64)
            floor = NOISE * np.abs(w32 - w.array)
            assert_values_close(
                g.numpy(),
                w.array,
                tol,
                f"{what}{p} (float32 reference: {np.nanmax(floor, initial=0) / NOISE:.3g} off)",
                floor,
                nonfinite,
            )


def assert_explain_matches_hlo(
    fn: Callable, mesh_: md.Mesh, layout: md.Layout | Any, args: Sequence[Any], compiled: md.Compiled | None = None
) -> dict:
    """``md.explain`` predicts exactly the collectives (count and bytes per kind) of the compiled spmd program; returns
    them."""
    compiled = compiled if compiled is not None else md.compile(fn, mesh_, layout)
    predicted = md.explain(fn, mesh_, layout, *args).summary()
    actual = hlo.summary(compiled.lower(*args).compile().as_text())
    assert predicted == actual, f"md.explain predicts {predicted}, the compiled HLO runs {actual}"
    return actual


# ---- subprocesses ------------------------------------------------------------------------------


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a ``meshdsl`` command the tests start: this one's, on CPU, with the XLA
    flags conftest.py set (the same compiler options, so losses agree bit for bit with runs in
    this process) except the device count, which the command sets itself (``--devices``)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu", **extra}


# ---- compiling ---------------------------------------------------------------------------------

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
"""XLA options for the programs the harness compiles: LLVM without optimisation and XLA's loop
emitters instead of its MLIR fusion emitters. Both act after the HLO passes (partitioning and
collectives are the same); compiling a test program takes about a quarter of the time."""

_fast_compile = [True]


def compile_fast(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered.compile()`` with :data:`FAST_COMPILE` (plainly, on an XLA that lacks the options)."""
    if _fast_compile[0]:
        try:
            return lowered.compile(compiler_options=FAST_COMPILE)
        except jax.errors.JaxRuntimeError as e:
            if "compile option" not in str(e):
                raise
            _fast_compile[0] = False
    return lowered.compile()


# ---- the check ---------------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)


def require_finite(tree: Any, what: str) -> None:
    """Reject the draw (in a hypothesis test; else fail) if a float leaf of the reference ``tree`` is
    not finite or beyond float32's range: never compare against a NaN or an overflow."""
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf.array if isinstance(leaf, Named) else leaf)
        if _is_float(a.dtype) and not np.all(np.abs(a.astype(np.float64)) <= F32_MAX):
            if currently_in_test_context():
                reject()
            raise AssertionError(f"{what} is not finite in float32: the inputs are outside the function's domain")


def _named(t: md.Tensor, to_jax: bool, dtype: Any = np.float64) -> Named:
    """``t``'s global value, floats as ``dtype`` (float64 unless asked): a numpy array, or
    (``to_jax``, for float64 under :func:`float64_jax`) a jax array on one device."""
    a = t.numpy()
    a = a.astype(dtype) if _is_float(a.dtype) else a
    return Named(jax.device_put(a, jax.devices()[0]) if to_jax else a, t.names)


def float64_jax():
    """A context in which jax.numpy computes in float64 (``jax.enable_x64``; an older JAX's
    ``jax.experimental.enable_x64``)."""
    return jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64()


def check(
    fn: Callable[..., Any],
    args: Sequence[md.Tensor],
    reference: Callable[..., Any],
    mesh_: md.Mesh,
    layout: md.Layout | str | Mapping,
    *,
    tol: float = TOL,
    grad_tol: float = GRAD_TOL,
    grad: bool = True,
    explain: bool = True,
    backends: Sequence[str] = BACKENDS,
    around: bool = False,
    nonfinite: bool | None = None,
) -> bool:
    """Run the checks of this module's docstring; False (after checking the error) if the layout cannot apply.

    ``nonfinite``: the inputs (closed over ones too) may hold NaN or +-inf (None: whether ``args`` do)."""
    layout = md.Layout(layout)
    args = tuple(args)
    nonfinite = has_nonfinite(args) if nonfinite is None else nonfinite
    with recording() as made, np.errstate(all="ignore"):
        expected = reference(*(_named(a, to_jax=False) for a in args))
    if not nonfinite:
        require_finite(expected, "the reference's result")
    shapes = [dict(zip(a.names, a.shape.sizes)) for a in args] + [x.sizes for x in made]
    problem = layout_problem(layout, mesh_, shapes)
    if problem is not None:
        for b in backends:
            with pytest.raises(md.LayoutError):
                md.compile(fn, mesh_, layout, backend=b)(*args)
        return False

    # Arguments arrive laid out as the layout says, as a user's sharded data would (putting
    # single-device arrays on the mesh inside the call would compile a slicing program per shape).
    args = tuple(from_numpy(a.numpy(), a.shape.dims, expected_sharding(layout, mesh_, a.names)) for a in args)
    float_pos = [i for i, a in enumerate(args) if _is_float(a.dtype)]
    outs = [o for o in jax.tree_util.tree_leaves(expected) if _is_float(o.array.dtype)]
    grad = grad and bool(float_pos) and bool(outs) and not nonfinite
    program, program_args, want, want32, cot_arrays = fn, args, None, None, []

    def reference32() -> Any:
        with np.errstate(all="ignore"):
            return reference(*(_named(a, to_jax=False, dtype=np.float32) for a in args))

    expected32 = _once(reference32)
    if grad:
        rng = np.random.default_rng(len(outs))
        cot_arrays = [rng.standard_normal(o.array.shape).astype(np.float32) for o in outs]
        cots = [
            from_numpy(c, dims(o.sizes.items()), expected_sharding(layout, mesh_, o.names))
            for c, o in zip(cot_arrays, outs)
        ]
        want = _reference_gradient(reference, args, float_pos, cot_arrays)
        want32 = _once(lambda: _reference_gradient(reference, args, float_pos, cot_arrays, np.float32))
        program, program_args = _with_gradient(fn, len(args), float_pos), (*args, *cots)

    for b in backends:
        executable = compile_fast(md.compile(program, mesh_, layout, backend=b).lower(*program_args))
        result = executable(*program_args)
        out, grads = result if grad else (result, None)
        assert_tree_close(out, expected, tol, f"{b} forward", expected32, nonfinite)
        for t in jax.tree_util.tree_leaves(out, is_leaf=_is_tensor):
            assert_laid_out(t, layout, mesh_, f"{b} result")
        if grad:
            assert_tree_close(grads, tuple(want), grad_tol, f"{b} gradient", want32)
            for g in grads:
                assert_laid_out(g, layout, mesh_, f"{b} gradient")
        if explain and b == "spmd":
            predicted = md.explain(program, mesh_, layout, *program_args).summary()
            actual = hlo.summary(executable.as_text())
            assert predicted == actual, f"md.explain predicts {predicted}, the compiled HLO runs {actual}"
    if grad and around:
        _check_around(fn, args, want, want32, float_pos, cot_arrays, mesh_, layout, grad_tol, backends)
    return True


def _with_gradient(fn: Callable[..., Any], n: int, float_pos: Sequence[int]) -> Callable[..., Any]:
    """``(inputs..., cotangents...) -> (fn(inputs), jax.grad of sum(out * cotangent) over the float inputs)``."""

    def program(*inputs_and_cots):
        inputs, cts = inputs_and_cots[:n], inputs_and_cots[n:]

        def loss(floats):
            full = list(inputs)
            for i, f in zip(float_pos, floats):
                full[i] = f
            result = fn(*full)
            leaves = [o for o in jax.tree_util.tree_leaves(result, is_leaf=_is_tensor) if _is_float(o.dtype)]
            total = None
            for o, c in zip(leaves, cts):
                term = md.reduce_sum(o * c)
                total = term if total is None else total + term
            return total.array, result

        grads, result = jax.grad(loss, has_aux=True)(tuple(inputs[i] for i in float_pos))
        return result, grads

    return program


def _reference_gradient(reference, args, float_pos, cot_arrays, dtype: Any = np.float64) -> list[Named]:
    """jax.grad of ``sum(reference(args) * cotangents)`` over the float arguments: jax.numpy in
    ``dtype`` (float64, or float32 for the noise floor), one device, one jitted program (op-by-op
    eager dispatch would compile every op apart)."""

    def ref_loss(floats):
        named = [_named(a, to_jax=True, dtype=dtype) for a in args]
        for i, f in zip(float_pos, floats):
            named[i] = Named(f, args[i].names)
        leaves = [o for o in jax.tree_util.tree_leaves(reference(*named)) if _is_float(o.array.dtype)]
        return sum(jnp.sum(o.array * c.astype(dtype)) for o, c in zip(leaves, cot_arrays))

    with float64_jax() if dtype == np.float64 else contextlib.nullcontext():
        starts = [_named(args[i], to_jax=True, dtype=dtype).array for i in float_pos]
        grads = compile_fast(jax.jit(jax.grad(ref_loss)).lower(starts))(starts)
        want = [Named(np.asarray(g), args[i].names) for i, g in zip(float_pos, grads)]
    if dtype == np.float64:
        require_finite(want, "the reference's gradient")
    return want


def _once(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make``, called on first use only (a float32 reference is needed only where a value misses)."""
    return functools.cache(make)


def _check_around(fn, args, want, want32, float_pos, cot_arrays, mesh_, layout, tol, backends) -> None:
    """``jax.grad`` around the compiled function, each backend's in one jitted program, equals ``want``."""
    compiled = {b: md.compile(fn, mesh_, layout, backend=b) for b in backends}

    def grads(inputs, cts):
        def loss(b, floats):
            full = list(inputs)
            for i, f in zip(float_pos, floats):
                full[i] = f
            leaves = [
                o for o in jax.tree_util.tree_leaves(compiled[b](*full), is_leaf=_is_tensor) if _is_float(o.dtype)
            ]
            return sum(jnp.sum(o.array * c) for o, c in zip(leaves, cts))

        return {b: jax.grad(functools.partial(loss, b))(tuple(inputs[i] for i in float_pos)) for b in backends}

    cts = [
        jax.device_put(c, NamedSharding(mesh_.jax_mesh, PartitionSpec())) for c in cot_arrays
    ]  # replicated: no resharding per call
    got = compile_fast(jax.jit(grads).lower(args, cts))(args, cts)
    for b in backends:
        picks = [float_pos.index(i) for i in float_pos]
        assert_tree_close(
            got[b],
            tuple(want[k] for k in picks),
            tol,
            f"{b} gradient around md.compile",
            lambda picks=picks: tuple(want32()[k] for k in picks),
        )


def train(trainer: Any, steps: int) -> tuple[np.ndarray, Any]:
    """``steps`` steps of ``trainer`` on the synthetic task from seed 0 (data key 1): (losses, final state)."""
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    key = jax.random.key_data(jax.random.key(1))
    losses = []
    for _ in range(steps):
        state, loss = trainer.step(state, key)
        losses.append(float(loss))
    return np.array(losses), state
