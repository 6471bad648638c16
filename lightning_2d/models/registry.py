"""What the library knows of a model given without a plan: its family's plan (our Llama ``Transformer``,
a Hugging Face Llama-family decoder), init hooks and the checks' inputs; ``resolve_plan`` picks the plan the
strategies apply, ``validation_inputs_of`` what the registered checks (and the model converters) may read of the
module or model trained; ``materialize_known_model`` does on one device what the Fabric strategy does to such a
model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_2d.models.hf_decoders import HFDecoderInit, check_hf_decoder, hf_decoder_plan
from lightning_2d.models.llama.model import Transformer
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.ops.lora import LoRA, lora_of
from lightning_2d.ops.moe import MoE
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.parallelize import convert_and_materialize


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face ``transformers`` model (without importing ``transformers``)."""
    # The MRO, not the class: FSDP2 swaps in a subclass (``FSDPLlamaForCausalLM``) defined in torch.
    return hasattr(model, "config") and any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def known_plan(owner: Any, config: ParallelConfig) -> ParallelPlan | None:
    """The plan of a model this library knows (a bare ``Transformer``; a Hugging Face Llama-family
    decoder such as ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``), else ``None``."""
    if isinstance(owner, Transformer):
        return llama_plan(owner.args, config)
    if is_hf_model(owner):
        check_hf_decoder(owner)
        return hf_decoder_plan(owner.config, config, module="")
    return None


def output_head(model: nn.Module) -> nn.Module:
    """The output projection of a model this library knows (a ``Transformer``'s ``output``, a Hugging Face decoder's
    ``lm_head``), which a fused loss runs inside (``parallel.distillation.head_computes``)."""
    if is_hf_model(model):
        return model.get_output_embeddings()
    head = getattr(model, "output", None)
    if not isinstance(head, nn.Module) or not hasattr(head, "weight"):
        raise TypeError(f"{type(model).__name__} has no output projection this library knows (a Transformer's"
                        " `output`, a Hugging Face decoder's `lm_head`)")
    return head


def model_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> Any:
    """What a known model's forward returns where its logits go: a ``Transformer``'s output, a Hugging Face decoder's
    ``.logits`` (each packed document's ``position_ids`` to both)."""
    if is_hf_model(model):
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return model(input_ids, position_ids=position_ids)


def known_init_hooks(model: Any) -> Any:
    """Init hooks (``param_init_specs``/``init_buffers``) for a known model class that has none
    (a Hugging Face decoder), else ``None``."""
    if is_hf_model(model):
        return HFDecoderInit(model)
    return None


def resolve_plan(owner: Any, config: ParallelConfig, plan: ParallelPlan | None) -> ParallelPlan:
    """The plan to apply: the one given to the strategy, else ``owner.parallel_plan(config)``, else the
    plan of a model this library knows (a bare Llama ``Transformer``), else the default names."""
    if plan is not None:
        return plan
    plan_fn = getattr(owner, "parallel_plan", None)
    if callable(plan_fn):
        return plan_fn(config)
    return known_plan(owner, config) or ParallelPlan()


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` holds mixture-of-experts layers: ours (``ops.moe.MoE``) or transformers' (``Qwen3MoeExperts``,
    ``MixtralExperts``)."""
    return any(isinstance(m, MoE) or type(m).__name__.endswith("Experts") for m in model.modules())


def validation_inputs_of(owner: Any) -> dict[str, Any]:
    """What the registered checks (``parallel.checks.INPUTS``) may read of ``owner``, the LightningModule or the model
    trained: its own ``validation_inputs()`` (``CausalLMModule``'s: its settings, before the model is built), else what
    its modules show (a model given to Fabric, a LightningModule of one's own: the class, the adapters found, whether
    it has experts); ``{}`` for anything else. ``None``: unknown."""
    own = getattr(owner, "validation_inputs", None)
    if callable(own):
        return dict(own())
    if not isinstance(owner, nn.Module):
        return {}
    lora = getattr(owner, "lora", None)
    return {
        "owner": type(owner).__name__,
        "lora": lora if isinstance(lora, LoRA) else lora_of(owner),
        "experts": has_experts(owner),
        "supports_document_mask": bool(getattr(owner, "supports_document_mask", False)),
    }


def materialize_known_model(model: nn.Module, device: torch.device, seed: int) -> None:
    """One device (a plain single-device Fabric loop, the reference of the 2D one): what the Fabric strategy's
    ``setup`` does to ``model`` (on the meta device, a family this library knows), without the parallelism: the model
    converters it asks for (its declared ``lora``: ``validation_inputs_of``) applied with its family's plan, then its
    tensors allocated on ``device`` and initialized from ``seed``, with the values every layout gives it."""
    plan = known_plan(model, ParallelConfig()) or ParallelPlan(module="")
    convert_and_materialize(model, plan, device, seed, validation_inputs_of(model), known_init_hooks)
