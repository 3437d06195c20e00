"""The processor mesh: devices arranged in an array with named axes."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from meshdsl.errors import LayoutError

DEVICE_FLAG = "--xla_force_host_platform_device_count"
"""The XLA flag that makes the CPU backend simulate several devices."""
_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _parse(axes: Mapping[str, int] | str | Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    if isinstance(axes, str):
        items = []
        for part in axes.replace(",", " ").split():
            name, eq, size = part.partition("=")
            if not eq or not re.fullmatch(r"-?\d+", size.strip()):
                raise LayoutError(
                    f"malformed mesh axis {part!r} in {axes!r}: expected name=size, e.g. 'data=4 model=2'"
                )
            items.append((name.strip(), int(size)))
        return items
    if isinstance(axes, Mapping):
        return [(str(k), v) for k, v in axes.items()]
    if isinstance(axes, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in axes):
        return [(str(k), v) for k, v in axes]
    raise LayoutError(
        f"mesh axes must be a dict, a string like 'data=4 model=2' or (name, size) pairs, got {type(axes).__name__} "
        f"{axes!r}"
    )


def _devices(devices: Any) -> list:
    """``devices`` as a list of distinct JAX devices; LayoutError naming what else it holds."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise LayoutError(
            f"mesh devices must be a list of JAX devices (e.g. jax.devices()), got {type(devices).__name__} {devices!r}"
        )
    out = list(np.asarray(devices, dtype=object).flat) if isinstance(devices, np.ndarray) else list(devices)
    for d in out:
        if not isinstance(d, jax.Device):
            raise LayoutError(
                f"mesh devices must be JAX devices (e.g. jax.devices()), got {type(d).__name__} {d!r} among them"
            )
    seen: set = set()
    for d in out:
        if d in seen:
            raise LayoutError(f"mesh devices list {d} twice; each device may hold one place of the mesh")
        seen.add(d)
    return out


class _TooFew(LayoutError):
    """A mesh larger than the devices there are (``size``: the devices it needs)."""

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size


def axis_sizes(axes: Mapping[str, int] | str | Sequence[tuple[str, int]], devices: int) -> dict[str, int]:
    """The axis sizes of a mesh ``axes`` on ``devices`` devices (a ``-1`` axis takes what the others
    leave); LayoutError for a malformed mesh or one that needs more devices than that. What ``Mesh``
    builds its grid from, and what ``meshdsl launch`` checks before any process (or device) exists."""
    items = _parse(axes)
    names = [n for n, _ in items]
    for name, size in items:
        if not _AXIS.match(name):
            raise LayoutError(f"mesh axis name {name!r} is not an identifier")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
            raise LayoutError(f"mesh axis {name} has size {size!r}; a size is a positive int or -1")
    if len(set(names)) != len(names):
        raise LayoutError(f"mesh axes {names} repeat a name")
    wildcards = [n for n, s in items if s == -1]
    if len(wildcards) > 1:
        raise LayoutError(
            f"mesh axes {', '.join(wildcards)} are all -1; at most one axis may take the remaining devices"
        )
    fixed = math.prod(int(s) for _, s in items if s != -1)
    if wildcards:
        if devices % fixed:
            raise LayoutError(
                f"mesh axis {wildcards[0]}=-1 takes the devices the others leave, but {devices} devices "
                f"are not divisible by {fixed} (the product of the other axes)"
            )
        items = [(n, devices // fixed if s == -1 else int(s)) for n, s in items]
    sizes = {n: int(s) for n, s in items}
    size = math.prod(sizes.values())
    if size > devices:
        shown = " ".join(f"{n}={s}" for n, s in sizes.items())
        raise _TooFew(f"mesh {shown} needs {size} devices, but only {devices} are available", size)
    return sizes


class Mesh:
    """Devices arranged as an array with named axes: ``Mesh({"data": 4, "model": 2})``.

    Also ``Mesh("data=4 model=2")``. One size may be ``-1``: all the devices the others leave.
    ``devices`` defaults to ``jax.devices()``; the mesh uses the first ``size`` of them.
    """

    def __init__(self, axes: Mapping[str, int] | str | Sequence[tuple[str, int]], devices: Sequence | None = None):
        given = devices is not None
        devices = _devices(devices) if given else list(jax.devices())
        try:
            self.axis_sizes: dict[str, int] = axis_sizes(axes, len(devices))
        except _TooFew as e:
            hint = (
                ""
                if given or devices[0].platform != "cpu"
                else (
                    f"; on a machine without accelerators, simulate {e.size} CPU devices by setting "
                    f"XLA_FLAGS={DEVICE_FLAG}={e.size} before JAX starts (or jax.config.update('jax_num_cpu_devices', "
                    f"{e.size}) before its first use)"
                )
            )
            raise LayoutError(f"{e}{hint}") from None
        grid = np.array(devices[: self.size], dtype=object).reshape(tuple(self.axis_sizes.values()))
        self.jax_mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh = jax.sharding.Mesh(grid, tuple(self.axis_sizes))

    @classmethod
    def abstract(cls, axis_sizes: Mapping[str, int]) -> Mesh:
        """A mesh with axis names and sizes but no devices: enough to trace, not to run."""
        mesh = cls.__new__(cls)
        mesh.axis_sizes = {str(k): int(v) for k, v in axis_sizes.items()}
        auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_sizes)
        mesh.jax_mesh = jax.sharding.AbstractMesh(mesh.shape, mesh.axis_names, axis_types=auto)
        return mesh

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.axis_sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.axis_sizes.values())

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.axis_sizes.values())

    @property
    def devices(self) -> np.ndarray:
        return self.jax_mesh.devices

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.jax_mesh == other.jax_mesh

    def __hash__(self) -> int:
        return hash(self.jax_mesh)

    def __str__(self) -> str:
        return " ".join(f"{n}={s}" for n, s in self.axis_sizes.items())

    def __repr__(self) -> str:
        return f"Mesh({str(self)!r})"
