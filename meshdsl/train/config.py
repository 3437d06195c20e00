"""What ``meshdsl train`` runs (:class:`RunConfig`): each setting defined once, as one field.

A field's :class:`Setting` (its metadata, written with :func:`setting`) says everything the rest of
the code needs about it, so nothing is written twice:

- its default (the field's own) and help text: the ``meshdsl train`` flag and ``--help``
  (:func:`meshdsl.commands.flags.add_settings`);
- ``resume``: what resuming does with it (:class:`Resume`; :mod:`meshdsl.train.resume`);
- ``table``: whether a layout file's ``[train]`` table may set it (:mod:`meshdsl.train.settings`);
- ``needs``: the setting without which the run would ignore it (:class:`Needs`), so giving it
  alone is refused;
- ``check``: what a value must be, said once whether it came from a flag or a layout file.

Adding a ``meshdsl train`` flag is adding a field here; the run reads it as ``run.<name>``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

from meshdsl.collectives import GRAD_REDUCE_DTYPES
from meshdsl.errors import ConfigError
from meshdsl.train.data import EVAL_FRACTION


class Resume(enum.Enum):
    """What ``--resume`` does with a setting. A recorded setting (MATCH, CHANGE) that the command line
    does not repeat takes the checkpoint's value."""

    MATCH = "must match"
    """Recorded; given differently, the resume is refused: it would change the run (its model, data, rate)."""
    CHANGE = "may change"
    """Recorded; given differently, the new value is applied and said (how long, how it is laid out)."""
    OWN = "this run's own"
    """Not recorded: what this invocation writes or prints (logs, traces, the checkpoint dir)."""


@dataclasses.dataclass(frozen=True)
class Needs:
    """The run ignores a setting unless ``field``'s value passes ``test``; ``words`` name that condition."""

    field: str
    test: Callable[[Any], bool]
    words: str


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a :class:`RunConfig` field means on the command line, in a layout file and on resume."""

    help: str
    resume: Resume = Resume.OWN
    table: bool = False
    needs: Needs | None = None
    check: Callable[[Any], str | None] | None = None
    """The complaint about a bad value (None: fine), after ``--flag VALUE:`` or the file's key."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default_words: str | None = None
    """``--help``'s words for the default, when the default value alone does not say it."""
    flag: str | None = None
    """The flag, when it is not ``--`` and the name with dashes."""


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A :class:`RunConfig` field: its default and its :class:`Setting`."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, metadata={"setting": Setting(help, **kw)})
    return dataclasses.field(default=default, metadata={"setting": Setting(help, **kw)})


