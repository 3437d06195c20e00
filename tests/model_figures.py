"""The shipped models' figures: first training losses and one step's collectives, per layout.

For each shipped model at preset ``tiny`` under each layout it ships with (``Model.LAYOUTS``; the
convnet's ``spatial`` and ``data_parallel``; the Transformer also ``pipeline`` and ``gpipe``), the
first :data:`STEPS` losses of AdamW (learning rate 1e-2, init key 0, data key 1: ``harness.train``)
and ``md.explain``'s summary of one step (``Trainer.explain``: count and bytes per collective kind).

``tests/data/model_figures.json`` holds them as recorded from the models before they were rebuilt
on ``md.nn``, with the commit they came from; ``tests/test_model_figures.py`` asserts the models
of today reproduce them. To record them again (only when a change of the numbers is intended)::

    PYTHONPATH=$PWD:$PWD/tests XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m model_figures tests/data/model_figures.json
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

LAYOUTS_DIR = Path(__file__).resolve().parents[1] / "layouts"
STEPS = 3
LEARNING_RATE = 1e-2
CASES: dict[str, tuple[str, ...]] = {
    "mlp": ("data_parallel", "megatron", "dp_tp", "fsdp"),
    "transformer": ("data_parallel", "megatron", "dp_tp", "fsdp", "pipeline", "gpipe"),
    "moe": ("moe_expert", "data_parallel", "dp_tp", "megatron", "fsdp"),
    "convnet": ("spatial", "data_parallel"),
}
"""Model -> the layouts it ships with (``Model.LAYOUTS``, plus the Transformer's pipelines and the convnet's layouts)."""


def figures(model_name: str, layout_name: str) -> dict[str, Any]:
    """``{"losses": [...], "collectives": {kind: {"count", "bytes"}}}`` of ``model_name`` (preset tiny) under ``layout_name``."""
    import jax

    import harness
    import meshdsl as md
    from meshdsl.train.optim import adamw
    from meshdsl.train.step import Trainer

    module = importlib.import_module(f"models.{model_name}")
    model = module.Model(module.Config.preset("tiny"))
    layout = md.Layout.load(LAYOUTS_DIR / f"{layout_name}.toml")
    trainer = Trainer(model, adamw(LEARNING_RATE), layout.mesh(), layout)
    losses, _ = harness.train(trainer, STEPS)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    summary = trainer.explain(state, jax.random.key_data(jax.random.key(1))).summary()
    return {"losses": [float(x) for x in losses], "collectives": summary}


def record() -> dict[str, Any]:
    """Every case's figures, with the commit of the code that made them."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=LAYOUTS_DIR.parent).stdout.strip()
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


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
