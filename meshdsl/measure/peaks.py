"""Peak dense matmul FLOP/s per device, from vendor datasheets, for MFU.

Dense figures (NVIDIA's datasheets print "with sparsity" figures twice these). The f32 peak is
what the matmul units run an f32 matmul at under JAX's default precision: TF32 on NVIDIA parts
since Ampere, bf16 passes on TPUs. A device kind is matched by the first entry whose name it
contains, so a more specific name (``H100 PCIe``, ``GB200``, ``L40S``, ``TPU v5 lite``) comes
before the name it contains (``H100``, ``B200``, ``L4``, ``TPU v5``). One TPU device is one
chip from v4 on.
"""

from __future__ import annotations

# (device_kind substring, bf16 peak, f32 peak as the matmul units run it)
_PEAKS = [
    ("GB200", 2.5e15, 1.25e15),
    ("B200", 2.25e15, 1.125e15),
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100", 989e12, 494e12),
    ("H800", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L4", 121e12, 60e12),
    ("TPU v6 lite", 918e12, 918e12),
    ("TPU v6e", 918e12, 918e12),
    ("TPU v5 lite", 197e12, 197e12),
    ("TPU v5e", 197e12, 197e12),
    ("TPU v5p", 459e12, 459e12),
    ("TPU v5", 459e12, 459e12),
    ("TPU v4", 275e12, 275e12),
]


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak FLOP/s of one device of ``device_kind`` for matmuls in ``dtype``; None when unknown (CPU)."""
    for name, bf16, f32 in _PEAKS:
        if name.lower() in device_kind.lower():
            return bf16 if dtype == "bfloat16" else f32
    return None
