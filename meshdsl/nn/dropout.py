"""``dropout``: ``md.dropout`` with the switch every model needs between training and evaluation."""

from __future__ import annotations

from typing import Any

from meshdsl.dims import ShapeLike
from meshdsl.random import check_rate
from meshdsl.random import dropout as _dropout
from meshdsl.tensor import Tensor


def dropout(
    key: Any, x: Tensor, rate: float, *, deterministic: bool = False, noise_shape: ShapeLike | None = None
) -> Tensor:
    """``x`` with each entry zeroed with probability ``rate`` and the rest scaled by ``1 / (1 - rate)``;
    ``x`` itself when ``deterministic`` (evaluation) or ``rate`` is 0 (``key`` may then be None).

    The mask is ``md.random``'s: the same under every layout, each device drawing only its block.
    ``noise_shape`` (a subset of ``x``'s dims) shares one draw across the dims it leaves out.
    """
    check_rate(rate)
    return x if deterministic else _dropout(key, x, rate, noise_shape)
