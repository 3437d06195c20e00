"""The errors meshdsl raises for user mistakes.

Each one names the tensor, dim, size and mesh axis involved, so a mistake is fixed from the
message alone. Both derive from ``ValueError`` so code that already catches that keeps working.
"""


class MeshDslError(ValueError):
    """Base class of every error meshdsl raises for a user mistake.

    ``op``: the md op (or API function) the message names, without ``md.`` (``"einsum"``,
    ``"compile"``, ``"random.uniform"``); None until one is known. An error raised inside an op
    without one gets the op's name as its ``op`` and as its message's first word
    (:func:`meshdsl.lowering.context.op_scope`), so an error names its op exactly once.
    """

    op: str | None = None

    def __init__(self, *args: object, op: str | None = None):
        super().__init__(*args)
        if op is not None:
            self.op = op


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


class ModelError(ConfigError):
    """A mistake in the user's own model code: an exception in its ``Config``, ``Model(config)``, ``init``,
    ``batch`` or ``loss``, or a result meshdsl cannot use (a loss that is no scalar float md tensor). The
    message names the user's file and line. Unlike a layout that does not fit, it is the same under
    every layout, so ``bench`` and ``search`` stop at it instead of skipping the layout."""


class WriteError(MeshDslError):
    """An output that could not be written once the work had started (disk full, a read-only disk,
    a file size limit): the message names the file, the cause and what is intact."""


class TrainingError(MeshDslError):
    """A training run that cannot go on: a loss that is NaN or infinite (``--allow-nan`` trains on)."""


class UnsupportedJaxError(MeshDslError):
    """A traced program meshdsl cannot read on the JAX at hand: a primitive whose parameters are laid
    out as no supported JAX version lays them out (the message names the primitive and the version)."""


class Interrupted(Exception):
    """A run that a signal stopped (SIGTERM, Ctrl-C) after saving what it had: not a mistake, so not an
    md error. ``exit_status``: ``128 + signal``, the status a shell gives a run the signal ended, so
    a script or scheduler tells an interrupted run from a finished one (:mod:`meshdsl.train.signals`)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum
