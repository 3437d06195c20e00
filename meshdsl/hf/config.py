"""A Hugging Face ``config.json`` read into the llama decoder's ``Config`` and written back from it.

Every field of the file is either translated (``hidden_size`` -> ``d_model``, ...), checked against the
one value the decoder models (``attention_bias: false``, ``sliding_window`` null or at least the
sequence, ...), or bookkeeping that does not change the numbers (token ids, ``torch_dtype``,
``transformers_version``, ...). Anything else (another ``rope_scaling`` type, mixture-of-experts
fields, an unknown ``model_type``) is a ConfigError naming the field and its value: never dropped.
Both layouts of the rope fields are read: 4.x's top-level ``rope_theta`` and ``rope_scaling``, and
5.x's ``rope_parameters``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshdsl.errors import ConfigError, DataError

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
}
"""The ``model_type``s read, and the architecture each is saved as."""

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"},
    "mistral": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"},
    "qwen2": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"},
    "qwen3": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"},
    "gemma": {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "gelu"},
}
"""Each family's transformers defaults for the fields a saved ``config.json`` may leave out."""

SIZES = {
    "hidden_size": "d_model",
    "intermediate_size": "d_ff",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "vocab_size": "vocab",
}
"""Fields copied to the Config as they are (required)."""

BOOKKEEPING = {
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "initializer_range",
    "max_position_embeddings",
    "use_cache",
    "_name_or_path",
    "pretraining_tp",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "attn_implementation",
    "_attn_implementation_autoset",
}
"""Fields that do not change the model's numbers (``pretraining_tp`` only splits matmuls into sums)."""

REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "attention_dropout": (0, 0.0),
    "use_mrope": (False,),
    "partial_rotary_factor": (1, 1.0),
    "use_bidirectional_attention": (None, False),
}
"""Fields the decoder models at one value only (or absent)."""

GELU_TANH = ("gelu", "gelu_pytorch_tanh", "gelu_new")
"""Gemma's activations: transformers runs each as the tanh GELU (``gelu`` included, for Gemma 1)."""


