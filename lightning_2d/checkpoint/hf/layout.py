"""Our Llama in the Hugging Face layout, both ways: parameter names (``hf_name``), the RoPE row permutation of
``wq``/``wk`` (``meta_to_hf``, ``hf_to_meta``), ``config.json`` from our ``ModelArgs`` and back, and the
safetensors file names of a Hugging Face directory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.models.llama.model import ModelArgs

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


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with these shapes."""
    return {
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
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


def model_args_from_hf(directory: Path) -> ModelArgs:
    """``ModelArgs`` from a Hugging Face Llama ``config.json`` (``multiple_of`` chosen to reproduce its FFN size)."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; init_from needs a Hugging Face Llama directory")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{config_path} describes a {config.get('model_type')!r} model, not 'llama'")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError(
            f"{config_path} uses rotary scaling ({rope.get('rope_type') or config.get('rope_scaling')}), which this"
            " model does not implement"
        )
    if config.get("tie_word_embeddings"):
        raise ValueError(f"{config_path} ties the embedding and output weights, which this model does not")
    n_heads = config["num_attention_heads"]
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        vocab_size=config["vocab_size"],
        hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        max_seq_len=config.get("max_position_embeddings", 4096),
    )


def same_shapes(a: ModelArgs, b: ModelArgs) -> list[str]:
    """Fields (those that shape the weights or their meaning) where ``a`` and ``b`` differ."""
    checks = {
        "dim": (a.dim, b.dim), "n_layers": (a.n_layers, b.n_layers), "n_heads": (a.n_heads, b.n_heads),
        "n_kv_heads": (a.kv_heads, b.kv_heads), "vocab_size": (a.vocab_size, b.vocab_size),
        "ffn_hidden_dim": (a.ffn_hidden_dim, b.ffn_hidden_dim), "rope_theta": (a.rope_theta, b.rope_theta),
        "norm_eps": (a.norm_eps, b.norm_eps),
    }
    return [f"{k}: {x} vs {y}" for k, (x, y) in checks.items() if x != y]
