"""The layout-validation part of the 2D strategies: what the layout is checked against, found once.

``validate_parallel_dims`` (``parallel/dims.py``) is the one entry that checks a layout: it runs every registered
check (``parallel/checks.py``) whose inputs are known, every problem listed, the same messages wherever it runs.
The strategies call it through ``ModelParallel2DBase.validate`` as soon as each thing it checks is known, always
before a process group exists for what it checks:

- in the launching process, when the Trainer/Fabric is constructed (the world, the precision, the
  hardware), and when the Trainer's launcher starts ``fit``/``validate``/``test``/``predict`` (the
  LightningModule's plan, the datamodule's sequence length and batch size: ``ValidatingLauncher``);
- in each rank, before its process group (``setup_environment``: the rank's GPU; under torchrun or SLURM,
  where no launching process of ours exists, everything), and once the model is built, before it is parallelized
  (``setup``: adapters a ``configure_model`` added itself); Fabric meets the model only in ``setup_module``, and
  checks its plan and what its modules show there, before any collective touches it.

``model_context`` derives the model-dependent part from a LightningModule and a datamodule, the same way
in the launching process and in each rank: the plan, the batch's shape, and the check inputs the module gives of
itself (``models.registry.validation_inputs_of``). The checks of the datamodule against the module are registered
here.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_2d.models.registry import validation_inputs_of, resolve_plan
from lightning_2d.ops.preference import PreferenceConfigError, PreferenceLoss
from lightning_2d.parallel.checks import check
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError, ParallelPlan


def model_context(
    module: Any, datamodule: Any, config: ParallelConfig, plan: Optional[ParallelPlan], before_launch: bool = False
) -> dict[str, Any]:
    """``plan``, ``seq_len`` and ``batch_size`` for ``validate`` from a LightningModule and a datamodule
    (either may be ``None``), with the other check inputs they know (``parallel.checks.INPUTS``): what the module says
    of itself (``models.registry.validation_inputs_of``: ``owner``, ``lora`` …) and the datamodule's
    ``document_mask`` and ``preference_units``.

    ``before_launch``: a plan that cannot be resolved before the model is built (it reads the model) is left
    to the check in each process; a ``ParallelConfigError`` is raised in any case.
    """
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
    known = {**validation_inputs_of(module), "document_mask": getattr(datamodule, "document_mask", None),
             "preference_units": getattr(datamodule, "preference_units", None)}
    return {
        "plan": resolved,
        "seq_len": _int_or_none(getattr(datamodule, "seq_len", None)),
        "batch_size": _int_or_none(getattr(datamodule, "batch_size", None)),
        **{name: value for name, value in known.items() if value is not None},  # unknown: left out
    }


@check
def document_mask_support(document_mask: bool, supports_document_mask: bool, owner: str) -> list[str]:
    """A datamodule's document masking (``TextDataModule(document_mask=True)``) needs a module that takes each packed
    document's positions."""
    if not document_mask or supports_document_mask:
        return []
    return [
        f"TextDataModule(document_mask=True) gives each packed document its own positions, but {owner} cannot take"
        " them (its supports_document_mask is False). Use LlamaLightningModule or HFCausalLMModule, or"
        " document_mask=False"
    ]


@check(error=PreferenceConfigError)
def preference_data_units(preference: PreferenceLoss, preference_units: str) -> list[str]:
    """A pairwise loss needs pairs, KTO unpaired examples (``PreferenceDataModule`` reads either)."""
    if preference.paired and preference_units == "examples":
        return [
            f"preference loss_type={preference.loss_type!r} compares a chosen and a rejected completion of one prompt,"
            " but the PreferenceDataModule's rows are unpaired examples (prompt, completion, label: TRL's KTO format);"
            " use loss_type='kto', or rows of pairs (prompt, chosen, rejected)"
        ]
    if not preference.paired and preference_units == "pairs":
        return [
            "preference loss_type='kto' scores unpaired examples (prompt, completion, label), but the"
            " PreferenceDataModule's rows are pairs (chosen and rejected); write each completion as its own row"
            " (lightning_2d.data.preference.unpaired_rows of the pairs; format='unpaired' with paths=None: the"
            " built-in ones), or use a pairwise loss (sigmoid, ipo, hinge, robust, simpo, orpo)"
        ]
    return []


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
