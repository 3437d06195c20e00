"""Device profiles: how fast a device computes and how fast its collectives run.

A profile gives the matmul rate, the memory bandwidth (for element-wise work), the memory size,
and for each collective kind a latency and a bandwidth, once for links inside a node (NVLink,
ICI) and once across nodes. A mesh axis whose devices all sit in one node (``node_size``
consecutive devices; the last mesh axis is the fastest-varying) uses the inside link.

Shipped profiles (``meshdsl/planner/profiles/*.json``) come from vendor datasheets, except
``cpu-sim``, which ``meshdsl calibrate`` measured on the simulated CPU mesh. A datasheet profile
leaves its matmul rate to :mod:`meshdsl.measure.peaks` (the one table of peak FLOP/s).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from meshdsl.collectives import Collective
from meshdsl.errors import ConfigError
from meshdsl.measure.peaks import peak_flops
from meshdsl.runtime import output_paths

KINDS = tuple(c.value for c in Collective)


@dataclasses.dataclass(frozen=True)
class Link:
    """One collective kind on one kind of link: ``latency_s`` per call plus bytes / ``bandwidth`` (bytes/s per
    device)."""

    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: float, calls: int) -> float:
        return calls * self.latency_s + nbytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know about one device kind (see the module docstring)."""

    name: str
    source: str
    platform: str
    device_kind: str
    memory_bytes: float
    memory_bandwidth: float
    node_size: int
    intra: Mapping[str, Link]
    inter: Mapping[str, Link]
    matmul_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    attention_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Measured FLOP/s of the fused attention kernel per dtype (its matmuls as the planner counts them,
    forward and backward, causal half); a dtype without one is priced at the matmul rate."""

    def matmul_rate(self, dtype: str = "float32") -> float:
        """Matmul FLOP/s of one device in ``dtype``: measured, else the datasheet peak from measure.peaks."""
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        peak = peak_flops(self.device_kind, dtype)
        if peak is None:
            raise ConfigError(
                f"device profile {self.name!r} has no matmul rate for {dtype} and measure.peaks knows no peak for "
                f"{self.device_kind!r}"
            )
        return peak

    def attention_rate(self, dtype: str = "float32") -> float:
        """FLOP/s of fused attention in ``dtype``: measured (``meshdsl calibrate`` on a GPU), else the matmul rate."""
        return self.attention_flops.get(dtype) or self.matmul_rate(dtype)

    def link(self, kind: str, span: int) -> Link:
        """The link a collective of ``kind`` over a group spanning ``span`` consecutive devices uses."""
        return (self.intra if span <= self.node_size else self.inter)[kind]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["intra"] = {k: dataclasses.asdict(v) for k, v in self.intra.items()}
        data["inter"] = {k: dataclasses.asdict(v) for k, v in self.inter.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> DeviceProfile:
        """The profile a JSON object describes; ConfigError naming the field that is missing, or not a positive number
        where one is needed."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"device profile {where} holds a JSON {type(data).__name__}, not an object")
        try:
            links = {side: {k: Link(**data[side][k]) for k in KINDS} for side in ("intra", "inter")}
            fields: dict[str, Any] = {
                k: data[k]
                for k in ("name", "source", "platform", "device_kind", "memory_bytes", "memory_bandwidth", "node_size")
            }
            rates = dict(data.get("matmul_flops", {}))
            attention = dict(data.get("attention_flops", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"device profile {where}: missing or malformed field {e}") from None
        positive = {k: fields[k] for k in ("memory_bytes", "memory_bandwidth", "node_size")}
        positive |= {
            f"{side}.{k}.bandwidth": link.bandwidth for side, kinds in links.items() for k, link in kinds.items()
        }
        positive |= {f"matmul_flops.{k}": v for k, v in rates.items()}
        positive |= {f"attention_flops.{k}": v for k, v in attention.items()}
        latencies = {
            f"{side}.{k}.latency_s": link.latency_s for side, kinds in links.items() for k, link in kinds.items()
        }
        for name, value in (positive | latencies).items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or value < 0 or (value == 0 and name in positive):
                need = "a positive number" if name in positive else "a number >= 0"
                raise ConfigError(f"device profile {where}: {name} is {value!r}; it must be {need}")
        return cls(**fields, intra=links["intra"], inter=links["inter"], matmul_flops=rates, attention_flops=attention)

    def save(self, path: str | Path, measurements: list[dict[str, Any]] | None = None) -> None:
        """Write as JSON; ``measurements``: calibration's raw points, kept beside the fit for reference."""
        data = self.to_json() | ({"measurements": measurements} if measurements else {})
        output_paths.parent(path).write_text(json.dumps(data, indent=2) + "\n")


def shipped() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(
        p.name[:-5]
        for p in resources.files("meshdsl.planner").joinpath("profiles").iterdir()
        if p.name.endswith(".json")
    )


def load_profile(spec: str | Path) -> DeviceProfile:
    """A profile from a JSON file, or a shipped one by name (``h100``, ``cpu-sim``, ...)."""
    path = Path(spec)
    if path.is_file():
        where = repr(str(path))
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ConfigError(
                f"device profile {where} is not a JSON text file (it is binary: byte {path.read_bytes()[:1]!r} first)"
            ) from None
    elif path.is_dir():
        raise ConfigError(
            f"device profile {str(spec)!r} is a directory; give a JSON file or a shipped profile "
            f"({', '.join(shipped())})"
        )
    elif str(spec) in shipped():
        text, where = (
            resources.files("meshdsl.planner").joinpath("profiles", f"{spec}.json").read_text(),
            repr(str(spec)),
        )
    else:
        raise ConfigError(
            f"device profile {str(spec)!r} is neither a file nor a shipped profile ({', '.join(shipped())})"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"device profile {where} is not valid JSON: {e}") from None
    return DeviceProfile.from_json(data, where)


def default_profile() -> DeviceProfile:
    """The profile of the devices at hand: ``cpu-sim`` on CPU, else the shipped one whose device kind matches."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return load_profile("cpu-sim")
    for name in shipped():
        profile = load_profile(name)
        if (
            profile.device_kind.lower() in device.device_kind.lower()
            or device.device_kind.lower() in profile.device_kind.lower()
        ):
            return profile
    raise ConfigError(
        f"no shipped device profile matches {device.device_kind!r}; run meshdsl calibrate and pass --profile FILE"
    )
