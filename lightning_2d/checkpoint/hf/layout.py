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
from lightning_2d.ops.moe import MoEArgs

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
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
}
#: The Hugging Face architectures our ``Transformer`` is written as and read from (``hf_model_type``).
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "mixtral": "MixtralForCausalLM"}
_FAMILY_NAMES = {"llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral"}
#: A mixture-of-experts family's files: the layer's module (``mlp`` / ``block_sparse_moe``) and each expert's
#: gate, up and down projections (ours: ``w1``, ``w3``, ``w2``), per expert as ``….experts.E.<proj>.weight``. The
#: router is ``….gate.weight``. transformers 5 keeps them fused in memory and may save them so: ``mlp.experts.
#: gate_up_proj`` ``(E, 2F, D)`` (gate rows first) and ``mlp.experts.down_proj`` ``(E, D, F)``.
MOE_LAYOUTS = {"qwen3_moe": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
               "mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"})}
_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_ROUTER = re.compile(r"layers\.(\d+)\.feed_forward\.router\.weight$")
_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)\.weight$")


def hf_model_type(args: ModelArgs) -> str:
    """The Hugging Face architecture a ``Transformer(args)`` is (``HF_ARCHITECTURES``): ``qwen3``/``qwen3_moe`` with
    per-head q/k norms, ``mixtral`` for experts without them, else ``llama``; ``hf_export_problems`` says whether
    the architecture can hold it."""
    if args.qk_norm:
        return "qwen3_moe" if args.moe is not None else "qwen3"
    return "mixtral" if args.moe is not None else "llama"


def hf_export_problems(args: ModelArgs) -> list[str]:
    """What of ``args`` its Hugging Face architecture (``hf_model_type``) cannot hold (empty: nothing)."""
    model_type, moe, problems = hf_model_type(args), args.moe, []
    if moe is None:
        return problems
    if moe.num_shared_experts:
        problems.append(f"num_shared_experts={moe.num_shared_experts}: {model_type} has no shared experts")
    if moe.score_func != "softmax" or moe.route_scale != 1.0:
        problems.append(f"score_func={moe.score_func!r}, route_scale={moe.route_scale}: {model_type} routes by softmax,"
                        " unscaled")
    if moe.load_balancing == "bias":
        problems.append(f"load_balancing='bias': the experts' balancing bias routes tokens and {model_type} has no"
                        " place for it")
    if model_type == "mixtral":
        if not moe.norm_topk_prob:
            problems.append("norm_topk_prob=False: Mixtral always renormalizes the top-k weights")
        if len(args.moe_layers) != args.n_layers:
            problems.append(f"dense blocks {[i for i in range(args.n_layers) if not args.is_moe_layer(i)]}: every"
                            " Mixtral block is a mixture of experts (Qwen3-MoE's layout has dense blocks: qk_norm)")
    return problems


def hf_name(name: str, model_type: str = "llama") -> str:
    """Our parameter name → the Hugging Face name (of ``model_type``; not the stacked experts: ``expert_hf_name``)."""
    if model_type in MOE_LAYOUTS and (router := _ROUTER.match(name)):
        return f"model.layers.{router.group(1)}.{MOE_LAYOUTS[model_type][0]}.gate.weight"
    match = _LAYER_NAME.match(name)
    if match:
        return f"model.layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}.weight"
    return f"{_TOP_MAP[name.removesuffix('.weight')]}.weight"


def expert_name(name: str) -> Optional[tuple[int, str]]:
    """``(block, "w1" | "w2" | "w3")`` of a stacked experts tensor of ours (``layers.N.feed_forward.experts.w1``)."""
    match = _EXPERTS.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def expert_hf_name(layer: int, which: str, expert: int, model_type: str) -> str:
    """The per-expert Hugging Face name of expert ``expert``'s ``which`` (``w1``/``w2``/``w3``) in block ``layer``."""
    module, projections = MOE_LAYOUTS[model_type]
    return f"model.layers.{layer}.{module}.experts.{expert}.{projections[which]}.weight"


def fused_expert_name(layer: int, which: str) -> str:
    """transformers 5's fused name holding ``which``: ``gate_up_proj`` (``w1`` rows first, then ``w3``) or
    ``down_proj`` (``w2``)."""
    return f"model.layers.{layer}.mlp.experts.{'down_proj' if which == 'w2' else 'gate_up_proj'}"


