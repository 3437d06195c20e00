"""``md.compile``: run a meshdsl function on a mesh under a layout, jitted.

Backend ``spmd`` (default) runs the whole function inside one ``jax.shard_map`` under
``jax.jit``: arguments enter as their shards, each op works on local shards and meshdsl emits the
collectives. The output structure (and so ``out_specs``) is found first by evaluating the
function's shapes on global arrays, which costs a trace but no computation.

Backend ``gspmd`` runs the same ops on global arrays with a sharding constraint on every result
and leaves the collectives to XLA.

Arguments and results are pytrees of md tensors; plain JAX arrays among them are replicated.
``in_layouts`` / ``out_layouts`` give some arguments or results another layout than the one the
ops compute in: parameters stored split for FSDP enter in their stored layout and are gathered by
the first op that uses them, and their gradients leave it reduce-scattered.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from meshdsl.errors import ConfigError, LayoutError, ShapeError
from meshdsl.jax_compat import at_top_level
from meshdsl.layout import Layout, Split
from meshdsl.lowering.base import GlobalLowering
from meshdsl.lowering.context import use
from meshdsl.lowering.gspmd import GspmdLowering
from meshdsl.lowering.spmd import SpmdLowering
from meshdsl.mesh import Mesh
from meshdsl.runtime.compiler_options import compiler_options
from meshdsl.tensor import Tensor, describe, is_tensor

LayoutLike = Layout | str | Mapping


class Backend(enum.Enum):
    """How ``md.compile`` lowers the ops."""

    SPMD = "spmd"
    GSPMD = "gspmd"


def _as_layout(layout: LayoutLike | None, default: Layout, what: str = "layout") -> Layout:
    if layout is None:
        return default
    if not isinstance(layout, (Layout, str, Mapping)):
        raise LayoutError(
            f"md.compile: {what} must be an md.Layout, a string like 'batch:data' or a dict, got {describe(layout)}",
            op="compile",
        )
    return layout if isinstance(layout, Layout) else Layout(layout)


def _check_argument(name: str, leaf: Any) -> None:
    """A compiled function takes md tensors, arrays and numbers (``lower`` also their shapes:
    ``jax.ShapeDtypeStruct``)."""
    if isinstance(leaf, (Tensor, jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, bool, int, float, complex)):
        return
    raise ShapeError(f"{name} is {describe(leaf)}; a compiled function takes md tensors, arrays and numbers")


class Compiled:
    """A meshdsl function compiled for ``mesh`` and ``layout``; call it like the function.

    ``in_layouts``: one entry per positional argument (a layout, or None for ``layout``).
    ``out_layouts``: a layout for every result, or one entry per element of a tuple result.
    ``grad_reduce_dtype`` (spmd): sum gradients across devices in this dtype, e.g. bfloat16.
    ``donate_argnums``: positional arguments whose buffers the call may reuse for its results
    (as ``jax.jit``'s): a training step donates its state, so old and new state never coexist.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        mesh: Mesh,
        layout: LayoutLike | None,
        backend: Backend | str = Backend.SPMD,
        in_layouts: Sequence[LayoutLike | None] | None = None,
        out_layouts: LayoutLike | Sequence[LayoutLike | None] | None = None,
        grad_reduce_dtype: Any = None,
        donate_argnums: Sequence[int] = (),
    ):
        if not callable(fn):
            raise ConfigError(f"md.compile: fn must be a function, got {describe(fn)}", op="compile")
        if not isinstance(mesh, Mesh):
            raise ConfigError(
                f"md.compile: mesh must be an md.Mesh, got {describe(mesh)}; build one with md.Mesh({mesh!r})",
                op="compile",
            )
        if grad_reduce_dtype is not None:
            try:
                jnp.dtype(grad_reduce_dtype)
            except TypeError:
                raise ConfigError(
                    f"md.compile: grad_reduce_dtype {grad_reduce_dtype!r} is not a dtype (e.g. 'bfloat16')",
                    op="compile",
                ) from None
        backends = [b.value for b in Backend]
        if not isinstance(backend, Backend) and backend not in backends:
            raise ConfigError(f"md.compile: backend {backend!r} is not one of {', '.join(backends)}", op="compile")
        self.fn = fn
        self.grad_reduce_dtype = grad_reduce_dtype
        self.mesh = mesh
        self.layout = _as_layout(layout, Layout())
        self.backend = Backend(backend)
        self.in_layouts = (
            None if in_layouts is None else tuple(_as_layout(x, self.layout, "in_layouts") for x in in_layouts)
        )
        if out_layouts is None or isinstance(out_layouts, (Layout, str, Mapping)):
            self.out_layouts: Layout | tuple[Layout, ...] = _as_layout(out_layouts, self.layout, "out_layouts")
        else:
            self.out_layouts = tuple(_as_layout(x, self.layout, "out_layouts") for x in out_layouts)
        outs = self.out_layouts if isinstance(self.out_layouts, tuple) else (self.out_layouts,)
        for lay in (self.layout, *(self.in_layouts or ()), *outs):
            lay.check_mesh(mesh)
        program = self.spmd_function if self.backend is Backend.SPMD else self._gspmd
        self.donate_argnums = tuple(donate_argnums)
        self._jitted = jax.jit(program, donate_argnums=self.donate_argnums)
        # XLA's options apply only where this is the whole program, not traced into a caller's jit or grad
        options = self._options()
        self._top = jax.jit(program, donate_argnums=self.donate_argnums, compiler_options=options) if options else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_arguments(args, kwargs)
        abstract = isinstance(self.mesh.jax_mesh, jax.sharding.AbstractMesh)
        if abstract and not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
            raise ConfigError(
                f"md.compile'd {self._name}: mesh {self.mesh} is abstract (md.Mesh.abstract: no devices), so it can be "
                "traced (md.explain, .lower) but not run; build the mesh on devices (md.Mesh(...))"
            )
        return self._program()(*args)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lower for ``args`` as ``jax.jit(...).lower`` does (then ``.compile().as_text()`` shows the HLO)."""
        self._check_arguments(args, kwargs)
        return self._program().lower(*args)

    def _program(self) -> Any:
        """The jitted program to run: with XLA's options at top level, without them inside a JAX trace."""
        return self._top if self._top is not None and at_top_level() else self._jitted

    def _options(self) -> dict[str, Any]:
        """XLA's options for the platform of the mesh's devices (an abstract mesh, which is traced and never
        compiled, needs none)."""
        jax_mesh = self.mesh.jax_mesh
        if isinstance(jax_mesh, jax.sharding.AbstractMesh):
            return {}
        return compiler_options(jax_mesh.devices.flat[0].platform)

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__name__", "function")

    def _check_arguments(self, args: tuple, kwargs: dict[str, Any] | None = None) -> None:
        if kwargs:
            raise ShapeError(
                f"md.compile'd {self._name} called with keyword argument(s) {', '.join(map(repr, kwargs))}; it takes "
                "positional arguments only (in_layouts and donate_argnums count positions)"
            )
        try:
            inspect.signature(self.fn).bind(*args)
        except TypeError as e:
            raise ShapeError(f"md.compile'd {self._name} called with {len(args)} argument(s): {e}") from None
        except ValueError:  # no signature to check (a builtin)
            pass
        beyond = [i for i in self.donate_argnums if i >= len(args)]
        if beyond:
            raise ConfigError(
                f"md.compile: donate_argnums {beyond} name no argument of a call with {len(args)} argument(s)",
                op="compile",
            )
        if self.in_layouts is not None and len(self.in_layouts) != len(args):
            raise LayoutError(
                f"md.compile: {len(self.in_layouts)} in_layouts given for a call with {len(args)} argument(s); give "
                "one per positional argument",
                op="compile",
            )
        for path, leaf in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_tensor)[0]:
            _check_argument(f"argument {jax.tree_util.keystr(path)}", leaf)

    def _leaves(
        self, tree: Any, layouts: Layout | tuple[Layout, ...] | None, prefix: str
    ) -> list[tuple[str, Any, Layout]]:
        """(name for messages, leaf, its layout) for each leaf; tuple ``layouts`` go element by element."""
        if isinstance(layouts, tuple):
            if not isinstance(tree, (tuple, list)) or len(tree) != len(layouts):
                got = f"a sequence of {len(tree)}" if isinstance(tree, (tuple, list)) else describe(tree)
                raise LayoutError(
                    f"md.compile: {len(layouts)} out_layouts given, one per {prefix}, but the {prefix} is {got}",
                    op="compile",
                )
            return [
                item
                for i, (sub, lay) in enumerate(zip(tree, layouts))
                for item in self._leaves(sub, lay, f"{prefix}[{i}]")
            ]
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_tensor)[0]
        return [(prefix + jax.tree_util.keystr(p), x, layouts or self.layout) for p, x in leaves]

    def _axes(self, name: str, leaf: Any, layout: Layout) -> Split | None:
        return layout.axes(leaf.shape, self.mesh, name) if isinstance(leaf, Tensor) else None

    @staticmethod
    def _spec(leaf: Any, layout: Layout) -> PartitionSpec:
        return layout.spec(leaf.shape) if isinstance(leaf, Tensor) else PartitionSpec()

    def spmd_function(self, *args: Any, shapes: Any = None) -> Any:
        """The unjitted spmd program: one ``shard_map`` over the mesh (``md.explain`` traces this).

        ``shapes``: the global results' shapes when the caller knows them (the planner, which traces one step
        under many layouts: they are the same under each), else traced here on global arrays.
        """
        treedef = jax.tree_util.tree_structure(args, is_leaf=is_tensor)
        ins = [
            item
            for i, a in enumerate(args)
            for item in self._leaves(a, self.in_layouts[i] if self.in_layouts else None, f"argument [{i}]")
        ]
        in_axes = [self._axes(*item) for item in ins]
        if shapes is None:
            with use(GlobalLowering()):
                shapes = jax.eval_shape(self.fn, *args)
        out_tree = jax.tree_util.tree_structure(shapes, is_leaf=is_tensor)
        outs = self._leaves(shapes, self.out_layouts, "result")
        out_axes = [self._axes(*item) for item in outs]

        def body(*local: Any) -> tuple:
            inputs = [
                Tensor(a, x.shape, (), ax) if isinstance(x, Tensor) else a
                for a, (_, x, _), ax in zip(local, ins, in_axes)
            ]
            with use(SpmdLowering(self.mesh, self.layout, self.grad_reduce_dtype)) as lowering:
                result = self.fn(*jax.tree_util.tree_unflatten(treedef, inputs))
                flat = jax.tree_util.tree_leaves(result, is_leaf=is_tensor)
                with jax.named_scope("md.result"):
                    return tuple(
                        lowering.prepare(x, ax) if isinstance(x, Tensor) else x for x, ax in zip(flat, out_axes)
                    )

        mapped = jax.shard_map(
            body,
            mesh=self.mesh.jax_mesh,
            in_specs=tuple(self._spec(x, lay) for _, x, lay in ins),
            out_specs=tuple(self._spec(x, lay) for _, x, lay in outs),
            check_vma=True,
        )
        flat_out = mapped(*[x._data if isinstance(x, Tensor) else x for _, x, _ in ins])
        wrapped = [Tensor(a, x.shape) if isinstance(x, Tensor) else a for a, (_, x, _) in zip(flat_out, outs)]
        return jax.tree_util.tree_unflatten(out_tree, wrapped)

    def _gspmd(self, *args: Any) -> Any:
        lowering = GspmdLowering(self.mesh, self.layout)

        def constrain(tree: Any, layouts: Any, prefix: str) -> Any:
            items = self._leaves(tree, layouts, prefix)
            leaves = [
                lowering.with_layout(lay).constrain(x, name) if isinstance(x, Tensor) else x for name, x, lay in items
            ]
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree, is_leaf=is_tensor), leaves)

        args = tuple(
            constrain(a, self.in_layouts[i] if self.in_layouts else None, f"argument [{i}]") for i, a in enumerate(args)
        )
        with use(lowering):
            result = self.fn(*args)
        return constrain(result, self.out_layouts, "result")


def compile(  # noqa: A001  (md.compile)
    fn: Callable[..., Any],
    mesh: Mesh,
    layout: LayoutLike,
    backend: Backend | str = "spmd",
    in_layouts: Sequence[LayoutLike | None] | None = None,
    out_layouts: LayoutLike | Sequence[LayoutLike | None] | None = None,
    grad_reduce_dtype: Any = None,
    donate_argnums: Sequence[int] = (),
) -> Compiled:
    """Compile ``fn`` (md tensors in, md tensors out) for ``mesh`` under ``layout``; see :class:`Compiled`."""
    return Compiled(fn, mesh, layout, backend, in_layouts, out_layouts, grad_reduce_dtype, donate_argnums)
