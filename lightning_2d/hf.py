"""Hugging Face Llama interop: export a checkpoint to ``model.safetensors`` + ``config.json``, and load
such a directory into a (sharded) model.

Names map one to one (``layers.N.attention.wq`` ↔ ``model.layers.N.self_attn.q_proj``). The only
change of values is in ``wq``/``wk``: Meta's rotary embedding rotates interleaved pairs
``(x[2i], x[2i+1])`` while Hugging Face's rotates the halves ``(x[i], x[i + d/2])`` of each head,
so the rows of each head are permuted between the two layouts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.model import ModelArgs

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


# ---- export -----------------------------------------------------------------------------------
def _checkpoint_model_args(metadata: dict[str, Any]) -> ModelArgs:
    if "model_args" in metadata:
        return ModelArgs(**metadata["model_args"])
    hp = metadata.get("hyper_parameters") or {}
    model = hp.get("model", "debug")
    if isinstance(model, ModelArgs):
        return ModelArgs(**{**asdict(model), **(hp.get("model_overrides") or {})})
    return ModelArgs.from_name(model, **(hp.get("model_overrides") or {}))


def _iter_checkpoint_weights(checkpoint: Path, prefix: str = "model.") -> Iterator[tuple[str, ModelArgs, torch.Tensor]]:
    """``(our name, model args, full tensor)`` for each weight of a sharded or full Lightning checkpoint,
    one tensor in memory at a time (sharded) — no process group needed."""
    from lightning_2d.checkpoint import METADATA_FILE, is_complete

    checkpoint = Path(checkpoint)
    if not is_complete(checkpoint):
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint")
    if checkpoint.is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = torch.load(checkpoint / METADATA_FILE, weights_only=False)
        args = _checkpoint_model_args(metadata)
        stored = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        key_prefix = f"state_dict.{prefix}"
        for key, meta in stored.items():
            if not key.startswith(key_prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            dcp.load({key: tensor}, checkpoint_id=str(checkpoint), no_dist=True)
            yield key[len(key_prefix):], args, tensor
    else:
        full = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
        args = _checkpoint_model_args(full)
        for key, tensor in full["state_dict"].items():
            if key.startswith(prefix):
                yield key[len(prefix):], args, tensor


def export_hf(checkpoint: Path, out_dir: Path, dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``out_dir/model.safetensors`` (or shards + index) and ``config.json`` from a Lightning checkpoint.

    Args:
        checkpoint: A sharded checkpoint folder or a full checkpoint file of ``LlamaLightningModule``.
        out_dir: Where the Hugging Face directory is written.
        dtype: Dtype of the exported weights (default: as stored).
        max_shard_bytes: Start a new ``.safetensors`` file beyond this size.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, args, out_dtype = 0, None, dtype
    for name, args, tensor in _iter_checkpoint_weights(checkpoint):
        heads = rotary_heads(name, args)
        tensor = tensor.to(dtype or tensor.dtype)
        out_dtype = tensor.dtype
        if heads is not None:
            tensor = meta_to_hf(tensor, heads)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name(name)] = tensor.contiguous()
        size += nbytes
    if args is None:
        raise ValueError(f"{checkpoint} holds no model weights (expected keys under 'model.')")
    if len(shards) == 1:
        save_file(shards[0], out_dir / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out_dir / file, metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out_dir / "config.json").write_text(json.dumps(hf_config(args, out_dtype), indent=1))
    return out_dir


# ---- import -----------------------------------------------------------------------------------
class HFWeights:
    """Reads a Hugging Face Llama directory block by block: each rank reads only the rows and columns
    of the shards it holds (safetensors slices are memory-mapped reads)."""

    def __init__(self, directory: Path, args: ModelArgs) -> None:
        self.directory, self.args = Path(directory), args
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.files = {k: self.directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.directory / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(self.directory / SINGLE_FILE, framework="pt") as f:
                self.files = {k: self.directory / SINGLE_FILE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        loaded = model_args_from_hf(self.directory)
        if mismatch := same_shapes(args, loaded):
            raise ValueError(f"The model does not match {directory}/config.json: " + "; ".join(mismatch))

    @torch.no_grad()
    def fill_block_(self, out: torch.Tensor, name: str, global_shape: tuple[int, ...], offset: Optional[tuple[int, ...]]) -> None:
        """Copy the block of weight ``name`` starting at ``offset`` (``None``: the whole) into ``out``."""
        from safetensors import safe_open

        key = hf_name(name)
        if key not in self.files:
            raise KeyError(f"{self.directory} has no weight {key!r} (for {name})")
        offset = offset or (0,) * len(global_shape)
        rows = slice(offset[0], offset[0] + out.shape[0])
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
        heads = rotary_heads(name, self.args)
        with safe_open(self.files[key], framework="pt") as f:
            stored = f.get_slice(key)
            if heads is None:
                block = stored[(rows, *cols)]
            else:
                # Rows of a head are permuted within the head: read the whole heads the block touches.
                head_rows = global_shape[0] // heads
                first, last = rows.start // head_rows, (rows.stop - 1) // head_rows + 1
                whole = stored[(slice(first * head_rows, last * head_rows), *cols)]
                block = hf_to_meta(whole, last - first)[rows.start - first * head_rows : rows.stop - first * head_rows]
        out.copy_(block)
