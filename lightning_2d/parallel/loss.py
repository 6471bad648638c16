"""Next-token loss normalized by the tokens of the *global* batch; vocabulary-parallel losses.

Averaging each data-parallel rank's mean loss (what DDP/FSDP gradient averaging does with a
per-rank ``mean``) weighs a token on a rank with many ignored labels more than one on a full
rank, so the result differs from single-device training on the same global batch. Here every rank
divides its *sum* by the global number of target tokens (one all-reduce of two numbers over the
data-parallel group per step) and multiplies by the data-parallel size to undo the gradient
averaging: the gradients are then exactly those of the global-batch mean.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lightning_2d._compat import compute_local_shape_and_global_offset
from lightning_2d.ops.distillation import TeacherHead, linear_distillation_from
from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX, VocabReduce, linear_cross_entropy, linear_log_probs
from lightning_2d.parallel.meshes import as_meshes
from lightning_2d.parallel.names import CP_DIM, DP_CP_DIM

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_2d.parallel.meshes import ParallelMeshes


def loss_parallel_context(logits: torch.Tensor) -> AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``logits`` are vocabulary-sharded DTensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def backward_context(loss: torch.Tensor, loss_parallel_enabled: bool) -> AbstractContextManager:
    """Where a strategy runs ``backward``: a vocabulary-parallel loss must be differentiated inside
    ``loss_parallel()`` too."""
    if loss_parallel_enabled and hasattr(loss, "placements"):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def data_context_group(mesh: "ParallelMeshes | DeviceMesh | None"):  # type: ignore[no-untyped-def]
    """The ranks holding distinct tokens: replicas × shards × context ranks (``data_context_parallel``, the same
    ranks as ``data_parallel`` at context size 1). Not the world: the tensor- and pipeline-parallel ranks of a
    replica hold the same tokens (counting them would log tp·pp times the global tokens and all-reduce across every
    rank, nodes included)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    meshes = as_meshes(mesh)
    if meshes is None:
        return dist.group.WORLD  # plain data parallelism (DDP/FSDP1): every rank is a replica
    return meshes.get(DP_CP_DIM).get_group()


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """``lightning_2d.ops.linear_cross_entropy`` when the output projection is tensor-parallel.

    Installed on the model's ``VocabProjection`` by the tensor-parallel plan. Each rank holds a
    slice of the vocabulary (``weight``: ``Shard(0)`` DTensor over the tensor-parallel mesh) and
    the hidden states of every token (``Replicate``); one all-gather of ``3 × chunk`` numbers per
    chunk gives the softmax statistics over the whole vocabulary. The logits are never gathered.

    Args:
        hidden: ``(N, D)`` DTensor, replicated over the tensor-parallel mesh.
        weight: ``(V, D)`` DTensor sharded over the vocabulary (rows).
        labels: ``(N,)`` plain tensor of global target ids, the same on every tensor-parallel rank.
        chunk_size: Tokens per chunk; ``None``: sized by memory (``ops.linear_cross_entropy.auto_chunk_tokens``).

    Returns:
        The summed cross-entropy, a plain 0-dim tensor equal on the tensor-parallel ranks.
    """
    local_hidden, local_weight, vocab_start, reduce = _vocab_shards(hidden, weight)
    return linear_cross_entropy(
        local_hidden, local_weight, labels, chunk_size=chunk_size, vocab_start=vocab_start, reduce=reduce
    )


def vocab_parallel_linear_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """``lightning_2d.ops.linear_log_probs`` (each token's log-probability) when the output projection is
    tensor-parallel: as ``vocab_parallel_linear_cross_entropy`` (arguments alike), the ``(N,)`` log-probabilities a
    plain tensor equal on the tensor-parallel ranks. Backward needs no collective of its own (the stored
    log-normalizers are the whole vocabulary's)."""
    local_hidden, local_weight, vocab_start, reduce = _vocab_shards(hidden, weight)
    return linear_log_probs(
        local_hidden, local_weight, labels, chunk_size=chunk_size, vocab_start=vocab_start, reduce=reduce
    )


