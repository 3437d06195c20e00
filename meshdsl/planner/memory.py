"""Per-device memory of a training step: state from the shapes, peak temporaries from a liveness walk.

The state (parameters, optimizer state, step counter) is exact: each tensor's bytes divided by
the product of the mesh axes its stored layout splits it over. The temporaries (activations kept
for the backward pass, gradients, the optimizer's intermediates) come from walking the traced
per-device program in order, keeping every value that XLA would hold in memory alive from the
step that makes it to its last use, and taking the largest total. XLA fuses chains of
element-wise ops into the op that consumes them, so an element-wise result is counted only when
something other than another element-wise op reads it (a matmul, a reduction, a collective, a
loop) or when it leaves its block. A loop body's peak counts once (its buffers are reused every
iteration), on top of what is live around the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import meshdsl as md
from meshdsl.planner.program import Block

FUSIBLE = frozenset(
    "abs add add_any and broadcast_in_dim clamp convert_element_type cos copy div eq erf erf_inv exp exp2 expand_dims "
    "floor ceil ge gt imag integer_pow iota is_finite le log log1p logistic lt max min mul ne neg not or pcast pow "
    "pvary real reduce_precision rem reshape round rsqrt select_n shift_left shift_right_logical sign sin sqrt square "
    "squeeze stop_gradient sub tan tanh xor".split()
)
FUSING_READERS = frozenset("reduce_sum reduce_max reduce_min reduce_prod argmax argmin".split())
"""Non-fusible steps that read element-wise producers inside their own fusion (XLA's reduce fusions)."""

ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device. ``total`` is what the compiled program needs: state plus peak temporaries."""

    parameters: int
    optimizer_state: int
    gradients: int
    peak_temporaries: int
    other_state: int = 0

    @property
    def state(self) -> int:
        return self.parameters + self.optimizer_state + self.other_state

    @property
    def activations(self) -> int:
        """Peak temporaries beyond one copy of the gradients: activations and working buffers."""
        return max(0, self.peak_temporaries - self.gradients)

    @property
    def total(self) -> int:
        return self.state + self.peak_temporaries


def _is_tensor(x: Any) -> bool:
    return isinstance(x, md.Tensor)


def local_bytes(tree: Any, layout: md.Layout, mesh: md.Mesh) -> int:
    """Bytes one device holds of ``tree`` (md tensors split as ``layout`` says; other leaves whole)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_is_tensor):
        if _is_tensor(leaf):
            split = 1
            for axes in layout.axes(leaf.shape, mesh):
                for a in axes:
                    split *= mesh.axis_sizes[a]
            total += leaf.shape.size * leaf.dtype.itemsize // split
        else:
            total += leaf.size * leaf.dtype.itemsize
    return total


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to XLA's buffer alignment (each buffer starts on a 64-byte boundary)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def materialised(block: Block) -> set[int]:
    """Value ids XLA keeps in a buffer: made by a non-fusible step, read by one that cannot fuse its
    producers (reductions can), or leaving the block."""
    keep = set(block.outputs)
    for step in block.steps:
        if step.name not in FUSIBLE:
            keep.update(i for i, _ in step.outs)
            if step.name not in FUSING_READERS:
                keep.update(step.ins)
    return keep


def peak_bytes(block: Block, count_outputs: bool = True) -> int:
    """Largest total of live values made inside ``block`` (its inputs belong to the caller).

    ``count_outputs``: whether the block's results count (the whole step's results are the
    program's outputs, which XLA accounts apart from temporaries).
    """
    keep = materialised(block)
    last: dict[int, int] = {}
    for i, step in enumerate(block.steps):
        for v in step.ins:
            last[v] = i
    outputs = set(block.outputs)
    for v in outputs:
        last[v] = len(block.steps)
    size: dict[int, int] = {}
    live = peak = 0
    for i, step in enumerate(block.steps):
        made = sum(_aligned(b) for v, b in step.outs if v in keep and (count_outputs or v not in outputs))
        inner = max((peak_bytes(body) for body, _ in step.bodies), default=0)
        peak = max(peak, live + made + inner)
        for v, b in step.outs:
            if v in keep and (count_outputs or v not in outputs) and v in last:
                size[v] = _aligned(b)
                live += size[v]
        for v in set(step.ins):
            if last.get(v) == i and v in size:
                live -= size.pop(v)
    return peak


def breakdown(state: Any, batch: Any, layout: md.Layout, mesh: md.Mesh, body: Block) -> MemoryBreakdown:
    """The :class:`MemoryBreakdown` of a step on ``state`` and ``batch`` whose per-device program is ``body``.

    The traced program takes the batch as an input; the real step makes it first, from a key. So
    the batch counts as a temporary, and so does the peak of making it (traced once on global
    arrays, scaled to this device's share of the batch), on top of the step's own: on CPU, XLA's
    buffer assignment was observed not to reuse those buffers for the step's.
    """
    stored = layout.param_layout
    params = local_bytes(state["params"], stored, mesh)
    opt = local_bytes(state["opt"], stored, mesh)
    other = local_bytes({k: v for k, v in state.items() if k not in ("params", "opt")}, stored, mesh)
    local = local_bytes(batch.shapes, layout, mesh)
    whole = local_bytes(batch.shapes, md.Layout(), mesh)
    making = batch.making_peak * local // max(whole, 1)
    temporaries = peak_bytes(body, count_outputs=False) + making + local
    return MemoryBreakdown(params, opt, params, temporaries, other)
