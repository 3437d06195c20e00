"""Per-device memory of a training step: state from the shapes, temporaries from a liveness walk packed as XLA
packs them.

The state (parameters, optimizer state, step counter) is exact: each tensor's bytes divided by
the product of the mesh axes its stored layout splits it over. The temporaries (activations kept
for the backward pass, gradients, the optimizer's intermediates) come from walking the traced
per-device program in XLA's order, keeping every value that XLA would hold in memory alive from
the step that makes it to its last use, and taking the largest total. XLA fuses chains of
element-wise ops into the op that consumes them, so an element-wise result is counted only when
something other than another element-wise op reads it (a matmul, a reduction, a collective, a
loop) or when it leaves its block, or when it is expensive (``exp``, ``tanh``, ...) and two steps read it
(:func:`unduplicated`); a fused op reads its inputs where its fusion runs (:func:`last_uses`);
transposes are folded into their neighbours' layouts (see
:mod:`~meshdsl.planner.program`), except a dot's operand that XLA:CPU copies into the order its dot runs
in while another step reads it as it is (:func:`relaid`). These two decide the peak of a rematerialised
step, whose backward loop body holds the recomputed forward beside the backward's buffers, with a copy of
its carried gradient (:func:`copied_carries`). The order is the traced one, except that values made from
constants alone (zero-filled gradient accumulators, masks) come first, where XLA's scheduler puts them, and
slices that together free a value run as soon as they can (:func:`freeing_slices`). Loops run in place, as
XLA's buffer assignment shows: a carry keeps one buffer from its initial value to its final one; a scanned-out
value is written straight into its slice of the stacked result unless a matmul or collective made or read it;
a scanned-over slice that a matmul or collective reads is copied out of its stack; a loop body's peak counts
once (its buffers are reused every iteration), on top of what is live around the loop. One-iteration scans are
no loops at all (XLA removes them). A scan's stacked results hold their buffers from the start of the scan's
block (:func:`stacked`), and an update writes into its old value's buffer
(:func:`updated`) unless another step still reads that value, when it writes an early copy of it
(:func:`copied_updates`): a pipeline's ticks do both. A scatter into zeros that is then added to a value
is a scatter into that value in place (:func:`folded_scatters`): a cross-entropy's gradient.

The live buffers are then packed as XLA packs them (:func:`heap_bytes`): largest first, each in
the smallest gap that fits it, so the prediction includes the gaps XLA's heap leaves between
buffers of different lifetimes; and each running loop adds XLA's own small buffers (its tuple and
counter, :func:`loop_overhead`), which decide the peak of the tiniest programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Set
from typing import Any

import numpy as np

import meshdsl as md
from meshdsl.analysis.jaxpr_walk import loop_carries, scan_counts
from meshdsl.measure.sizes import local_bytes
from meshdsl.planner.program import Block, Step, nbytes

FUSIBLE = frozenset(
    "abs add add_any and broadcast_in_dim clamp convert_element_type cos copy div eq erf erf_inv exp exp2 expand_dims "
    "floor ceil ge gt imag integer_pow iota is_finite le log log1p logistic lt max min mul ne neg not or pad pcast pow "
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


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to XLA's buffer alignment (each buffer starts on a 64-byte boundary)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def folded_scatters(block: Block) -> set[int]:
    """Results of ``scatter-add`` steps into a broadcast constant that one addition alone reads: XLA's algebraic
    simplifier scatters into the other addend instead (``add(x, scatter(0, i, u)) -> scatter(x, i, u)``, in place),
    so neither the zeros nor the scatter's result has a buffer. A gathered logit's gradient added to the softmax's
    is one: XLA's buffer assignment shows the softmax gradient's fusion, then the scatter into its buffer."""
    read = readers(block.steps)
    made_by = {v: step for step in block.steps for v, _ in step.outs}
    folded: set[int] = set()
    for step in block.steps:
        if step.name != "scatter-add" or len(step.outs) != 1:
            continue
        (out, _), zeros = step.outs[0], made_by.get(step.ins[0])
        sums = read.get(out, [])
        if (
            zeros is not None
            and zeros.name == "broadcast_in_dim"
            and not any(zeros.ins)
            and len(read[step.ins[0]]) == 1
            and len(sums) == 1
            and block.steps[sums[0]].name in ("add", "add_any")
            and out not in block.outputs
        ):
            folded.add(out)
    return folded


def computed(block: Block) -> set[int]:
    """Value ids XLA computes into a buffer of their own: made by a non-fusible step, or read by one
    that cannot fuse its producers (reductions can); not a scatter that XLA folds into a sum
    (:func:`folded_scatters`), nor its zeros."""
    keep: set[int] = set()
    folded = folded_scatters(block)
    for step in block.steps:
        if step.name not in FUSIBLE:
            into_sum = bool(step.outs) and step.outs[0][0] in folded
            keep.update(i for i, _ in step.outs if i not in folded)
            if step.name not in FUSING_READERS:
                keep.update(step.ins[1:] if into_sum else step.ins)
    return keep


EXPENSIVE = frozenset("exp exp2 log log1p tanh logistic erf erf_inv rsqrt sqrt div pow sin cos tan".split())
"""Element-wise steps XLA's fusion will not duplicate (its ``IsExpensive``): read by two steps or more, such a
result is computed once into a buffer of its own, not recomputed inside each reader's fusion."""


