"""Decoding: a KV cache in named dims, ``md.generate`` (greedy and sampled) and the compiled steps it runs.

:mod:`.checks` validates ``md.generate``'s arguments, :mod:`.sampling` picks the next tokens from
the global logits, :mod:`.decoder` compiles the prefill and decode steps for a mesh and layout,
:mod:`.generate` runs them token by token.
"""

from meshdsl.decoding.decoder import Decoder
from meshdsl.decoding.generate import Generation, generate

__all__ = ["Decoder", "Generation", "generate"]
