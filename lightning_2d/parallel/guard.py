"""Non-finite steps and weights: detected on every rank, agreed on by all, never applied or saved.

A NaN or inf on one rank does not stay there: the next reduce-scatter spreads it into every
rank's gradients, AdamW turns it into NaN weights, and a checkpoint callback may then keep the
NaN checkpoint and delete the good ones. Worse, it can also stay invisible: a rank whose local
gradient shard is NaN after the reduce-scatter updates only its shard, while rank 0 logs a finite
loss. So the decision is taken once per optimizer step, by all ranks together, before the update:

* each rank computes two flags: all its losses since the last step finite (kept as a device
  tensor, so backward never waits for the host), and its local gradient shards finite (one fused
  ``_foreach_norm``);
* one all-gather of ``2 × world_size`` numbers tells every rank which ranks saw what;
* policy ``"raise"`` stops every rank with ``NonFiniteStepError`` naming the step and the ranks;
  ``"skip"`` drops the gradients on every rank (AdamW then leaves every weight and moment
  unchanged) and warns, so the weights stay bit-identical to those before the step.

Saving checks the weights too (``check_finite_weights``): a checkpoint is never written from
non-finite weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import torch
from torch import nn

from lightning_2d._compat import foreach_norm
from lightning_2d.errors import Lightning2DWarning
from lightning_2d.ops.weights import weight_format
from lightning_2d.parallel.modules import canonical_name


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradients were NaN/inf on some rank; raised on every rank before the update."""


class NonFiniteWeightsError(RuntimeError):
    """A checkpoint was to be written from NaN/inf weights; raised on every rank before anything is written."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def finite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``1.0`` if every element of ``tensors`` (local shards) is finite, else ``0.0`` (a device tensor; no sync)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.ones((), device=device)
    # The max-norm is finite exactly when every element is (NaN propagates), reads each tensor once
    # (fused), and, unlike the 2-norm, cannot overflow on large finite values.
    norms = foreach_norm([t.float() if not t.is_floating_point() else t for t in tensors], float("inf"))
    return torch.isfinite(torch.stack([n.float().to(device) for n in norms]).max()).float()


def _gather_flags(flags: torch.Tensor) -> torch.Tensor:
    """``(world_size, len(flags))``: every rank's flags (one all-gather; ``flags`` alone without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flags.reshape(1, -1)
    device = flags.device if dist.get_backend() != "gloo" else torch.device("cpu")
    flags = flags.to(device)
    gathered = [torch.empty_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flags)
    return torch.stack(gathered)


def _ranks(column: torch.Tensor) -> list[int]:
    return [rank for rank, ok in enumerate(column.tolist()) if not ok]


@torch.no_grad()
def guard_step(
    parameters: Iterable[nn.Parameter], loss_flag: torch.Tensor, step: int, policy: str
) -> bool:
    """Agree across ranks whether this optimizer step is finite; raise, or drop its gradients.

    Args:
        parameters: The parameters the optimizer updates (DTensor or plain).
        loss_flag: This rank's ``1.0``/``0.0``: were all its losses since the last step finite.
        step: The step number, for messages.
        policy: ``"raise"`` or ``"skip"``.

    Returns:
        Whether the step goes ahead (``False``: skipped; the gradients were set to ``None``).

    Raises:
        NonFiniteStepError: Under ``"raise"``, on every rank, naming the ranks.
    """
    params = [p for p in parameters if p.grad is not None]
    device = loss_flag.device
    grads_flag = finite_flag([_local(p.grad) for p in params], device)
    flags = _gather_flags(torch.stack([loss_flag.float().to(device), grads_flag]))
    if bool(flags.all()):
        return True
    loss_ranks, grad_ranks = _ranks(flags[:, 0]), _ranks(flags[:, 1])
    what = "; ".join(
        part for part in (
            f"non-finite loss on rank(s) {loss_ranks}" if loss_ranks else "",
            f"non-finite gradients on rank(s) {grad_ranks}" if grad_ranks else "",
        ) if part
    )
    if policy == "skip":
        import warnings

        for p in params:
            p.grad = None
        warnings.warn(
            f"Step {step} skipped on every rank ({what}): no weight or optimizer state was updated."
            " (non_finite='skip'; use 'raise' to stop instead.)",
            Lightning2DWarning,
            stacklevel=2,
        )
        return False
    raise NonFiniteStepError(
        f"Step {step} stopped before the update ({what}); every rank checked, no weight was changed."
        " A NaN/inf from one rank would spread to all weights through the gradient reduction. Causes: a"
        " learning rate too high, bad inputs (token ids beyond the vocabulary), float16 overflow. Resume from"
        " the last checkpoint with a lower learning rate, or pass non_finite='skip' to the strategy to drop"
        " such steps and go on."
    )


@torch.no_grad()
def check_finite_weights(module: nn.Module, path: object) -> None:
    """Refuse (on every rank, before any file is written) to save ``module`` if a weight is NaN/inf anywhere. Weights
    whose format is not checked (``ops.weights.WeightFormat.checks_finite``: QLoRA's NF4 bases, frozen 4-bit codes
    whose values training cannot change, and of which torchao has no norm) are left out."""
    import torch.distributed as dist

    named = [(name, p) for name, p in module.named_parameters() if weight_format(p).checks_finite]
    device = named[0][1].device if named else torch.device("cpu")
    flag = finite_flag([_local(p) for _, p in named], device)
    flags = _gather_flags(flag.reshape(1))
    if bool(flags.all()):
        return

    bad = [canonical_name(name) for name, p in named if not bool(torch.isfinite(_local(p)).all())]
    everyone: list[Optional[list[str]]] = [bad]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bad)
    names = sorted({n for names in everyone for n in (names or [])})
    raise NonFiniteWeightsError(
        f"Not saving {path}: {len(names)} parameter(s) hold NaN/inf values ({', '.join(names[:5])}"
        f"{', …' if len(names) > 5 else ''}; on rank(s) {_ranks(flags[:, 0])}). Checkpoints already on disk"
        " were left as they are; resume from the last one."
    )
