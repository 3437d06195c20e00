"""Checks of the plain-number arguments of the public API (rates, scales, epsilons, bounds), each an
md error naming the argument and its value, so a NaN or a negative epsilon is refused where it
enters instead of turning every result into NaN later."""

from __future__ import annotations

import math
import numbers
from typing import Any

from meshdsl.errors import ConfigError, MeshDslError


def number(
    value: Any,
    what: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
    error: type[MeshDslError] = ConfigError,
    op: str | None = None,
) -> float:
    """``value`` as a float if it is a finite real number within the bounds given; else ``error``
    naming ``what`` (``"LayerNorm: eps"``), the value and what is allowed; ``op``: the op ``what`` names
    (the error's ``op``), when it does."""
    bounds = [
        f"at least {at_least}" if at_least is not None else "",
        f"above {above}" if above is not None else "",
        f"below {below}" if below is not None else "",
    ]
    wanted = "a finite number" + "".join(f", {b}" for b in bounds if b)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be {wanted}, got {type(value).__name__} {value!r}", op=op)
    x = float(value)
    if (
        not math.isfinite(x)
        or (at_least is not None and x < at_least)
        or (above is not None and x <= above)
        or (below is not None and x >= below)
    ):
        raise error(f"{what} must be {wanted}, got {value!r}", op=op)
    return x
