"""The shipped models, rebuilt on md.nn, reproduce the figures recorded before (tests/data/model_figures.json).

For every shipped model x layout: md.explain's collectives of one training step, exactly (count
and bytes per kind). The losses are checked where they are computed anyway: the
layout-invariance tests (test_training, test_moe, test_convnet) compare their one-device run's
first 3 AdamW losses with every recorded layout's, to 1e-6 relative
(``model_figures.recorded_losses_mismatch``); ``python -m model_figures --check`` recomputes
every case under its own layout.
"""

from __future__ import annotations

import json

import model_figures as F
import pytest

RECORDED = json.loads(F.FIXTURE.read_text())
CASES = [(m, name) for m, layouts in F.CASES.items() for name in layouts]


def test_fixture_covers_every_shipped_case():
    assert {(m, name) for m, layouts in RECORDED["models"].items() for name in layouts} == set(CASES)
    assert RECORDED["steps"] == F.STEPS and len(RECORDED["commit"]) == 40


@pytest.mark.parametrize("model,layout", CASES)
def test_collectives_reproduced(model, layout):
    why = F.mismatch({"collectives": F.collectives(model, layout)}, RECORDED["models"][model][layout])
    assert why is None, why
