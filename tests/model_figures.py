"""The shipped models' figures: first training losses and one step's collectives, per layout.

For each shipped model at preset ``tiny`` under each layout it ships with (``Model.LAYOUTS``; the
convnet's ``spatial`` and ``data_parallel``; the Transformer also ``pipeline`` and ``gpipe``), the
first :data:`STEPS` losses of AdamW (learning rate 1e-2, init key 0, data key 1: ``harness.train``)
and ``md.explain``'s summary of one step (``Trainer.explain``: count and bytes per collective kind).

``tests/data/model_figures.json`` holds them as recorded from the models before they were rebuilt
on ``md.nn``, with the commit they came from; ``tests/test_model_figures.py`` asserts the models
of today reproduce every case's collectives, and the layout-invariance tests (test_training,
test_moe, test_convnet) that their one-device losses equal every recorded layout's
(:func:`recorded_losses_mismatch`). To check every case's losses too (minutes)::

    PYTHONPATH=$PWD:$PWD/tests XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m model_figures --check tests/data/model_figures.json

and to record them again (only when a change of the numbers is intended), the same without
``--check``. A case whose collectives a change meant to alter, its losses the same, is amended in place
instead, with the commit and why, in the fixture's ``amended`` list.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

LAYOUTS_DIR = Path(__file__).resolve().parents[1] / "layouts"
FIXTURE = Path(__file__).resolve().parent / "data" / "model_figures.json"
STEPS = 3
LEARNING_RATE = 1e-2
RTOL = 1e-6
"""Losses must match the recorded ones to this relative tolerance (collectives exactly)."""
CASES: dict[str, tuple[str, ...]] = {
    "mlp": ("data_parallel", "megatron", "dp_tp", "fsdp"),
    "transformer": ("data_parallel", "megatron", "dp_tp", "fsdp", "pipeline", "gpipe"),
    "moe": ("moe_expert", "data_parallel", "dp_tp", "megatron", "fsdp"),
    "convnet": ("spatial", "data_parallel"),
}
"""Model -> the layouts it ships with (``Model.LAYOUTS``, plus the Transformer's pipelines and the convnet's
layouts)."""


def trainer(model_name: str, layout_name: str) -> Any:
    """The AdamW ``Trainer`` of ``model_name`` (preset tiny) under the shipped layout ``layout_name``."""
    import meshdsl as md
    from meshdsl.train.optim import adamw
    from meshdsl.train.step import Trainer

    module = importlib.import_module(f"meshdsl.models.{model_name}")
    layout = md.Layout.load(LAYOUTS_DIR / f"{layout_name}.toml")
    return Trainer(module.Model(module.Config.preset("tiny")), adamw(LEARNING_RATE), layout.mesh(), layout)


def collectives(model_name: str, layout_name: str) -> dict[str, dict[str, float]]:
    """md.explain's summary of one step (traced on the state's shapes: nothing compiled)."""
    import jax

    t = trainer(model_name, layout_name)
    return t.explain(t.abstract_state(), jax.random.key_data(jax.random.key(1))).summary()


def losses(model_name: str, layout_name: str) -> list[float]:
    """The first :data:`STEPS` training losses (init key 0, data key 1)."""
    import harness

    return [float(x) for x in harness.train(trainer(model_name, layout_name), STEPS)[0]]


def recorded_losses_mismatch(model_name: str, one_device_losses: Any) -> str | None:
    """Why the one-device run's first losses differ from those recorded under each shipped layout (None: they agree).

    The layout-invariance tests (test_training, test_moe, test_convnet) compute the one-device
    losses anyway; checking them here against the recording proves the rebuilt model trains as
    the old one did, under every layout it was recorded with, without compiling anything more.
    """
    recorded = json.loads(FIXTURE.read_text())["models"][model_name]
    for layout_name, want in recorded.items():
        why = mismatch({"losses": [float(x) for x in one_device_losses[:STEPS]]}, want)
        if why is not None:
            return f"{model_name} (recorded under {layout_name}): {why}"
    return None


def figures(model_name: str, layout_name: str) -> dict[str, Any]:
    """``{"losses": [...], "collectives": {kind: {"count", "bytes"}}}`` of one case."""
    return {"losses": losses(model_name, layout_name), "collectives": collectives(model_name, layout_name)}


def mismatch(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """Why ``got`` does not reproduce the recorded ``want`` (None: it does)."""
    if "collectives" in got and got["collectives"] != want["collectives"]:
        return f"collectives {got['collectives']}, recorded {want['collectives']}"
    if "losses" in got and not np.allclose(got["losses"], want["losses"], rtol=RTOL, atol=0):
        return f"losses {got['losses']}, recorded {want['losses']}"
    return None


def record() -> dict[str, Any]:
    """Every case's figures, with the commit of the code that made them."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=LAYOUTS_DIR.parent
    ).stdout.strip()
    out: dict[str, Any] = {
        "commit": commit,
        "script": "tests/model_figures.py (python -m model_figures; see its docstring)",
        "preset": "tiny",
        "optimizer": f"adamw({LEARNING_RATE})",
        "steps": STEPS,
        "models": {},
    }
    for model_name, layouts in CASES.items():
        out["models"][model_name] = {name: figures(model_name, name) for name in layouts}
        print(model_name, "done", file=sys.stderr)
    return out


def check(path: Path) -> int:
    """Recompute every case and compare with ``path``; prints one line per case, returns the failures."""
    recorded = json.loads(path.read_text())["models"]
    failures = 0
    for model_name, layouts in CASES.items():
        for name in layouts:
            why = mismatch(figures(model_name, name), recorded[model_name][name])
            failures += why is not None
            print(f"{model_name:12} {name:14} {why or 'reproduced'}", flush=True)
    return failures


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        sys.exit(1 if check(Path(sys.argv[2])) else 0)
    path = Path(sys.argv[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
