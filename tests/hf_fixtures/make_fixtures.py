"""Makes the Hugging Face fixtures under ``tests/data/hf/`` with transformers itself (run by hand, never by the suite).

For each family a tiny random ``*ForCausalLM`` is built from its transformers config, every
parameter drawn at random (norm scales near their identity, biases non-zero, so no tensor can be
forgotten unseen), saved with ``save_pretrained`` into ``tests/data/hf/<name>/`` (``config.json``,
``model.safetensors``), and run in float32 on a fixed batch: ``expected.npz`` holds the input ids
``[2, 10]``, transformers' logits, its loss with plain labels and with ``-100`` labels (and those
labels), and ``generate``'s greedy continuation of 6 tokens (with an eos id that never occurs).

Run it in a scratch venv outside the repository (torch from PyPI is the CUDA build, ~5.6 GB)::

    python3.11 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors
    /tmp/hfvenv/bin/python tests/hf_fixtures/make_fixtures.py
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parents[1] / "data" / "hf"
V5 = int(transformers.__version__.split(".")[0]) >= 5
BATCH, LENGTH, NEW = 2, 10, 6


def rope(theta: float, scaling: dict | None = None) -> dict:
    """The rope fields in the layout of the installed transformers (5.x: ``rope_parameters``)."""
    if V5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})}}
    return {"rope_theta": theta, **({"rope_scaling": scaling} if scaling else {})}


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # wavelengths of head_dim 8 fall in all three bands
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=96, max_position_embeddings=128)

FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            **rope(10000.0),
        ),
    ),
    "llama_tied_llama3": (
        transformers.LlamaConfig,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            **rope(10000.0, LLAMA3),
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            rms_norm_eps=1e-5,
            sliding_window=4096,
            tie_word_embeddings=False,
            **rope(1000000.0),
        ),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            **rope(1000000.0),
        ),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            **rope(1000000.0),
        ),
    ),
    "gemma": (
        transformers.GemmaConfig,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            rms_norm_eps=1e-6,
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            **rope(10000.0),
        ),
    ),
}


def randomize(model: torch.nn.Module, gemma: bool, tied: bool, gen: torch.Generator) -> None:
    """Every parameter at random: norm scales near identity (Gemma's stored as ``w`` of ``1 + w``), a tied
    table small enough that its logits stay moderate."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_((0.3 if gemma or tied else 1.0) * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def make(name: str, config_class: type, fields: dict) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    config = config_class(**fields, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model, name == "gemma", config.tie_word_embeddings, gen)
    where = OUT / name
    shutil.rmtree(where, ignore_errors=True)
    model.save_pretrained(where)
    for f in where.iterdir():
        os.chmod(f, 0o644)
    vocab = config.vocab_size
    rng = np.random.default_rng(len(name))
    ids = rng.integers(0, vocab, (BATCH, LENGTH)).astype(np.int64)
    labels = ids.copy()
    labels[0, :3] = -100  # a prompt not trained on
    labels[1, -4:] = -100  # right padding
    t = torch.from_numpy(ids)
    with torch.no_grad():
        out = model(t, labels=t)
        masked = model(t, labels=torch.from_numpy(labels))
        for eos in range(vocab - 1, -1, -1):  # an eos that greedy decoding never produces
            generated = model.generate(
                t,
                attention_mask=torch.ones_like(t),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            ).numpy()
            if generated.shape == (BATCH, LENGTH + NEW) and not (generated[:, LENGTH:] == eos).any():
                break
    np.savez(
        where / "expected.npz",
        input_ids=ids.astype(np.int32),
        logits=out.logits.float().numpy(),
        loss=np.float32(out.loss.item()),
        labels=labels.astype(np.int32),
        loss_masked=np.float32(masked.loss.item()),
        generated=generated.astype(np.int32),
    )
    os.chmod(where / "expected.npz", 0o644)
    print(f"{name}: loss {out.loss.item():.6f}, with -100 labels {masked.loss.item():.6f}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (config_class, fields) in FAMILIES.items():
        make(name, config_class, fields)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    (OUT / "VERSIONS.json").write_text(json.dumps(versions, indent=1) + "\n")
    print(versions)


if __name__ == "__main__":
    main()
