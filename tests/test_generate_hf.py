"""Greedy ``md.generate`` on the Hugging Face fixtures equals transformers' own greedy ``generate``.

The fixtures (``tests/data/hf/<family>/``: a tiny random checkpoint and ``expected.npz`` with
``input_ids`` and transformers' ``generated``, prompt plus 6 greedy ids) were made by transformers
itself (``tests/hf_fixtures/make_fixtures.py``); the suite reads only the stored files.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import meshdsl as md
from meshdsl import hf
from meshdsl.cli import main

FIXTURES = Path(__file__).resolve().parent / "data" / "hf"

FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.npz").is_file())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_equal_transformers_generate(family):
    """Under data and tensor parallelism at once: each device its row and its heads' cache."""
    expected = np.load(FIXTURES / family / "expected.npz")
    prompt, generated = expected["input_ids"], expected["generated"]
    mesh = md.Mesh({"data": 2, "model": 2})
    heads = "kv_heads" if hf.config_of(FIXTURES / family).kv_heads % 2 == 0 else "group"  # multi-query: the group
    layout = f"batch:data; {heads}:model; d_ff:model; vocab:model"
    model, params = hf.load(FIXTURES / family, mesh=mesh, layout=layout)
    new = generated.shape[1] - prompt.shape[1]
    ids = md.generate(model, params, prompt, max_new_tokens=new, mesh=mesh, layout=layout)
    np.testing.assert_array_equal(ids, generated)


def test_meshdsl_generate_from_a_hugging_face_folder_equals_transformers_under_two_layouts(capsys):
    """``meshdsl generate --init-from-hf``: the same greedy ids as transformers' ``generate`` under a
    data-parallel and a tensor-parallel layout (the fixture's two prompts, four times: a row a device)."""
    expected = np.load(FIXTURES / "llama" / "expected.npz")
    prompt, generated = np.tile(expected["input_ids"], (4, 1)), np.tile(expected["generated"], (4, 1))
    new = generated.shape[1] - prompt.shape[1]
    prompts = "; ".join(" ".join(map(str, row)) for row in prompt)
    for layout in ("data_parallel", "dp_tp"):
        argv = ["generate", "--init-from-hf", str(FIXTURES / "llama"), "--layout", layout]
        assert main([*argv, "--prompt-ids", prompts, "--max-new-tokens", str(new)]) == 0
        out = capsys.readouterr().out
        rows = [
            [int(t) for t in line.split("] ", 1)[1].split()] for line in out.splitlines() if re.match(r"\[\d+\] ", line)
        ]
        np.testing.assert_array_equal(rows, generated[:, prompt.shape[1] :], err_msg=layout)
