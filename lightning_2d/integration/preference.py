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

Under pipeline parallelism the pairs' losses are the schedule's (``pipelined_preference_step``: ``PipelinedPairs``
per micro-batch on the last stage), and KTO's too (``pipelined_kto_step``: ``PipelinedExamples``), its KL estimate
computed before the schedule runs by a forward-only pass of the trained stages (TRL's own KL forward has no graph
either). ``reference_pass`` and ``reference_key`` serve ``precompute_reference``: each
sequence's reference log-probability computed once into the data cache, keyed by what the reference is.
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
from lightning_2d.ops.preference import PreferenceConfigError, PreferenceLoss, sequence_sums
from lightning_2d.parallel.context import context_shard
from lightning_2d.parallel.loss import (
    count_global_tokens,
    data_context_group,
    global_means,
    normalize_by_global_count,
    sum_over_context,
    token_scale,
    unit_scale,
)

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
    ref = None
    if preference.needs_reference:
        assert reference_log_probs is not None, "a reference-based loss needs the reference's log-probabilities"
        with torch.no_grad():
            ref = reference_log_probs(batch)
    terms, logps, tokens = score_pairs(preference, token_log_probs(batch), labels, sequence_ids, sequences, ref, mesh)
    pairs = torch.tensor(float(terms.losses.numel()), device=logps.device)
    loss, mean, global_pairs = normalize_by_global_count(terms.losses.sum(), pairs, mesh, step_count=step_pairs,
                                                         accumulate=accumulate)
    if preference.loss_type == "orpo":  # ORPO adds the chosen completions' NLL, a mean over their tokens
        nll, nll_mean, _ = normalize_by_global_count(-logps[0::2].sum(), tokens[0::2].sum(), mesh)
        loss, mean = loss + nll, mean + nll_mean
    values = metric_sums(terms, pairs)
    if preference.loss_type == "orpo":
        values["nll_loss"] = (-logps[0::2].detach().sum(), tokens[0::2].sum())
    return loss, mean, global_pairs, global_means(values, mesh)


def score_pairs(
    preference: PreferenceLoss, token_logps: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor,
    sequences: torch.Tensor, reference_token_logps: Optional[torch.Tensor], mesh: Any,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(terms, logps, tokens)``: each packed sequence's log-probability and trained tokens (summed on the ranks
    that hold its positions and over the context ranks) and the pairs' ``PairTerms`` against the reference's sums."""
    def sums(values: torch.Tensor) -> torch.Tensor:
        return sum_over_context(sequence_sums(values, sequence_ids, sequences), mesh)

    logps = sums(token_logps)
    tokens = sums((labels != IGNORE_INDEX).to(logps.dtype))
    ref = sums(reference_token_logps.detach().to(logps.dtype)) if reference_token_logps is not None else None
    terms = preference.pair_terms(logps[0::2], logps[1::2], tokens[0::2], tokens[1::2],
                                  ref[0::2] if ref is not None else None, ref[1::2] if ref is not None else None)
    return terms, logps, tokens


def metric_sums(terms: Any, pairs: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``METRICS`` as ``(sum, count)`` over this rank's pairs (``global_means`` averages them)."""
    chosen, rejected = terms.chosen_rewards.detach(), terms.rejected_rewards.detach()
    return {
        "rewards/chosen": (chosen.sum(), pairs),
        "rewards/rejected": (rejected.sum(), pairs),
        "rewards/accuracies": ((chosen > rejected).float().sum(), pairs),
        "rewards/margins": ((chosen - rejected).sum(), pairs),
        "logps/chosen": (terms.chosen_logps.detach().sum(), pairs),
        "logps/rejected": (terms.rejected_logps.detach().sum(), pairs),
    }