def readers(steps: list[Step]) -> dict[int, list[int]]:
    """Value id -> the indices of the steps that read it (each step once, in order)."""
    found: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        for v in dict.fromkeys(step.ins):
            found.setdefault(v, []).append(i)
    return found


def unduplicated(block: Block) -> set[int]:
    """Results of :data:`EXPENSIVE` element-wise steps that two or more steps of ``block`` read: XLA computes
    each into a buffer of its own (a softmax's exponentials, a GELU's ``tanh``), which a rematerialised
    layer's recomputed forward holds beside the backward's buffers."""
    read = readers(block.steps)
    return {v for step in block.steps if step.name in EXPENSIVE for v, _ in step.outs if len(read.get(v, ())) > 1}


def _canonical(dims: list[int], sizes: tuple[int, ...]) -> bool:
    """Whether an operand read in the dimension order ``dims`` is already laid out so (size-1 dims move freely)."""
    kept = [d for d in dims if sizes[d] != 1]
    return kept == sorted(kept)


def relaid(step: Step) -> list[tuple[int, int]]:
    """``(operand, bytes)`` of a ``dot_general`` operand that XLA:CPU copies into another layout before the
    dot: it runs a dot as ``[batch, rows, contracted] x [batch, contracted, columns]`` (the right operand
    may also be ``[batch, columns, contracted]``), so a left operand contracted over its leading dims (a
    weight gradient's activations or output gradient) or an operand whose batch dims do not lead is copied
    transposed (``copy_bitcast_fusion`` in its buffer assignment)."""
    if step.name != "dot_general":
        return []
    (lc, rc), (lb, rb) = step.params["dimension_numbers"]
    (lhs, rhs), (la, ra) = step.ins[:2], step.in_avals[:2]
    lfree = [d for d in range(len(la.shape)) if d not in (*lc, *lb)]
    rfree = [d for d in range(len(ra.shape)) if d not in (*rc, *rb)]
    out = []
    if not _canonical([*lb, *lfree, *lc], la.shape):
        out.append((lhs, nbytes(la)))
    if not (_canonical([*rb, *rc, *rfree], ra.shape) or _canonical([*rb, *rfree, *rc], ra.shape)):
        out.append((rhs, nbytes(ra)))
    return out


def _relayout_copies(steps: list[Step], inputs: Set[int]) -> dict[int, list[tuple[int, int]]]:
    """Step index -> ``(operand, bytes)`` of the :func:`relaid` copies that dot holds in buffers of their own.

    Where the dot is an operand's only reader, XLA lays the operand out as the dot wants it where it is made:
    no copy. Otherwise (another step reads it as it is, or it is the block's input, whose layout the
    caller fixed), the copy is a buffer of its own, made after the operand's previous use (where the value is
    made when the dot reads it first, as XLA's fusions make both layouts of a value at once; after the step
    that made it where that step writes one layout only: a matmul, a scatter, a collective)."""
    read = readers(steps)
    out: dict[int, list[tuple[int, int]]] = {}
    for i, step in enumerate(steps):
        for v, b in relaid(step):
            if v and (len(read[v]) > 1 or v in inputs):
                out.setdefault(i, []).append((v, b))
    return out


