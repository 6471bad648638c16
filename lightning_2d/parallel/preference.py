"""What preference tuning (``ops.preference.PreferenceLoss``: DPO and its relatives) cannot run with, refused before
any process group by registered checks (``parallel/checks.py``; ``parallel/dims.py`` imports this module so they
register before the layout's).

The pair's two sequences are summed on the ranks that hold their tokens (``parallel.loss.sum_over_context``), so
data, tensor, sequence and context parallelism need nothing more; under pipeline parallelism the last stage computes
each micro-batch's losses (``integration.preference.PipelinedPairs``, KTO's ``PipelinedExamples``) and a frozen
reference copy is split beside the trained stages (``parallel.frozen``): every schedule runs them.
"""

from __future__ import annotations

from typing import Optional

from lightning_2d.ops.lora import LoRA
from lightning_2d.ops.preference import PreferenceConfigError, PreferenceLoss
from lightning_2d.parallel.checks import check


@check(error=PreferenceConfigError)
def preference_reference(preference: PreferenceLoss, owner: str, lora: Optional[LoRA] = None) -> list[str]:
    """Where the reference log-probabilities come from: the base with its adapters off needs adapters; a frozen copy
    is of the whole initial model (under LoRA, the adapters' own base is the reference)."""
    if preference is None:
        return []
    mode = preference.reference_mode(adapters=lora is not None)
    if mode == "adapters_off" and lora is None:
        return [
            f"preference reference='adapters_off' needs adapters to switch off, but {owner} trains the whole model"
            " (no lora=). Use reference='copy' (a frozen copy of the initial model beside it, or 'auto'), or train"
            " adapters (lora=...)"
        ]
    if preference.reference_from is not None and mode != "copy":
        return [
            f"preference reference_from={preference.reference_from!r} reads a frozen reference copy, but the reference"
            f" is {'none (a reference-free loss)' if mode is None else repr(mode)}. Use reference='copy' without"
            " lora=, or leave reference_from out"
        ]
    if mode == "copy" and lora is not None:
        return [
            f"preference reference='copy' with lora=: under LoRA the reference is the base the adapters start from;"
            " switching them off gives it without a second copy. Use reference='adapters_off' (or 'auto')"
        ]
    return []


__all__ = ["preference_reference"]
