"""Peak dense matmul FLOP/s per device, from vendor datasheets, for MFU."""

from __future__ import annotations

# (device_kind substring, bf16 peak, f32 peak as the matmul units run it: TF32 on NVIDIA)
_PEAKS = [
    ("H200", 989e12, 494e12),
    ("H100", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("TPU v5p", 459e12, 459e12),
    ("TPU v5 lite", 197e12, 197e12),
    ("TPU v5e", 197e12, 197e12),
    ("TPU v4", 275e12, 275e12),
]


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak FLOP/s of one device of ``device_kind`` for matmuls in ``dtype``; None when unknown (CPU)."""
    for name, bf16, f32 in _PEAKS:
        if name.lower() in device_kind.lower():
            return bf16 if dtype == "bfloat16" else f32
    return None
