"""A distillation step (``teacher=`` and ``distillation=`` on the modules; ``lightning_2d.fabric.distillation_step``):
the student's next-token loss and its divergence from a frozen teacher, both from one pass of each model's fused
head, mixed as ``DistillationConfig`` says.

One function for both modules and a Fabric loop: given the student, the teacher (both parallelized by the strategy:
the teacher by its own family's plan, FSDP-sharded, frozen), a batch of ``input_ids``, ``labels`` (``-100``: not
trained) and, for packed documents, ``position_ids``, it

1. marks the distilled positions (``distillation_mask``) on the whole rows, then takes this rank's context slices;
2. runs the student; inside its head's call (``parallel.distillation.head_computes``: the head's weight gathered,
   its hidden states as the head takes them) the fused next-token loss and the fused divergence, whose autograd
   function runs the teacher's whole forward without a graph and computes, chunk by chunk over both heads'
   vocabulary rows, the divergence and the student's gradients (``ops.distillation.linear_distillation_from``;
   vocabulary-parallel under tensor parallelism, ``parallel.loss``);
3. normalizes each sum by its global count (``normalize_by_global_tokens``: the distilled tokens for the divergence,
   the trained ones for the next-token loss, over every data and context rank; the optimizer step's where the data
   counts it ahead, ``step_tokens``) and mixes them: ``alpha · D + (1 − alpha) · NLL``.

Neither model's ``(tokens × vocab)`` logits exist; the teacher keeps no activation, gets no gradient, and its FSDP
units gather and free as in a forward of its own.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_2d.integration.batches import document_positions_of
from lightning_2d.models.registry import model_logits, output_head
from lightning_2d.ops.distillation import DistillationConfig
from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX
from lightning_2d.parallel.context import context_shard
from lightning_2d.parallel.distillation import head_computes
from lightning_2d.parallel.loss import fused_cross_entropy, fused_distillation_from, normalize_by_global_tokens

#: The batch entry holding the distilled positions (``distillation_mask``), cut with the batch under context
#: parallelism (``parallel.context.shard_sequence``).
MASK_KEY = "distillation_mask"


def metric_names(config: DistillationConfig) -> tuple[str, ...]:
    """What a step logs besides ``train_loss`` (each a global mean): the mixed loss, the divergence, the next-token
    loss."""
    return "distill/loss", config.metric, "distill/next_token_loss"


def distillation_mask(batch: dict[str, torch.Tensor], tokens: str) -> torch.Tensor:
    """``(B, T)`` bool: the positions distilled (``DistillationConfig.tokens``), from whole rows (before a context
    split). ``"trained"``: where the label counts. ``"all"``: every position of a document (a run of
    ``position_ids`` counting up; the row without them) up to its last trained position, so a chat's prompt counts,
    its padding (no trained token) and what follows its last answer (no next token of its own) do not."""
    labels = batch["labels"]
    trained = labels != IGNORE_INDEX
    if tokens == "trained":
        return trained
    index = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    positions = batch.get("position_ids")
    if positions is None:
        documents = torch.zeros_like(labels)
    else:
        starts = torch.ones_like(trained)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        documents = starts.long().cumsum(1) - 1
    last = torch.full((labels.shape[0], labels.shape[1]), -1, dtype=index.dtype, device=labels.device)
    last = last.scatter_reduce(1, documents, torch.where(trained, index, -1), reduce="amax")
    return index <= last.gather(1, documents)


def distillation_step(
    student: nn.Module,
    teacher: nn.Module,
    batch: dict[str, torch.Tensor],
    config: DistillationConfig,
    mesh: Any = None,
    step_tokens: Optional[torch.Tensor] = None,
    accumulate: int = 1,
    *,
    logits_of: Callable[..., Any] = model_logits,
    head_of: Callable[[nn.Module], nn.Module] = output_head,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation loss of ``batch`` (whole rows: this function takes this rank's context slices).

    Args:
        student: The trained model (a ``Transformer``, a Hugging Face decoder), parallelized or not.
        teacher: The frozen model distilled from, on the same meshes (its own plan), or on the same device.
        batch: ``input_ids``, ``labels`` and, for packed documents, ``position_ids``, ``(B, T)`` each.
        config: The divergence, its weight and where it applies.
        mesh: The strategy's meshes (``None`` on one device).
        step_tokens: This replica's trained tokens over the optimizer step (``ChatDataModule``'s): the next-token
            loss, and the divergence over ``tokens="trained"``, are then the step's means across accumulation;
            ``None``: each batch's.
        accumulate: Batches per optimizer step.
        logits_of: ``(model, input_ids, position_ids=…)`` → what the model's forward returns in place of its logits
            (a module's ``logits_of``; known models' by default).
        head_of: The model's output projection (known models' by default).

    Returns:
        ``(loss_to_backward, global_mean_loss, global_tokens, metrics)``: the mixed loss, its global mean, the
        batch's trained tokens over every replica and ``metric_names``' global means; identical on every rank.
    """
    batch = context_shard({**batch, MASK_KEY: distillation_mask(batch, config.tokens)}, mesh)
    tokens, labels, mask = batch["input_ids"], batch["labels"], batch[MASK_KEY]
    positions = document_positions_of(batch)
    flat_labels, flat_mask = labels.flatten(), mask.flatten()

    def teacher_head(consume: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """The teacher's forward; its head hands its hidden states and weight to the loss and returns nothing."""
        def hand_over(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            consume(hidden.flatten(0, -2), weight)
            return torch.zeros((), device=weight.device)

        with torch.no_grad(), head_computes(head_of(teacher), hand_over):
            logits_of(teacher, tokens, **positions)

    def student_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = hidden.flatten(0, -2)
        with nullcontext() if config.alpha < 1 else torch.no_grad():  # at alpha 1 only logged
            nll = fused_cross_entropy(flat, weight, flat_labels, chunk_size=config.chunk_size)
        divergence, _ = fused_distillation_from(flat, weight, teacher_head, flat_mask, beta=config.divergence_beta,
                                                temperature=config.temperature, chunk_size=config.chunk_size)
        return torch.stack([nll.float().reshape(()), divergence.reshape(())])

    with head_computes(head_of(student), student_head):
        sums = logits_of(student, tokens, **positions)  # (2,): the summed NLL and divergence
    step = {"step_tokens": step_tokens, "accumulate": accumulate} if step_tokens is not None else {}
    nll, nll_mean, trained = normalize_by_global_tokens(sums[0], labels, mesh, **step)
    distilled = torch.where(mask, labels.new_zeros(()), IGNORE_INDEX)
    divergence, divergence_mean, _ = normalize_by_global_tokens(sums[1], distilled, mesh,
                                                                **(step if config.tokens == "trained" else {}))
    alpha = config.alpha
    loss = divergence if alpha == 1 else alpha * divergence + (1 - alpha) * nll
    mean = (alpha * divergence_mean + (1 - alpha) * nll_mean).detach()
    metrics = dict(zip(metric_names(config), (mean, divergence_mean.detach(), nll_mean.detach())))
    return loss, mean, trained, metrics


__all__ = ["MASK_KEY", "distillation_mask", "distillation_step", "metric_names"]