def transformers_to_files(name: str, tensor: torch.Tensor, model_type: str) -> dict[str, torch.Tensor]:
    """A tensor of transformers' own mixture-of-experts model (``HFCausalLMModule``) as ``save_pretrained`` writes
    it: the fused experts split per expert (``gate_up_proj``'s gate rows, then its up rows; ``down_proj``), Mixtral's
    router and experts under ``block_sparse_moe``; any other tensor as it is."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)", name)
    if model_type not in MOE_LAYOUTS or match is None:
        return {name: tensor}
    layer, what = int(match.group(1)), match.group(2)
    if what == "gate.weight":
        return {f"model.layers.{layer}.{MOE_LAYOUTS[model_type][0]}.gate.weight": tensor}
    if what == "experts.down_proj":
        return {expert_hf_name(layer, "w2", e, model_type): tensor[e].contiguous() for e in range(tensor.shape[0])}
    half = tensor.shape[1] // 2
    out = {}
    for e in range(tensor.shape[0]):
        out[expert_hf_name(layer, "w1", e, model_type)] = tensor[e, :half].contiguous()
        out[expert_hf_name(layer, "w3", e, model_type)] = tensor[e, half:].contiguous()
    return out


def rotary_heads(name: str, args: ModelArgs) -> Optional[int]:
    """Number of heads whose rows are permuted between the layouts (``wq``: n_heads, ``wk``: n_kv_heads; a per-head
    norm's weight, one head's features: 1)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    if name.endswith("attention.q_norm.weight") or name.endswith("attention.k_norm.weight"):
        return 1
    return None


