"""``md.checkpoint``: checkpoints that describe themselves and reshard on load, and Hugging Face weights.

:func:`save` and :func:`restore` write and read a directory (a manifest plus one zarr array per leaf)
under any mesh and layout; :class:`CheckpointManager` keeps the newest ``keep`` of a run's steps
behind a lock (:mod:`.lock`) so that two runs never share a directory; :func:`load_safetensors`
reads Hugging Face ``.safetensors`` files into a model's parameters, each device reading its block.
How the files are laid out and committed is in :mod:`.store`'s docstring.
"""

from meshdsl.checkpoint.safetensors_io import Source, check_safetensors, load_safetensors
from meshdsl.checkpoint.store import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointManager,
    latest,
    read_manifest,
    restore,
    save,
    steps,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "CheckpointManager",
    "Source",
    "latest",
    "check_safetensors",
    "load_safetensors",
    "read_manifest",
    "restore",
    "save",
    "steps",
]
