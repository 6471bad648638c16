"""Hugging Face Llama-family decoders (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``) under the 2D strategies: their parallel plan and their layout-independent initialization
(``lightning_2d.integration.hf_module.HFCausalLMModule`` trains one). Public names are re-exported by
``lightning_2d.hf``.

These models share one module layout::

    model.embed_tokens                               vocabulary-parallel embedding
    model.layers.N.input_layernorm / post_attention_layernorm     RMSNorm (sequence-parallel)
    model.layers.N.self_attn.{q,k,v}_proj (+ bias)   column-wise: n_heads / tp heads per rank
    model.layers.N.self_attn.{q,k}_norm              Qwen3 only: RMSNorm of each head (HeadShardedNorm)
    model.layers.N.self_attn.o_proj                  row-wise
    model.layers.N.mlp.{gate,up}_proj / down_proj    column-wise / row-wise
    model.norm, lm_head                              final norm, vocabulary-parallel head
    model.rotary_emb                                 rotary tables (non-persistent buffers)

Sequence parallelism differs from the plan of our own ``Transformer`` in one place. The HF model
runs code of its own between the embedding and the first layer on the embedding's output: the
positions (when ``position_ids`` is not given), the causal or padding mask and the rotary tables
are all derived from its shape. If the embedding returned this rank's slice of the sequence, as in
torchtitan's plan, each of those would silently describe a sequence ``tp`` times shorter. Here the
embedding's output stays whole (an all-reduce instead of a reduce-scatter) and the first layer
takes its slice (``SequenceShardInput``: no communication forward, an all-gather backward). The
extra cost is one activation-sized all-gather per step; every decoder layer runs exactly as under
torchtitan's plan, and a model called as ``model(input_ids)`` is correct with no extra arguments.

Qwen3 normalizes each query and key head (``q_norm``/``k_norm``, one weight of ``head_dim`` shared by
all heads) right after the projections, so each rank normalizes its own heads; the weight is a
``Replicate()`` DTensor over the tensor-parallel ranks whose gradient is summed over them
(``HeadShardedNorm``). Its sliding-window layers (``use_sliding_window``/``layer_types``, as Mistral's
and Qwen2's ``sliding_window``) need nothing of the plan: the model builds each layer kind's mask from
the whole sequence before the first layer, and every rank attends over the whole sequence.

``transformers`` is imported only when one of these is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_2d.models.lora_targets import HF_TARGETS, LLAMA_TO_HF
from lightning_2d.ops.init import InitSpec
from lightning_2d.ops.moe import HF_MOE_TYPES, MoEArgs, is_sparse_block
from lightning_2d.parallel.checks import check
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.parallel.styles import HeadShardedNorm, SequenceShardInput, VocabParallelHead, WholeOnEachRank

#: ``model_type`` values whose ``*ForCausalLM`` has the layout above.
HF_DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# The mixtures of experts among them (``HF_MOE_TYPES``, ``ops.moe``'s): some blocks' ``mlp`` is a sparse block
# (``mlp.gate`` router, ``mlp.experts.gate_up_proj`` ``(E, 2F, D)`` and ``down_proj`` ``(E, D, F)``, transformers 5's
# fused experts).

#: Every parameter of the Llama layout the built-in plan knows how to shard (names relative to the ``*ForCausalLM``).
_KNOWN_PARAMETER = re.compile(
    r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)"
    r"|model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.(weight|bias))"
)
#: The model types whose attention normalizes each query and key head (``HeadShardedNorm`` in the plan).
_PER_HEAD_NORM_TYPES = ("qwen3", "qwen3_moe")
#: Their norms' parameters, known only for those types: on another model a ``q_norm`` is not one the plan knows.
_PER_HEAD_NORM_PARAMETER = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight")


_MOE_PARAMETER = re.compile(r"model\.layers\.\d+\.mlp\.(gate\.weight|experts\.(gate_up_proj|down_proj))")


def hf_moe_layers(hf_config: Any) -> tuple[int, ...]:
    """The blocks whose ``mlp`` is a mixture of experts (Mixtral: all; Qwen3-MoE: not in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th), empty for a dense model: as ``MoEArgs.from_hf_config`` / ``hf_block_rule`` read the
    config."""
    if MoEArgs.from_hf_config(hf_config) is None:
        return ()
    step, dense = MoEArgs.hf_block_rule(hf_config)
    return tuple(i for i in range(int(hf_config.num_hidden_layers)) if is_sparse_block(i, step, dense))


def hf_config_problems(hf_config: Any) -> list[str]:
    """What keeps the built-in plan from applying to a model of ``hf_config`` (empty: it applies)."""
    problems = []
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in HF_DECODER_TYPES:
        problems.append(
            f"model_type {model_type!r} is not one of the Llama-family decoders the built-in plan knows"
            f" ({', '.join(HF_DECODER_TYPES)}); pass your own ParallelPlan to the strategy (or define"
            " parallel_plan(config) on your LightningModule)"
        )
    return problems


def _is_known_parameter(name: str, model_type: Any) -> bool:
    if _KNOWN_PARAMETER.fullmatch(name):
        return True
    if model_type in HF_MOE_TYPES and _MOE_PARAMETER.fullmatch(name):
        return True
    return model_type in _PER_HEAD_NORM_TYPES and _PER_HEAD_NORM_PARAMETER.fullmatch(name) is not None


def check_hf_decoder(model: nn.Module) -> None:
    """Refuse a model whose parameters the built-in plan would not shard correctly: any parameter outside
    its family's layout (a per-head ``q_norm`` on a Llama, a norm with a bias on a Qwen3 …), which the plan
    would leave unsharded and, under tensor parallelism, with a gradient differing between ranks.

    Args:
        model: A ``transformers`` ``*ForCausalLM`` (on any device, the meta device included).

    Raises:
        ValueError: Its config or parameters are outside the layout ``hf_decoder_plan`` shards (every problem
            listed); pass your own ``ParallelPlan`` for such a model.
    """
    problems = hf_config_problems(model.config)
    model_type = getattr(model.config, "model_type", None)
    unknown = [n for n, _ in model.named_parameters() if not _is_known_parameter(canonical_name(n), model_type)]
    if unknown:
        problems.append(
            f"{type(model).__name__} has parameters outside the Llama layout the built-in plan shards"
            f" ({', '.join(unknown[:5])}{', …' if len(unknown) > 5 else ''}); pass your own ParallelPlan"
        )
    if problems:
        raise ValueError(f"{type(model).__name__} cannot use the built-in Hugging Face decoder plan:\n  - " + "\n  - ".join(problems))


def hf_decoder_plan(hf_config: Any, config: ParallelConfig, module: str = "model") -> ParallelPlan:
    """The tensor/sequence-parallel plan of a Hugging Face Llama-family ``*ForCausalLM``.

    Args:
        hf_config: The model's ``PretrainedConfig``.
        config: The strategy's options: ``sequence_parallel`` and ``loss_parallel`` shape the plan.
        module: Attribute of the owner holding the model (``"model"`` in ``HFCausalLMModule``;
            ``""`` when the plan applies to the model itself, as with Fabric).

    Returns:
        The plan: the blocks ``model.layers``, the attention and MLP projections column- and row-wise, the head over
        the vocabulary, and under ``sequence_parallel`` the norms and the residual stream along the sequence.

    Raises:
        ValueError: A config the plan does not apply to (a model type or attention layout it does not know).

    Example:
        ```python
        from lightning_2d import ParallelConfig
        from lightning_2d.hf import hf_decoder_plan, load_hf_config

        hf_config = load_hf_config({"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4})
        plan = hf_decoder_plan(hf_config, ParallelConfig(tensor_parallel_size=2))
        plan.blocks, plan.tp_divides  # ('model.layers', {'num_attention_heads': 8, 'num_key_value_heads': 4})
        ```

        ``HFCausalLMModule.parallel_plan`` returns it; a ``LightningModule`` of your own holding a decoder may too.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if problems := hf_config_problems(hf_config):
        raise ValueError("The built-in Hugging Face decoder plan does not apply:\n  - " + "\n  - ".join(problems))
    sp, lp = config.sequence_parallel, config.loss_parallel
    between = Shard(1) if sp else Replicate()  # the residual stream between the layers
    block = "model.layers.*"
    styles: dict[str, Any] = {
        # Whole output even under SP: the model derives positions and masks from its shape (module docstring).
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Column-wise over the vocabulary; a fused loss computed in its call (distillation) passes through as is.
        "lm_head": VocabParallelHead(
            input_layouts=between, output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp
        ),
    }
    # The dense MLPs: every block's (one pattern), or each dense block's by index beside mixtures of experts, whose
    # sparse block runs whole on every tensor-parallel rank (WholeOnEachRank: the same routing everywhere).
    moe_layers = hf_moe_layers(hf_config)
    dense = [block] if not moe_layers else [f"model.layers.{i}" for i in range(int(hf_config.num_hidden_layers))
                                             if i not in moe_layers]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        styles[f"{block}.{name}"] = ColwiseParallel()
    styles[f"{block}.self_attn.o_proj"] = RowwiseParallel(output_layouts=between)
    for prefix in dense:
        styles[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        styles[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        styles[f"{prefix}.mlp.down_proj"] = RowwiseParallel(output_layouts=between)
    if hf_config.model_type in _PER_HEAD_NORM_TYPES:
        # On the projections' local heads, with or without SP (the attention sees the whole sequence):
        # a replicated weight whose gradient is summed over the TP ranks.
        styles[f"{block}.self_attn.q_norm"] = HeadShardedNorm()
        styles[f"{block}.self_attn.k_norm"] = HeadShardedNorm()
    if sp:
        styles["model.layers.0"] = SequenceShardInput("hidden_states")
        styles[f"{block}.input_layernorm"] = SequenceParallel()
        styles[f"{block}.post_attention_layernorm"] = SequenceParallel()
        # The decoder layer passes hidden_states to self_attn by keyword, to the MLP positionally.
        styles[f"{block}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        )
        for prefix in dense:
            styles[f"{prefix}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                         desired_input_layouts=(Replicate(),))
        # A plain tensor out of the base model (as without SP): lm_head gathers it.
        styles["model.norm"] = SequenceParallel(use_local_output=True)
    for i in moe_layers:
        styles[f"model.layers.{i}.mlp"] = WholeOnEachRank(sp)
    n_heads = hf_config.num_attention_heads
    return ParallelPlan(
        tensor_parallel=styles,
        blocks="model.layers",
        module=module,
        tp_divides={
            "num_attention_heads": n_heads,
            "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or n_heads,
        },
        input_units=("model.embed_tokens",),
        output_unit=("model.norm", "lm_head"),
        blocks_use_randomness=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0.0,
        # Tied: one weight for both (both styles shard it over the vocabulary); kept by parallelize_model.
        tied_weights=(("model.embed_tokens.weight", "lm_head.weight"),)
        if getattr(hf_config, "tie_word_embeddings", False) else (),
        whole_experts=hf_config.model_type if moe_layers else None,  # WholeOnEachRank: expert parallelism refused
        adapter_targets=HF_TARGETS,  # transformers' names; ours accepted
        adapter_aliases=LLAMA_TO_HF,
    )


def hf_validation_inputs(hf_config: Any) -> dict[str, Any]:
    """What the registered checks may know of ``HFCausalLMModule``'s decoder before its plan
    (``parallel.checks.INPUTS``): whether it has mixture-of-experts layers, and its config."""
    return {"experts": bool(hf_moe_layers(hf_config)), "hf_config": hf_config}


# ---- the checks (``parallel/checks.py``) of what a Hugging Face decoder cannot train with ------------------------
@check
def hf_expert_parallel(expert_parallel_size: int, plan: ParallelPlan, owner: str = "HFCausalLMModule") -> list[str]:
    """transformers' experts run whole on every rank (``plan.whole_experts``): expert parallelism is our Llama's."""
    if expert_parallel_size == 1 or plan.whole_experts is None:
        return []
    return [
        f"expert_parallel_size={expert_parallel_size} with {owner}: transformers' experts run whole on every rank"
        " (data and tensor parallel); expert parallelism runs on our own Llama:"
        f" LlamaLightningModule(init_from=<the {plan.whole_experts} folder>) reads the same files"
    ]


@check(error=ValueError)
def hf_router_logits(hf_config: Any) -> list[str]:
    """``HFCausalLMModule`` trains the language-model loss alone: transformers' auxiliary loss, which a mixture of
    experts' config may ask for, would be each rank's, not the global batch's."""
    moe = MoEArgs.from_hf_config(hf_config)
    if not (hf_moe_layers(hf_config) and moe is not None and moe.load_balancing == "aux_loss"):
        return []
    return [
        f"HFCausalLMModule trains the language-model loss of a {hf_config.model_type} model, without"
        " transformers' auxiliary load-balancing loss, but its config asks for it (output_router_logits=True);"
        " transformers would compute it over each rank's tokens, not the global batch. Use"
        " LlamaLightningModule(init_from=...) (the auxiliary loss over the global batch, expert parallelism),"
        " or config_overrides: {output_router_logits: false}"
    ]


class HFDecoderInit:
    """Layout-independent initialization of a Hugging Face Llama-family decoder (``ModelInitHooks``).

    The values follow the distributions of the model's own ``_init_weights`` (linear and embedding
    weights ``N(0, initializer_range)``, biases 0, RMSNorm weights 1) but are drawn by
    ``lightning_2d.ops.init``: the same seed gives the same weights on one device and at every
    ``(dp, tp)`` layout. (Unlike ``_init_weights``, the ``pad_token_id`` row of the embedding is
    not zeroed.) The rotary tables are recomputed from the config.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def param_init_specs(self) -> dict[str, InitSpec]:
        std = float(getattr(self.model.config, "initializer_range", 0.02))
        specs, unknown = {}, []
        for module_name, module in self.model.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                name = canonical_name(f"{module_name}.{param_name}" if module_name else param_name)
                if param_name == "bias":
                    specs[name] = InitSpec("constant", value=0.0)
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    specs[name] = InitSpec("normal", std=std)
                elif type(module).__name__.endswith(("Experts", "TopKRouter")):  # MoE: stacked experts, router
                    specs[name] = InitSpec("normal", std=std)
                elif "Norm" in type(module).__name__ and param_name == "weight":
                    specs[name] = InitSpec("constant", value=1.0)
                else:
                    unknown.append(f"{name} ({type(module).__name__})")
        if unknown:
            raise ValueError(
                f"No initialization is known for {', '.join(unknown)} of {type(self.model).__name__}; give the"
                " LightningModule a param_init_specs() returning an InitSpec for each (names relative to the model)"
            )
        return specs

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute each rotary module's tables (``inv_freq`` …) by building it again from its config."""
        for module in self.model.modules():
            buffers = dict(module.named_buffers(recurse=False))
            if not buffers or not hasattr(module, "config"):
                continue
            with torch.device("cpu"):
                fresh = type(module)(config=module.config)
            for name, value in fresh.named_buffers(recurse=False):
                if name in buffers:
                    buffers[name].copy_(value)


def load_hf_config(config: Union[str, Path, Mapping[str, Any], Any], overrides: Optional[Mapping[str, Any]] = None) -> Any:
    """A ``PretrainedConfig`` from a config object, a dict with ``model_type``, or a directory / ``config.json``.

    Args:
        config: A ``PretrainedConfig``, a dict with ``model_type`` and the fields to set, or a model directory or its
            ``config.json``.
        overrides: Fields to change (``{"num_hidden_layers": 2}``).

    Raises:
        FileNotFoundError: A path that is neither a directory with a ``config.json`` nor a ``config.json`` file.
        ValueError: Fields without a ``model_type``.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        fields = config.to_dict()
    elif isinstance(config, Mapping):
        fields = dict(config)
    else:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(
                f"{config} is neither a Hugging Face model directory with a config.json nor a config.json file"
            )
        fields = json.loads(path.read_text())
    fields.update(overrides or {})
    if "model_type" not in fields:
        raise ValueError(f"The Hugging Face config needs a model_type (one of {', '.join(HF_DECODER_TYPES)}): {fields}")
    return AutoConfig.for_model(**fields)
