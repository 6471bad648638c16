"""Preference losses on sequence log-probabilities: DPO and its relatives (IPO, hinge, robust), the reference-free
SimPO and ORPO, and the unpaired KTO, with the reward metrics TRL logs.

Every loss here takes each completion's *summed* log-probability under the trained model (``logps``: the completion
tokens only, from ``ops.linear_cross_entropy.linear_log_probs`` summed per sequence) and its number of completion
tokens; the DPO family also the reference model's. Nothing here knows how the sums were made (packed windows,
context or vocabulary shards): the module sums them, this module turns them into per-pair losses, and the module
averages those over the step's pairs.

The formulas are TRL 1.16's (``DPOTrainer._compute_loss``, the experimental ``CPOTrainer.cpo_loss`` for SimPO,
``ORPOTrainer.odds_ratio_loss``, ``KTOTrainer.kto_loss``); ``tests/unit/test_preference_losses.py`` runs TRL's own
code on the same numbers. One deliberate difference: TRL 1.16's ``sigmoid`` has no label smoothing (it moved to
``robust``); here ``label_smoothing`` ε > 0 gives the conservative DPO of TRL < 1.0
(``-(1-ε)·log σ(βΔ) - ε·log σ(-βΔ)``), and ε = 0 is TRL 1.16's loss exactly.

Pure ``torch``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import torch
import torch.nn.functional as F

#: The pairwise losses against a reference model (TRL's ``DPOConfig.loss_type`` names).
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
#: The pairwise losses without a reference model.
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
#: Every loss of one example at a time (a completion labelled desirable or not).
UNPAIRED_LOSSES = ("kto",)
LOSSES = DPO_LOSSES + REFERENCE_FREE_LOSSES + UNPAIRED_LOSSES
#: Where the reference model's log-probabilities come from (``PreferenceLoss.reference``).
REFERENCES = ("auto", "adapters_off", "copy")


class PreferenceConfigError(ValueError):
    """Preference settings that cannot train (an unknown loss, β ≤ 0 …), raised before anything is built."""


@dataclass(frozen=True)
class PairTerms:
    """Per-pair results of a pairwise loss (each ``(P,)``; the rewards and log-probabilities detached).

    Args:
        losses: Each pair's loss (the module averages them over the step's pairs).
        chosen_rewards, rejected_rewards: TRL's implicit rewards (``β·(logps - ref_logps)``; SimPO and ORPO:
            ``β·`` the mean log-probability per token).
        chosen_logps, rejected_logps: What TRL logs as ``logps/chosen`` / ``logps/rejected``: the summed
            log-probabilities (SimPO, ORPO: per token).
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


