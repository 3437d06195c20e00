"""By hand: transformers loads the folders ``md.hf.save`` writes and gives meshdsl's logits (never run by the suite).

Two halves, in two environments::

    .venv/bin/python tests/hf_fixtures/check_transformers_loads.py write /tmp/hf_saved
    /tmp/hfvenv/bin/python tests/hf_fixtures/check_transformers_loads.py check /tmp/hf_saved

``write`` (meshdsl's venv) loads each fixture family, moves every parameter by random noise (so the
weights are no longer the fixture's), saves the folder with ``md.hf.save`` (the qwen2 one in shards of
20 kB, with the index) and stores meshdsl's float32 logits on the fixture's ids beside it. ``check``
(a venv with torch and transformers) loads each folder with ``AutoModelForCausalLM.from_pretrained``,
requires no missing, unexpected or mismatched tensor, and compares transformers' logits with meshdsl's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "hf"
FAMILIES = ("llama", "llama_tied_llama3", "mistral", "qwen2", "qwen3", "gemma")


def write(out: Path) -> None:
    import jax

    import meshdsl as md

    mesh = md.Mesh({"data": 1})
    for i, name in enumerate(FAMILIES):
        ids = np.load(DATA / name / "expected.npz")["input_ids"]
        model, params = md.hf.load(DATA / name, mesh=mesh, batch=ids.shape[0], length=ids.shape[1])
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.key(i), len(leaves))
        params = tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
        logits = md.compile(model.logits, mesh, md.Layout({}))(params, md.tensor(ids, "batch length")).numpy()
        md.hf.save(out / name, model, params, max_shard_bytes=20_000 if name == "qwen2" else md.hf.SHARD_BYTES)
        np.savez(out / name / "meshdsl.npz", input_ids=ids, logits=logits)
        print(f"{name}: wrote {sorted(p.name for p in (out / name).iterdir())}")


def check(out: Path) -> None:
    import torch
    import transformers

    for name in FAMILIES:
        saved = np.load(out / name / "meshdsl.npz")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            out / name, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
        )
        problems = {k: v for k, v in info.items() if v}
        assert not problems, (name, problems)
        with torch.no_grad():
            logits = model(torch.from_numpy(saved["input_ids"]).long()).logits.numpy()
        error = np.abs(logits - saved["logits"]).max() / np.abs(saved["logits"]).max()
        print(f"{name}: {type(model).__name__}, no missing/unexpected/mismatched tensors, logits within {error:.1e}")
        assert error < 1e-4, (name, error)
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}: all families load with meshdsl's logits"
    )


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](Path(sys.argv[2]))