def carried(step: Step) -> list[tuple[int, int]]:
    """``(output, input)`` pairs of a loop whose output is the next value of that input (its carry);
    ``threefry2x32`` is one (XLA runs its rounds as a loop over the two counter words).

    XLA runs a loop in place: each carry has one buffer, the initial value's when nothing reads
    that value after the loop.
    """
    if step.name == "threefry2x32":  # a loop in XLA too, over its two counter words (the keys are scalars)
        inits = step.ins[2:]
    else:
        inits = [step.ins[i] for i in loop_carries(step.name, step.params, len(step.ins))]
    return [(out, init) for (out, _), init in zip(step.outs, inits)]


def in_place(step: Step, body: Block) -> set[int]:
    """Results of loop ``body`` that XLA writes straight into ``step``'s buffers, not buffers of their own.

    A carry's next value goes to the carry's buffer; a scanned-out value (a slice of a stacked
    result) is fused into the write of its slice, unless a step that cannot fuse it made or
    read it (a matmul, a collective): then it is computed apart and copied in.
    """
    if step.name != "scan":
        return set(body.outputs)
    _, carries = scan_counts(step.params)
    apart = computed(body)
    return set(body.outputs[:carries]) | {v for v in body.outputs[carries:] if v not in apart}


def sliced(step: Step, body: Block) -> dict[int, int]:
    """The slices of a scan's scanned-over inputs that a matmul or collective in ``body`` reads: XLA
    copies each out of its stack into a buffer of its own every iteration (value id -> bytes)."""
    if step.name != "scan":
        return {}
    start = sum(scan_counts(step.params))
    apart = computed(body)
    sizes = {v: nbytes(a) for s in body.steps for v, a in zip(s.ins, s.in_avals)}
    return {v: sizes[v] for v in body.inputs[start : len(step.ins)] if v in apart}


def copied_carries(step: Step, body: Block) -> dict[int, int]:
    """The carries of scan ``body`` that XLA copies at the body's start (value id -> bytes): those read by
    a step that the next carries do not depend on (a weight gradient read from the carried output
    gradient). XLA's copy insertion keeps such a copy, as it cannot order that read before the next
    carry overwrites the carry's buffer; seen in the backward loop of every layout (``copy`` of the
    carry's ``get-tuple-element``)."""
    if step.name != "scan":
        return {}
    consts, carries = scan_counts(step.params)
    made_by = {v: s for s in body.steps for v, _ in s.outs}
    needed: set[int] = set()
    todo = list(body.outputs[:carries])
    while todo:
        v = todo.pop()
        if v in needed:
            continue
        needed.add(v)
        if v in made_by:
            todo.extend(made_by[v].ins)
    inputs = body.inputs[consts : consts + carries]
    sizes = {v: nbytes(a) for s in body.steps for v, a in zip(s.ins, s.in_avals)}
    return {
        v: sizes[v]
        for v in inputs
        if v in sizes and any(v in s.ins and not any(o in needed for o, _ in s.outs) for s in body.steps)
    }


def stacked(step: Step) -> set[int]:
    """A scan's stacked results (its outputs past the carries): XLA allocates each from its block's start.

    JAX lowers a scan's stacked result to a loop carry initialised with a zero broadcast, which XLA's
    scheduler runs first in its computation like the other values made from constants alone (see
    :func:`scheduled`); one broadcast of a shape serves several loops, each then taking a copy of it
    made there too. So a stacked result holds its buffer from its block's start, not from its loop:
    a pipelined step runs a layer scan in each of its inline ticks, and all their stacked residuals
    are live at the step's start.
    """
    if step.name != "scan":
        return set()
    return {v for v, _ in step.outs[scan_counts(step.params)[1] :]}


