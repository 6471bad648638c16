"""Our Llama in the Hugging Face layout, both ways: parameter names (``hf_name``), the RoPE row permutation of
``wq``/``wk`` (``meta_to_hf``, ``hf_to_meta``), ``config.json`` from our ``ModelArgs`` and back, and the
safetensors file names of a Hugging Face directory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from lightning_2d.models.llama.model import ModelArgs, RopeScaling, rope_scaling_problems

class WeightInfo(NamedTuple):
    """A weight of a checkpoint as its metadata describes it (no data read).

    Args:
        name: Our parameter name (``layers.0.attention.wq.weight``).
        shape: Its full (unsharded) shape.
        dtype: Its stored dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)\.weight$")


def hf_name(name: str) -> str:
    """Our parameter name → the Hugging Face Llama name."""
    match = _LAYER_NAME.match(name)
    if match:
        return f"model.layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}.weight"
    return f"{_TOP_MAP[name.removesuffix('.weight')]}.weight"


def rotary_heads(name: str, args: ModelArgs) -> Optional[int]:
    """Number of heads whose rows are permuted between the layouts (``wq``: n_heads, ``wk``: n_kv_heads)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def meta_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head: interleaved pairs → halves."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_to_meta(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head: halves → interleaved pairs (inverse of ``meta_to_hf``)."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _hf_rope_scaling(scaling: RopeScaling) -> dict[str, Any]:
    """A ``RopeScaling`` as Hugging Face writes it (the keys of ``rope_scaling``, Meta's Llama 3.1 ``config.json``)."""
    return {
        "rope_type": scaling.rope_type,
        "factor": float(scaling.factor),
        "low_freq_factor": float(scaling.low_freq_factor),
        "high_freq_factor": float(scaling.high_freq_factor),
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with these shapes.

    The rotary embedding is written both ways: ``rope_parameters`` (transformers 5) and, with a scaling,
    ``rope_scaling`` + ``rope_theta`` as in Meta's Llama 3.1 files (what transformers 4 and other readers take;
    transformers 5 reads ``rope_scaling`` too, before ``rope_parameters``, so the two must agree).
    """
    scaling = _hf_rope_scaling(args.rope_scaling) if args.rope_scaling is not None else None
    rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta} if scaling is None else {
        **scaling, "rope_theta": args.rope_theta
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling_from_hf(config: dict[str, Any], config_path: Path) -> tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, rope_scaling)`` of a Hugging Face ``config.json``, read as transformers reads it: the legacy
    ``rope_scaling`` (with ``type`` or ``rope_type``, and a top-level ``rope_theta``) before ``rope_parameters``."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    legacy_type = params.pop("type", "default")  # older files: "type"; "rope_type" wins where both are
    rope_type = params.pop("rope_type", legacy_type)
    supported = "'default' (no scaling) and 'llama3' (Llama 3.1's)"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"{config_path} uses the rotary scaling rope_type {rope_type!r}, which this model does not implement;"
            f" supported: {supported}"
        )
    missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key not in params]
    if missing:
        raise ValueError(
            f"{config_path}: the rotary scaling rope_type 'llama3' needs factor, low_freq_factor and high_freq_factor;"
            f" missing: {', '.join(missing)}"
        )
    # transformers' defaults: a top-level original_max_position_embeddings wins, else max_position_embeddings.
    original = config.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    fields = {
        "rope_type": rope_type, "factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
        "high_freq_factor": params["high_freq_factor"],
        "original_max_position_embeddings": original if original is not None else config.get("max_position_embeddings"),
    }
    if problems := rope_scaling_problems(fields):
        raise ValueError(f"{config_path} has a rotary scaling this model cannot read: " + "; ".join(problems))
    return theta, RopeScaling(**fields)


def model_args_from_hf(directory: Path) -> ModelArgs:
    """``ModelArgs`` from a Hugging Face Llama ``config.json`` (``multiple_of`` chosen to reproduce its FFN size)."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; init_from needs a Hugging Face Llama directory")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{config_path} describes a {config.get('model_type')!r} model, not 'llama'")
    rope_theta, rope_scaling = _rope_scaling_from_hf(config, config_path)
    if problems := _unrepresentable(config):
        raise ValueError(
            f"{config_path} describes a Llama this model cannot represent: " + "; ".join(problems)
            + ". Load it with the Hugging Face path instead (lightning_2d.hf.HFCausalLMModule)"
        )
    n_heads = config["num_attention_heads"]
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        vocab_size=config["vocab_size"],
        hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        max_seq_len=config.get("max_position_embeddings", 4096),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _unrepresentable(config: dict[str, Any]) -> list[str]:
    """The fields of a Llama ``config.json`` whose values the native model does not implement (each named with its
    value and the one it needs): importing them anyway would load the weights and compute something else."""
    n_heads, dim = config.get("num_attention_heads"), config.get("hidden_size")
    needed = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "partial_rotary_factor": (config.get("partial_rotary_factor", 1.0), 1.0),
    }
    if n_heads and dim and config.get("head_dim") is not None:
        needed["head_dim"] = (config["head_dim"], dim // n_heads)
    return [f"{name} is {value!r} (needs {want!r})" for name, (value, want) in needed.items()
            if value is not None and value != want]


def tied_aliases(args: ModelArgs) -> frozenset[str]:
    """Our names that are another name's weight under ``args`` (the head's, when tied): a checkpoint may hold them
    (DCP saves every name), a Hugging Face directory does not (``tie_word_embeddings``: one tensor)."""
    return frozenset({"output.weight"}) if args.tie_word_embeddings else frozenset()


def same_shapes(a: ModelArgs, b: ModelArgs) -> list[str]:
    """Fields (those that shape the weights or their meaning) where ``a`` and ``b`` differ."""
    checks = {
        "dim": (a.dim, b.dim), "n_layers": (a.n_layers, b.n_layers), "n_heads": (a.n_heads, b.n_heads),
        "n_kv_heads": (a.kv_heads, b.kv_heads), "vocab_size": (a.vocab_size, b.vocab_size),
        "ffn_hidden_dim": (a.ffn_hidden_dim, b.ffn_hidden_dim), "rope_theta": (a.rope_theta, b.rope_theta),
        "norm_eps": (a.norm_eps, b.norm_eps), "rope_scaling": (a.rope_scaling, b.rope_scaling),
        "tie_word_embeddings": (a.tie_word_embeddings, b.tie_word_embeddings),
    }
    return [f"{k}: {x} vs {y}" for k, (x, y) in checks.items() if x != y]