class PipelinedPairs:
    """The loss of a micro-batch of packed pairs on the last pipeline stage (``Pipeline.objective_step``'s
    objective, called once per micro-batch with each token's log-probability): the schedule splits the batch into
    micro-batches by windows, so a pair's two sequences are always in one. The ``target`` carries per position the
    label, the sequence, its window's pair count and the reference's log-probability (``target``); the losses are
    scaled by factors counted before the schedule runs (``unit_scale``: the step's pairs over every replica), and
    the sums the metrics need are kept (``totals``).
    """

    def __init__(self, preference: PreferenceLoss, mesh: Any, pair_scale: torch.Tensor,
                 nll_scale: Optional[torch.Tensor]) -> None:
        self.preference, self.mesh, self.pair_scale, self.nll_scale = preference, mesh, pair_scale, nll_scale
        self._sums: list[torch.Tensor] = []

    @staticmethod
    def target(batch: dict[str, torch.Tensor], reference_token_logps: Optional[torch.Tensor]) -> torch.Tensor:
        """``(B, T, 4)`` float64 (exact for the ids and for fp32 values): label, sequence, pairs, reference."""
        labels = batch["labels"]
        pairs = batch["pairs"].reshape(-1, 1).to(labels.device).expand_as(labels)
        reference = reference_token_logps if reference_token_logps is not None else torch.zeros_like(labels)
        return torch.stack([labels, batch["sequence_ids"], pairs, reference.to(labels.device)], dim=-1).double()

    def __call__(self, token_logps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, sequence_ids = target[..., 0].long(), target[..., 1].long()
        sequences, reference = 2 * target[:, 0, 2].long(), target[..., 3].float()
        terms, logps, tokens = score_pairs(self.preference, token_logps, labels, sequence_ids, sequences,
                                           reference if self.preference.needs_reference else None, self.mesh)
        loss = terms.losses.sum() * self.pair_scale
        pairs = torch.tensor(float(terms.losses.numel()), device=logps.device)
        nll = -logps[0::2].sum()
        if self.nll_scale is not None:
            loss = loss + nll * self.nll_scale
        self._sums.append(torch.stack([terms.losses.detach().sum(), nll.detach(), tokens[0::2].detach().sum(), pairs]
                                      + [value.detach().reshape(()) for value, _ in metric_sums(terms, pairs).values()]))
        return loss

    def totals(self, device: torch.device) -> torch.Tensor:
        """The micro-batches' sums (zeros on a rank without the last stage): loss, NLL, chosen tokens, pairs, then
        ``METRICS``."""
        if not self._sums:
            return torch.zeros(4 + len(METRICS), device=device)
        return torch.stack(self._sums).sum(0)


def pipelined_preference_step(
    pipeline: Any,
    preference: PreferenceLoss,
    batch: dict[str, torch.Tensor],
    reference_log_probs: Optional[Callable[[dict[str, torch.Tensor]], Optional[torch.Tensor]]],
    mesh: Any,
    train: bool,
    step_pairs: Optional[torch.Tensor] = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``preference_step`` under pipeline parallelism: the pairs' losses computed by the last stage per micro-batch
    (``PipelinedPairs``), forward and backward run by the schedule (``train``) or the forwards only. The reference's
    log-probabilities come first (``reference_log_probs``: the batch's precomputed values, or a forward-only run of
    the stages with the adapters off, ``Pipeline.token_log_probs``). Returns what ``preference_step`` returns, the
    loss detached (the gradients are already in the parameters), identical on every rank."""
    check_batch_units(preference, batch)
    labels = batch["labels"]
    reference = None
    if preference.needs_reference:
        assert reference_log_probs is not None, "a reference-based loss needs the reference's log-probabilities"
        reference = reference_log_probs(batch)
    pairs = batch["pairs"].reshape(-1).to(labels.device)
    pair_scale, global_pairs = unit_scale(pairs.sum(), mesh, step_pairs if train else None,
                                          accumulate if train else 1)
    nll_scale = None
    if preference.loss_type == "orpo":  # the chosen completions' NLL: a mean over their tokens (the batch's)
        chosen = torch.where((batch["sequence_ids"] % 2 == 0) & (batch["sequence_ids"] >= 0), labels, IGNORE_INDEX)
        chosen_tokens, dp_size = count_global_tokens(chosen, mesh)
        nll_scale = token_scale(chosen_tokens, dp_size)
    objective = PipelinedPairs(preference, mesh, pair_scale, nll_scale)
    pipeline.objective_step(objective, batch["input_ids"], labels, objective.target(batch, reference), train,
                            grad_scale=1.0 / accumulate if train else 1.0, position_ids=batch.get("position_ids"))
    sums = objective.totals(labels.device)
    names = ("loss", "nll") + METRICS
    values = from_last_stage(pipeline, global_means({name: (sums[i], sums[3] if name != "nll" else sums[2])
                                                     for i, name in zip((0, 1, *range(4, 4 + len(METRICS))), names)},
                                                    mesh))
    mean = values[0] + (values[1] if nll_scale is not None else 0.0)
    metrics = dict(zip(METRICS, values[2:]))
    if nll_scale is not None:
        metrics["nll_loss"] = values[1]
    return mean.detach(), mean.detach(), global_pairs, metrics


def from_last_stage(pipeline: Any, means: dict[str, torch.Tensor]) -> torch.Tensor:
    """``means``' values stacked, as the last stage's rank computed them, on every pipeline rank (a broadcast)."""
    values = torch.stack(list(means.values())).contiguous()
    dist.broadcast(values, src=pipeline.last_stage_rank, group=pipeline.pp_group)
    return values


class PipelinedExamples:
    """KTO's loss of a micro-batch of unpaired examples on the last pipeline stage (``Pipeline.objective_step``'s
    objective), as ``PipelinedPairs``: a window holds each example with its KL sequence, so a micro-batch does. The
    reference point, the KL estimate, is the batch's (a mean over every KL sequence of every replica): computed before
    the schedule runs (``pipelined_kto_step``), it rides in the target as a constant. The KL sequences' log-probabilities
    in the schedule's forward give no gradient (the estimate is a number). The sums the metrics need are kept
    (``totals``)."""

    #: ``totals``' entries: the loss and the examples, then each metric's sum and count.
    SUMS = ("loss", "examples", "rewards/chosen", "desirable", "rewards/rejected", "undesirable", "logps/chosen",
            "logps/rejected")

    def __init__(self, preference: PreferenceLoss, mesh: Any, example_scale: torch.Tensor) -> None:
        self.preference, self.mesh, self.example_scale = preference, mesh, example_scale
        self._sums: list[torch.Tensor] = []

    @staticmethod
    def target(batch: dict[str, torch.Tensor], reference_token_logps: Optional[torch.Tensor],
               kl: torch.Tensor) -> torch.Tensor:
        """``(B, T, 6)`` float64: label, sequence, the window's examples, the reference, whether the position's
        example is desirable (1 on its sequence's positions, 0 elsewhere: summed per sequence as the log-probabilities
        are, so also under context parallelism), the KL estimate."""
        labels, sequence_ids = batch["labels"], batch["sequence_ids"]
        examples = batch["examples"].reshape(-1, 1).to(labels.device).expand_as(labels)
        reference = reference_token_logps if reference_token_logps is not None else torch.zeros_like(labels)
        desirable = batch["desirable"].to(labels.device).gather(1, (sequence_ids // 2).clamp(min=0))
        desirable = desirable & (sequence_ids >= 0) & (sequence_ids % 2 == 0)  # an example's positions, not its KL's
        return torch.stack([labels, sequence_ids, examples, reference.to(labels.device), desirable,
                            kl.to(labels.device).expand_as(labels)], dim=-1).double()

    def __call__(self, token_logps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        sequence_ids, examples = target[..., 1].long(), target[:, 0, 2].long()

        def sums(values: torch.Tensor) -> torch.Tensor:
            return sum_over_context(sequence_sums(values, sequence_ids, 2 * examples), self.mesh)

        logps = sums(token_logps)[0::2]  # the examples'; their KL sequences' only made the estimate
        ref = sums(target[..., 3].float())[0::2]
        desirable = sums(target[..., 4].float())[0::2] > 0
        losses, rewards = self.preference.kto_terms(logps, ref, desirable, target[0, 0, 5].float())
        chosen, rejected, policy = desirable.float(), (~desirable).float(), logps.detach()
        self._sums.append(torch.stack([
            losses.detach().sum(), torch.tensor(float(losses.numel()), device=logps.device),
            (rewards * chosen).sum(), chosen.sum(), (rewards * rejected).sum(), rejected.sum(),
            (policy * chosen).sum(), (policy * rejected).sum(),
        ]))
        return losses.sum() * self.example_scale

    def totals(self, device: torch.device) -> torch.Tensor:
        """The micro-batches' ``SUMS`` (zeros on a rank without the last stage)."""
        if not self._sums:
            return torch.zeros(len(self.SUMS), device=device)
        return torch.stack(self._sums).sum(0)


def pipelined_kto_step(
    pipeline: Any,
    preference: PreferenceLoss,
    batch: dict[str, torch.Tensor],
    reference_log_probs: Callable[[dict[str, torch.Tensor]], Optional[torch.Tensor]],
    mesh: Any,
    train: bool,
    step_examples: Optional[torch.Tensor] = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``kto_step`` under pipeline parallelism: first the reference's log-probabilities and the trained model's, both
    forward-only runs of the stages (no graph, as TRL's KL forward), which give the KL estimate (the batch's KL
    sequences, every replica's); then the examples' losses computed by the last stage per micro-batch
    (``PipelinedExamples``), forward and backward run by the schedule (``train``) or the forwards only. Returns what
    ``kto_step`` returns, the loss detached, identical on every rank."""
    check_batch_units(preference, batch)
    labels, sequence_ids = batch["labels"], batch["sequence_ids"]
    tokens, positions = batch["input_ids"], batch.get("position_ids")
    examples = batch["examples"].reshape(-1).to(labels.device)
    reference = reference_log_probs(batch)  # on the last stage's rank (or every rank's precomputed values)
    policy = pipeline.token_log_probs(tokens, labels, position_ids=positions)  # None off the last stage
    kl_sum = torch.zeros((), device=labels.device)
    if policy is not None:  # collectives over the last stage's context ranks only
        assert reference is not None
        kl_sum = sum_over_context(sequence_sums(policy - reference.to(policy.dtype), sequence_ids, 2 * examples),
                                  mesh)[1::2].sum()
    # A window of one example has no KL sequence (its slot sums to 0): only the others count in the mean.
    kl_count = torch.where(examples > 1, examples, torch.zeros_like(examples)).sum()
    (kl,) = global_means({"kl": (kl_sum, kl_count)}, mesh).values()  # the last stage's ranks: the estimate
    example_scale, global_examples = unit_scale(examples.sum(), mesh, step_examples if train else None,
                                                accumulate if train else 1)
    objective = PipelinedExamples(preference, mesh, example_scale)
    pipeline.objective_step(objective, tokens, labels, objective.target(batch, reference, kl), train,
                            grad_scale=1.0 / accumulate if train else 1.0, position_ids=positions)
    sums = dict(zip(PipelinedExamples.SUMS, objective.totals(labels.device)))
    values = from_last_stage(pipeline, {
        **global_means({
            "loss": (sums["loss"], sums["examples"]),
            "rewards/chosen": (sums["rewards/chosen"], sums["desirable"]),
            "rewards/rejected": (sums["rewards/rejected"], sums["undesirable"]),
            "logps/chosen": (sums["logps/chosen"], sums["desirable"]),
            "logps/rejected": (sums["logps/rejected"], sums["undesirable"]),
        }, mesh),
        "kl": kl.clamp(min=0),
    })
    mean, metrics = values[0].detach(), dict(zip(("rewards/chosen", "rewards/rejected", "logps/chosen",
                                                  "logps/rejected", "kl"), values[1:]))
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return mean, mean, global_examples, {name: metrics[name] for name in KTO_METRICS}


def reference_pass(
    reference_log_probs: Callable[[dict[str, torch.Tensor]], Optional[torch.Tensor]],
    loaders: Iterable[Iterable[dict[str, torch.Tensor]]],
    sequences: int,
    mesh: Any,
    device: torch.device,
    pipeline_group: Any = None,
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
        pipeline_group: Under pipeline parallelism, the pipeline ranks (the last stage's rank scores, the others
            add 0).
    """
    values = torch.zeros(sequences, dtype=torch.float32, device=device)
    with torch.no_grad():
        for loader in loaders:
            for batch in loader:
                batch = context_shard({key: value.to(device) for key, value in batch.items()}, mesh)
                numbers = batch["sequence_numbers"]
                counted = numbers >= 0
                logps = reference_log_probs(batch)  # None on a pipeline rank without the last stage
                if logps is not None:
                    values.index_add_(0, numbers[counted], logps[counted].float())
    for group in (data_context_group(mesh), pipeline_group):
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


__all__ = ["KTO_METRICS", "METRICS", "ORPO_METRICS", "PipelinedExamples", "PipelinedPairs", "check_batch_units",
           "from_last_stage", "kto_step", "metric_names", "metric_sums", "pipelined_kto_step",
           "pipelined_preference_step", "preference_step", "reference_key", "reference_pass", "score_pairs"]
