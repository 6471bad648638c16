"""What a step reads off a batch besides its tokens: the packed documents' positions, the optimizer step's counts."""

from __future__ import annotations

from typing import Any

import torch


def step_tokens_of(batch: dict[str, torch.Tensor], accumulate: int) -> dict[str, Any]:
    """``{"step_tokens": ..., "accumulate": ...}`` when the batch carries its optimizer step's target tokens
    (``ChatDataModule``): the loss is then the step's mean over every trained token, else ``{}``."""
    return {"step_tokens": batch["step_tokens"], "accumulate": accumulate} if "step_tokens" in batch else {}


def document_positions_of(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"position_ids": ...}`` when the batch carries each packed document's positions, else ``{}``."""
    return {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
