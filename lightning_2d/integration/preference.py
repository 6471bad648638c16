"""A preference-tuning step (``preference=`` on the modules): the pairs' sequence log-probabilities from the fused,
vocabulary-parallel head, the reference's beside them, the loss averaged over the step's pairs, TRL's metrics; KTO's
step (``kto_step``) on unpaired examples alike.

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

KTO's batches hold unpaired examples (``sequence_ids`` ``2e`` on example ``e``, ``2e + 1`` on its KL sequence: its
prompt and another example's completion), ``examples``, ``desirable`` and ``step_examples`` instead. Its reference
point, the KL estimate, is TRL's: the detached mean of the trained minus the reference log-probabilities of the KL
sequences, over the global batch (every data-parallel replica's windows: TRL gathers it across processes), clamped at
0. The KL sequences are scored by the same forward passes as the examples and give no gradient (their sums are
detached). TRL's estimate is per batch, so an optimizer step that accumulates batches uses one per batch, as TRL's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX
from lightning_2d.ops.preference import PreferenceConfigError, PreferenceLoss, sequence_sums
from lightning_2d.parallel.loss import global_means, normalize_by_global_count, sum_over_context

#: The metrics a step logs (TRL's names), each a mean over the global batch's pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
#: What ORPO logs besides: its NLL term, a mean over the chosen completions' tokens.
ORPO_METRICS = METRICS + ("nll_loss",)
#: What KTO logs (TRL's ``KTOTrainer`` names): the rewards and log-probabilities of the desirable (``chosen``) and the
#: undesirable (``rejected``) examples, each a mean over its kind's examples of the global batch (0 without one), the
#: margin of those means, and the KL estimate.
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def metric_names(preference: PreferenceLoss) -> tuple[str, ...]:
    """The metrics ``preference``'s step logs."""
    if not preference.paired:
        return KTO_METRICS
    return ORPO_METRICS if preference.loss_type == "orpo" else METRICS


def check_batch_units(preference: PreferenceLoss, batch: dict[str, torch.Tensor]) -> None:
    """Refuse a batch of the other kind: pairs for KTO, unpaired examples for a pairwise loss (the registered check
    ``integration.validation.preference_data_units`` refuses it before launch where a strategy validates; this is the
    step's own guard, also on one device)."""
    unpaired = "examples" in batch
    if preference.paired and unpaired:
        raise PreferenceConfigError(
            f"preference loss_type={preference.loss_type!r} compares a chosen and a rejected completion of one prompt,"
            " but the batch holds unpaired examples (PreferenceDataModule format='unpaired': a completion and its"
            " label); use loss_type='kto', or pairs (prompt, chosen, rejected)"
        )
    if not preference.paired and not unpaired:
        raise PreferenceConfigError(
            "preference loss_type='kto' scores unpaired examples (a completion and its label), but the batch holds"
            " pairs (PreferenceDataModule's chosen and rejected); read the rows as unpaired examples"
            " (format='unpaired' and rows of prompt, completion, label, e.g. data.preference.unpaired_rows of the"
            " pairs), or use a pairwise loss (sigmoid, ipo, hinge, robust, simpo, orpo)"
        )


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
    check_batch_units(preference, batch)
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
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    values = {
        "rewards/chosen": (chosen.sum(), pairs),
        "rewards/rejected": (rejected.sum(), pairs),
        "rewards/accuracies": ((chosen > rejected).float().sum(), pairs),
        "rewards/margins": ((chosen - rejected).sum(), pairs),
        "logps/chosen": (terms.chosen_logps.sum(), pairs),
        "logps/rejected": (terms.rejected_logps.sum(), pairs),
    }
    if preference.loss_type == "orpo":  # ORPO adds the chosen completions' NLL, a mean over their tokens
        nll, nll_mean, _ = normalize_by_global_count(-logps[0::2].sum(), tokens[0::2].sum(), mesh)
        loss, mean = loss + nll, mean + nll_mean
        values["nll_loss"] = (-logps[0::2].detach().sum(), tokens[0::2].sum())
    return loss, mean, global_pairs, global_means(values, mesh)


def kto_step(
    preference: PreferenceLoss,
    batch: dict[str, torch.Tensor],
    token_log_probs: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    reference_log_probs: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    mesh: Any,
    step_examples: Optional[torch.Tensor] = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """KTO's loss of ``batch``'s unpaired examples (this rank's part of a context-parallel batch): as
    ``preference_step``'s (its arguments and returns alike, ``step_examples`` for ``step_pairs``), the examples
    counted instead of pairs, the KL estimate from the KL sequences (the module docstring), ``KTO_METRICS``."""
    check_batch_units(preference, batch)
    sequence_ids = batch["sequence_ids"]
    examples = batch["examples"].reshape(-1).to(sequence_ids.device)

    def sums(values: torch.Tensor) -> torch.Tensor:
        return sum_over_context(sequence_sums(values, sequence_ids, 2 * examples), mesh)

    logps = sums(token_log_probs(batch))
    with torch.no_grad():
        ref = sums(reference_log_probs(batch))
    # A window of one example has no KL sequence (its slot sums to 0): only the others count in the mean.
    kl_count = torch.where(examples > 1, examples, torch.zeros_like(examples)).sum()
    (kl,) = global_means({"kl": ((logps[1::2] - ref[1::2]).detach().sum(), kl_count)}, mesh).values()
    slots = torch.arange(batch["desirable"].shape[-1], device=sequence_ids.device)
    desirable = batch["desirable"].to(sequence_ids.device)[slots < examples[:, None]]  # (Σ examples,), window order
    losses, rewards = preference.kto_terms(logps[0::2], ref[0::2], desirable, kl)
    count = torch.tensor(float(losses.numel()), device=logps.device)
    loss, mean, global_examples = normalize_by_global_count(losses.sum(), count, mesh, step_count=step_examples,
                                                            accumulate=accumulate)
    chosen, rejected = desirable.float(), (~desirable).float()
    policy = logps[0::2].detach()
    metrics = global_means({
        "rewards/chosen": ((rewards * chosen).sum(), chosen.sum()),
        "rewards/rejected": ((rewards * rejected).sum(), rejected.sum()),
        "logps/chosen": ((policy * chosen).sum(), chosen.sum()),
        "logps/rejected": ((policy * rejected).sum(), rejected.sum()),
    }, mesh)
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    metrics["kl"] = kl.clamp(min=0)
    return loss, mean, global_examples, {name: metrics[name] for name in KTO_METRICS}


__all__ = ["KTO_METRICS", "METRICS", "ORPO_METRICS", "check_batch_units", "kto_step", "metric_names",
           "preference_step"]