def copied_updates(steps: list[Step]) -> dict[int, int]:
    """``dynamic_update_slice`` results that XLA writes into a copy of the updated value (result id -> value id).

    XLA updates a buffer in place, unless another step reads the old value and need not run before the
    update (it is not among the update's ancestors): then copy insertion gives the update a copy of the old
    value, which XLA's scheduler makes as soon as the old value is made. A pipeline's tick writes its
    forward's residuals into the ring the previous tick's backward still reads: every such tick holds two
    rings from the previous tick on. ``steps`` in order (each step after the ones it reads from).
    """
    made = {v: i for i, step in enumerate(steps) for v, _ in step.outs}
    read = readers(steps)
    copies: dict[int, int] = {}
    for i, step in enumerate(steps):
        if step.name != "dynamic_update_slice" or not step.ins[0]:
            continue
        others = {r for r in read[step.ins[0]] if r != i}
        if not others:
            continue
        # the update's ancestors, searched no further back than the earliest other reader
        earliest, todo = min(others), [i]
        seen: set[int] = set()
        while todo and not others <= seen:
            for v in steps[todo.pop()].ins:
                j = made.get(v)
                if j is not None and j >= earliest and j not in seen:
                    seen.add(j)
                    todo.append(j)
        if not others <= seen:
            copies[step.outs[0][0]] = step.ins[0]
    return copies


def updated(step: Step, copies: Mapping[int, int]) -> list[tuple[int, int]]:
    """``(result, updated value)`` of a ``dynamic_update_slice`` that XLA writes into the updated value's buffer
    (not given a copy: :func:`copied_updates`). One buffer then holds both, as a loop's carry does, where a
    buffer of each, overlapping at the update, would take two places in the heap for the ring's whole life."""
    if step.name != "dynamic_update_slice" or step.outs[0][0] in copies:
        return []
    return [(step.outs[0][0], step.ins[0])]


def scheduled(block: Block) -> list[Step]:
    """``block``'s steps in the order XLA runs them: those made from constants alone (zero-filled
    accumulators, masks) first, as XLA's scheduler was observed to place them; the rest as traced,
    except slices that free a value, run as soon as their operands exist (:func:`freeing_slices`)."""
    steps = [s for s in block.steps if not any(s.ins)] + [s for s in block.steps if any(s.ins)]
    early = freeing_slices(steps)
    if not early:
        return steps
    made = {v: i for i, step in enumerate(steps) for v, _ in step.outs}
    after: dict[int, list[int]] = {}  # step index -> steps run right after it (a slice, and its index arithmetic first)
    for j in sorted(early):
        index_steps, anchor, todo = set(), -1, list(steps[j].ins)
        while todo:
            i = made.get(todo.pop())
            if i is None or i in index_steps:
                continue
            if _index_arithmetic(steps[i]) and i not in early:
                index_steps.add(i)
                todo += steps[i].ins
            else:
                anchor = max(anchor, i)
        after.setdefault(anchor, []).extend([*sorted(index_steps), j])
    order: list[Step] = []
    done: set[int] = set()

    def run(i: int) -> None:
        if i not in done:
            done.add(i)
            order.append(steps[i])
            for k in after.get(i, []):
                run(k)

    for k in after.get(-1, []):
        run(k)
    for i in range(len(steps)):
        if i not in early:
            run(i)
    return order


def _index_arithmetic(step: Step) -> bool:
    """A step of scalars alone (an index computed from the device's position): XLA runs it wherever it is needed."""
    return not step.bodies and all(b <= 8 for _, b in step.outs)


def freeing_slices(steps: list[Step]) -> set[int]:
    """Indices of ``dynamic_slice`` steps that XLA runs as soon as their operands exist: all the readers of a
    value made in the block, each copying its slice out for matmuls (non-fusible readers; a slice that an
    element-wise step reads is fused into that step and runs there). XLA's list scheduler prefers a step that
    frees a buffer, and these together free the value: a pipeline's residual ring whose last backward reads
    it only through matmuls dies right after its last update, not where the cooldown's ticks read it (XLA's
    live ranges of the 1F1B step over ``stage=4 model=2``, small preset: two of eight 1-MiB rings and two of
    eight 512-KiB ones)."""
    read = readers(steps)
    made = {v: i for i, step in enumerate(steps) for v, _ in step.outs}
    early: set[int] = set()
    for v, at in read.items():
        if v in made and all(_copied_out_for_matmuls(steps[j], v, steps, read) for j in at):
            early.update(at)
    return {j for j in early if not any(made.get(v) in early for v in steps[j].ins)}


