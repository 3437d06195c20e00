"""``md.compile``: run a meshdsl function on a mesh under a layout, jitted.

Backend ``spmd`` (default) runs the whole function inside one ``jax.shard_map`` under
``jax.jit``: arguments enter as their shards, each op works on local shards and meshdsl emits the
collectives. The output structure (and so ``out_specs``) is found first by evaluating the
function's shapes on global arrays, which costs a trace but no computation.

Backend ``gspmd`` runs the same ops on global arrays with a sharding constraint on every result
and leaves the collectives to XLA.

Arguments and results are pytrees of md tensors; plain JAX arrays among them are replicated.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping

import jax
from jax.sharding import PartitionSpec

from meshdsl.layout import Layout
from meshdsl.lowering.base import Lowering
from meshdsl.lowering.context import use
from meshdsl.lowering.gspmd import GspmdLowering
from meshdsl.lowering.spmd import SpmdLowering
from meshdsl.mesh import Mesh
from meshdsl.tensor import Tensor


class Backend(enum.Enum):
    """How ``md.compile`` lowers the ops."""

    SPMD = "spmd"
    GSPMD = "gspmd"


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _where(prefix: str, path: tuple) -> str:
    return prefix + jax.tree_util.keystr(path)


class Compiled:
    """A meshdsl function compiled for ``mesh`` and ``layout``; call it like the function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        mesh: Mesh,
        layout: Layout | str | Mapping,
        backend: Backend | str = Backend.SPMD,
    ):
        self.fn = fn
        self.mesh = mesh
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.backend = Backend(backend)
        self.layout.check_mesh(mesh)
        self._jitted = jax.jit(self.spmd_function if self.backend is Backend.SPMD else self._gspmd)

    def __call__(self, *args: Any) -> Any:
        return self._jitted(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lower for ``args`` as ``jax.jit(...).lower`` does (then ``.compile().as_text()`` shows the HLO)."""
        return self._jitted.lower(*args)

    def _spec(self, where: str, leaf: Any) -> PartitionSpec:
        if isinstance(leaf, Tensor):
            self.layout.axes(leaf.shape, self.mesh, where)
            return self.layout.spec(leaf.shape)
        return PartitionSpec()

    def spmd_function(self, *args: Any) -> Any:
        """The unjitted spmd program: one ``shard_map`` over the mesh (``md.explain`` traces this)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_tensor)
        in_specs = tuple(self._spec(_where("argument ", p), x) for p, x in leaves)
        with use(Lowering()):
            shapes = jax.eval_shape(self.fn, *args)
        out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_tensor)
        out_specs = tuple(self._spec(_where("result ", p), x) for p, x in out_leaves)

        def body(*local: Any) -> tuple:
            inputs = [Tensor(a, x.shape) if isinstance(x, Tensor) else a for a, (_, x) in zip(local, leaves)]
            with use(SpmdLowering(self.mesh, self.layout)) as lowering:
                result = self.fn(*jax.tree_util.tree_unflatten(treedef, inputs))
                flat = jax.tree_util.tree_leaves(result, is_leaf=_is_tensor)
                with jax.named_scope("md.result"):
                    return tuple(lowering.prepare(x) if isinstance(x, Tensor) else x for x in flat)

        arrays = [x._data if isinstance(x, Tensor) else x for _, x in leaves]
        mapped = jax.shard_map(body, mesh=self.mesh.jax_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
        flat_out = mapped(*arrays)
        wrapped = [Tensor(a, x.shape) if isinstance(x, Tensor) else a for a, (_, x) in zip(flat_out, out_leaves)]
        return jax.tree_util.tree_unflatten(out_tree, wrapped)

    def _gspmd(self, *args: Any) -> Any:
        lowering = GspmdLowering(self.mesh, self.layout)

        def constrain(prefix: str):
            return lambda p, x: lowering.constrain(x, _where(prefix, p)) if isinstance(x, Tensor) else x

        args = jax.tree_util.tree_map_with_path(constrain("argument "), args, is_leaf=_is_tensor)
        with use(lowering):
            result = self.fn(*args)
        return jax.tree_util.tree_map_with_path(constrain("result "), result, is_leaf=_is_tensor)


def compile(fn: Callable[..., Any], mesh: Mesh, layout: Layout | str | Mapping, backend: Backend | str = "spmd") -> Compiled:  # noqa: A001
    """Compile ``fn`` (md tensors in, md tensors out) for ``mesh`` under ``layout``; see :class:`Compiled`."""
    return Compiled(fn, mesh, layout, backend)
