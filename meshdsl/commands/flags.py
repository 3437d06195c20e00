"""The flags several commands take, each defined once, and what they mean once parsed.

The settings of a run are the fields of :class:`meshdsl.train.config.RunConfig`, each defined
there once (default, help, resume behaviour); :func:`add_settings` makes their flags, for ``train``
and for each command that shares one (``--model``, ``--preset``, ``--set``, ``--layout``,
``--optimizer``, ``--backend``, ``--grad-reduce-dtype``). ``--init-from-hf`` is ``train``'s setting
too; the commands that only read the folder's model add it with :func:`add_init_from_hf`. A flag only
one command takes is defined in that command's module.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from meshdsl.models import NAMES
from meshdsl.train.config import HF_HELP, overrides

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


SHARED_HELP = {"model": MODEL_HELP, "preset": PRESET_HELP, "overrides": SET_HELP, "layout": LAYOUT_HELP}
"""The help of the settings several commands take, beside their :class:`~meshdsl.train.config.RunConfig` fields."""


def misplaced(top: argparse.ArgumentParser, command: str, extra: Sequence[str]) -> str | None:
    """The error for a flag of ``meshdsl`` itself (``--devices``, ...) given after the command ``command``,
    which argparse only calls unrecognized; None when ``extra`` (the unrecognized arguments) holds none."""
    own = {s for action in top._actions for s in action.option_strings if s not in ("-h", "--help")}
    found = [a for a in extra if a.split("=")[0] in own]
    if not found:
        return None
    flag = found[0].split("=")[0]
    return f"{flag} is a flag of meshdsl itself: give it before the command, e.g. meshdsl {flag} ... {command} ..."


def add_init_from_hf(parser: argparse.ArgumentParser, weights: bool = False) -> None:
    """``--init-from-hf DIR``: the llama decoder a Hugging Face folder's config.json describes (``weights``:
    and its weights as the starting parameters); read with :func:`model_spec`."""
    what = "config.json and weights" if weights else "config.json"
    parser.add_argument("--init-from-hf", default=None, metavar="DIR", help=HF_HELP % what)


def model_spec(model: str, init_from_hf: str | None) -> str:
    """The ``--model`` spec a command builds: ``hf:DIR`` for ``--init-from-hf DIR`` (:mod:`meshdsl.model.loader`)."""
    from meshdsl.model.loader import HF_PREFIX

    return model if init_from_hf is None else HF_PREFIX + init_from_hf


def add_settings(
    parser: argparse.ArgumentParser, *names: str, given_only: bool = False, helps: dict[str, str] | None = None
) -> None:
    """The flags of the :class:`~meshdsl.train.config.RunConfig` fields ``names`` (none: every field, in
    their order), each as its field defines it: flag, type, choices, default (shown by ``--help``) and help.
    ``given_only``: a flag not on the command line leaves no attribute (so ``config`` knows what was given);
    else it holds the field's default."""
    from meshdsl.train import config

    for name in names or tuple(config.settings()):
        setting, default = config.setting_of(name), config.default_of(name)
        text = (helps or {}).get(name) or setting.help or SHARED_HELP[name]
        shown = setting.default_words or (None if default is None or default is False or default == {} else default)
        if setting.table:
            shown = f"the layout file's [train] {name}" + ("" if shown is None else f", else {shown}")
        kwargs: dict[str, Any] = {
            "dest": name,
            "help": (text if shown is None else f"{text} (default: {shown})").replace("%", "%%"),
            "default": argparse.SUPPRESS if given_only else default,
        }
        annotation = str(config.settings()[name].type)
        if annotation == "bool":
            kwargs["action"] = "store_true"
        elif name == "overrides":
            kwargs.update(action="append", metavar=setting.metavar, default=argparse.SUPPRESS if given_only else [])
        else:
            kwargs.update(metavar=setting.metavar, choices=setting.choices)
            kwargs["type"] = float if "float" in annotation else int if "int" in annotation else str
        parser.add_argument(config.flag_of(name), **kwargs)


def settings_given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings ``args`` holds (those of :func:`add_settings`), ``--set``'s items read as overrides."""
    from meshdsl.train import config

    given = {name: getattr(args, name) for name in config.settings() if hasattr(args, name)}
    if "overrides" in given:
        given["overrides"] = overrides(given["overrides"])
    return given


def add_model(parser: argparse.ArgumentParser) -> None:
    """``--model M [M ...]``: several models (``bench``)."""
    from meshdsl.train.config import default_of

    parser.add_argument(
        "--model", nargs="+", default=[default_of("model")], help="models to benchmark, each " + MODEL_HELP
    )


def add_profile(parser: argparse.ArgumentParser) -> None:
    """``--profile NAME|FILE``: read with :func:`profile`."""
    parser.add_argument("--profile", default=None, help=PROFILE_HELP)


def profile(spec: str | None) -> Any:
    """The device profile ``--profile`` names (None: that of the devices at hand)."""
    from meshdsl.planner.profile import default_profile, load_profile

    return default_profile() if spec is None else load_profile(spec)