def _copied_out_for_matmuls(step: Step, value: int, steps: list[Step], read: Mapping[int, list[int]]) -> bool:
    """Whether ``step`` slices ``value`` into a buffer that only non-fusible steps read."""
    if step.name != "dynamic_slice" or step.ins[0] != value or value in step.ins[1:]:
        return False
    users = [k for out, _ in step.outs for k in read.get(out, [])]
    return bool(users) and all(steps[k].name not in FUSIBLE for k in users)


def last_uses(steps: list[Step], outputs: list[int], materialized: Set[int] = frozenset()) -> dict[int, int]:
    """Value id -> index of the step where it is last read (``len(steps)`` for the block's results).

    An element-wise step none of whose results is ``materialized`` runs inside the fusions of the steps that read
    it, so it reads its inputs where the last of those runs: a gradient summed over a pipeline's ticks (``g + a``,
    then ``+ b``, ...) is one fusion where the sum is stored, and every tick's term is live until then.
    """
    read_at = list(range(len(steps)))
    consumers = readers(steps)
    for i in reversed(range(len(steps))):
        step = steps[i]
        fused = step.name in FUSIBLE or step.name == "scatter-add"  # a scatter folded into a sum runs there
        if fused and step.outs and not any(v in materialized for v, _ in step.outs):
            read_at[i] = max((read_at[j] for v, _ in step.outs for j in consumers.get(v, [])), default=i)
    last: dict[int, int] = {}
    for i, step in enumerate(steps):
        for v in step.ins:
            last[v] = max(last.get(v, i), read_at[i])
    last.update({v: len(steps) for v in outputs})
    return last


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """One buffer: ``size`` bytes, live from tick ``start`` to tick ``end`` (both included)."""

    start: int
    end: int
    size: int


LOOP_TUPLE_SLOT = 8
"""Bytes per element of the tuple buffer an XLA loop carries (one pointer each)."""
THREEFRY_STATE = (4, 4, 4, 16, 16)
"""Bytes of the loop state XLA's CPU threefry keeps beside its two counter words: three key words
and two vectors of four rotation amounts."""


def loop_overhead(step: Step) -> list[int]:
    """Buffers XLA adds for a loop while it runs: the tuple of its carried values and its counter
    (and threefry's key schedule); each is 64 bytes at least, which counts in small programs."""
    if step.name in ("scan", "while"):
        slots = len(step.outs) + (step.name == "scan")  # a scan's counter is carried too
        return [_aligned(LOOP_TUPLE_SLOT * slots), _aligned(4)]
    if step.name == "threefry2x32":
        return [_aligned(LOOP_TUPLE_SLOT * (3 + len(THREEFRY_STATE))), _aligned(4)] + [
            _aligned(b) for b in THREEFRY_STATE
        ]
    return []


class _Clock:
    """Ticks shared by a block and the loop bodies inside it: a body runs within its loop's ticks."""

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now


