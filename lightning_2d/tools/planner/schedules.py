"""Pipeline schedules: the order torch runs a rank's forwards and backwards, and the activation peak it gives.

``schedule_order`` replays ``torch.distributed.pipelining``'s GPipe, 1F1B, Interleaved1F1B and the zero-bubble
schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) for one pipeline rank; ``pipeline_activation_estimate`` walks that order, counting the micro-batches in flight, and
adds up each stage's ``ActivationModel`` with the receive buffers and stage outputs a pipeline keeps.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from lightning_2d.parallel.pipeline import stages_of_rank
from lightning_2d.parallel.schedules import SCHEDULES
from lightning_2d.tools.planner.activations import ActivationEstimate, ActivationModel


#: What each kind of operation does to its micro-batch: ``"F"`` forward (its activations kept from here),
#: ``"B"`` full backward (freed), ``"I"`` input half of a split backward (kept: the graph is retained for the
#: weight half), ``"W"`` weight half (freed).
RELEASING = ("B", "W")


def schedule_order(
    schedule: str, pp: int, stages_per_rank: int, microbatches: int, pp_rank: int
) -> list[tuple[str, int]]:
    """This rank's operations in the order torch runs them, each with the local stage it runs
    (``0 .. stages_per_rank - 1``; local stage ``j`` is ``stages_of_rank(pp_rank, pp, stages_per_rank,
    placement)[j]``: stage ``pp_rank + j·pp`` in a loop, ``pp_rank`` then ``2·pp - 1 - pp_rank`` in a V).

    Kinds: ``"F"`` forward, ``"B"`` full backward, ``"I"``/``"W"`` the input and weight halves of a split
    backward (the zero-bubble schedules). Follows ``torch.distributed.pipelining.schedules``:
    ``ScheduleGPipe`` runs every forward, then every backward; ``Schedule1F1B`` runs ``min(m, pp - pp_rank)``
    warm-up forwards, then alternates one backward and one forward; ``ScheduleInterleaved1F1B`` runs
    ``_get_warmup_ops`` warm-up forwards, then alternates one forward and one backward (``_get_1f1b_rank_ops``),
    its local stage changing every ``microbatches_per_round`` operations; ``ScheduleInterleavedZeroBubble``
    is that order with one hop less of warm-up per rank, each backward an ``I`` and, from the
    ``pp_rank``-th on, each followed by the ``W`` of the oldest pending one; ``ScheduleZBVZeroBubble`` and
    ``ScheduleDualPipeV`` are their ``_calculate_single_rank_operations`` (DualPipeV's overlapped
    forward+backward pairs flattened, forward first, as its runtime runs them).

    Args:
        schedule: A ``pipeline_schedule``.
        pp: Pipeline ranks.
        stages_per_rank: Stages each rank holds (1 but for the interleaved and V schedules).
        microbatches: Micro-batches per step ``m``.
        pp_rank: This rank's place in the pipeline.
    """
    m, n = microbatches, stages_per_rank
    if schedule == "GPipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1F1B":
        warmup = min(m, pp - pp_rank)
        order = [("F", 0)] * warmup
        for done in range(m):
            order.append(("B", 0))
            if warmup + done < m:
                order.append(("F", 0))
        return order
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return _interleaved_order(pp, n, m, pp_rank, zero_bubble=schedule == "InterleavedZeroBubble")
    if schedule == "ZBVZeroBubble":
        return _zbv_order(pp, m, pp_rank)
    if schedule == "DualPipeV":
        return _dualpipev_order(pp, m, pp_rank)

    raise ValueError(f"schedule={schedule!r}; use {', '.join(map(repr, SCHEDULES))}")


def _interleaved_order(pp: int, n: int, m: int, rank: int, zero_bubble: bool) -> list[tuple[str, int]]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    # _get_warmup_ops: (n - 1) rounds for the last rank, 2 more per hop before it (1 for zero bubble); at most
    # every chunk.
    warmup = min((n - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * n)
    chunks = m * n
    order: list[tuple[str, int]] = []
    backwards: list[int] = []  # the local stage of each input-gradient pass, in order, for its weight pass
    for op in range(chunks + warmup):  # warm-up forwards, (forward, backward) pairs, cool-down backwards
        if op < chunks:
            order.append(("F", (op // per_round) % n))
        if op >= warmup:
            local = n - 1 - ((op - warmup) // per_round) % n
            if not zero_bubble:
                order.append(("B", local))
                continue
            order.append(("I", local))
            backwards.append(local)
            if op - warmup >= rank:  # the first `rank` backwards' weight passes wait for the end
                order.append(("W", backwards[len([k for k, _ in order if k == "W"])]))
    done = len([k for k, _ in order if k == "W"])
    order += [("W", local) for local in backwards[done:]]
    return order


def _zbv_order(pp: int, m: int, rank: int) -> list[tuple[str, int]]:
    n_micro = max(2 * pp - 1, m)  # torch builds the order for at least this many, then drops the extra ones
    ops: list[tuple[str, int, int]] = []  # (kind, local stage, micro-batch)
    f, b = [0, 0], [0, 0]  # forwards and input passes so far, per local stage

    def forward(local: int) -> None:
        ops.append(("F", local, f[local]))
        f[local] += 1

    def backward(local: int, with_weight: bool) -> None:
        ops.append(("I", local, b[local]))
        if with_weight:
            ops.append(("W", local, b[local]))
        b[local] += 1

    for _ in range(2 * (pp - rank) - 1):  # warm-up
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(pp - rank):
        forward(1)
        backward(1, with_weight=True)
    while f[1] < f[0] or f[0] < n_micro:  # steady
        if f[0] < n_micro:
            forward(0)
        backward(0, with_weight=True)
        forward(1)
        backward(1, with_weight=True)
    w = list(b)  # cool-down: the weight passes deferred from here
    for _ in range(rank):
        backward(0, with_weight=False)
        backward(1, with_weight=False)
    for _ in range(pp - rank):
        backward(0, with_weight=False)
        ops.append(("W", 0, w[0]))
        w[0] += 1
    for local in (1, 0):
        while w[local] < b[local]:
            ops.append(("W", local, w[local]))
            w[local] += 1
    return [(kind, local) for kind, local, mb in ops if mb < m]


def _dualpipev_order(pp: int, m: int, rank: int) -> list[tuple[str, int]]:
    order: list[tuple[str, int]] = []
    pending: list[int] = []  # local stages of input-gradient passes whose weight pass is still to run

    def add(kind: str, local: int) -> None:
        order.append((kind, local))
        if kind == "I":
            pending.append(local)

    def weight() -> None:
        if pending:
            order.append(("W", pending.pop(0)))

    for _ in range((pp - rank - 1) * 2):  # 1: F0
        add("F", 0)
    for _ in range(rank + 1):  # 2: F0 F1
        add("F", 0)
        add("F", 1)
    for _ in range(pp - rank - 1):  # 3: I1 W F1
        add("I", 1)
        weight()
        add("F", 1)
    for i in range(m - 2 * pp + rank + 1):  # 4: F0 B1, F1 B0 (overlapped pairs: the forward first)
        add("F", 0)
        add("B", 1)
        add("F", 1)
        add("B", 0)
    for _ in range(pp - rank - 1):  # 5: B1, F1 B0
        add("B", 1)
        add("F", 1)
        add("B", 0)
    zero_bubble = False
    for i in range(rank + 1):  # 6: B1 B0, the second half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        add("I" if zero_bubble else "B", 1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        add("I" if zero_bubble else "B", 0)
    for _ in range(pp - rank - 1):  # 7: W B0
        weight()
        add("I" if zero_bubble else "B", 0)
    for _ in range(rank + 1):  # 8: W
        weight()
    return order


def pipeline_activation_estimate(
    base: ActivationModel,
    split: list[int],
    *,
    pp: int,
    pp_rank: int,
    schedule: str,
    microbatches: int,
    activation_checkpointing: str,
    selective_ac_option: Any = "op",
) -> ActivationEstimate:
    """The activation peak of one pipeline rank over a schedule step.

    Each of the rank's stages is an ``ActivationModel`` of its blocks (``base`` with ``n_layers``,
    ``has_embedding`` and ``has_head`` set; ``base`` is one micro-batch of ``micro_batch_size``
    sequences). The rank's operations are walked in torch's order (``schedule_order``); at each one
    the peak is the micro-batch being processed at its own single-micro-batch peak plus, for every
    other micro-batch in flight (forward run, backward not yet; under the zero-bubble schedules until its
    weight pass, since the input pass retains the graph for it), what its stage keeps between the two:
    the blocks' saved tensors, on the last stage the final norm's and the fused loss's (its hidden-state
    gradient and fp32 head-gradient accumulator), on non-last stages the stage output (torch keeps it
    for the backward). Always there: the receive buffers ``PipelineStage`` allocates for every
    micro-batch up front, activations on non-first stages and gradients on non-last ones
    (residual-stream tensors). A non-first stage's first block gets its receive buffer as input:
    what it saves of it is not counted twice.

    Args:
        base: One micro-batch of the whole model on one device (``ActivationModel.for_layout``).
        split: Blocks of every stage, in stage order (``pipeline_split``).
        pp: Pipeline ranks.
        pp_rank: The rank to estimate.
        schedule: A ``pipeline_schedule`` (its stage placement: a loop, or a V).
        microbatches: Micro-batches per step.
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        selective_ac_option: ``"op"`` or N.

    Returns:
        The peak; ``saved_by_blocks``, ``head_and_loss`` and ``stage_outputs`` sum over the micro-batches
        in flight, ``transient`` is the processed one's, ``receive_buffers`` the rank's.
    """
    num_stages = len(split)
    per_rank = num_stages // pp
    placement = SCHEDULES[schedule].placement
    residual = base.residual_bytes
    kept: list[tuple[int, int, int]] = []  # per local stage, one micro-batch between forward and backward
    active: list[tuple[int, int, int, int]] = []  # per local stage, one micro-batch at its own peak
    estimates: list[ActivationEstimate] = []
    receive = 0
    for stage in stages_of_rank(pp_rank, pp, per_rank, placement):
        first, last = stage == 0, stage == num_stages - 1
        model = replace(base, n_layers=split[stage], has_embedding=first, has_head=last)
        est = model.estimate(activation_checkpointing, selective_ac_option)
        shared = 0 if first else model.saved_input(est.block_modes[0])
        output = 0 if last else residual
        # (blocks, final norm/loss/inputs, stage output); at the peak also the transient
        kept.append((est.kept_by_blocks - shared, est.kept_by_head, output))
        active.append((est.saved_by_blocks - shared, est.head_and_loss, output, est.transient))
        estimates.append(est)
        receive += microbatches * residual * ((not first) + (not last))
    counts = [0] * per_rank
    best_total, best_local, best_counts = -1, 0, counts
    for kind, local in schedule_order(schedule, pp, per_rank, microbatches, pp_rank):
        if kind == "F":
            counts[local] += 1
        # The micro-batch being processed at its own peak, every other one in flight as kept.
        total = sum(c * sum(k) for c, k in zip(counts, kept)) - sum(kept[local]) + sum(active[local])
        if total > best_total:
            best_total, best_local, best_counts = total, local, list(counts)
        if kind in RELEASING:
            counts[local] -= 1
    others = list(best_counts)
    others[best_local] -= 1
    parts = [sum(c * k[i] for c, k in zip(others, kept)) + active[best_local][i] for i in range(3)]
    est = estimates[best_local]
    in_flight = sum(best_counts)
    nouns = ("stage-chunk", "stage-chunks") if per_rank > 1 else ("micro-batch", "micro-batches")
    what = nouns[in_flight != 1]
    stage = stages_of_rank(pp_rank, pp, per_rank, placement)[best_local]
    offset = sum(split[:stage])  # the stage's blocks are numbered from 0: name them as in the model
    phase = re.sub(r"block (\d+)", lambda m: f"block {int(m.group(1)) + offset}", est.phase)
    return ActivationEstimate(
        peak=receive + sum(parts) + active[best_local][3],
        phase=f"{schedule}, {in_flight} {what} in flight: stage {stage}, {phase}",
        saved_by_blocks=parts[0],
        head_and_loss=parts[1],
        transient=active[best_local][3],
        block_modes=[m for e in estimates for m in e.block_modes],
        block_saved=estimates[-1].block_saved,
        kept_by_blocks=sum(k[0] for k in kept),
        kept_by_head=sum(k[1] for k in kept),
        receive_buffers=receive,
        stage_outputs=parts[2],
        in_flight=in_flight,
    )