def vocab_parallel_linear_distillation(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int | None = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lightning_2d.ops.distillation.linear_distillation`` when both output projections are tensor-parallel: the
    teacher's head sharded by the same plan as the student's (the same vocabulary rows on each rank), both models'
    hidden states replicated DTensors over the same tensor-parallel mesh; three all-reduces of at most
    ``2 × chunk_size`` numbers per chunk. Arguments as there (``mask``: a plain tensor, the same on every
    tensor-parallel rank). Returns ``(total, count)``, plain tensors equal on the tensor-parallel ranks."""
    return vocab_parallel_linear_distillation_from(
        student_hidden, student_weight, lambda consume: consume(teacher_hidden, teacher_weight), mask, beta=beta,
        temperature=temperature, chunk_size=chunk_size,
    )


def vocab_parallel_linear_distillation_from(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: TeacherHead,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int | None = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_distillation_from`` (the teacher's side handed over from inside its head's call) when both output
    projections are tensor-parallel: ``teacher`` hands over DTensors (its hidden states replicated, its head's rows
    sharded as the student's), of which this rank's parts enter the loss. As ``vocab_parallel_linear_distillation``
    otherwise."""
    local_hidden, local_weight, vocab_start, reduce = _vocab_shards(student_hidden, student_weight)

    def local_teacher(consume: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        def local(teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor) -> None:
            _, teacher_start = compute_local_shape_and_global_offset(
                teacher_weight.shape, teacher_weight.device_mesh, teacher_weight.placements)
            if teacher_weight.shape[0] != student_weight.shape[0] or teacher_start[0] != vocab_start \
                    or teacher_weight.device_mesh != student_weight.device_mesh:
                raise ValueError(
                    f"the teacher's head (vocabulary {teacher_weight.shape[0]}, rows from {teacher_start[0]} here) must"
                    f" be sharded as the student's (vocabulary {student_weight.shape[0]}, rows from {vocab_start}"
                    " here) over the same mesh: parallelize the teacher with a plan sharding its head as the student's")
            consume(teacher_hidden.to_local(), teacher_weight.to_local())

        teacher(local)

    return linear_distillation_from(local_hidden, local_weight, local_teacher, mask, beta=beta,
                                    temperature=temperature, chunk_size=chunk_size, reduce=reduce)


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        chunk_size: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of ``hidden @ weight.T`` against ``labels`` without the logits: vocabulary-parallel
    when ``weight`` is a tensor-parallel DTensor (``vocab_parallel_linear_cross_entropy``), else
    ``ops.linear_cross_entropy``."""
    if hasattr(weight, "placements"):
        return vocab_parallel_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    return linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)


def fused_distillation_from(
    student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher: TeacherHead, mask: torch.Tensor, *,
    beta: float, temperature: float = 1.0, chunk_size: int | None = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_distillation_from``, vocabulary-parallel when the student's head is a tensor-parallel DTensor
    (``vocab_parallel_linear_distillation_from``)."""
    if hasattr(student_weight, "placements"):
        return vocab_parallel_linear_distillation_from(student_hidden, student_weight, teacher, mask, beta=beta,
                                                       temperature=temperature, chunk_size=chunk_size)
    return linear_distillation_from(student_hidden, student_weight, teacher, mask, beta=beta,
                                    temperature=temperature, chunk_size=chunk_size)


def _vocab_shards(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, VocabReduce]:
    """This rank's hidden states and vocabulary rows, the first row's global id, and the collectives over the
    tensor-parallel group that combine the shards' softmax statistics (the all-gather the cross-entropy and
    log-probabilities use, one per chunk; the all-reduces the distillation uses)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial

    mesh = weight.device_mesh
    group = mesh.get_group()
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    shards = dist.get_world_size(group)

    def gather_(t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty(shards * t.numel())  # flat: all_gather_into_tensor's concatenated form, on gloo too
        dist.all_gather_into_tensor(out, t.contiguous().view(-1), group=group)
        return out.view(shards, *t.shape)

    reduce = VocabReduce(
        max_=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group),
        sum_=lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group),
        gather_=gather_,
    )
    # Each rank's gradient of the hidden states covers its vocabulary slice only: a partial sum,
    # which DTensor reduces (a reduce-scatter back to the sequence shards under SP) in backward.
    return hidden.to_local(grad_placements=[Partial()]), weight.to_local(), offset[0], reduce


def normalize_by_global_tokens(
    loss_sum: torch.Tensor,
    labels: torch.Tensor,
    mesh: "ParallelMeshes | DeviceMesh | None" = None,
    step_tokens: torch.Tensor | None = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn this data-parallel rank's *summed* loss into the global-batch mean (see the module docstring).

    Args:
        loss_sum: Sum of the per-token losses of this rank's batch (a replicated DTensor under loss
            parallelism is accepted).
        labels: This rank's target ids (``-100`` ignored), to count its tokens.
        mesh: The strategy's meshes (``ParallelMeshes``, or ``strategy.device_mesh``, or Lightning's 2D mesh), or
            ``None`` outside a model-parallel strategy (then all ranks are data-parallel).
        step_tokens: This data-parallel replica's target tokens over *every* batch the optimizer step accumulates
            (the data loader counts them ahead: ``ChatDataModule``'s ``step_tokens``). The loss is then the step's
            mean over all its target tokens (what one device computes on the whole step's batch), not the mean of
            each batch's mean: with ``accumulate`` batches per step, a batch with few trained tokens weighs no
            more per token than one with many.
        accumulate: Batches per optimizer step (the Trainer divides each batch's loss by it).

    Returns:
        ``(loss_to_backward, global_mean_loss, global_tokens)``, as ``next_token_loss``; the mean and the count are
        this batch's.
    """
    local_sum = loss_sum.detach()
    if hasattr(local_sum, "full_tensor"):  # DTensor (replicated) under loss parallelism
        local_sum = local_sum.full_tensor()
    # Each rank's own tokens; the step's count is over whole sequences: once per context-parallel group.
    step = step_tokens * float(_first_context_rank(mesh)) if step_tokens is not None else None
    return _normalized(loss_sum, local_sum, (labels != IGNORE_INDEX).sum(), step, mesh, accumulate)


def _normalized(
    loss_sum: torch.Tensor,
    local_sum: torch.Tensor,
    local_count: torch.Tensor,
    step_count: torch.Tensor | None,
    mesh: "ParallelMeshes | DeviceMesh | None",
    accumulate: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one all-reduce of the loss normalizations: this rank's ``local_sum`` and ``local_count`` (and the step's
    count) summed over the data × context ranks; ``loss_sum`` scaled to the global mean (``token_scale``)."""
    import torch.distributed as dist

    local = [local_sum.float().reshape(()), local_count.float().reshape(())]
    if step_count is not None:
        local.append(step_count.to(local_sum.device).float().reshape(()))
    stats = torch.stack(local)
    group = data_context_group(mesh)
    dp_size = 1
    if group is not None:
        dist.all_reduce(stats, group=group)
        dp_size = dist.get_world_size(group)
    global_sum, global_count = stats[0], stats[1]
    scale = token_scale(global_count, dp_size) if step_count is None else token_scale(stats[2], dp_size) * accumulate
    return loss_sum * scale, global_sum / global_count.clamp(min=1.0), global_count


def _first_context_rank(mesh: "ParallelMeshes | DeviceMesh | None") -> bool:
    """Whether this rank is its context-parallel group's first (always, without context parallelism)."""
    import torch.distributed as dist

    meshes = as_meshes(mesh) if dist.is_available() and dist.is_initialized() else None
    cp_mesh = meshes.optional(CP_DIM) if meshes is not None else None
    return cp_mesh is None or cp_mesh.get_local_rank() == 0


def count_step_tokens(
    step_tokens: torch.Tensor, mesh: "ParallelMeshes | DeviceMesh | None" = None
) -> tuple[torch.Tensor, int]:
    """The target tokens of the whole optimizer step over every data-parallel replica (``step_tokens`` summed, once
    per context-parallel group) and the data-parallel size: ``token_scale`` of them gives each token of the step
    the same weight (the pipeline's loss function)."""
    import torch.distributed as dist

    count = (step_tokens.float() * float(_first_context_rank(mesh))).reshape(1)
    group = data_context_group(mesh)
    if group is None:
        return count.reshape(()), 1
    dist.all_reduce(count, group=group)
    return count.reshape(()), dist.get_world_size(group)


def token_scale(global_tokens: torch.Tensor, dp_size: int) -> torch.Tensor:
    """The factor that turns one data-parallel rank's summed loss into the loss it differentiates: the
    global-batch mean times ``dp_size`` (FSDP averages the gradients over the data-parallel ranks).

    The one place the normalization is written: ``normalize_by_global_tokens`` and the pipeline's loss
    function (``parallel/pipeline.py``, which applies it per micro-batch inside the schedule) use it.
    A global batch without targets gives a zero loss, not NaN (the count is clamped to 1).
    """
    return dp_size / global_tokens.clamp(min=1.0)


def count_global_tokens(
    labels: torch.Tensor, mesh: "ParallelMeshes | DeviceMesh | None" = None
) -> tuple[torch.Tensor, int]:
    """The target tokens (``labels != -100``) of the global batch and the data-parallel size."""
    import torch.distributed as dist

    count = (labels != IGNORE_INDEX).sum().to(torch.float32).reshape(1)
    group = data_context_group(mesh)
    if group is None:
        return count.reshape(()), 1
    dist.all_reduce(count, group=group)
    return count.reshape(()), dist.get_world_size(group)


def next_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: "ParallelMeshes | DeviceMesh | None" = None,
    step_tokens: torch.Tensor | None = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``logits (B, T, V)`` against ``labels (B, T)`` (``-100`` ignored).

    Args:
        logits: Model output; a vocabulary-sharded DTensor under loss parallelism.
        labels: Target ids, already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``).
        mesh: The strategy's meshes (``ParallelMeshes``, or ``strategy.device_mesh``, or Lightning's 2D mesh), or
            ``None`` outside a model-parallel strategy (then all ranks are data-parallel).
        step_tokens: See ``normalize_by_global_tokens``.
        accumulate: See ``normalize_by_global_tokens``.

    Returns:
        ``(loss_to_backward, global_mean_loss, global_tokens)``: the first carries the gradient of
        the global-batch mean once the data-parallel gradient averaging has been applied; the
        second (detached) is the global-batch mean loss, identical on every rank; the third is
        the number of target tokens in the global batch.
    """
    with loss_parallel_context(logits):
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    return normalize_by_global_tokens(loss_sum, labels, mesh, step_tokens, accumulate)


class _SumOverContext(torch.autograd.Function):
    """All-reduce (sum) over the context-parallel group in forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def, override]
        return grad, None