@dataclass(frozen=True)
class PreferenceLoss:
    """Which preference loss trains, and its constants.

    Args:
        loss_type: ``sigmoid`` (DPO), ``ipo``, ``hinge``, ``robust`` (against a reference model); ``simpo``,
            ``orpo`` (reference-free); ``kto`` (unpaired: each completion labelled desirable or not). ORPO's loss is
            its odds-ratio term (``pair_terms``) plus the NLL of the chosen completions, a mean over their
            *completion* tokens (the ORPO paper's ``-log P(y_w | x)``; the step adds it): TRL's experimental
            ``ORPOTrainer`` averages that NLL over the chosen sequences' prompt *and* completion tokens instead.
        beta: β, the strength of the implicit KL penalty (DPO family, KTO), SimPO's reward scale, ORPO's λ.
        label_smoothing: ε ∈ [0, 0.5): the assumed fraction of flipped preference labels (``sigmoid``: cDPO,
            ``robust``, ``simpo``).
        simpo_gamma: SimPO's target reward margin γ (TRL's ``CPOConfig.simpo_gamma``).
        desirable_weight: KTO's weight of the desirable examples' losses.
        undesirable_weight: KTO's weight of the undesirable examples' losses.
        reference: Where the reference model's log-probabilities come from (the DPO family, KTO): ``"adapters_off"``
            (under LoRA: the trained model with its adapters switched off, no second copy), ``"copy"`` (a frozen
            copy of the initial model, parallelized beside it by the same plan: sharded, no gradients, no optimizer
            state, not in checkpoints); ``"auto"``: ``adapters_off`` under LoRA, else ``copy``.
        reference_from: A model folder (``init_from``'s kind) the frozen copy is read from instead of the trained
            model's initial weights (``copy`` only).
        precompute_reference: Before training, one pass of the reference (as ``reference`` says) over every pair of
            the data writes each sequence's log-probability into the data cache (keyed by the reference's weights
            and the data: a later run reads it, and never builds a frozen copy); training then reads them from its
            batches, and a frozen copy is released: no reference model in memory, no reference forward per step.

    Raises:
        PreferenceConfigError: A setting out of its range or settings that contradict each other (every problem in
            one message); a ``ValueError``.

    Example:
        ```python
        from lightning_2d import LlamaLightningModule, LoRA, PreferenceLoss

        dpo = PreferenceLoss(beta=0.1)                              # sigmoid: DPO against a frozen copy
        simpo = PreferenceLoss(loss_type="simpo", beta=2.0, simpo_gamma=0.5)  # no reference model
        module = LlamaLightningModule(init_from="Llama-3.1-8B-Instruct/", lora=LoRA(rank=16, alpha=32),
                                      preference=dpo)  # under LoRA the reference is the base, adapters off
        ```
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference: str = "auto"
    reference_from: Optional[str] = None
    precompute_reference: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise PreferenceConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """What makes these settings unable to train (empty: none)."""
        out = []
        if self.loss_type not in LOSSES:
            out.append(f"preference loss_type must be one of {', '.join(LOSSES)}; got {self.loss_type!r}")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta > 0):
            out.append(f"preference beta must be a positive number, got {self.beta!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            out.append(f"preference label_smoothing must be in [0, 0.5) (the fraction of flipped labels), got"
                       f" {self.label_smoothing!r}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            out.append(f"preference label_smoothing applies to sigmoid, robust and simpo, not {self.loss_type!r};"
                       " leave it at 0")
        if self.reference not in REFERENCES:
            out.append(f"preference reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if self.precompute_reference and not self.needs_reference:
            out.append(f"preference precompute_reference=True, but loss_type={self.loss_type!r} uses no reference"
                       " model: nothing to precompute; leave precompute_reference out")
        if self.precompute_reference and self.loss_type in UNPAIRED_LOSSES:
            out.append(f"preference precompute_reference=True with loss_type={self.loss_type!r}: KTO's KL sequences are"
                       " built per window, and only pairs' values are precomputed yet; leave precompute_reference out")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            out.append(f"preference desirable_weight and undesirable_weight must be positive, got"
                       f" {self.desirable_weight!r} and {self.undesirable_weight!r}")
        return out

    @classmethod
    def of(cls, value: "PreferenceLoss | Mapping[str, Any] | None") -> Optional["PreferenceLoss"]:
        """``value`` as settings (a dict of the fields, from a recipe or a checkpoint's hyperparameters)."""
        if value is None or isinstance(value, PreferenceLoss):
            return value
        if not isinstance(value, Mapping):
            raise PreferenceConfigError(f"preference must be a PreferenceLoss or a dict of its fields, got"
                                        f" {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise PreferenceConfigError(f"preference has no field(s) {unknown}; its fields:"
                                        f" {', '.join(f.name for f in fields(cls))}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (hyperparameters, checkpoints)."""
        return asdict(self)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model's log-probabilities (not SimPO or ORPO)."""
        return self.loss_type not in REFERENCE_FREE_LOSSES

    def reference_mode(self, adapters: bool) -> Optional[str]:
        """``"adapters_off"`` or ``"copy"`` (``reference`` with ``"auto"`` resolved for a model that trains
        ``adapters`` or not), ``None`` for a reference-free loss."""
        if not self.needs_reference:
            return None
        if self.reference == "auto":
            return "adapters_off" if adapters else "copy"
        return self.reference

    @property
    def paired(self) -> bool:
        """Whether examples come as (chosen, rejected) pairs (not KTO)."""
        return self.loss_type not in UNPAIRED_LOSSES

    def pair_terms(
        self,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        chosen_tokens: torch.Tensor,
        rejected_tokens: torch.Tensor,
        ref_chosen_logps: Optional[torch.Tensor] = None,
        ref_rejected_logps: Optional[torch.Tensor] = None,
    ) -> PairTerms:
        """Each pair's loss and metrics from the completions' summed log-probabilities (``(P,)`` each).

        Args:
            chosen_logps: The trained model's summed log-probability of each pair's chosen completion.
            rejected_logps: The same of each pair's rejected completion.
            chosen_tokens: The chosen completions' token counts (what IPO, SimPO and ORPO average over).
            rejected_tokens: The rejected completions' token counts.
            ref_chosen_logps: The reference model's ``chosen_logps`` (the DPO family; ignored otherwise).
            ref_rejected_logps: The reference model's ``rejected_logps`` (the DPO family; ignored otherwise).
        """
        if not self.paired:
            raise PreferenceConfigError(f"{self.loss_type} scores unpaired examples: use kto_terms")
        beta, eps = self.beta, self.label_smoothing
        chosen_mean = chosen_logps / chosen_tokens.clamp(min=1)
        rejected_mean = rejected_logps / rejected_tokens.clamp(min=1)
        if self.loss_type in REFERENCE_FREE_LOSSES:
            if self.loss_type == "simpo":  # CPO's simpo: mean log-probabilities, margin γ/β
                logits = chosen_mean - rejected_mean - self.simpo_gamma / beta
                losses = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
            else:  # ORPO's odds ratio term (the step adds the NLL, over the chosen completions' tokens only)
                log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
                losses = -beta * F.logsigmoid(log_odds)
            return PairTerms(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach(),
                             chosen_mean.detach(), rejected_mean.detach())
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise PreferenceConfigError(f"the {self.loss_type} loss needs the reference model's log-probabilities")
        chosen_ratio = chosen_logps - ref_chosen_logps
        rejected_ratio = rejected_logps - ref_rejected_logps
        delta = chosen_ratio - rejected_ratio
        if self.loss_type == "sigmoid":
            losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - beta * delta)
        elif self.loss_type == "ipo":  # on the log ratios' means per completion token (TRL's, the IPO authors')
            ipo_delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (ipo_delta - 1 / (2 * beta)) ** 2
        else:  # robust
            losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(),
                         chosen_logps.detach(), rejected_logps.detach())

    def kto_terms(
        self, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KTO's per-example losses and rewards (``(E,)`` each).

        Args:
            logps: Each completion's summed log-probability under the trained model.
            ref_logps: The same under the reference model.
            desirable: ``(E,)`` bool: whether the completion is labelled desirable.
            kl: KTO's reference point: the batch's estimate of KL(trained ‖ reference), from completions paired with
                other examples' prompts (detached, clamped at 0, averaged over the whole batch by the caller).
        """
        kl = kl.detach().clamp(min=0)
        ratio = logps - ref_logps
        beta = self.beta
        losses = torch.where(desirable, self.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                             self.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
        return losses, beta * ratio.detach()


def sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """Each sequence's sum of ``values`` over its positions, for a batch of packed windows.

    Args:
        values: ``(B, T)`` per position (a token's log-probability, 1 for a trained token …).
        sequence_ids: ``(B, T)``: the position's sequence within its window (``0 … n_b - 1``; a pair's chosen
            ``2p``, its rejected ``2p + 1``), ``-1`` where none (padding).
        sequences: ``(B,)`` the number of sequences ``n_b`` in each window.

    Returns:
        ``(Σ n_b,)``: the windows' sequences in order (window 0's first).
    """
    offsets = torch.cumsum(sequences, 0) - sequences  # each window's first slot
    slots = sequence_ids + offsets[:, None]
    valid = sequence_ids >= 0
    total = int(sequences.sum())
    return values.new_zeros(total).index_add(0, slots[valid], values[valid])


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2`` (Mächler's)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


__all__ = ["DPO_LOSSES", "LOSSES", "PairTerms", "PreferenceConfigError", "PreferenceLoss", "REFERENCES", "REFERENCE_FREE_LOSSES",
           "UNPAIRED_LOSSES", "sequence_sums"]