def lifetimes(
    block: Block,
    elsewhere: Set[int] = frozenset(),
    copied_in: Mapping[int, int] | None = None,
    clock: _Clock | None = None,
) -> list[Lifetime]:
    """The buffers of values made inside ``block`` (its inputs belong to the caller), on one clock.

    ``elsewhere``: results of ``block`` held in the caller's buffers, not counted here (the whole
    step's results are the program's outputs, which XLA accounts apart from temporaries; a loop
    body writes into the loop's buffers, counted where the loop runs). ``copied_in``: inputs that
    the block holds a copy of from its start to their last use (id -> bytes; see :func:`sliced`).
    A step's inputs stay live to its end, and a loop body's buffers live within its loop's ticks,
    so the body's peak lands on top of what is live around the loop.
    """
    clock = clock or _Clock()
    materialized = computed(block) | unduplicated(block) | set(block.outputs)
    keep = materialized - set(elsewhere)
    steps = scheduled(block)
    update_copies = copied_updates(steps)
    # An update given a copy reads the old value where the copy is made (as soon as the old value is), not where
    # the update runs: the old value's last use is counted without that read.
    last = last_uses(
        [dataclasses.replace(s, ins=[0, *s.ins[1:]]) if s.outs and s.outs[0][0] in update_copies else s for s in steps],
        block.outputs,
        materialized,
    )
    due: dict[int, list[int]] = {}  # step index -> values last read there by a fused step, not by the step itself
    for i, step in enumerate(steps):
        for v in step.ins:
            j = last.get(v, i)
            if i < j < len(steps) and v not in steps[j].ins:
                due.setdefault(j, []).append(v)
    opened = clock.tick()
    made_at: dict[int, int] = {}  # value id -> the tick of the step that made it
    size = {v: _aligned(b) for v, b in (copied_in or {}).items() if v in last}
    born = dict.fromkeys(size, opened)
    found: list[Lifetime] = []
    relaid_copies = _relayout_copies(steps, set(block.inputs) - set(copied_in or {}))
    folded = folded_scatters(block)
    read_at: dict[int, int] = dict.fromkeys(block.inputs, opened)  # value id -> tick of its latest making or reading
    for i, step in enumerate(steps):
        start = clock.tick()
        copied = [(read_at.get(v, start), b) for v, b in relaid_copies.get(i, [])]
        read_at.update(dict.fromkeys(step.ins, start))
        read_at.update((v, start) for v, _ in step.outs)
        for out, init in carried(step) + updated(step, update_copies):
            if last.get(init) == i and init in size:
                size[out], born[out] = size.pop(init), born.pop(init)
        made = {v: _aligned(b) for v, b in step.outs if v in keep and v not in size}
        size.update(made)
        born.update(dict.fromkeys(made, start))
        born.update(dict.fromkeys(stacked(step) & made.keys(), opened))
        made_at.update((v, start) for v, _ in step.outs)
        born.update({v: made_at.get(update_copies[v], opened) for v in made.keys() & update_copies.keys()})
        for body, _ in step.bodies:
            found += lifetimes(body, in_place(step, body), {**sliced(step, body), **copied_carries(step, body)}, clock)
        end = clock.tick()
        if step.name not in FUSIBLE or any(v in folded for v in step.ins):
            # one layout out: a copy in another is made after the step, not beside it by the same fusion
            read_at.update((v, end + 1) for v, _ in step.outs)
        found += [Lifetime(start, end, b) for b in loop_overhead(step)]
        found += [Lifetime(at, end, _aligned(b)) for at, b in copied]
        for v in {*step.ins, *(v for v, _ in step.outs if v not in last), *due.get(i, ())}:
            if last.get(v, i) == i and v in size:
                found.append(Lifetime(born.pop(v), end, size.pop(v)))
    closed = clock.tick()
    return found + [Lifetime(born[v], closed, b) for v, b in size.items()]


def _best_fit(buffers: list[Lifetime]) -> int:
    """Heap bytes when each buffer, in the order given, takes the smallest gap that fits it among
    the buffers already placed whose lifetimes overlap its own (or the top of the heap); the earliest of
    equal gaps wins (:func:`_packed`)."""
    return _packed(*_arrays(buffers))