def sum_over_context(partial: torch.Tensor, mesh: "ParallelMeshes | DeviceMesh | None") -> torch.Tensor:
    """Per-sequence sums (``(S,)``) whose tokens are split over the context-parallel ranks, summed over them: every
    context rank then holds the whole sequences' values (unchanged without context parallelism).

    The gradient of each rank's copy flows back to its own tokens only (identity backward): each context rank
    differentiates the same loss of the whole sums, and the data × context gradient reduction then adds the
    ranks' parts once — an all-reduce's autograd (which sums the copies' gradients) would count them ``cp`` times.
    """
    import torch.distributed as dist

    meshes = as_meshes(mesh) if dist.is_available() and dist.is_initialized() else None
    cp_mesh = meshes.optional(CP_DIM) if meshes is not None else None
    if cp_mesh is None or cp_mesh.size() == 1:
        return partial
    return _SumOverContext.apply(partial, cp_mesh.get_group())


def normalize_by_global_count(
    loss_sum: torch.Tensor,
    count: torch.Tensor,
    mesh: "ParallelMeshes | DeviceMesh | None" = None,
    step_count: torch.Tensor | None = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``normalize_by_global_tokens`` for units that every context rank of a group holds whole (preference pairs,
    after ``sum_over_context``): this rank's summed loss over ``count`` units becomes the global mean over the
    batch's units (or, with ``step_count``, this replica's units over the whole optimizer step), each unit counted
    once per context-parallel group.

    Returns:
        ``(loss_to_backward, global_mean_loss, global_count)`` for this batch.
    """
    first = float(_first_context_rank(mesh))  # every context rank holds the units whole: count them once
    return _normalized(loss_sum, loss_sum.detach() * first, count.detach() * first,
                       step_count * first if step_count is not None else None, mesh, accumulate)


def unit_scale(
    count: torch.Tensor,
    mesh: "ParallelMeshes | DeviceMesh | None" = None,
    step_count: torch.Tensor | None = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, global_count)``: the factor ``normalize_by_global_count`` multiplies a rank's summed loss by, counted
    before the loss exists (a pipeline's objective applies it per micro-batch inside the schedule), and the batch's
    units over every replica. ``count`` and ``step_count`` as there (units held whole by every context rank)."""
    import torch.distributed as dist

    first = float(_first_context_rank(mesh))
    stats = torch.stack([count.detach().float().reshape(())] + ([step_count.to(count.device).float().reshape(())]
                                                               if step_count is not None else [])) * first
    group = data_context_group(mesh)
    dp_size = 1
    if group is not None:
        dist.all_reduce(stats, group=group)
        dp_size = dist.get_world_size(group)
    if step_count is None:
        return token_scale(stats[0], dp_size), stats[0]
    return token_scale(stats[1], dp_size) * accumulate, stats[0]


def global_means(values: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 mesh: "ParallelMeshes | DeviceMesh | None" = None) -> dict[str, torch.Tensor]:
    """Metrics averaged over the global batch: ``values[name] = (sum, count)`` of this rank's units (held whole by
    every context rank: counted once per context-parallel group), one all-reduce for all of them."""
    import torch.distributed as dist

    names = list(values)
    if not names:
        return {}
    first = float(_first_context_rank(mesh))
    stats = torch.stack([torch.stack([s.detach().float().reshape(()), c.detach().float().reshape(())])
                         for s, c in values.values()]) * first
    group = data_context_group(mesh)
    if group is not None:
        dist.all_reduce(stats, group=group)
    return {name: stats[i, 0] / stats[i, 1].clamp(min=1.0) for i, name in enumerate(names)}
