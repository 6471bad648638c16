"""A preference-tuning step (``preference=`` on the modules): the pairs' sequence log-probabilities from the fused,
vocabulary-parallel head, the reference's beside them, the loss averaged over the step's pairs, TRL's metrics.

One function for both modules (``CausalLMModule.training_step`` and validation call it): the module gives each
token's log-probability (``token_log_probs``: Llama's fused head, a Hugging Face model's logits) and the reference
(``reference_log_probs``); what a batch holds is ``PreferenceDataModule``'s contract: ``input_ids``, ``labels``
(the completions' tokens, ``-100`` elsewhere), ``position_ids`` (each sequence its own document), ``sequence_ids``
(pair ``p``'s chosen ``2p``, its rejected ``2p + 1`` within a window, ``-1`` on padding), ``pairs`` (per window)
and, for training, ``step_pairs`` (this replica's pairs over the optimizer step).

Each sequence is summed on the ranks that hold its tokens and over the context-parallel group
(``parallel.loss.sum_over_context``); tensor parallelism gives every rank the same sums (the vocabulary-parallel
head). The loss is the mean over the step's pairs of every data-parallel replica: each rank's sum over its pairs
scaled as the token-normalized loss is (``parallel.loss.normalize_by_global_count``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightning_2d.checkpoint.integrity import fingerprint
from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX
from lightning_2d.ops.preference import PreferenceLoss, sequence_sums
from lightning_2d.parallel.context import context_shard
from lightning_2d.parallel.loss import data_context_group, global_means, normalize_by_global_count, sum_over_context

#: The metrics a step logs (TRL's names), each a mean over the global batch's pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def preference_step(
    preference: PreferenceLoss,
    batch: dict[str, torch.Tensor],
    token_log_probs: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    reference_log_probs: Optional[Callable[[dict[str, torch.Tensor]], torch.Tensor]],
    mesh: Any,
    step_pairs: Optional[torch.Tensor] = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of ``batch``'s pairs (this rank's part of a context-parallel batch).

    Args:
        preference: The loss and its constants.
        batch: The (context-sharded) batch, as the module docstring says.
        token_log_probs: ``batch → (B, T)`` each position's log-probability of its label (0 where ignored) under the
            trained model.
        reference_log_probs: The same under the reference model (run without gradients here); ``None`` for a
            reference-free loss.
        mesh: The strategy's meshes (``None`` on one device).
        step_pairs: This replica's pairs over the optimizer step (training batches): the loss is then the step's mean
            over every pair, across accumulation; ``None``: the batch's mean.
        accumulate: Batches per optimizer step.

    Returns:
        ``(loss_to_backward, global_mean_loss, global_pairs, metrics)``: the batch's pairs over every replica, and
        the metrics, global means (``METRICS``); all identical on every rank.
    """
    labels, sequence_ids = batch["labels"], batch["sequence_ids"]
    sequences = 2 * batch["pairs"].reshape(-1).to(sequence_ids.device)
    trained = (labels != IGNORE_INDEX)

    def sums(values: torch.Tensor) -> torch.Tensor:
        return sum_over_context(sequence_sums(values, sequence_ids, sequences), mesh)

    logps = sums(token_log_probs(batch))
    tokens = sums(trained.to(logps.dtype))
    ref: Optional[torch.Tensor] = None
    if preference.needs_reference:
        assert reference_log_probs is not None, "a reference-based loss needs the reference's log-probabilities"
        with torch.no_grad():
            ref = sums(reference_log_probs(batch))
    terms = preference.pair_terms(logps[0::2], logps[1::2], tokens[0::2], tokens[1::2],
                                  ref[0::2] if ref is not None else None, ref[1::2] if ref is not None else None)
    pairs = torch.tensor(float(terms.losses.numel()), device=logps.device)
    loss, mean, global_pairs = normalize_by_global_count(terms.losses.sum(), pairs, mesh, step_count=step_pairs,
                                                         accumulate=accumulate)
    if preference.loss_type == "orpo":  # ORPO adds the chosen completions' NLL, a mean over their tokens
        nll, nll_mean, _ = normalize_by_global_count(-logps[0::2].sum(), tokens[0::2].sum(), mesh)
        loss, mean = loss + nll, mean + nll_mean
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    metrics = global_means({
        "rewards/chosen": (chosen.sum(), pairs),
        "rewards/rejected": (rejected.sum(), pairs),
        "rewards/accuracies": ((chosen > rejected).float().sum(), pairs),
        "rewards/margins": ((chosen - rejected).sum(), pairs),
        "logps/chosen": (terms.chosen_logps.sum(), pairs),
        "logps/rejected": (terms.rejected_logps.sum(), pairs),
    }, mesh)
    return loss, mean, global_pairs, metrics


def reference_pass(
    reference_log_probs: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    loaders: Iterable[Iterable[dict[str, torch.Tensor]]],
    sequences: int,
    mesh: Any,
    device: torch.device,
) -> np.ndarray:
    """Each cache sequence's log-probability under the reference (``precompute_reference``): one forward without a
    graph of every window (``PreferenceDataModule.reference_loaders``: each replica its share, in even batches), each
    sequence summed as a training step sums it, then summed over the data and context ranks (every other rank adds
    0 to a sequence's value) so that every rank holds all ``sequences`` values.

    Args:
        reference_log_probs: ``batch → (B, T)`` each position's log-probability under the reference.
        loaders: This replica's batches (``sequence_numbers``: each position's cache sequence, ``-1`` for none).
        sequences: How many sequences the cache holds.
        mesh: The strategy's meshes (``None`` on one device).
        device: Where the model runs.
    """
    values = torch.zeros(sequences, dtype=torch.float32, device=device)
    with torch.no_grad():
        for loader in loaders:
            for batch in loader:
                batch = context_shard({key: value.to(device) for key, value in batch.items()}, mesh)
                numbers = batch["sequence_numbers"]
                counted = numbers >= 0
                values.index_add_(0, numbers[counted], reference_log_probs(batch)[counted].float())
    group = data_context_group(mesh)
    if group is not None:
        dist.all_reduce(values, group=group)
    return values.cpu().numpy()


def reference_key(identity: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(key, identity)``: a digest of what makes the reference's log-probabilities (its weights: a folder, with
    every file's size and modification time, or a seed; the model's settings; the precision), and the identity with
    the folders' fingerprints added, as written beside the values."""
    identity = dict(identity)
    for name in ("init_from", "reference_from"):
        folder = identity.get(name)
        if folder:
            path = Path(folder).expanduser().resolve()
            identity[name] = {"path": str(path), "files": [list(item) for item in fingerprint(path)]}
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20], identity


__all__ = ["METRICS", "preference_step", "reference_key", "reference_pass"]
