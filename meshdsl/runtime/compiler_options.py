"""The XLA options every program meshdsl compiles and times is compiled with.

On CPU, XLA (from jaxlib 0.10) hands dots, and the element-wise chains and reductions around them,
to YNNPACK as "library fusions" (``ynn_fusion`` in the HLO). A library fusion fuses none of its
producers, so every operand it reads is computed into a buffer of its own, broadcasts included: in
the backward loop of a rematerialised 1B transformer (``[data=16 model=4]``, 64 devices), layer
norm's ``rsqrt`` broadcast to ``[batch, length, d_model]`` and other such activations sit beside the
recomputed forward, and the step compiled to 15.2 GiB a device with them, 13.4 GiB without
(docs/performance.md, "Planner: predicted vs compiled memory"). XLA:GPU has no such fusions: it
fuses element-wise producers into their readers, which is what :mod:`meshdsl.planner.memory`
predicts. So meshdsl turns them off on CPU, where its runs simulate an accelerator's: the step then
needs the memory a GPU's would, and the planner's prediction can be checked against it. The step
time did not move (the small transformer, ``dp_tp``, 8 simulated devices: 159.7 against 159.0 ms a
step) and the losses agree to the 4 decimals train prints (float32 sums in another order).

The option is XLA's own (``xla_cpu_experimental_ynn_fusion_type``, empty: no library fusion); a
jaxlib that no longer knows it compiles as it would without it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

NO_LIBRARY_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def _accepted(options: tuple[tuple[str, str], ...]) -> bool:
    """Whether this jaxlib's CPU compiler takes ``options`` (an unknown option fails the compile)."""
    one = jax.device_put(np.float32(1), jax.devices("cpu")[0])
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(one).compile()
    except Exception:  # noqa: BLE001 - XLA's error for an unknown option is a plain exception
        return False
    return True


def compiler_options(platform: str) -> dict[str, Any]:
    """Options for ``jax.jit(..., compiler_options=...)`` of a program that runs on ``platform``
    (a device's ``.platform``): on CPU, no YNNPACK library fusions; elsewhere, none."""
    if platform != "cpu":
        return {}
    return dict(NO_LIBRARY_FUSIONS) if _accepted(tuple(NO_LIBRARY_FUSIONS.items())) else {}