def read(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model folder; DataError for a missing folder or an unreadable file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"Hugging Face folder {str(folder)!r} not found (or not a directory)")
    path = folder / "config.json"
    if not path.is_file():
        raise DataError(f"Hugging Face folder {str(folder)!r} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise DataError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise DataError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def _rope(hf: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    """The rope fields of the Config from 4.x's ``rope_theta``/``rope_scaling`` or 5.x's ``rope_parameters``."""
    parameters = hf.get("rope_parameters")
    if parameters is not None and hf.get("rope_scaling") is not None:
        raise ConfigError(f"{where}: both rope_parameters and rope_scaling are set; a config has one")
    scaling = dict(parameters if parameters is not None else hf.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", hf.get("rope_theta", DEFAULTS[family]["rope_theta"]))
    field = "rope_parameters" if parameters is not None else "rope_scaling"
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default" and not scaling:
        return out
    if kind != "llama3":
        raise ConfigError(f"{where}: {field} of type {kind!r} is not modelled (only 'default' and 'llama3')")
    names = {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_length",
    }
    unknown = sorted(set(scaling) - set(names))
    if unknown:
        raise ConfigError(f"{where}: {field}.{unknown[0]}={scaling[unknown[0]]!r} is not modelled for rope type llama3")
    missing = sorted(set(names) - set(scaling))
    if missing:
        raise ConfigError(f"{where}: {field} of type 'llama3' lacks {', '.join(missing)}")
    out["rope_scaling"] = "llama3"
    for k, v in scaling.items():
        out[names[k]] = int(v) if k == "original_max_position_embeddings" else float(v)
    return out


def _activation(hf: dict[str, Any], family: str, where: str) -> str:
    """``"silu"`` or ``"gelu_tanh"`` from ``hidden_act`` (and Gemma's ``hidden_activation``, which wins)."""
    field = "hidden_activation" if family == "gemma" and hf.get("hidden_activation") is not None else "hidden_act"
    value = hf.get(field, DEFAULTS[family]["hidden_act"])
    if family == "gemma" and value in GELU_TANH:
        return "gelu_tanh"
    if family != "gemma" and value == "silu":
        return "silu"
    raise ConfigError(f"{where}: {field}={value!r} is not modelled for {family}")


def _window(hf: dict[str, Any], family: str, length: int, where: str) -> None:
    """ConfigError for a sliding window shorter than the sequence, or sliding layers, where they apply."""
    if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        return
    window = hf.get("sliding_window")
    if window is not None and window < length:
        raise ConfigError(
            f"{where}: sliding_window={window} is shorter than the sequence (length={length}); "
            "sliding-window attention is not modelled"
        )


def fields(hf: dict[str, Any], length: int, where: str) -> dict[str, Any]:
    """The llama ``Config`` fields of a ``config.json`` (dict ``hf``) for sequences of ``length``."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"{where}: model_type={family!r} is not modelled; known: {', '.join(FAMILIES)}")
    missing = [k for k in SIZES if k not in hf]
    if missing:
        raise ConfigError(f"{where}: lacks {', '.join(missing)}")
    handled = {*SIZES, *BOOKKEEPING, *REQUIRED_VALUES, "model_type", "num_key_value_heads", "head_dim"}
    handled |= {"rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "hidden_act"}
    handled |= {"hidden_activation"} if family == "gemma" else set()
    handled |= {"sliding_window"} if family != "llama" else set()
    handled |= {"use_sliding_window", "max_window_layers", "layer_types"} if family in ("qwen2", "qwen3") else set()
    for key, value in hf.items():
        if key not in handled:
            raise ConfigError(f"{where}: field {key}={value!r} is not modelled for {family}")
        if key in REQUIRED_VALUES and value not in REQUIRED_VALUES[key]:
            raise ConfigError(f"{where}: {key}={value!r} is not modelled (only {REQUIRED_VALUES[key][0]!r})")
    if family != "qwen2" and hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias={hf['attention_bias']!r} is not modelled")
    types = hf.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types) and hf.get("use_sliding_window", False):
        bad = next(t for t in types if t != "full_attention")
        raise ConfigError(f"{where}: layer_types holds {bad!r}; only 'full_attention' layers are modelled")
    _window(hf, family, length, where)
    heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = hf.get("num_key_value_heads") or heads
    out = {mine: hf[theirs] for theirs, mine in SIZES.items()}
    out |= {
        "kv_heads": kv_heads,
        "d_kv": hf.get("head_dim") or d_model // heads,
        "norm_eps": float(hf.get("rms_norm_eps", DEFAULTS[family]["rms_norm_eps"])),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", DEFAULTS[family]["tie_word_embeddings"])),
        "activation": _activation(hf, family, where),
        "qkv_bias": family == "qwen2",
        "qk_norm": family == "qwen3",
        "embed_scale": family == "gemma",
        "norm_offset": 1.0 if family == "gemma" else 0.0,
        "rope": "half",
        **_rope(hf, family, where),
    }
    return out


def family_of(config: Any) -> str:
    """The Hugging Face ``model_type`` a llama ``Config``'s switches make; ConfigError for a mix none is."""
    gemma = (config.activation == "gelu_tanh", config.embed_scale, config.norm_offset == 1.0)
    if any(gemma):
        if not all(gemma) or config.qkv_bias or config.qk_norm:
            raise ConfigError(
                "hf.save: activation, embed_scale and norm_offset are Gemma's only together "
                f"(got {config.activation!r}, {config.embed_scale}, {config.norm_offset}); "
                "no Hugging Face family has this mix"
            )
        return "gemma"
    if config.norm_offset != 0.0:
        raise ConfigError(f"hf.save: norm_offset={config.norm_offset} is no Hugging Face family's (0 or Gemma's 1)")
    if config.qkv_bias and config.qk_norm:
        raise ConfigError("hf.save: qkv_bias (Qwen2) with qk_norm (Qwen3) is no Hugging Face family's")
    return "qwen2" if config.qkv_bias else "qwen3" if config.qk_norm else "llama"


def write(config: Any, dtype: str) -> dict[str, Any]:
    """The ``config.json`` (4.x layout, which transformers 4 and 5 both read) of a llama ``Config``."""
    if config.rope != "half":
        raise ConfigError(f"hf.save: Hugging Face's weights are for rope='half' (rotate-half), not {config.rope!r}")
    family = family_of(config)
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.d_kv,
        "vocab_size": config.vocab,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "gelu_pytorch_tanh" if family == "gemma" else "silu",
        "max_position_embeddings": max(config.length, config.rope_original_length),
        "torch_dtype": dtype,
    }
    if family == "gemma":
        out["hidden_activation"] = "gelu_pytorch_tanh"
    if family != "qwen2":
        out["attention_bias"] = False
    if config.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": config.rope_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_length,
        }
    return out
