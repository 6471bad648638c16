"""Where each model family takes LoRA adapters by default (``lightning_2d.ops.lora``), and the other names of
those layers a user may write in ``lora.targets``: the attention and MLP projections, as peft's defaults for
these architectures and torchtune's ``lora_attn_modules`` + ``apply_lora_to_mlp``. Data: each family's plan carries
them (``ParallelPlan.adapter_targets``/``adapter_aliases``) to the adapters' converter (``parallel.lora``)."""

from __future__ import annotations

#: Our Llama's projections (Meta's names). In a mixture-of-experts block ``w1``/``w2``/``w3`` are the shared experts'
#: Linears and the routed experts' stacked projections (``feed_forward.experts.w1`` …, ``ops.lora.LoRAExperts``:
#: per-expert adapters): the defaults adapt both; ``experts.w1`` or ``shared_experts.w1`` names one of them.
LLAMA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
#: Hugging Face Llama-family decoders' projections (``LlamaForCausalLM``, Qwen2/3, Mistral).
HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Hugging Face name → ours (the same layer), and back.
HF_TO_LLAMA = dict(zip(HF_TARGETS, ("wq", "wk", "wv", "wo", "w1", "w3", "w2")))
LLAMA_TO_HF = {ours: hf for hf, ours in HF_TO_LLAMA.items()}
