"""Hugging Face, in one place: decoders from ``transformers`` under the 2D strategies, and our Llama's
checkpoints to and from Hugging Face directories.

- ``HFCausalLMModule`` trains a ``LlamaForCausalLM``/``MistralForCausalLM``/``Qwen2ForCausalLM``/
  ``Qwen3ForCausalLM`` (``hf_decoder_plan``, ``HFDecoderInit``: ``lightning_2d.models.hf_decoders``);
- ``export_hf`` writes a Lightning checkpoint of the Llama as a Hugging Face directory and
  ``HFWeights``/``model_args_from_hf`` read one back (``lightning_2d.checkpoint.hf``).

A front door: the names live in their layers; ``transformers`` is imported only when a model is built.
"""

from lightning_2d.checkpoint.hf import (
    ExportError,
    HFWeights,
    SafetensorsWeights,
    checkpoint_model_args,
    export_hf,
    hf_to_meta,
    meta_to_hf,
    model_args_from_hf,
)
from lightning_2d.integration.hf_module import HFCausalLMModule
from lightning_2d.models.hf_decoders import HFDecoderInit, check_hf_decoder, hf_decoder_plan, load_hf_config

__all__ = [
    "ExportError",
    "HFCausalLMModule",
    "HFDecoderInit",
    "HFWeights",
    "SafetensorsWeights",
    "check_hf_decoder",
    "checkpoint_model_args",
    "export_hf",
    "hf_decoder_plan",
    "hf_to_meta",
    "load_hf_config",
    "meta_to_hf",
    "model_args_from_hf",
]
