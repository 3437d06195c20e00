"""``meshdsl calibrate``: measure the devices at hand into a :class:`DeviceProfile`.

Every measurement runs on all devices at once (one ``shard_map``), as a training step does, so
devices that share hardware (simulated CPU devices share the host's cores) are measured as they
will run. Measured: the matmul rate (f32, and bf16 where the device has it), the memory
bandwidth of element-wise work, the rate of causal attention with the kernel meshdsl picks
there (cuDNN's fused attention for bf16 on a GPU: what the planner prices fused attention at;
measured on one device), and for each collective kind, each mesh axis of a 1-D and a 2-D
mesh and several buffer sizes, the time of one call. Latency and bandwidth per kind are the
least-squares line ``time = latency + bytes / bandwidth`` through those points, with bytes from
:func:`meshdsl.collectives.bytes_moved` (the cost model's own rule).

Rates are measured at growing problem sizes until they stop rising (:func:`saturated`): a GPU's
bf16 matmul needs thousands of rows to reach its rate, a CPU's a few hundred. One device has no
links: its profile takes them from the shipped profile of its device kind (``cpu-sim`` on a
CPU), and says so in its ``source``.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshdsl.collectives import Collective, bytes_moved
from meshdsl.errors import ConfigError
from meshdsl.measure import fits
from meshdsl.planner.profile import KINDS, DeviceProfile, Link, default_profile
from meshdsl.runtime.compiler_options import compiler_options

SIZES = (2**14, 2**17, 2**20)
"""Buffer bytes per device the collectives are measured at."""
RISE = 0.1
"""A size's rate must beat the last one's by this fraction for the sizes to keep growing."""
MAX_CALL_S = 0.25
"""The sizes stop growing once one call takes longer than this (seconds)."""
MATMUL_SIZES = tuple(2**k for k in range(8, 15))
"""Matmul sides tried, smallest first (256 to 16384)."""
BANDWIDTH_SIZES = tuple(2**k for k in range(22, 31, 2))
"""Element-wise buffer bytes tried, smallest first (4 MiB to 1 GiB)."""
ATTENTION_LENGTHS = (512, 1024, 2048, 4096)
"""Sequence lengths the attention rate is measured at, shortest first."""
ATTENTION_SHAPE = (4, 16, 128)
"""Batch, heads and head size of the attention measured (the 1b preset's heads)."""


def _time(fn: Callable[[], Any], repeats: int = 5, inner: int = 3) -> float:
    """Median seconds of one call of ``fn`` (after a warm-up call)."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _per_device(mesh: jax.sharding.Mesh, body: Callable, local_shape: tuple[int, ...], dtype: Any) -> Callable[[], Any]:
    """``body`` run on every device of ``mesh`` on a local array of ``local_shape``."""
    names = mesh.axis_names
    global_shape = (local_shape[0] * mesh.size, *local_shape[1:])
    spec = P(names)
    x = jax.device_put(jnp.ones(global_shape, dtype), NamedSharding(mesh, spec))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False),
        compiler_options=compiler_options(mesh.devices.flat[0].platform),
    )
    return functools.partial(fn, x)


def saturated(
    measure: Callable[[int], tuple[float, float]],
    sizes: Sequence[int],
    rise: float = RISE,
    max_call_s: float = MAX_CALL_S,
) -> tuple[int, float]:
    """The best (size, rate) of ``measure(size) -> (rate, seconds per call)`` over ``sizes``, tried
    smallest first until the rate rises by less than ``rise`` over the previous size, or a call
    takes over ``max_call_s``, or a size would not fit the device (:func:`meshdsl.measure.fits`
    is checked by the caller's ``measure`` raising ``MemoryError``)."""
    best: tuple[int, float] | None = None
    previous = 0.0
    for size in sizes:
        try:
            rate, seconds = measure(size)
        except MemoryError:
            break
        if best is None or rate > best[1]:
            best = (size, rate)
        if rate < previous * (1 + rise) or seconds > max_call_s:
            break
        previous = rate
    if best is None:
        raise ConfigError(f"calibrate: even the smallest size ({sizes[0]}) does not fit the device's memory")
    return best


def _fits(nbytes: int) -> None:
    """MemoryError when buffers of ``nbytes`` per device would take over a quarter of a device."""
    cap = fits.capacity()
    if cap is not None and 4 * nbytes > cap.bytes:
        raise MemoryError(nbytes)


def matmul_rate(mesh: jax.sharding.Mesh, dtype: Any, sizes: Sequence[int] = MATMUL_SIZES) -> float:
    """FLOP/s of one device doing ``n x n`` matmuls while every device does, ``n`` grown until the rate saturates."""

    def measure(n: int) -> tuple[float, float]:
        _fits(3 * n * n * jnp.dtype(dtype).itemsize)
        seconds = _time(_per_device(mesh, lambda x: x @ x, (n, n), dtype))
        return 2.0 * n**3 / seconds, seconds

    return saturated(measure, sizes)[1]


def memory_bandwidth(mesh: jax.sharding.Mesh, sizes: Sequence[int] = BANDWIDTH_SIZES) -> float:
    """Bytes/s of element-wise work per device (written and read once, as the cost model counts),
    the buffer grown until the rate saturates."""

    def measure(nbytes: int) -> tuple[float, float]:
        _fits(2 * nbytes)
        seconds = _time(_per_device(mesh, lambda x: x * 1.5 + 1.0, (nbytes // 4,), jnp.float32))
        return 2.0 * nbytes / seconds, seconds

    return saturated(measure, sizes)[1]


def attention_rate(
    dtype: Any, lengths: Sequence[int] = ATTENTION_LENGTHS, shape: tuple[int, int, int] = ATTENTION_SHAPE
) -> tuple[float, str]:
    """FLOP/s of one device's causal attention, forward and backward, with the kernel meshdsl chooses
    for ``dtype`` here (cuDNN's fused attention on a GPU, XLA's formula elsewhere), counted as the
    planner counts the fused kernel (:data:`meshdsl.planner.flops.FUSED_ATTENTION`: 2 + 5 matmuls,
    causal half), the length grown until the rate saturates; and the kernel's name."""
    from meshdsl.nn.attention_impl import implementation_here
    from meshdsl.planner.flops import FUSED_ATTENTION, attention_flops

    b, n, h = shape
    kernel = implementation_here(dtype, h, "causal")
    passes = sum(FUSED_ATTENTION.values()) / 2

    def measure(t: int) -> tuple[float, float]:
        _fits(8 * b * t * n * h * jnp.dtype(dtype).itemsize)

        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            fused: Literal["xla", "cudnn"] = "cudnn" if kernel == "cudnn" else "xla"
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=fused)
            return jnp.sum(out.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=compiler_options(jax.devices()[0].platform))
        q = jnp.ones((b, t, n, h), dtype)
        seconds = _time(functools.partial(grad, q, q, q))
        return attention_flops(b, n, t, t, h, causal=True, passes=1) * passes / seconds, seconds

    return saturated(measure, lengths)[1], kernel


def _collective(kind: str, axis: str) -> Callable[[jax.Array], jax.Array]:
    if kind == Collective.ALL_REDUCE.value:
        return lambda x: lax.psum(x, axis)
    if kind == Collective.ALL_GATHER.value:
        return lambda x: lax.all_gather(x, axis, tiled=True)
    if kind == Collective.REDUCE_SCATTER.value:
        return lambda x: lax.psum_scatter(x, axis, tiled=True)
    if kind == Collective.ALL_TO_ALL.value:
        return lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)

    def shift(x: jax.Array) -> jax.Array:  # collective-permute: every device sends to the next along the axis
        size = lax.axis_size(axis)
        return lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])

    return shift


def collective_times(
    mesh: jax.sharding.Mesh, axis: str, kind: str, sizes: tuple[int, ...] = SIZES
) -> list[tuple[float, float]]:
    """(bytes moved per device, seconds) of ``kind`` over ``axis`` of ``mesh`` at each local input size."""
    n = mesh.shape[axis]
    out = []
    for nbytes in sizes:
        local = (max(n, nbytes // 4 // n * n),)
        names = mesh.axis_names
        spec = P(names)
        x = jax.device_put(jnp.ones((local[0] * mesh.size,), jnp.float32), NamedSharding(mesh, spec))
        fn = jax.jit(
            jax.shard_map(_collective(kind, axis), mesh=mesh, in_specs=spec, out_specs=P(names), check_vma=False),
            compiler_options=compiler_options(mesh.devices.flat[0].platform),
        )
        seconds = _time(functools.partial(fn, x))
        result = jax.eval_shape(fn, x)  # the global result: one device holds 1 / mesh.size of it
        out_bytes = result.size * result.dtype.itemsize // mesh.size
        out.append((float(bytes_moved(Collective(kind), local[0] * 4, out_bytes, n)), seconds))
    return out


UNRESOLVED = 1e15
"""The bandwidth :func:`fit` gives where the times do not grow with the bytes (its slope clamped): a placeholder."""


def fit(points: list[tuple[float, float]]) -> Link:
    """Least-squares ``seconds = latency + bytes / bandwidth`` (latency and 1/bandwidth kept positive)."""
    x = np.array([b for b, _ in points])
    y = np.array([s for _, s in points])
    if len(set(x.tolist())) < 2:
        got = sorted(set(x.tolist()))
        raise ConfigError(f"calibrate: a latency and a bandwidth need points at two or more byte counts, got {got}")
    slope, intercept = np.polyfit(x, y, 1)
    bandwidth = UNRESOLVED if slope <= 1 / UNRESOLVED else 1.0 / slope
    return Link(latency_s=float(max(intercept, 0.0)), bandwidth=float(bandwidth))


def _meshes(count: int) -> list[jax.sharding.Mesh]:
    meshes = [_mesh((count,), ("all",))]
    if count >= 4 and count % 2 == 0:
        meshes.append(_mesh((2, count // 2), ("outer", "inner")))
    return meshes


def calibrate(
    name: str,
    out: Callable[[str], None] = print,
    matmul_sizes: Sequence[int] | None = None,
    bandwidth_sizes: Sequence[int] | None = None,
    collective_sizes: Sequence[int] | None = None,
    attention_lengths: Sequence[int] | None = None,
) -> tuple[DeviceProfile, list[dict[str, Any]]]:
    """Measure the devices at hand; the profile and every raw measurement. The sizes tried (None:
    :data:`MATMUL_SIZES`, :data:`BANDWIDTH_SIZES`, :data:`SIZES`, :data:`ATTENTION_LENGTHS`; smaller ones make a quick,
    unsaturated run, as ``meshdsl gpu-check --dry`` does)."""
    matmul_sizes, bandwidth_sizes = matmul_sizes or MATMUL_SIZES, bandwidth_sizes or BANDWIDTH_SIZES
    collective_sizes = collective_sizes or SIZES
    devices = jax.devices()
    count = len(devices)
    meshes = _meshes(count)
    rates = {dtype: matmul_rate(meshes[0], jnp.dtype(dtype), matmul_sizes) for dtype in ("float32", "bfloat16")}
    for dtype, rate in rates.items():
        out(f"  matmul {dtype}: {rate / 1e9:.2f} GFLOP/s per device")
    bandwidth = memory_bandwidth(meshes[0], bandwidth_sizes)
    out(f"  element-wise: {bandwidth / 1e9:.2f} GB/s per device")
    attention: dict[str, float] = {}
    for dtype in ("float32", "bfloat16"):
        attention[dtype], kernel = attention_rate(jnp.dtype(dtype), attention_lengths or ATTENTION_LENGTHS)
        out(f"  attention {dtype} ({kernel}, causal, forward and backward): {attention[dtype] / 1e9:.2f} GFLOP/s")
    device = devices[0]
    source = f"measured by meshdsl calibrate on {count} x {device.device_kind} ({device.platform})"
    raw: list[dict[str, Any]] = []
    if count == 1:
        links, origin = _unmeasured_links(device)
        out(f"  collectives: not measured, one device has no links; taken from the shipped profile {origin}")
        source += f"; collectives not measured (one device), from the shipped profile {origin}"
    else:
        links = _measure_links(meshes, raw, out, collective_sizes)
    profile = DeviceProfile(
        name=name,
        source=source,
        platform=device.platform,
        device_kind=device.device_kind,
        memory_bytes=_memory_bytes(device),
        memory_bandwidth=bandwidth,
        node_size=count,
        intra=links,
        inter=links,
        matmul_flops=rates,
        attention_flops=attention,
    )
    return profile, raw


def _measure_links(
    meshes: list[jax.sharding.Mesh], raw: list[dict[str, Any]], out: Callable[[str], None], sizes: Sequence[int]
) -> dict[str, Link]:
    """Each collective kind's fitted link over every axis of ``meshes``; appends the raw points to ``raw``."""
    links = {}
    for kind in KINDS:
        points = []
        for mesh in meshes:
            for axis in mesh.axis_names:
                for moved, seconds in collective_times(mesh, axis, kind, tuple(sizes)):
                    points.append((moved, seconds))
                    raw.append(
                        {
                            "collective": kind,
                            "mesh": dict(mesh.shape),
                            "axis": axis,
                            "bytes_moved": moved,
                            "seconds": seconds,
                        }
                    )
        links[kind] = fit(points)
        out(link_line(kind, links[kind]))
    return links


def link_line(kind: str, link: Link) -> str:
    """The line calibrate prints for a fitted link; a clamped fit's bandwidth is named as unresolved, not shown as a
    figure (a dry run's sizes are too small for the time to grow with the bytes)."""
    if link.bandwidth >= UNRESOLVED:
        return (
            f"  {kind}: latency {link.latency_s * 1e6:.1f} us, bandwidth not resolved (the times did not grow with "
            "the bytes at these sizes: too small to measure it)"
        )
    return f"  {kind}: latency {link.latency_s * 1e6:.1f} us, {link.bandwidth / 1e9:.2f} GB/s per device"


def _unmeasured_links(device: Any) -> tuple[dict[str, Link], str]:
    """The links of the shipped profile of ``device``'s kind (``cpu-sim`` on a CPU), and its name."""
    try:
        shipped = default_profile()
    except ConfigError:
        raise ConfigError(
            f"calibrate: one {device.device_kind} has no links to measure and no shipped profile matches it; "
            "run calibrate on two or more devices"
        ) from None
    return dict(shipped.intra), shipped.name


def _memory_bytes(device: Any) -> float:
    """The device's memory as every command reads it (:func:`meshdsl.measure.fits.capacity`)."""
    cap = fits.capacity(device)
    if cap is None:
        raise ConfigError(f"cannot read the memory of {device}: set {fits.ENV} to its bytes, e.g. 24e9")
    return float(cap.bytes)
