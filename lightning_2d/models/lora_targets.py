"""Where each model family takes LoRA adapters by default (``lightning_2d.ops.lora``), and the other names of
those layers a user may write in ``lora.targets``: the attention and MLP projections, as peft's defaults for
these architectures and torchtune's ``lora_attn_modules`` + ``apply_lora_to_mlp``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from lightning_2d.ops.lora import LoRA

#: Our Llama's projections (Meta's names).
LLAMA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
#: Hugging Face Llama-family decoders' projections (``LlamaForCausalLM``, Qwen2/3, Mistral).
HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Hugging Face name → ours (the same layer), and back.
HF_TO_LLAMA = dict(zip(HF_TARGETS, ("wq", "wk", "wv", "wo", "w1", "w3", "w2")))
LLAMA_TO_HF = {ours: hf for hf, ours in HF_TO_LLAMA.items()}


def add_family_lora(model: "nn.Module", lora: "LoRA") -> list[str]:
    """``ops.lora.add_lora`` with the model family's default targets and other names: our Llama ``Transformer``'s
    (Meta's names, Hugging Face's accepted), else a Hugging Face decoder's (theirs, ours accepted). What the adapters
    cannot train with (a mixture of experts, float8, QLoRA's layouts) is refused by the registered checks
    (``parallel/lora.py``), which read the adapters' settings from the module or the model (``ops.lora.lora_of``)."""
    from lightning_2d.models.llama.model import Transformer
    from lightning_2d.ops.lora import add_lora

    if isinstance(model, Transformer):
        return add_lora(model, lora, LLAMA_TARGETS, HF_TO_LLAMA)
    return add_lora(model, lora, HF_TARGETS, LLAMA_TO_HF)
