"""Plans of the models this library knows: the Llama ``Transformer``."""

from __future__ import annotations

from typing import Any

from lightning_2d.model import ModelArgs, Transformer
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.tensor_parallel import llama_tensor_parallel_plan


def llama_plan(args: ModelArgs, config: ParallelConfig, module: str = "") -> ParallelPlan:
    """The Llama plan: Meta's module names and the head counts tensor parallelism must divide.

    Args:
        args: The model's shape.
        config: Sequence/loss parallel options shape the plan.
        module: Attribute holding the ``Transformer`` (``"model"`` in ``LlamaLightningModule``;
            ``""`` when the plan applies to the ``Transformer`` itself, as in Fabric).
    """
    return ParallelPlan(
        tensor_parallel=llama_tensor_parallel_plan(config.sequence_parallel, config.loss_parallel),
        blocks="layers",
        module=module,
        tp_divides={"n_heads": args.n_heads, "n_kv_heads": args.kv_heads},
        input_units=("tok_embeddings",),
        output_unit=("norm", "output"),
        blocks_use_randomness=False,  # no dropout in Llama
        num_blocks=args.n_layers,
        supports_pipeline=True,
    )


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face ``transformers`` model (without importing ``transformers``)."""
    # The MRO, not the class: FSDP2 swaps in a subclass (``FSDPLlamaForCausalLM``) defined in torch.
    return hasattr(model, "config") and any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def known_plan(owner: Any, config: ParallelConfig) -> ParallelPlan | None:
    """The plan of a model this library knows (a bare ``Transformer``; a Hugging Face Llama-family
    decoder such as ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``), else ``None``."""
    if isinstance(owner, Transformer):
        return llama_plan(owner.args, config)
    if is_hf_model(owner):
        from lightning_2d.hf_models import check_hf_decoder, hf_decoder_plan

        check_hf_decoder(owner)
        return hf_decoder_plan(owner.config, config, module="")
    return None


def known_init_hooks(model: Any) -> Any:
    """Init hooks (``param_init_specs``/``init_buffers``) for a known model class that has none
    (a Hugging Face decoder), else ``None``."""
    if is_hf_model(model):
        from lightning_2d.hf_models import HFDecoderInit

        return HFDecoderInit(model)
    return None