def _whole(least: int, what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = not isinstance(value, bool) and isinstance(value, int) and value >= least
        return None if ok else f"{what} is a whole number, {least} or more"

    return check


def _steps(value: Any) -> str | None:
    return _whole(1, "the step count")(value) and "train at least 1 step"


def _positive_rate(value: Any) -> str | None:
    ok = value is None or (isinstance(value, (int, float)) and math.isfinite(value) and value > 0)
    return None if ok else "the learning rate must be a positive, finite number"


def _ratio(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1
    return None if ok else "the final learning rate is a fraction of the peak, from 0 to 1"


def _compute_dtype(value: Any) -> str | None:
    return (
        None if value is None or value in COMPUTE_DTYPES else f"the compute dtype is one of {', '.join(COMPUTE_DTYPES)}"
    )


def _seed(value: Any) -> str | None:
    return None if SEED_RANGE[0] <= value <= SEED_RANGE[1] else "a seed is a 64-bit integer, from -2**63 to 2**63 - 1"


SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds ``jax.random.key`` takes (a 64-bit integer)."""
COMPUTE_DTYPES = ("float32", "bfloat16")
"""What ``--compute-dtype`` (and ``--set compute_dtype=``) take."""
DECAYING = ("cosine", "linear", "wsd")
"""The learning-rate schedules that end at ``min_lr_ratio`` (and so depend on ``steps``)."""
PIPELINE = "the layout's [pipeline], else %s"
HF_HELP = (
    "the model of a Hugging Face folder (%s; Llama, Mistral, Qwen2/3, Gemma) instead of "
    "--model/--preset; --set still sets batch, length and meshdsl's own fields"
)
"""``--init-from-hf``'s help (``train``'s field, the other commands' :func:`meshdsl.commands.flags.add_init_from_hf`),
saying what of the folder the command reads."""

M, C = Resume.MATCH, Resume.CHANGE


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What ``meshdsl train`` runs; every field but ``given`` is a flag (:class:`Setting`)."""

    model: str = setting("transformer", "", resume=M)
    """A shipped model's name, a Python file or an importable module (:mod:`meshdsl.model.loader`)."""
    preset: str = setting("small", "", resume=M)
    overrides: dict[str, Any] = setting({}, "", flag="--set", metavar="FIELD=VALUE")
    """Config fields set by ``--set FIELD=VALUE`` (the checkpoint's whole model config is compared on resume)."""
    layout: str = setting("data_parallel", "", resume=C)
    steps: int = setting(200, "steps to train (a resumed run: up to this step)", resume=C, check=_steps)
    optimizer: str = setting("adamw", "sgd, adamw or adafactor", resume=M)
    learning_rate: float | None = setting(
        None, "peak learning rate", resume=M, table=True, check=_positive_rate, default_words="the optimizer's own"
    )
    backend: str = setting(
        "spmd", "spmd: meshdsl's collectives; gspmd: XLA's partitioner", resume=C, choices=("spmd", "gspmd")
    )
    seed: int = setting(0, "seed of the parameters, the data order and the eval set", resume=M, check=_seed)
    data: str | None = setting(
        None,
        "token file (.npy, or raw uint16 .bin/.u16, uint32 .u32) read into the keys and dims of the model's own "
        "batch(key), in a seeded shuffled order, or an .npz of padded examples (input_ids [N, T], optional "
        "labels with -100)",
        resume=M,
        default_words="the synthetic task",
    )
    init_from_hf: str | None = setting(None, HF_HELP % "config.json and weights", resume=M, metavar="DIR")
    """A Hugging Face folder whose weights are the parameters at step 0 (``model`` is then ``hf:DIR``)."""
    eval_fraction: float = setting(
        EVAL_FRACTION,
        "the tail of the --data file held out for evaluation, never trained on",
        resume=M,
        needs=Needs("data", lambda v: v is not None, "--data"),
    )
    compute_dtype: str | None = setting(
        None,
        "compute in bf16 with f32 master parameters; for a model whose Config declares a compute_dtype field",
        resume=M,
        table=True,
        check=_compute_dtype,
        choices=COMPUTE_DTYPES,
    )
    remat: bool = setting(
        False,
        "recompute each layer's activations in the backward pass; for a model whose Config declares a remat field",
        resume=C,
        table=True,
    )
    grad_reduce_dtype: str | None = setting(
        None,
        "sum gradients across devices in this dtype (float16 and 8-bit: with a per-tensor scale)",
        resume=M,
        choices=GRAD_REDUCE_DTYPES,
        needs=Needs(
            "backend",
            lambda v: v == "spmd",
            "--backend spmd (under gspmd XLA chooses the collectives and sums gradients in their own dtype)",
        ),
    )
    grad_error_feedback: bool = setting(
        False,
        "keep each device's rounding error of the compressed sum and add it to the next step's gradient",
        resume=M,
    )
    log_json: str | None = setting(
        None, "also write each step's loss and time to FILE, one JSON object a line", metavar="FILE"
    )
    checkpoint_dir: str | None = setting(
        None, "save checkpoints step_<N> here (and after the last step)", metavar="DIR"
    )
    save_every: int = setting(
        0,
        "save a checkpoint every N steps (0: only after the last)",
        resume=C,
        metavar="N",
        needs=Needs("checkpoint_dir", lambda v: v is not None, "--checkpoint-dir"),
    )
    keep: int = setting(
        3,
        "keep the newest K checkpoints",
        resume=C,
        metavar="K",
        needs=Needs("checkpoint_dir", lambda v: v is not None, "--checkpoint-dir"),
    )
    resume: bool = setting(
        False,
        "continue from the latest checkpoint in --checkpoint-dir (any mesh, layout or device count), "
        "with the settings it records unless given",
        needs=Needs("checkpoint_dir", lambda v: v is not None, "--checkpoint-dir"),
    )
    microbatches: int | None = setting(None, "pipeline microbatches per step", resume=C, default_words=PIPELINE % 1)
    schedule: str | None = setting(
        None,
        "pipeline schedule",
        resume=C,
        choices=("gpipe", "1f1b", "interleaved"),
        default_words=PIPELINE % "1f1b",
    )
    virtual_stages: int | None = setting(
        None,
        "interleaved schedule: chunks of layers per stage",
        resume=C,
        metavar="V",
        default_words=PIPELINE % 1,
    )
    lr_schedule: str = setting(
        "constant", "learning-rate schedule", resume=M, table=True, choices=("constant",) + DECAYING
    )
    warmup_steps: int = setting(
        0,
        "rise linearly from 0 to the learning rate over N steps",
        resume=M,
        table=True,
        metavar="N",
        check=_whole(0, "the warmup"),
    )
    min_lr_ratio: float = setting(
        0.0,
        "cosine/linear/wsd end at R x the learning rate",
        resume=M,
        table=True,
        metavar="R",
        check=_ratio,
        needs=Needs("lr_schedule", lambda v: v in DECAYING, "a decaying --lr-schedule (cosine, linear or wsd)"),
    )
    accumulate: int = setting(
        1,
        "cut each step's batch into N microbatches (gradient accumulation)",
        resume=C,
        table=True,
        metavar="N",
        check=_whole(1, "the microbatches of a step"),
    )
    eval_every: int = setting(
        0,
        "evaluate on held-out batches every N steps and after the last (0: never)",
        resume=C,
        metavar="N",
        check=_whole(0, "the steps between evaluations (0: none)"),
    )
    eval_steps: int = setting(
        10,
        "batches each evaluation averages over",
        resume=C,
        metavar="K",
        check=_whole(1, "the batches an evaluation averages over"),
        needs=Needs("eval_every", lambda v: v > 0, "--eval-every N"),
    )
    log_every: int = setting(
        10,
        "off a terminal, print a line every N steps",
        metavar="N",
        check=_whole(1, "the steps between printed lines"),
    )
    tensorboard: str | None = setting(
        None, "write TensorBoard scalars (loss, eval loss, learning rate, ...) into DIR", metavar="DIR"
    )
    profile_steps: str | None = setting(None, "record a jax.profiler trace of steps A to B", metavar="A:B")
    profile_dir: str | None = setting(
        None,
        "where the trace goes",
        metavar="DIR",
        default_words="--tensorboard DIR, else ./profile",
        needs=Needs("profile_steps", lambda v: v is not None, "--profile-steps A:B (the steps to trace)"),
    )
    allow_nan: bool = setting(False, "train on past a NaN or infinite loss (default: stop, naming the step)", resume=C)
    given: frozenset[str] = frozenset()
    """Fields set on purpose even where they equal their defaults (the command line's flags). A setting
    not given (nor different from its default) takes the layout file's ``[train]`` value, a resumed
    checkpoint's, else its default."""

    def is_given(self, name: str) -> bool:
        """Whether ``name`` was set on purpose: named in ``given``, or not at its default."""
        return name in self.given or bool(getattr(self, name) != default_of(name))


def settings() -> dict[str, dataclasses.Field[Any]]:
    """The fields of :class:`RunConfig` that are settings (flags), by name, in ``--help``'s order."""
    return {f.name: f for f in dataclasses.fields(RunConfig) if "setting" in f.metadata}


def setting_of(name: str) -> Setting:
    """The :class:`Setting` of field ``name``."""
    found: Setting = settings()[name].metadata["setting"]
    return found


def default_of(name: str) -> Any:
    """The default of field ``name``."""
    field = settings()[name]
    if field.default is dataclasses.MISSING:
        return field.default_factory()  # type: ignore[operator]
    return field.default


def flag_of(name: str) -> str:
    """The command-line flag of field ``name`` (``learning_rate``: ``--learning-rate``)."""
    return setting_of(name).flag or "--" + name.replace("_", "-")


def table_keys() -> tuple[str, ...]:
    """The keys a layout file's ``[train]`` table may set."""
    return tuple(name for name in settings() if setting_of(name).table)


def overrides(items: Sequence[str]) -> dict[str, object]:
    """``--set``'s ``["layers=32", "norm=layer", "remat=true"]`` as
    ``{"layers": 32, "norm": "layer", "remat": True}`` (the commands' and ``planner.validate``'s)."""

    out: dict[str, object] = {}
    for item in items:
        field, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. layers=32")
        out[field] = {"true": True, "false": False}.get(value.lower(), value)
        for cast in (int, float):
            try:
                out[field] = cast(value)
                break
            except ValueError:
                pass
        if field == "compute_dtype" and out[field] not in COMPUTE_DTYPES:
            raise ConfigError(f"--set compute_dtype={value}: the compute dtype is one of {', '.join(COMPUTE_DTYPES)}")
    return out
