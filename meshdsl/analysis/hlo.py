"""The collectives a compiled program really runs, read from its HLO text.

``md.explain`` predicts the collectives of a program from its trace; this module reads them
back from what XLA compiled (``jax.jit(f).lower(*args).compile().as_text()``) so the two can
be compared. Both sides price a collective with :func:`meshdsl.collectives.bytes_moved`, so
they agree to the byte when the compiler did what meshdsl asked.

What is counted, per device:

* Every ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` and
  ``collective-permute`` reachable from the ``ENTRY`` computation. Async pairs count once, at
  their ``-start``; ``-update``/``-done`` are skipped. Other collectives (``ragged-all-to-all``,
  ``collective-broadcast``, ...) are not counted: meshdsl never emits them.
* Its output buffer comes from the instruction's own result type; its input follows from it
  (:func:`meshdsl.collectives.input_bytes`), since operand shapes are not printed inline, and
  :func:`meshdsl.collectives.bytes_moved` picks the buffer ``S`` it prices from the two. XLA's
  combiners merge independent all-reduces (and all-gathers, reduce-scatters) into one
  instruction with a tuple result: each element is its own reduction and counts as one, so
  counts do not depend on what the combiner merged. A tuple ``all-to-all`` is one exchange cut
  into pieces and counts once.
* Its group size comes from ``replica_groups`` in any of its printed forms (explicit lists,
  iota ``[g,n]<=[...]``, ``mesh[...] {axes}``); an absent or empty list means every device.
* How often it runs: reached through ``while`` loops it runs once per iteration of each
  enclosing loop (XLA's ``known_trip_count``; a loop condition runs one time more than its
  body). Computations reached through ``call``, fusions' and async ops' ``calls=`` run once per
  call. Each branch of a ``conditional`` is counted as if taken, so with collectives in
  branches the totals are an upper bound. Reduction functions (``to_apply`` of a collective,
  ``reduce``, ``sort``, ...) are not entered: they compute, they do not communicate.
* A ``collective-permute`` moves bytes only from the sources of its pairs: :func:`summary`
  totals each kind per device and reports the busiest device's
  (:func:`meshdsl.collectives.busiest_device`), as ``md.explain`` does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np

from meshdsl.collectives import Collective, busiest_device, bytes_moved, input_bytes, priced_buffer

_KINDS = {c.value: c for c in Collective}

_COMMENT = re.compile(r"/\*.*?\*/")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_NAME = r"%?([\w.\-]+)"
_NAMES = r"\{([^}]*)\}"


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective instruction of a compiled program, with how often it runs."""

    collective: Collective
    in_bytes: Fraction
    """One device's input buffer (:func:`meshdsl.collectives.input_bytes` of the output: the text prints no
    operand shapes; a fraction where an all-gather's odd-sized output does not split into whole bytes)."""
    out_bytes: int
    """One device's output buffer."""
    group_size: int
    """Devices per replica group; for ``collective-permute`` the distinct devices in its pairs."""
    count: int
    """Executions per program run: the product of the trip counts of the enclosing loops."""
    group: tuple[int, ...] = ()
    """Partition ids of the first replica group, in order (a partition id indexes the mesh's
    devices in row-major order); for ``collective-permute`` every id its pairs name. Empty
    where the printed form cannot be read as ids."""
    pairs: tuple[tuple[int, int], ...] = ()
    """``collective-permute``: its (source, target) partition ids."""
    op_name: str = ""
    """The ``op_name`` of the instruction's metadata: the JAX name stack it was lowered from."""

    @property
    def buffer_bytes(self) -> int:
        """``S`` of the ring model (:func:`meshdsl.collectives.priced_buffer`)."""
        return int(priced_buffer(self.collective, self.in_bytes, self.out_bytes, self.group_size))

    @property
    def bytes_per_device(self) -> float:
        """Bytes one device sends over all :attr:`count` executions."""
        return float(bytes_moved(self.collective, self.in_bytes, self.out_bytes, self.group_size) * self.count)

    @property
    def senders(self) -> frozenset[int] | None:
        """The partition ids that send: a permute's sources; None (every device) for the other kinds, and
        for a permute whose pairs could not be read."""
        return frozenset(a for a, _ in self.pairs) if self.pairs else None


_Walk = Callable[[str], list[HloCollective]]
"""Collectives of one execution of the named computation."""


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    result_type: str
    opcode: str
    attributes: str
    """Everything after the operand list: ``channel_id=..., replica_groups=..., ...``."""


def collectives(hlo_text: str, *, num_devices: int | None = None) -> list[HloCollective]:
    """Every collective reachable from the ``ENTRY`` computation of ``hlo_text``, in program order.

    ``num_devices`` sizes the groups of collectives over all devices (``replica_groups={}``);
    without it the ``HloModule`` header's ``replica_count`` × ``num_partitions`` is used.
    Raises ``ValueError`` for a loop holding collectives without a known trip count, or for an
    all-device group when the device count is neither given nor in a header.
    """
    computations, entry = _parse(hlo_text)
    devices = num_devices if num_devices is not None else _header_devices(hlo_text)
    cache: dict[str, list[HloCollective]] = {}

    def walk(name: str) -> list[HloCollective]:
        """The collectives of one execution of computation ``name``."""
        if name not in cache:
            found: list[HloCollective] = []
            for instruction in computations[name]:
                found.extend(_visit(instruction, walk, devices))
            cache[name] = found
        return cache[name]

    return walk(entry)


def summary(hlo_text: str, *, num_devices: int | None = None) -> dict[str, dict[str, float]]:
    """Totals per collective kind present: ``{"all-reduce": {"count": runs, "bytes": bytes per device}}``.

    ``bytes`` is what the busiest device sends (:func:`meshdsl.collectives.busiest_device`): a
    permute counts only on its sources."""
    found = collectives(hlo_text, num_devices=num_devices)
    totals: dict[str, dict[str, float]] = {}
    for k in Collective:
        mine = [c for c in found if c.collective is k]
        if mine:
            totals[k.value] = {
                "count": sum(c.count for c in mine),
                "bytes": busiest_device((c.bytes_per_device, c.senders) for c in mine),
            }
    return totals


def _visit(instruction: _Instruction, walk: _Walk, devices: int | None) -> Iterator[HloCollective]:
    """The collectives one execution of ``instruction`` runs, itself or in what it calls."""
    opcode = instruction.opcode
    if opcode.endswith(("-update", "-done")):
        return
    kind = _KINDS.get(opcode.removesuffix("-start"))
    if kind is not None:
        yield from _collective(instruction, kind, devices)
        return
    for callee, times in _callees(instruction, walk):
        for c in walk(callee):
            yield dataclasses.replace(c, count=c.count * times)


def _callees(instruction: _Instruction, walk: _Walk) -> list[tuple[str, int]]:
    """The computations ``instruction`` runs, with how many times each runs per execution."""
    attributes = instruction.attributes
    if instruction.opcode == "while":
        body, condition = _attribute(attributes, "body"), _attribute(attributes, "condition")
        trip = _TRIP_COUNT.search(attributes)
        if trip is None:
            if walk(body) or walk(condition):
                raise ValueError(
                    f"while loop %{instruction.name} runs collectives but has no known_trip_count in its "
                    "backend_config, so how often they run cannot be counted"
                )
            return []
        n = int(trip.group(1))
        return [(body, n), (condition, n + 1)]
    if instruction.opcode == "call":
        return [(_attribute(attributes, "to_apply"), 1)]
    if instruction.opcode == "conditional":
        branches = re.search(r"\bbranch_computations=" + _NAMES, attributes)
        if branches:
            return [(name, 1) for name in _names(branches.group(1))]
        return [(_attribute(attributes, f), 1) for f in ("true_computation", "false_computation")]
    calls = re.search(r"\bcalls=(?:" + _NAMES + "|" + _NAME + ")", attributes)
    if calls is None:
        return []
    return [(name, 1) for name in _names(calls.group(1) or calls.group(2))]


def _collective(instruction: _Instruction, kind: Collective, devices: int | None) -> list[HloCollective]:
    """One execution of the collective ``instruction``: one entry per buffer it moves.

    XLA's combiners merge independent all-reduces (all-gathers, reduce-scatters) into one
    instruction with a tuple result; each element is still its own reduction, so each counts.
    A tuple all-to-all is one exchange split into pieces, so it counts once.
    """
    output = instruction.result_type
    # Async starts return (operands, outputs, context...); all-reduce-start returns just outputs.
    if instruction.opcode.endswith("-start") and kind is not Collective.ALL_REDUCE:
        output = _tuple_elements(output)[1]
    op_name = re.search(r'\bop_name="([^"]*)"', instruction.attributes)
    pairs: tuple[tuple[int, int], ...] = ()
    if kind is Collective.COLLECTIVE_PERMUTE:
        printed = re.search(r"\bsource_target_pairs=\{(.*?)\}\}", instruction.attributes)
        pairs = (
            tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", printed.group(1) + "}")) if printed else ()
        )
        ids = tuple(sorted({i for pair in pairs for i in pair}))
        group = len(ids)
    else:
        group, ids = _replica_group(instruction, devices)
    combined = output.startswith("(") and kind not in (Collective.ALL_TO_ALL, Collective.COLLECTIVE_PERMUTE)
    buffers = _tuple_elements(output) if combined else [output]
    name = op_name.group(1) if op_name else ""
    return [
        HloCollective(kind, input_bytes(kind, _bytes(b), group), _bytes(b), group, 1, ids, pairs, name) for b in buffers
    ]


