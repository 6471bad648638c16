"""The layout-validation part of the 2D strategies: what the layout is checked against, found once.

``validate_parallel_dims`` (``parallel/dims.py``) is the one entry that checks a layout: it runs every registered
check (``parallel/checks.py``) whose inputs are known, every problem listed, the same messages wherever it runs.
The strategies call it through ``ModelParallel2DBase.validate`` as soon as each thing it checks is known, always
before a process group exists for what it checks:

- in the launching process, when the Trainer/Fabric is constructed (the world, the precision, the
  hardware), and when the Trainer's launcher starts ``fit``/``validate``/``test``/``predict`` (the
  LightningModule's plan, the datamodule's sequence length and batch size: ``ValidatingLauncher``);
- in each rank, before its process group (``setup_environment``: the rank's GPU; under torchrun or SLURM,
  where no launching process of ours exists, everything); Fabric meets the model only in
  ``setup_module``, and checks its plan there, before any collective touches it.

``model_context`` derives the model-dependent part from a LightningModule and a datamodule, the same way
in the launching process and in each rank.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_2d.models.registry import resolve_plan
from lightning_2d.parallel.lora import qlora_problems
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError, ParallelPlan, raise_if_problems


def model_context(
    module: Any, datamodule: Any, config: ParallelConfig, plan: Optional[ParallelPlan], before_launch: bool = False
) -> dict[str, Any]:
    """``plan``, ``seq_len`` and ``batch_size`` for ``validate`` from a LightningModule and a datamodule
    (either may be ``None``).

    ``before_launch``: a plan that cannot be resolved before the model is built (it reads the model) is left
    to the check in each process; a ``ParallelConfigError`` is raised in any case.
    """
    raise_if_problems(document_mask_problems(module, datamodule) + lora_problems(module, config))
    resolved = None
    if module is not None:
        try:
            resolved = resolve_plan(module, config, plan)
        except ParallelConfigError:
            raise
        except Exception:
            if not before_launch:
                raise
    else:
        resolved = plan
    return {
        "plan": resolved,
        "seq_len": _int_or_none(getattr(datamodule, "seq_len", None)),
        "batch_size": _int_or_none(getattr(datamodule, "batch_size", None)),
    }


def document_mask_problems(module: Any, datamodule: Any) -> list[str]:
    """What keeps a datamodule's document masking (``TextDataModule(document_mask=True)``) from working."""
    if not getattr(datamodule, "document_mask", False):
        return []
    problems = []
    if module is not None and not getattr(module, "supports_document_mask", False):
        problems.append(
            f"TextDataModule(document_mask=True) gives each packed document its own positions, but"
            f" {type(module).__name__} cannot take them (its supports_document_mask is False). Use"
            " LlamaLightningModule or HFCausalLMModule, or document_mask=False"
        )
    return problems


def lora_problems(module: Any, config: ParallelConfig) -> list[str]:
    """What keeps a module's LoRA adapters (``lora=``) from composing with the strategy's options."""
    lora = getattr(module, "lora", None)
    if lora is None:
        return []
    problems = []
    if config.float8:
        problems.append(
            f"float8={config.float8!r} with LoRA adapters ({type(module).__name__}(lora=...)): float8 swaps the"
            " projections for torchao's Float8Linear, which the adapters cannot wrap, and a frozen base gains little"
            " from float8 training. Use float8=False with lora, or train without lora"
        )
    if lora.quantize_base is not None:
        problems += qlora_problems(config, _int_or_none(config.tensor_parallel_size))
    return problems


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
