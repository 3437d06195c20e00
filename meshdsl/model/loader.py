"""What ``--model``, ``--preset`` and ``--set`` mean in every command: a model from a shipped name,
a Python file or an importable module, at a preset, with fields overridden.

A model module (the shipped ones in ``meshdsl.models`` have this form too) defines

* ``Config``: a dataclass of the model's sizes and options, with ``PRESETS``, a dict mapping a
  preset name to field values (``{"tiny": {"rows": 16}}``); no base class is needed;
* ``Model``: ``Model(config)`` with the core of :class:`meshdsl.model.protocol.Model` (``init(key)``,
  ``batch(key)``, ``loss(params, batch)``); its optional parts (``flops_per_step()``, ``LAYOUTS``,
  ``DIM_ROLES``, the pipeline parts, ...) are listed there, the one place the model interface is written.

A model of the user's (not a shipped one) comes back wrapped in a :class:`meshdsl.model.user.UserModel`,
so a mistake in its code is one line naming the user's file and line, whichever command runs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from meshdsl.errors import ConfigError
from meshdsl.model import protocol as model_protocol
from meshdsl.model.config import configure
from meshdsl.model.user import UserModel, call, error_text, location
from meshdsl.models import NAMES

_FORM = (
    "a model module defines a Config dataclass with a PRESETS dict (preset name -> field values) and a Model class "
    "(Model(config) with init(key), batch(key), loss(params, batch)); see docs/tutorial.md"
)
HF_PREFIX = "hf:"
"""A spec naming a Hugging Face folder (``--init-from-hf DIR``)."""
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
    if spec.startswith(HF_PREFIX):  # --init-from-hf DIR: the llama decoder with the folder's config
        return importlib.import_module("meshdsl.models.llama")
    if spec in NAMES:
        module = importlib.import_module(f"meshdsl.models.{spec}")
    elif spec.endswith(".py") or "/" in spec or Path(spec).exists():
        module = _load_file(spec)
    else:
        module = _import(spec)
    _check_form(module, spec)
    return module


def build_model(spec: str, preset: str, **overrides: Any) -> Any:
    """``Model(config)`` of the module ``spec`` names (see :func:`load_module`; ``hf:DIR``: ``md.hf.model(DIR,
    **overrides)``, the preset unused), ``config`` being its
    preset ``preset`` with ``overrides`` (those that are None keep the preset's values) checked by
    :func:`configure`. The model gets a ``config`` attribute if its class sets none. A model of the
    user's comes back as a :class:`~meshdsl.model.user.UserModel`: a mistake in ``Config``, ``Model(config)``,
    ``init``, ``batch`` or ``loss`` is a one-line md error naming the user's file and line."""
    if spec.startswith(HF_PREFIX):
        from meshdsl import hf

        return hf.model(spec.removeprefix(HF_PREFIX), **{k: v for k, v in overrides.items() if v is not None})
    module = load_module(spec)
    shipped = module.__name__.startswith("meshdsl.models.")
    mine = [] if shipped else _mine(module, spec)
    values = {k: v for k, v in overrides.items() if v is not None}
    config = configure(module.Config, preset, values, spec, mine)
    model = module.Model(config) if shipped else call(module.Model, (config,), "Model(config)", mine)
    if getattr(model, "config", None) is None:
        model.config = config
    return model if shipped else UserModel(model, spec, mine)


def shipped_name(model: object) -> str | None:
    """The shipped model ``model`` is an instance of (``"mlp"``), or None for a model of the user's,
    whatever its module is called: bench's byte formulas and plain-JAX baselines exist only for the
    shipped models' own classes."""
    name = type(model).__module__.removeprefix("meshdsl.models.")
    if name not in NAMES or type(model) is not load_module(name).Model:
        return None
    return name


def _choices() -> str:
    shipped = ", ".join(NAMES)
    return f"a shipped model ({shipped}), a Python file (path/to/model.py) or an importable module (package.model)"


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
    """ConfigError unless ``module`` has a dataclass ``Config`` with a dict ``PRESETS`` and a ``Model`` with init,
    batch, loss."""
    missing = [n for n in ("Config", "Model") if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"model {spec} has no {' and no '.join(missing)}: {_FORM}")
    config, model = module.Config, module.Model
    if not dataclasses.is_dataclass(config):
        raise ConfigError(f"model {spec}: Config is not a dataclass (decorate it with @dataclasses.dataclass); {_FORM}")
    presets = getattr(config, "PRESETS", None)
    if not isinstance(presets, dict) or not presets or not all(isinstance(v, dict) for v in presets.values()):
        raise ConfigError(
            f"model {spec}: Config.PRESETS must be a non-empty dict of preset name -> dict of field values, "
            f"got {presets!r}"
        )
    lacking = model_protocol.missing(model)
    if lacking:
        raise ConfigError(f"model {spec}: Model has no {', '.join(lacking)}; {_FORM}")
