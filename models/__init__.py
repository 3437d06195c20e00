"""The shipped models, written only in meshdsl ops; installed as ``meshdsl.models``.

Each module has a ``Config`` dataclass with ``PRESETS`` and a ``Model``: the form every model takes,
shipped or the user's (see :mod:`meshdsl.model.loader`, which loads them all). A model is
layout-free: the same code runs under every layout.
"""

NAMES = ("mlp", "transformer", "moe", "convnet", "llama")
"""The shipped models, by the name ``--model`` takes."""
