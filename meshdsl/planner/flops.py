"""The work one device does in a traced step (matmul FLOPs and bytes written to memory), and the
one count of attention's model FLOPs.

Counted on the per-device program, so replicated work (every device of a ``model`` axis
computing the same thing) counts as often as it runs, and loop bodies count once per iteration.
cuDNN's fused attention (on a GPU: one primitive, no ``dot_general``) counts the matmuls it
runs: two in the forward pass, five in the backward (it recomputes the scores), each
``2 B N T S H``, halved under a causal mask (it skips the masked blocks).

:func:`attention_flops` is the model FLOPs of attention that bench's MFU counts (the shipped
models' ``flops_per_step``): causal attention counts half of full attention, the convention
MaxText adopted (its performance-metrics guide), since the masked half is work a fused kernel
does not do.
"""

from __future__ import annotations

import dataclasses
import math

from meshdsl.planner.memory import FUSIBLE, computed
from meshdsl.planner.program import Block, Step, nbytes


@dataclasses.dataclass(frozen=True)
class Work:
    """``matmul_flops``: 2 x multiply-adds of dots and convolutions; ``memory_bytes``: bytes of
    buffers written, plus bytes of buffers read (once per reading step); ``attention_flops``: the
    matmul FLOPs run inside fused attention kernels (priced at the profile's attention rate)."""

    matmul_flops: float
    memory_bytes: float
    attention_flops: float = 0.0

    @property
    def flops(self) -> float:
        """Every FLOP counted: matmuls and fused attention."""
        return self.matmul_flops + self.attention_flops

    def __add__(self, other: Work) -> Work:
        return Work(
            self.matmul_flops + other.matmul_flops,
            self.memory_bytes + other.memory_bytes,
            self.attention_flops + other.attention_flops,
        )

    def __mul__(self, k: float) -> Work:
        return Work(self.matmul_flops * k, self.memory_bytes * k, self.attention_flops * k)


def _dot_flops(step: Step) -> float:
    (contract, _), _ = step.params["dimension_numbers"]
    lhs = step.in_avals[0].shape
    return 2.0 * math.prod(step.out_avals[0].shape) * math.prod(lhs[d] for d in contract)


def _conv_flops(step: Step) -> float:
    rhs = step.in_avals[1].shape
    spec = step.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    kernel = math.prod(rhs[d] for d in spec[1:])
    return 2.0 * math.prod(step.out_avals[0].shape) * kernel


def attention_flops(
    batch: int, heads: int, length: int, memory: int, d_kv: int, causal: bool, passes: int = 3
) -> float:
    """Model FLOPs of attention's two matmuls (scores ``q k`` and ``p v``: ``2 x 2 B N T S H``) times
    ``passes`` (3: a training step's forward and backward, 1: a forward pass); causal: half."""
    full = 2 * 2 * batch * heads * length * memory * d_kv * passes
    return full / 2 if causal else full


FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": 2, "dot_product_attention_bwd_wrapper": 5}
"""cuDNN's fused attention primitives (JAX's ``jax._src.cudnn``) and the ``T x S`` matmuls each runs."""


def _fused_attention_flops(step: Step) -> float:
    """FLOPs of a fused attention primitive (see the module docstring) from its query and key
    shapes, layout (``BTNH`` = 0 or ``BNTH`` = 1) and mask type."""
    q, k = step.in_avals[0].shape, step.in_avals[1].shape
    layout = getattr(step.params.get("layout"), "value", step.params.get("layout"))
    b, t, n, h = (q[0], q[2], q[1], q[3]) if layout == 1 else q
    s = k[2] if layout == 1 else k[1]
    mask = getattr(step.params.get("mask_type"), "name", str(step.params.get("mask_type")))
    return FUSED_ATTENTION[step.name] * attention_flops(b, n, t, s, h, "CAUSAL" in mask, passes=1) / 2


def work(block: Block) -> Work:
    """The :class:`Work` of ``block``, loop bodies times their trip counts.

    Memory bytes: each buffer is written once, and read once by every non-fusible step that uses
    it plus once by the element-wise steps that use it (XLA fuses those into one loop).
    """
    keep = computed(block) | set(block.outputs) | set(block.inputs)
    readers: dict[int, int] = {}
    fused_read: set[int] = set()
    size: dict[int, int] = {}
    total = Work(0.0, 0.0)
    for step in block.steps:
        for v, aval in zip(step.ins, step.in_avals):
            if v in keep:
                size[v] = nbytes(aval)
                if step.name in FUSIBLE:
                    fused_read.add(v)
                else:
                    readers[v] = readers.get(v, 0) + 1
        if step.name == "dot_general":
            total += Work(_dot_flops(step), 0.0)
        elif step.name == "conv_general_dilated":
            total += Work(_conv_flops(step), 0.0)
        elif step.name in FUSED_ATTENTION:
            total += Work(0.0, 0.0, _fused_attention_flops(step))
        total += Work(0.0, float(sum(b for v, b in step.outs if v in keep)))
        for body, times in step.bodies:
            total += work(body) * times
    reads = sum(b * (readers.get(v, 0) + (v in fused_read)) for v, b in size.items())
    return total + Work(0.0, float(reads))