def _arrays(buffers: list[Lifetime]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers' starts, ends and sizes, as three arrays."""
    n = len(buffers)
    starts = np.fromiter((b.start for b in buffers), np.int64, n)
    ends = np.fromiter((b.end for b in buffers), np.int64, n)
    sizes = np.fromiter((b.size for b in buffers), np.int64, n)
    return starts, ends, sizes


def _packed(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> int:
    """:func:`_best_fit` of the buffers ``(starts[i], ends[i], sizes[i])`` in that order.

    The gaps are found with numpy over the buffers placed so far (a pipeline's step has thousands of
    buffers: a Python loop over the pairs took a minute). A buffer overlaps a hundred or so placed ones,
    so each numpy call's own cost is most of a step's: few calls are made, and ``nonzero`` rather than
    ``flatnonzero`` (half the cost)."""
    offsets = np.zeros(len(sizes), np.int64)
    top = 0
    for i, (start, end, size) in enumerate(zip(starts.tolist(), ends.tolist(), sizes.tolist())):
        overlap = ((starts[:i] <= end) & (ends[:i] >= start)).nonzero()[0]
        offset = 0
        if overlap.size:
            low = offsets[overlap]
            high = low + sizes[overlap]
            order = np.lexsort((high, low))
            low, high = low[order], high[order]
            below = np.maximum.accumulate(high)  # below[k]: the top of the buffers up to k, the floor of gap k + 1
            gaps = low.copy()  # gap k: from the floor (0 for the first) up to buffer k
            gaps[1:] -= below[:-1]
            fits = (gaps >= size).nonzero()[0]
            if fits.size:
                k = int(fits[gaps[fits].argmin()])
                offset = int(below[k - 1]) if k else 0
            else:
                offset = int(below[-1])
        offsets[i] = offset
        top = max(top, offset + size)
    return top


def heap_bytes(buffers: list[Lifetime]) -> int:
    """Bytes of the heap XLA's buffer assignment packs ``buffers`` into: its decreasing-size
    best-fit heap, placed largest first and longest-lived first, whichever packs smaller. A
    buffer cannot reuse a gap smaller than itself, so the heap can exceed the peak of live bytes.

    No packing is smaller than that peak, so where the first packing reaches it the second is not made
    (48 of the 8B llama search's
    74 heaps: about 2 of its 62 CPU-s, the result the same)."""
    starts, ends, sizes = _arrays(buffers)
    by_size = np.lexsort((starts, starts - ends, -sizes))  # stable, as sorted() by (-size, start - end, start)
    packed = _packed(starts[by_size], ends[by_size], sizes[by_size])
    if packed == _live_peak(starts, ends, sizes):
        return packed
    by_length = np.lexsort((starts, -sizes, starts - ends))
    return min(packed, _packed(starts[by_length], ends[by_length], sizes[by_length]))


def live_peak(buffers: list[Lifetime]) -> int:
    """The most bytes of ``buffers`` live at one tick: a lower bound on any packing of them."""
    return _live_peak(*_arrays(buffers))


def _live_peak(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> int:
    if not len(sizes):
        return 0
    change = np.zeros(int(ends.max()) + 2, np.int64)
    np.add.at(change, starts, sizes)
    np.add.at(change, ends + 1, -sizes)
    return int(np.max(np.cumsum(change)))


def peak_bytes(block: Block, elsewhere: Set[int] = frozenset()) -> int:
    """Heap bytes of the temporaries made inside ``block`` (see :func:`lifetimes` and :func:`heap_bytes`)."""
    return heap_bytes(lifetimes(block, elsewhere))


def breakdown(state: Any, batch: Any, layout: md.Layout, mesh: md.Mesh, body: Block) -> MemoryBreakdown:
    """The :class:`MemoryBreakdown` of a step on ``state`` and ``batch`` whose per-device program is ``body``.

    The traced program takes the batch as an input; the real step makes it first, from a key. So
    the batch counts as a temporary beside the step's own, and making it (traced once on global
    arrays, scaled to this device's share of the batch) is a peak of its own before the step runs:
    XLA's heap reuses its buffers for the step's (the mlp at the small preset: 3.1 MiB of
    temporaries a device, the step's peak and its batch, where adding the making's 1.5 MiB over-counted
    by 25%).
    """
    stored = layout.param_layout
    params = local_bytes(state["params"], stored, mesh)
    opt = local_bytes(state["opt"], stored, mesh)
    other = local_bytes({k: v for k, v in state.items() if k not in ("params", "opt")}, stored, mesh)
    local = local_bytes(batch.shapes, layout, mesh)
    whole = local_bytes(batch.shapes, md.Layout(), mesh)
    making = batch.making_peak * local // max(whole, 1)
    temporaries = max(peak_bytes(body, set(body.outputs)), making) + local
    return MemoryBreakdown(params, opt, params, temporaries, other)