def meta_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head: interleaved pairs → halves (a 1-D weight: its features, as rows).

    Meta's checkpoints (and our ``Transformer``) rotate interleaved pairs of each head's features, Hugging Face's
    Llama the two halves: the query and key projections' rows are permuted on the way out (``export_hf``).

    Args:
        weight: A ``wq``/``wk`` weight, ``(n_heads × head_dim, dim)``, or a per-head norm's ``(head_dim,)``.
        n_heads: The heads its rows hold (``n_heads`` for ``wq``, ``n_kv_heads`` for ``wk``; 1 for a per-head norm).

    Returns:
        The same weight with each head's rows in Hugging Face's order; ``hf_to_meta`` inverts it.
    """
    if weight.dim() == 1:
        return meta_to_hf(weight.unsqueeze(-1), n_heads).squeeze(-1)
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_to_meta(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head: halves → interleaved pairs (inverse of ``meta_to_hf``).

    Args:
        weight: A Hugging Face ``q_proj``/``k_proj`` weight, ``(n_heads × head_dim, dim)``, or a per-head norm's
            ``(head_dim,)``.
        n_heads: The heads its rows hold (``num_attention_heads`` for ``q_proj``, ``num_key_value_heads`` for
            ``k_proj``; 1 for a per-head norm).

    Returns:
        The same weight with each head's rows in Meta's (our ``Transformer``'s) order.
    """
    if weight.dim() == 1:
        return hf_to_meta(weight.unsqueeze(-1), n_heads).squeeze(-1)
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
    """``config.json`` of the Hugging Face architecture of these args (``hf_model_type``: ``LlamaForCausalLM``,
    ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``).

    The rotary embedding is written both ways: ``rope_parameters`` (transformers 5) and, with a scaling,
    ``rope_scaling`` + ``rope_theta`` as in Meta's Llama 3.1 files (what transformers 4 and other readers take;
    transformers 5 reads ``rope_scaling`` too, before ``rope_parameters``, so the two must agree).
    """
    scaling = _hf_rope_scaling(args.rope_scaling) if args.rope_scaling is not None else None
    rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta} if scaling is None else {
        **scaling, "rope_theta": args.rope_theta
    }
    model_type = hf_model_type(args)
    config = {
        "architectures": [HF_ARCHITECTURES[model_type]],
        "model_type": model_type,
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
    if model_type != "llama":  # Qwen3's and Mixtral's configs have no mlp_bias
        del config["mlp_bias"]
    if model_type in ("qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    moe = args.moe
    if moe is not None:
        # transformers trains with the auxiliary loss only when the config asks for the router logits.
        common = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
                  "output_router_logits": moe.load_balancing == "aux_loss" and moe.aux_loss_coef > 0}
        if model_type == "mixtral":
            config.update(common, num_local_experts=moe.num_experts, intermediate_size=moe.hidden_dim,
                          sliding_window=None)
        else:
            config.update(common, num_experts=moe.num_experts, moe_intermediate_size=moe.hidden_dim,
                          norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=args.moe_layer_step,
                          mlp_only_layers=list(args.dense_layers))
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
    """``ModelArgs`` from a Hugging Face ``config.json`` of a Llama, Qwen3, Qwen3-MoE or Mixtral (``multiple_of``
    chosen to reproduce its FFN size; a mixture of experts balanced as transformers would fine-tune it: by the
    auxiliary loss when the config asks for the router logits, else not at all).

    Args:
        directory: A Hugging Face model directory (what ``init_from`` takes).

    Returns:
        The model args our ``Transformer`` is built from to hold that model's weights.

    Raises:
        FileNotFoundError: The directory has no ``config.json``.
        ValueError: A ``model_type`` that is not one of these families, or fields (a rotary scaling, a feed-forward
            size) that our model cannot reproduce.

    Example:
        ```python
        from pathlib import Path
        from lightning_2d.hf import model_args_from_hf

        args = model_args_from_hf(Path("Meta-Llama-3-8B"))
        args.n_layers, args.n_kv_heads  # (32, 8)
        ```
    """
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; init_from needs a Hugging Face Llama directory")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"{config_path} describes a {model_type!r} model, not one of {', '.join(HF_ARCHITECTURES)}")
    rope_theta, rope_scaling = _rope_scaling_from_hf(config, config_path)
    if problems := _unrepresentable(config):
        raise ValueError(
            f"{config_path} describes a {_FAMILY_NAMES[model_type]} this model cannot represent: " + "; ".join(problems)
            + ". Load it with the Hugging Face path instead (lightning_2d.hf.HFCausalLMModule)"
        )
    n_heads, dim = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim")
    moe = MoEArgs.from_hf_config(config)  # the one reader of a mixture of experts' fields
    moe_fields: dict[str, Any] = {}
    if moe is not None:
        step, dense = MoEArgs.hf_block_rule(config)
        moe_fields = {"moe_layer_step": step, "dense_layers": dense}
    return ModelArgs(
        dim=dim,
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
        head_size=head_dim if head_dim is not None and head_dim * n_heads != dim else None,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=moe,
        **moe_fields,
    )


def _unrepresentable(config: dict[str, Any]) -> list[str]:
    """The fields of a ``config.json`` whose values the native model does not implement (each named with its value
    and the one it needs): importing them anyway would load the weights and compute something else."""
    n_heads, dim, model_type = config.get("num_attention_heads"), config.get("hidden_size"), config.get("model_type")
    needed = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "partial_rotary_factor": (config.get("partial_rotary_factor", 1.0), 1.0),
    }
    if model_type == "llama" and n_heads and dim and config.get("head_dim") is not None:
        needed["head_dim"] = (config["head_dim"], dim // n_heads)
    if model_type in ("qwen3", "qwen3_moe"):
        needed["use_sliding_window"] = (config.get("use_sliding_window", False), False)
    problems = [f"{name} is {value!r} (needs {want!r})" for name, (value, want) in needed.items()
                if value is not None and value != want]
    if model_type == "mixtral" and config.get("sliding_window") is not None:
        problems.append(
            f"sliding_window is {config['sliding_window']!r} (needs None: attention over the whole sequence)"
        )
    return problems


def tied_aliases(args: ModelArgs) -> frozenset[str]:
    """Our names that are another name's weight under ``args`` (the head's, when tied): a checkpoint may hold them
    (DCP saves every name), a Hugging Face directory does not (``tie_word_embeddings``: one tensor)."""
    return frozenset({"output.weight"}) if args.tie_word_embeddings else frozenset()


def _expert_shape(moe: Optional[MoEArgs]) -> Optional[tuple[int, int, int]]:
    return None if moe is None else (moe.num_experts, moe.top_k, moe.hidden_dim)


def same_shapes(a: ModelArgs, b: ModelArgs) -> list[str]:
    """Fields (those that shape the weights or their meaning) where ``a`` and ``b`` differ."""
    checks = {
        "dim": (a.dim, b.dim), "n_layers": (a.n_layers, b.n_layers), "n_heads": (a.n_heads, b.n_heads),
        "n_kv_heads": (a.kv_heads, b.kv_heads), "vocab_size": (a.vocab_size, b.vocab_size),
        "ffn_hidden_dim": (a.ffn_hidden_dim, b.ffn_hidden_dim), "rope_theta": (a.rope_theta, b.rope_theta),
        "norm_eps": (a.norm_eps, b.norm_eps), "rope_scaling": (a.rope_scaling, b.rope_scaling),
        "tie_word_embeddings": (a.tie_word_embeddings, b.tie_word_embeddings),
        "head_dim": (a.head_dim, b.head_dim), "qk_norm": (a.qk_norm, b.qk_norm),
        "moe_layers": (a.moe_layers, b.moe_layers),
        "experts": (_expert_shape(a.moe), _expert_shape(b.moe)),
    }
    return [f"{k}: {x} vs {y}" for k, (x, y) in checks.items() if x != y]
