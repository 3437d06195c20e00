"""What ``--model``, ``--preset`` and ``--set`` mean in every command: a model from a shipped name,
a Python file or an importable module, at a preset, with fields overridden.

A model module (the shipped ones in ``meshdsl.models`` have this form too) defines

* ``Config``: a dataclass of the model's sizes and options, with ``PRESETS``, a dict mapping a
  preset name to field values (``{"tiny": {"rows": 16}}``); no base class is needed;
* ``Model``: ``Model(config)`` with ``init(key) -> params``, ``batch(key) -> batch`` and
  ``loss(params, batch) -> scalar md.Tensor``, params and batch being pytrees of md tensors.

Optional, each used by the commands that need it (which say so in one line when it is missing):
``flops_per_step()`` (bench's FLOP/s and MFU), ``examples_per_step()`` (throughput), ``LAYOUTS``
(bench's default layouts), ``DIM_ROLES`` (search's candidate splits, else inferred: see
:mod:`meshdsl.planner.roles`), and the pipeline parts (``pipelined``, ``pre``, ``layer``, ``post``,
``with_batch``, ``layers``, ``batch_dim``: see :mod:`meshdsl.pipeline`).

A model of the user's (not a shipped one) comes back wrapped in a :class:`meshdsl.user_model.UserModel`,
so a mistake in its code is one line naming the user's file and line, whichever command runs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from meshdsl.errors import ConfigError
from meshdsl.models import NAMES
from meshdsl.user_model import UserModel, call, error_text, location

REQUIRED = ("init", "batch", "loss")
"""The methods every ``Model`` has."""

_FORM = (
    "a model module defines a Config dataclass with a PRESETS dict (preset name -> field values) and a Model class "
    "(Model(config) with init(key), batch(key), loss(params, batch)); see docs/tutorial.md"
)
_files: dict[Path, ModuleType] = {}
_PREFIX = "meshdsl_user_model_"
"""The start of the module name a model file is imported under (never shown to the user)."""


def load_module(spec: str) -> ModuleType:
    """The model module ``spec`` names: a shipped model (``mlp``), a Python file (``path/to/model.py``)
    or an importable module (``mypkg.model``). ConfigError, in one line, for a file that is missing or
    not Python, an unknown name, an import that fails (naming the user's own line), or a module
    without ``Config``, ``Config.PRESETS`` or ``Model``."""
    if not spec.strip():
        raise ConfigError(f"--model {spec!r} is empty: give {_choices()}")
    if spec in NAMES:
        module = importlib.import_module(f"meshdsl.models.{spec}")
    elif spec.endswith(".py") or "/" in spec or Path(spec).exists():
        module = _load_file(spec)
    else:
        module = _import(spec)
    _check_form(module, spec)
    return module


def build_model(spec: str, preset: str, **overrides: Any) -> Any:
    """``Model(config)`` of the module ``spec`` names (see :func:`load_module`), ``config`` being its
    preset ``preset`` with ``overrides`` (those that are None keep the preset's values) checked by
    :func:`configure`. The model gets a ``config`` attribute if its class sets none. A model of the
    user's comes back as a :class:`~meshdsl.user_model.UserModel`: a mistake in ``Config``, ``Model(config)``,
    ``init``, ``batch`` or ``loss`` is a one-line md error naming the user's file and line."""
    module = load_module(spec)
    shipped = module.__name__.startswith("meshdsl.models.")
    mine = [] if shipped else _mine(module, spec)
    values = {k: v for k, v in overrides.items() if v is not None}
    config = configure(module.Config, preset, values, spec, mine)
    model = module.Model(config) if shipped else call(module.Model, (config,), "Model(config)", mine)
    if getattr(model, "config", None) is None:
        model.config = config
    return model if shipped else UserModel(model, spec, mine)


def describe_model(model: Any) -> str:
    """``model`` for a message: a user's model by the file or module it came from (``llama.py``), never by
    the name meshdsl imported it under; another (a shipped one) by its class (``meshdsl.models.mlp.Model``)."""
    if isinstance(model, UserModel):
        return f"{model.spec} ({type(model.model).__name__})"
    return f"{type(model).__module__}.{type(model).__qualname__}"


def shipped_name(model: Any) -> str | None:
    """The shipped model ``model`` is an instance of (``"mlp"``), or None for a model of the user's,
    whatever its module is called: bench's byte formulas and plain-JAX baselines exist only for the
    shipped models' own classes."""
    name = type(model).__module__.removeprefix("meshdsl.models.")
    if name not in NAMES or type(model) is not load_module(name).Model:
        return None
    return name


def configure(config_class: Any, preset: str, overrides: dict[str, Any], model: str, mine: Sequence[Path] = ()) -> Any:
    """``config_class`` (a dataclass with a ``PRESETS`` dict) at the preset ``preset`` with ``overrides``.

    ConfigError for an unknown preset (naming the presets), an unknown field (naming the fields),
    or a value unlike the field's (its default, else the preset's value), in ``overrides`` or in the
    preset itself: integer fields (sizes, counts) take integers of at least 1, float fields finite
    numbers of at least 0, other fields values of that value's type; and for a config that rejects the
    values (its ``__post_init__``), naming the line of ``mine`` (the user's files or folders) that raised.
    """
    presets = config_class.PRESETS
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} for {model}; choose one of {', '.join(presets)}")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise ConfigError(f"model {model} has no option {', '.join(unknown)}; its fields are {', '.join(fields)}")
    values = {**presets[preset], **overrides}
    for name, value in overrides.items():
        reference = _default(fields[name])
        reference = presets[preset].get(name, reference) if reference is dataclasses.MISSING else reference
        if reference is not dataclasses.MISSING:
            _check_field(model, name, value, reference)
    for name, value in presets[preset].items():  # a preset's own sizes too: a 0 would train on empty tensors
        reference = _default(fields[name]) if name in fields and name not in overrides else None
        if reference is not None and reference is not dataclasses.MISSING:
            _check_field(f"{model} preset {preset}", name, value, reference)
    try:
        return config_class(**values)
    except ConfigError:
        raise
    except Exception as e:
        where = location(e, mine)
        at = f" at {where}" if where else ""
        raise ConfigError(
            f"model {model} preset {preset}: {config_class.__name__}({_show(values)}) failed{at}: {error_text(e)}"
        ) from None


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _show(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _check_field(model: str, field: str, value: Any, reference: Any) -> None:
    """ConfigError unless ``value`` suits a config field whose preset or default value is ``reference``."""
    if isinstance(reference, bool) or not isinstance(reference, (int, float)):
        if not isinstance(value, type(reference)):
            raise ConfigError(
                f"model {model}: {field}={value!r}, but {field} takes a {type(reference).__name__} such as {reference!r}"
            )
    elif isinstance(reference, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model {model}: {field}={value!r}, but {field} takes an integer of at least 1")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"model {model}: {field}={value!r}, but {field} takes a finite number of at least 0")


def _choices() -> str:
    return f"a shipped model ({', '.join(NAMES)}), a Python file (path/to/model.py) or an importable module (package.model)"


def _load_file(spec: str) -> ModuleType:
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"--model {spec!r}: file not found")
    if path.is_dir():
        raise ConfigError(f"--model {spec!r} is a directory; give the model's Python file (path/to/model.py)")
    if path.suffix != ".py":
        raise ConfigError(f"--model {spec!r} is not a Python file (a model file's name ends in .py)")
    path = path.resolve()
    if path in _files:
        return _files[path]
    name = f"{_PREFIX}{len(_files)}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--model {spec!r}: Python finds no way to load this file as a module")
    module = importlib.util.module_from_spec(module_spec)
    if str(path.parent) not in sys.path:  # as for a script: modules beside the file are importable
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise ConfigError(f"--model {spec!r}: {_exited(e, [path])}") from None
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"--model {spec!r}: importing it failed {_where(e, [path])}") from None
    _files[path] = module
    return module


