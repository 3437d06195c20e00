"""The errors meshdsl raises for user mistakes.

Each one names the tensor, dim, size and mesh axis involved, so a mistake is fixed from the
message alone. Both derive from ``ValueError`` so code that already catches that keeps working.
"""


class MeshDslError(ValueError):
    """Base class of every error meshdsl raises for a user mistake."""


class ShapeError(MeshDslError):
    """Named dims that do not fit together (mismatched sizes, unknown or repeated names), or an
    argument of the wrong kind: not an md tensor where an op takes one, an unknown dtype, float
    indices, a non-boolean condition."""


class LayoutError(MeshDslError):
    """A layout that cannot apply: malformed rule, unknown mesh axis, indivisible or clashing split."""


class ConfigError(MeshDslError):
    """An unknown model, preset, optimizer or option (a backend name, a dropout rate), or values
    that do not fit together."""


class DataError(MeshDslError):
    """A token file that is missing, malformed, too short, or holds ids outside the vocabulary."""


class UnsupportedJaxError(MeshDslError):
    """A traced program meshdsl cannot read on the JAX at hand: a primitive whose parameters are laid
    out as no supported JAX version lays them out (the message names the primitive and the version)."""
