"""The shipped models, rebuilt on md.nn, reproduce the figures recorded before (tests/data/model_figures.json).

For every shipped model x layout: md.explain's collectives of one training step, exactly (count
and bytes per kind). For one layout per model: the first 3 AdamW losses, to 1e-6 relative (the
other layouts' losses equal these to 1e-4 by the layout-invariance tests: test_training,
test_moe, test_convnet; ``python -m model_figures --check`` recomputes every case).
"""

from __future__ import annotations

import json

import pytest

import model_figures as F

RECORDED = json.loads(F.FIXTURE.read_text())
CASES = [(m, name) for m, layouts in F.CASES.items() for name in layouts]
LOSS_CASES = [("mlp", "dp_tp"), ("transformer", "pipeline"), ("moe", "moe_expert"), ("convnet", "spatial")]


def test_fixture_covers_every_shipped_case():
    assert {(m, name) for m, layouts in RECORDED["models"].items() for name in layouts} == set(CASES)
    assert RECORDED["steps"] == F.STEPS and len(RECORDED["commit"]) == 40


@pytest.mark.parametrize("model,layout", CASES)
def test_collectives_reproduced(model, layout):
    why = F.mismatch({"collectives": F.collectives(model, layout)}, RECORDED["models"][model][layout])
    assert why is None, why


@pytest.mark.parametrize("model,layout", LOSS_CASES)
def test_losses_reproduced(model, layout):
    why = F.mismatch({"losses": F.losses(model, layout)}, RECORDED["models"][model][layout])
    assert why is None, why
