"""The flags several commands take, each defined once, and what they mean once parsed.

A command's ``add_arguments`` calls these in the order its ``--help`` lists them; a flag only one
command takes is defined in that command's module.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from meshdsl.collectives import GRAD_REDUCE_DTYPES
from meshdsl.models import NAMES

COMPUTE_DTYPES = ("float32", "bfloat16")
MODEL_HELP = (
    f"a shipped model ({', '.join(NAMES)}), a Python file (path/to/my_model.py) "
    "or an importable module (mypkg.my_model)"
)
PRESET_HELP = "a preset of the model's Config.PRESETS (the shipped models: tiny, small, 1b; llama also 8b)"
SET_HELP = "override a field of the model's Config, e.g. --set layers=32 (repeatable)"
LAYOUT_HELP = "a layout TOML file, a shipped layout name (dp_tp), or rules such as 'batch:data'"
PROFILE_HELP = "device profile (shipped name or JSON file; default: the devices at hand)"


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags before the command: the simulated devices, the multi-process run, launch's verbosity."""
    parser.add_argument(
        "--devices", type=int, default=None, help="simulated CPU devices when no accelerator is present (default 8)"
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-process run: where process 0 listens (or MESHDSL_COORDINATOR)",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="multi-process run: how many processes (or MESHDSL_NUM_PROCESSES)",
    )
    parser.add_argument(
        "--process-id", type=int, default=None, help="multi-process run: this process, 0..N-1 (or MESHDSL_PROCESS_ID)"
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help="multi-process run: seconds of silence after which a process counts as dead and the others stop "
        "(or MESHDSL_HEARTBEAT_TIMEOUT; default 5)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="launch: also show the processes' JAX runtime log lines and Gloo's connection messages "
        "(else only counted)",
    )


def add_model(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """``--model M`` (``many``: ``--model M [M ...]``, a list)."""
    if many:
        parser.add_argument(
            "--model", nargs="+", default=["transformer"], help="models to benchmark, each " + MODEL_HELP
        )
    else:
        parser.add_argument("--model", default="transformer", help=MODEL_HELP)


def add_init_from_hf(parser: argparse.ArgumentParser, weights: bool = False) -> None:
    """``--init-from-hf DIR``: the llama decoder a Hugging Face folder's config.json describes (``weights``:
    and its weights as the starting parameters); read with :func:`model_spec`."""
    what = "config.json and weights" if weights else "config.json"
    parser.add_argument(
        "--init-from-hf",
        default=None,
        metavar="DIR",
        help=f"the model of a Hugging Face folder ({what}; Llama, Mistral, Qwen2/3, Gemma) instead of "
        "--model/--preset; --set still sets batch, length and meshdsl's own fields",
    )


def model_spec(model: str, init_from_hf: str | None) -> str:
    """The ``--model`` spec a command builds: ``hf:DIR`` for ``--init-from-hf DIR`` (:mod:`meshdsl.model.loader`)."""
    from meshdsl.model.loader import HF_PREFIX

    return model if init_from_hf is None else HF_PREFIX + init_from_hf


def add_preset(parser: argparse.ArgumentParser) -> None:
    """``--preset P``."""
    parser.add_argument("--preset", default="small", help=PRESET_HELP)


def add_set(parser: argparse.ArgumentParser) -> None:
    """``--set FIELD=VALUE``, repeatable: read with :func:`overrides`."""
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=SET_HELP)


def add_layout(parser: argparse.ArgumentParser) -> None:
    """``--layout L``: one layout."""
    parser.add_argument("--layout", default="data_parallel", help=LAYOUT_HELP)


def add_optimizer(parser: argparse.ArgumentParser) -> None:
    """``--optimizer O``."""
    parser.add_argument("--optimizer", default="adamw", help="sgd, adamw or adafactor")


def add_backend(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--backend {spmd,gspmd}``."""
    parser.add_argument("--backend", default="spmd", choices=["spmd", "gspmd"], help=help)


def add_grad_reduce_dtype(parser: argparse.ArgumentParser) -> None:
    """``--grad-reduce-dtype float16 | bfloat16 | float8_e4m3fn | float8_e5m2``."""
    parser.add_argument(
        "--grad-reduce-dtype",
        default=None,
        choices=GRAD_REDUCE_DTYPES,
        help="sum gradients across devices in this dtype (float16 and 8-bit: with a per-tensor scale)",
    )


def add_profile(parser: argparse.ArgumentParser) -> None:
    """``--profile NAME|FILE``: read with :func:`profile`."""
    parser.add_argument("--profile", default=None, help=PROFILE_HELP)


def overrides(items: Sequence[str]) -> dict[str, object]:
    """``--set``'s ``["layers=32", "norm=layer", "remat=true"]`` as
    ``{"layers": 32, "norm": "layer", "remat": True}``."""
    from meshdsl.errors import ConfigError

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


def profile(spec: str | None) -> Any:
    """The device profile ``--profile`` names (None: that of the devices at hand)."""
    from meshdsl.planner.profile import default_profile, load_profile

    return default_profile() if spec is None else load_profile(spec)