def _replica_group(instruction: _Instruction, devices: int | None) -> tuple[int, tuple[int, ...]]:
    """Devices per replica group and the first group's partition ids (empty where they cannot be
    read), from whichever form ``replica_groups`` is printed in."""
    attributes = instruction.attributes
    explicit = re.search(r"\breplica_groups=\{\{([^}]*)\}", attributes)
    if explicit:
        ids = tuple(int(i) for i in explicit.group(1).split(","))
        return len(ids), ids
    iota = re.search(r"\breplica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
        groups = [int(n) for n in iota.group(1).split(",")]
        return groups[-1], tuple(int(i) for i in _iota(iota.group(2), iota.group(3)).reshape(-1, groups[-1])[0])
    # mesh['a'=4,'b'=2] {'a'}, maybe with ", device_ids=([4,2]T(1,0))" before the axes.
    mesh = re.search(
        r"\breplica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^{}]*)\}",
        attributes,
    )
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'?([^'=,\s]+)'?=(\d+)", mesh.group(1))}
        selected = []
        for axis in mesh.group(4).split(","):
            ref = re.fullmatch(r"\s*'?([^':]+)'?(?::\((\d+)\)(\d+))?\s*", axis)  # name or name:(pre)size
            if ref is None or ref.group(1) not in sizes:
                raise ValueError(f"cannot read mesh axis {axis!r} in the replica groups of %{instruction.name}")
            name = ref.group(1)
            selected.append((name, int(ref.group(2) or 1), int(ref.group(3) or sizes[name])))
        order = _iota(mesh.group(2), mesh.group(3)) if mesh.group(2) else np.arange(math.prod(sizes.values()))
        order = order.reshape(tuple(sizes.values()))
        members: list[int] = []
        for combo in itertools.product(*[range(size) for _, _, size in selected]):
            position = dict.fromkeys(sizes, 0)
            for (name, pre, size), i in zip(selected, combo):
                position[name] += i * (sizes[name] // (pre * size))
            members.append(int(order[tuple(position.values())]))
        return len(members), tuple(members)
    if devices is None:
        raise ValueError(
            f"%{instruction.name} runs over all devices (no replica groups) and the device count is "
            "unknown: pass num_devices=, or give the text with its HloModule header"
        )
    return devices, tuple(range(devices))


def _iota(dims: str, permutation: str | None) -> np.ndarray:
    """The ids of an iota list ``[dims]T(permutation)``, flat, in order."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if permutation:
        ids = ids.transpose([int(p) for p in permutation.split(",")])
    return ids.reshape(-1)


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """The instructions of each computation, and the name of the entry computation."""
    computations: dict[str, list[_Instruction]] = {}
    entry = None
    current: list[_Instruction] | None = None
    for line in _COMMENT.sub("", hlo_text).splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header:
                current = computations[header.group(2)] = []
                entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif match := _INSTRUCTION.match(line):
            current.append(_instruction(match.group(1), match.group(2)))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _instruction(name: str, text: str) -> _Instruction:
    """Split ``TYPE opcode(operands), attributes`` into its parts."""
    type_end = _balanced_end(text, 0, stop_at_space=True)
    opcode = _OPCODE.match(text, type_end)
    if opcode is None:
        raise ValueError(f"cannot read the opcode of %{name}: {text[:120]!r}")
    operands_end = _balanced_end(text, opcode.end() - 1)
    return _Instruction(name, text[:type_end], opcode.group(1), text[operands_end:])


def _balanced_end(text: str, start: int, stop_at_space: bool = False) -> int:
    """Index just past the bracketed group at ``start`` (or, with ``stop_at_space``, the first
    space outside brackets)."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and not stop_at_space:
                return i + 1
        elif ch.isspace() and depth == 0 and stop_at_space:
            return i
    return len(text)


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, b, ...)``."""
    if not shape.startswith("("):
        raise ValueError(f"expected a tuple type, got {shape!r}")
    elements, depth, begin = [], 0, 1
    for i, ch in enumerate(shape[:-1]):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            elements.append(shape[begin:i].strip())
            begin = i + 1
    elements.append(shape[begin:-1].strip())
    return elements


def _bytes(shape: str) -> int:
    """Bytes of every array in ``shape`` (a tuple's are summed); a sub-byte element takes a byte."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in ("token", "opaque"):
            continue
        width = re.match(r"[a-z]+?(\d+)", dtype)
        if dtype != "pred" and width is None:
            raise ValueError(f"unknown element type {dtype!r} in {shape!r}")
        bits = int(width.group(1)) if width else 8
        elements = math.prod(int(d.removeprefix("<=")) for d in dims.split(",") if d)
        total += elements * max(1, bits // 8)
    return total


def _header_devices(hlo_text: str) -> int | None:
    """``replica_count`` × ``num_partitions`` from the ``HloModule`` line (the printer omits a 1)."""
    header = re.search(r"^HloModule\b.*$", hlo_text, re.MULTILINE)
    if header is None:
        return None
    counts = [re.search(rf"\b{key}=(\d+)", header.group(0)) for key in ("replica_count", "num_partitions")]
    return math.prod(int(c.group(1)) if c else 1 for c in counts)


def _attribute(attributes: str, key: str) -> str:
    """The computation named by ``key=%name``."""
    match = re.search(rf"\b{key}=" + _NAME, attributes)
    if match is None:
        raise ValueError(f"no {key}= in {attributes[:120]!r}")
    return match.group(1)


def _names(text: str) -> list[str]:
    """Computation names from a ``%a, %b`` list."""
    return [name.strip().lstrip("%") for name in text.split(",") if name.strip()]
