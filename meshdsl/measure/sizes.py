"""Bytes one device holds of a pytree under a layout (the planner's memory model and bench's formulas)."""

from __future__ import annotations

from typing import Any

import jax

import meshdsl as md
from meshdsl.tensor import is_tensor


def local_bytes(tree: Any, layout: md.Layout, mesh: md.Mesh) -> int:
    """Bytes one device holds of ``tree`` (md tensors split as ``layout`` says; other leaves whole)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_tensor):
        if is_tensor(leaf):
            split = 1
            for axes in layout.axes(leaf.shape, mesh):
                for a in axes:
                    split *= mesh.axis_sizes[a]
            total += leaf.shape.size * leaf.dtype.itemsize // split
        else:
            total += leaf.size * leaf.dtype.itemsize
    return total