def _import(spec: str) -> ModuleType:
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name is not None and (spec == e.name or spec.startswith(e.name + ".")):
            raise ConfigError(f"unknown model {spec!r}; choose {_choices()}") from None
        raise ConfigError(f"--model {spec!r}: importing it failed {_where(e, _package_dirs(spec))}") from None
    except SystemExit as e:
        raise ConfigError(f"--model {spec!r}: {_exited(e, _package_dirs(spec))}") from None
    except Exception as e:
        raise ConfigError(f"--model {spec!r}: importing it failed {_where(e, _package_dirs(spec))}") from None


def _exited(error: SystemExit, mine: list[Path]) -> str:
    """What to say of a model module that called ``sys.exit`` while being imported (nothing was trained)."""
    where = location(error, mine)
    at = f" at {where}" if where else ""
    return (
        f"importing it called sys.exit({error.code!r}){at}; a model module defines Config and Model and runs nothing "
        'when imported (put a script\'s code under `if __name__ == "__main__":`)'
    )


def _mine(module: ModuleType, spec: str) -> list[Path]:
    """The files or folders of the user's code behind ``module``: the file for a Python file, the
    top-level package's folder for an importable module."""
    file = getattr(module, "__file__", None)
    if module.__name__.startswith(_PREFIX) and file is not None:
        return [Path(file).resolve()]
    return _package_dirs(spec) or ([Path(file).resolve()] if file else [])


def _package_dirs(spec: str) -> list[Path]:
    """The folder of ``spec``'s top-level package (its files are the user's), if it can be found."""
    try:
        found = importlib.util.find_spec(spec.split(".")[0])
    except (ImportError, ValueError):
        return []
    if found is None or found.origin is None:
        return []
    return [Path(found.origin).resolve().parent]


def _where(error: BaseException, mine: list[Path]) -> str:
    """``at FILE:LINE (`code`): Type: message`` for ``error``, at the deepest frame in ``mine`` (files or
    folders of the user's code), else the deepest frame."""
    if isinstance(error, SyntaxError):
        code = (error.text or "").strip()
        return f"at {error.filename}:{error.lineno}" + (f" (`{code}`)" if code else "") + f": SyntaxError: {error.msg}"
    where = location(error, mine, anywhere=True)
    return (f"at {where}: " if where else "") + error_text(error)


def _check_form(module: ModuleType, spec: str) -> None:
    """ConfigError unless ``module`` has a dataclass ``Config`` with a dict ``PRESETS`` and a ``Model`` with init, batch, loss."""
    missing = [n for n in ("Config", "Model") if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"model {spec} has no {' and no '.join(missing)}: {_FORM}")
    config, model = module.Config, module.Model
    if not dataclasses.is_dataclass(config):
        raise ConfigError(f"model {spec}: Config is not a dataclass (decorate it with @dataclasses.dataclass); {_FORM}")
    presets = getattr(config, "PRESETS", None)
    if not isinstance(presets, dict) or not presets or not all(isinstance(v, dict) for v in presets.values()):
        raise ConfigError(
            f"model {spec}: Config.PRESETS must be a non-empty dict of preset name -> dict of field values, got {presets!r}"
        )
    lacking = [m for m in REQUIRED if not callable(getattr(model, m, None))]
    if lacking:
        raise ConfigError(f"model {spec}: Model has no {', '.join(lacking)}; {_FORM}")
