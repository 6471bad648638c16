"""Pipeline parallelism: a model split into stages by blocks, run by ``torch.distributed.pipelining``.

``parallelize_pipeline`` (called by ``parallelize_model`` when the mesh has a ``pipeline_parallel``
dimension) does, on the meta-device model:

1. **Split**: the blocks are cut into ``pipeline_parallel_size × stages_per_rank`` contiguous stages
   (``balanced_split``: by parameter count as a stand-in for compute, the output head counted in the
   last stage; or ``pipeline_layers_per_stage``). Stage ``s`` lives on pipeline rank
   ``s % pipeline_parallel_size`` (loop placement, what the interleaved schedules expect), or, under the
   V-shaped schedules (``ZBVZeroBubble``, ``DualPipeV``), rank ``r`` holds stages ``r`` and ``2·pp - 1 - r``
   (the first and the last stage on rank 0; the two middle ones on the last rank hand over locally).
2. **Prune**: the model keeps only this rank's blocks (and the embedding / final norm and head if it
   holds the first / last stage). Names are unchanged (``layers.17.attention.wq.weight``), so the
   layout-independent init, ``state_dict`` and DCP checkpoints see the same names as on one
   device: a checkpoint saved at one pipeline size loads at another.
3. **Stages**: each stage is a view holding references to its blocks (the model family builds it:
   ``ParallelPlan.pipeline_stages``, ``lightning_2d.models.llama.pipeline`` for our Llama).
   TP/SP, activation checkpointing, compile and FSDP2 are applied to each view (the view is its
   FSDP root, so ``PipelineStage`` defers FSDP's gradient reduce-scatter to the last micro-batch)
   over the ``(data_parallel, tensor_parallel)`` sub-mesh of this pipeline rank.
4. **Run**: the ``Pipeline`` (``parallelize_model(...).pipeline``, kept by the strategy as ``strategy.pipeline``)
   is stepped explicitly, as torchtitan's training
   step calls ``pp_schedule.step``: ``pipeline.train_step(tokens, labels, grad_scale=)`` runs the forward
   *and* backward of every micro-batch and leaves the gradients in the parameters;
   ``pipeline.eval_step(tokens, labels)`` runs the forwards only. Both return what
   ``normalize_by_global_tokens`` returns without a pipeline, detached, on every pipeline rank. The
   model object keeps its class; calling it raises (its blocks are spread over the pipeline ranks), so
   nothing runs a backward behind a call that looks like a forward. Under the Trainer the library's
   LightningModule steps it (``integration/module.py``); a Fabric loop calls ``train_step`` itself.

Loss scaling: the last stage returns each micro-batch's *summed* cross-entropy; the schedule's loss
function multiplies it by ``token_scale`` (``parallel/loss.py``: ``data_parallel_size / global target
tokens``, counted before the step, the factor ``normalize_by_global_tokens`` applies without a pipeline)
times the caller's ``grad_scale`` (``1 / n`` when accumulating over ``n`` batches); the schedule is built
with ``scale_grads=False`` (its default divides the gradients by the micro-batch count once more).

A mixture of experts' auxiliary loss (the plan's ``aux_loss_coef``): each pipeline micro-batch's, over every stage's
layers. In a training step the stages pass the micro-batch's routing statistics beside the hidden states and the
global counts come back as their gradient (``parallel.expert.PipelineAuxiliaryLoss``); ``last_aux_loss`` is the
step's value on every pipeline rank.

Other objectives (a preference loss): ``objective_step`` has the last stage return each token's log-probability
(``per_token=True``) and the schedule's loss function call the objective with the micro-batch's slice of a
``target`` the caller packs (the schedule splits ``target`` per micro-batch, not ``loss_kwargs``); the objective
normalizes its own loss. ``token_log_probs`` runs the forwards only for those outputs (a reference model's). A frozen
model held beside the trained one (``parallel/frozen.py``) is cut into the same stages on the same ranks and has its
own ``Pipeline``, which only ``token_log_probs`` steps (forward-only schedules, ``Schedule.forward_only_class``).
"""

from __future__ import annotations

import functools
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lightning_2d.parallel.config import (
    ParallelConfig,
    ParallelConfigError,
    ParallelPlan,
    PipelineStages,
    raise_if_problems,
)
from lightning_2d.ops.linear_cross_entropy import replayable_backward
from lightning_2d._compat import forward_pre_hooks
from lightning_2d.parallel.expert import PipelineAuxiliaryLoss
from lightning_2d.parallel.loss import count_global_tokens, count_step_tokens, normalize_by_global_tokens, token_scale
from lightning_2d.parallel.meshes import ParallelMeshes
from lightning_2d.parallel.names import DP_DIM, PP_DIM, TP_DIM
from lightning_2d.parallel.schedules import SCHEDULES
from lightning_2d.parallel.tensor_parallel import check_sequence_length


# ---- the split (pure) ------------------------------------------------------------------------
def balanced_split(block_costs: list[float], num_stages: int, last_extra: float = 0.0, first_extra: float = 0.0) -> list[int]:
    """Blocks per stage (contiguous, at least one each) minimizing the most expensive stage.

    Args:
        block_costs: The cost of each block, in order.
        num_stages: How many stages.
        last_extra: Cost the last stage carries besides its blocks (final norm + output head).
        first_extra: Cost the first stage carries besides its blocks (the embedding).

    Returns:
        The number of blocks of each stage; ties go to the split that puts blocks earlier.
    """
    n = len(block_costs)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"cannot split {n} blocks into {num_stages} stages of at least one block")
    prefix = [0.0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(start: int, end: int, index: int) -> float:
        extra = (first_extra if index == 0 else 0.0) + (last_extra if index == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    # best[s][e]: the smallest maximum stage cost splitting blocks [0, e) into s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for e in range(s, n - (num_stages - s) + 1):
            for b in range(s - 1, e):
                value = max(best[s - 1][b], stage_cost(b, e, s - 1))
                if value < best[s][e] - 1e-9 * max(1.0, abs(value)):
                    best[s][e], cut[s][e] = value, b
    sizes, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        sizes.append(end - start)
        end = start
    return sizes[::-1]


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int, placement: str = "loop") -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs, in stage order.

    Args:
        pp_rank: The pipeline rank.
        pp_size: Pipeline ranks.
        stages_per_rank: Stages each rank holds.
        placement: ``"loop"`` (stage ``s`` on rank ``s % pp``: 1F1B, GPipe, the interleaved schedules) or
            ``"v"`` (two stages per rank, rank ``r`` holding stages ``r`` and ``2·pp - 1 - r``: ZBVZeroBubble,
            DualPipeV; torch's ``generate_stage_to_rank_mapping(style="v")``). ``ParallelConfig.pipeline_placement``
            says which a schedule uses.
    """
    if placement == "v":
        if stages_per_rank != 2:
            raise ValueError(f"the V placement holds 2 stages per rank, got stages_per_rank={stages_per_rank}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    if placement != "loop":
        raise ValueError(f"placement={placement!r}; use 'loop' or 'v'")
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def rank_of_stage(stage: int, pp_size: int, placement: str = "loop") -> int:
    """The pipeline rank holding ``stage`` (the inverse of ``stages_of_rank``)."""
    if placement == "v":
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def pipeline_split(model: nn.Module, config: ParallelConfig, stages: PipelineStages) -> list[list[str]]:
    """The block names of every stage, in stage order (the given ``pipeline_layers_per_stage`` or balanced)."""
    names = stages.block_names(model)
    raise_if_problems(config.block_count_problems(len(names)))
    sizes = config.pipeline_layers_per_stage
    if sizes is None:
        blocks, head, embed = stages.block_costs(model, names)
        sizes = balanced_split(blocks, config.num_pipeline_stages, last_extra=head, first_extra=embed)
    out, start = [], 0
    for size in sizes:
        out.append(names[start : start + size])
        start += size
    return out


# ---- stages ----------------------------------------------------------------------------------
def stage_plan(stage: nn.Module, plan: ParallelPlan) -> ParallelPlan:
    """``plan`` without the entries naming modules this stage does not hold (embedding, norm, head)."""

    def held(name: str) -> bool:
        return getattr(stage, name.split(".", 1)[0], None) is not None

    return replace(
        plan,
        module="",
        tensor_parallel={k: v for k, v in plan.tensor_parallel.items() if held(k)},
        sequence_parallel={k: v for k, v in plan.sequence_parallel.items() if held(k)},
        expert_parallel={k: v for k, v in plan.expert_parallel.items() if held(k)},
        input_units=tuple(n for n in plan.input_units if held(n)),
        output_unit=tuple(n for n in plan.output_unit if held(n)),
    )


class _ReduceEveryMicroBatch(nn.Module):
    """A stage behind a plain module, for ``reduce_every_micro_batch=True``.

    ``PipelineStage`` recognizes an FSDP root and runs every micro-batch's backward with resharding
    and gradient reduction off, reduce-scattering once after the last one: until then every FSDP unit
    of the rank's stages stays gathered and holds its unsharded gradient (the most memory, the fewest
    collectives). Behind this wrapper each micro-batch's backward ends as without a pipeline: FSDP2's
    root callback reduce-scatters into the sharded gradients and reshards (an all-gather and a
    reduce-scatter per unit and micro-batch, the memory of no pipeline).
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.stage(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def timed_stage_class() -> type:
    """``PipelineStage`` whose forward, backward and weight-gradient passes (the zero-bubble schedules' ``W``
    actions) add their wall time to ``self.timer.busy_s`` and append ``(kind, stage, micro-batch, start, end)``
    to ``self.timer.actions`` (``time.perf_counter`` seconds; kind ``F`` forward, ``B`` full backward, ``I``
    input-gradient pass, ``W`` weight-gradient pass): the busy time and timeline of a step, for the bubble
    benchmark."""
    from torch.distributed import pipelining

    class TimedPipelineStage(pipelining.PipelineStage):
        timer: Any = None

        def _timed(self, kind: str, chunk: int, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(chunk, *args, **kwargs)
            finally:
                end = time.perf_counter()
                self.timer.busy_s += end - start
                self.timer.actions.append((kind, self.stage_index, chunk, start, end))

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("F", fwd_chunk_id, super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            # torch's signature: (bwd_chunk_id, loss=None, full_backward=True, last_backward=False)
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return self._timed("B" if full else "I", bwd_chunk_id, super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("W", bwd_chunk_id, super().backward_weight_one_chunk, *args, **kwargs)

    return TimedPipelineStage


# ---- the runtime -----------------------------------------------------------------------------
def _looped_bfs() -> type:
    from torch.distributed.pipelining import ScheduleLoopedBFS

    return ScheduleLoopedBFS


class VForwardOnly(_looped_bfs()):  # type: ignore[misc]
    """The forwards of every micro-batch over stages placed in a V (rank ``r``: stages ``r``, ``2·pp - 1 - r``).

    ``ScheduleZBVZeroBubble.eval``/``ScheduleDualPipeV.eval`` run their whole order with the backward off, and
    a backward action's local hand-over between the two middle stages (both on the last rank) asserts a
    backward (torch 2.13: "can't steal_bwd_input if this stage doesn't have backward"). This is LoopedBFS's
    order (every forward of the rank's first stage, then of its second) on the V's stages; torch infers the
    stage-to-rank map from the actions and checks that each stage has its backwards, which ``eval`` must
    skip: they are replaced by a no-op (their receives, empty without a backward, are dropped).
    """

    def __init__(self, stages: list[Any], n_microbatches: int, **kwargs: Any) -> None:
        from torch.distributed.pipelining.schedules import FULL_BACKWARD

        super().__init__(stages, n_microbatches, **kwargs)
        self.register_custom_function(FULL_BACKWARD, self._skip_backward)

    def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
        pp = self.pp_group_size
        v_stages = stages_of_rank(rank, pp, 2, "v")
        ops = super()._calculate_single_rank_operations(rank)  # stages rank and rank + pp: local 0 and 1
        return [None if op is None else op._replace(stage_index=v_stages[(op.stage_index - rank) // pp]) for op in ops]

    def _skip_backward(self, action: Any, ctx: Any) -> None:
        self.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)


def schedule_class(schedule: str, train: bool) -> type:
    """The ``torch.distributed.pipelining`` class running ``pipeline_schedule=schedule``.

    Forward only (``train=False``), every order computes the same: the fill-drain schedules take any
    micro-batch count (GPipe for one stage per rank, LoopedBFS for a loop, ``VForwardOnly`` for a V: the V
    classes' own ``eval`` fails in torch 2.13, running their backward actions' local hand-over).
    """
    from torch.distributed import pipelining

    facts = SCHEDULES[schedule]
    if not train and facts.forward_only_class == VForwardOnly.__name__:
        return VForwardOnly
    return getattr(pipelining, facts.torch_class if train else facts.forward_only_class)


class Pipeline:
    """This rank's stages and the schedules that run them (one per batch shape and mode).

    Args:
        stages: This rank's stage modules (``PipelineStages.stage``), in stage order.
        stage_indices: Their indices in the pipeline.
        meshes: The meshes (``ParallelDims.build_mesh``): the pipeline, data-parallel and tensor-parallel ones are read.
        config: The options (schedule, micro-batches, sequence parallelism, ``param_dtype``: the
            activations' dtype between stages).
        dim: Width of the hidden states sent between stages.
        split: The number of blocks of every stage, in stage order.
        check_inputs: Called with ``(tokens, labels, position_ids)`` before a step (the model's own input checks).
        aux_loss: A mixture of experts' auxiliary loss, its hooks attached to ``stages``
            (``parallel.expert.PipelineAuxiliaryLoss``): turned on for the training steps, whose stages then pass the
            routing statistics beside the hidden states.
    """

    def __init__(
        self,
        stages: list[nn.Module],
        stage_indices: list[int],
        meshes: ParallelMeshes,
        config: ParallelConfig,
        dim: int,
        split: Optional[list[int]] = None,
        check_inputs: Optional[Callable[..., None]] = None,
        aux_loss: Optional[PipelineAuxiliaryLoss] = None,
    ) -> None:
        self.stages = stages
        self.aux_loss = aux_loss
        #: The last training step's auxiliary loss (``coef`` × its micro-batches' mean), on every pipeline rank;
        #: ``None`` without ``aux_loss``.
        self.last_aux_loss: Optional[torch.Tensor] = None
        self.split = list(split or [])
        self.check_inputs = check_inputs
        self.stage_indices = stage_indices
        self.meshes = meshes
        self.config = config
        self.dim = dim
        self.num_stages = config.num_pipeline_stages
        self.pp_group = meshes.get(PP_DIM).get_group()
        self.dp_group = meshes.get(DP_DIM).get_group()
        self.has_first = 0 in stage_indices
        self.has_last = self.num_stages - 1 in stage_indices
        tp = meshes.size(TP_DIM)
        self.sequence_shards = tp if config.sequence_parallel and tp > 1 else 1
        self._schedules: dict[tuple, Any] = {}
        self._scale = torch.ones(())
        self._raw_losses: list[torch.Tensor] = []
        #: ``objective_step``'s loss of a micro-batch, while it runs.
        self._objective: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
        #: Wall time of this rank's forward/backward calls in the last step (``measure=True``): the bubble.
        self.busy_s = 0.0
        #: ``(kind, stage, micro-batch, start, end)`` of each of those calls in the last step (``timed_stage_class``).
        self.actions: list[tuple[str, int, int, float, float]] = []
        self.measure = False

    @property
    def schedules(self) -> dict[tuple, Any]:
        """The schedules built so far, by ``(batch size, sequence length, micro-batches, training, per token,
        outputs)``."""
        return dict(self._schedules)

    @property
    def last_stage_rank(self) -> int:
        """The global rank holding the last stage in this rank's pipeline."""
        import torch.distributed as dist

        pp = dist.get_world_size(self.pp_group)
        last = rank_of_stage(self.num_stages - 1, pp, self.config.pipeline_placement)
        return dist.get_global_rank(self.pp_group, last)

    def microbatches(self, batch_size: int, train: bool) -> int:
        """The micro-batch count for a batch: the configured one (or one sequence each), checked; in
        evaluation the largest count up to it that divides the batch (a last, smaller batch of a
        validation set), since the forward-only schedules take any count."""
        count = self.config.pipeline_microbatches or batch_size
        if not train:
            return max(m for m in range(1, min(count, batch_size) + 1) if batch_size % m == 0)
        problems = self.config.microbatch_problems(count, batch_size, schedule_checks=self.config.pipeline_microbatches is None)
        if problems:
            raise ParallelConfigError(problems)
        return count

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._objective is not None:  # the last stage gave each token's log-probability: the objective's loss
            output = self._objective(output, target)
        self._raw_losses.append(output.detach())
        return output * self._scale

    def _build(self, batch_size: int, seq_len: int, microbatches: int, device: torch.device, train: bool,
               per_token: bool = False, outputs: bool = False) -> Any:
        from torch.distributed import pipelining

        mb = batch_size // microbatches
        act_dtype = self.config.param_dtype or torch.float32
        # requires_grad: static metadata carries it, and a stage differentiates only inputs that require it.
        hidden = torch.empty((mb, seq_len // self.sequence_shards, self.dim), dtype=act_dtype, device="meta",
                             requires_grad=True)
        tokens = torch.empty((mb, seq_len), dtype=torch.long, device="meta")
        loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
        # Under the auxiliary loss a training step's stages pass each micro-batch's routing statistics beside the
        # hidden states (PipelineAuxiliaryLoss); their gradient brings the global counts back.
        carry = ()
        if train and self.aux_loss is not None:
            carry = (torch.empty((self.aux_loss.carry_size,), dtype=torch.float32, device="meta", requires_grad=True),)
        if per_token:  # the last stage gives each position's log-probability of its label (``per_token=True``)
            loss = torch.empty((mb, seq_len), dtype=torch.float32, device="meta", requires_grad=train)
        # measure: each stage adds the wall time of its passes to ``busy_s`` (a subclass, not patched methods).
        stage_class = timed_stage_class() if self.measure else pipelining.PipelineStage
        stages = []
        for module, index in zip(self.stages, self.stage_indices):
            stages.append(
                stage_class(
                    _ReduceEveryMicroBatch(module) if self.config.reduce_every_micro_batch else module,
                    index,
                    self.num_stages,
                    device,
                    input_args=(tokens,) if index == 0 else (hidden, *carry),
                    output_args=(loss,) if index == self.num_stages - 1 else (hidden, *carry),
                    group=self.pp_group,
                )
            )
        # outputs: the last stage's outputs are what the step is for (a reference's log-probabilities): no loss
        kwargs = dict(n_microbatches=microbatches, loss_fn=None if outputs else self._loss_fn, scale_grads=False)
        cls = self.schedule_class(train)
        single = SCHEDULES[self.config.pipeline_schedule].stages == "single"
        if self.measure:
            for stage in stages:
                stage.timer = self
        return cls(stages[0] if single else stages, **kwargs)

    def schedule_class(self, train: bool) -> type:
        """The ``torch.distributed.pipelining`` schedule class a training (or forward-only) step runs."""
        return schedule_class(self.config.pipeline_schedule, train)

    def train_step(
        self, tokens: torch.Tensor, labels: torch.Tensor, grad_scale: float = 1.0,
        position_ids: Optional[torch.Tensor] = None, step_tokens: Optional[torch.Tensor] = None, accumulate: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step of this data-parallel rank's batch: the forward and backward of every micro-batch.

        The gradients of ``grad_scale`` × the global-batch mean loss (× the data-parallel size, as without a
        pipeline) are *added* to the parameters' gradients: zero them after each optimizer step, and pass
        ``grad_scale=1 / n`` to accumulate over ``n`` batches. Nothing else runs a backward. ``position_ids``
        (packed documents kept apart, ``TextDataModule(document_mask=True)``) reach every stage. ``step_tokens`` and
        ``accumulate``: the loss is the optimizer step's mean over all its target tokens
        (``normalize_by_global_tokens``).

        Returns:
            ``(loss, global_mean, global_tokens)`` as ``normalize_by_global_tokens`` (``loss`` without the
            ``grad_scale``), detached: the gradients are already computed.
        """
        step = (step_tokens.to(labels.device), accumulate) if step_tokens is not None else None
        total = self._run(tokens, labels, True, grad_scale, position_ids, step)
        return normalize_by_global_tokens(total, labels, self.meshes)

    def eval_step(
        self, tokens: torch.Tensor, labels: torch.Tensor, position_ids: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forwards only (validation, test): ``(loss, global_mean, global_tokens)`` as ``train_step``."""
        with torch.no_grad():
            total = self._run(tokens, labels, False, 1.0, position_ids)
        return normalize_by_global_tokens(total, labels, self.meshes)

    def token_log_probs(self, tokens: torch.Tensor, labels: torch.Tensor,
                        position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The forwards only, the last stage giving each position's log-probability of its label (``(B, T)``, 0 where
        ignored: a preference loss's reference), on the rank holding the last stage; ``None`` on the others."""
        with torch.no_grad():
            return self._run(tokens, labels, False, 1.0, position_ids, per_token=True)

    def objective_step(
        self, objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokens: torch.Tensor,
        labels: torch.Tensor, target: torch.Tensor, train: bool, grad_scale: float = 1.0,
        position_ids: Optional[torch.Tensor] = None,
    ) -> None:
        """A step whose last stage gives each token's log-probability of its label and whose loss is
        ``objective(token_log_probs, target)`` per micro-batch (``target``: ``(B, …)``, split into micro-batches as
        the tokens are; the objective normalizes its loss and keeps what it reports). ``train``: forward and backward
        of every micro-batch, the gradients of ``grad_scale`` × the losses added to the parameters', as
        ``train_step``; else the forwards only."""
        self._objective = objective
        try:
            with nullcontext() if train else torch.no_grad():
                self._run(tokens, labels, train, grad_scale, position_ids, per_token=True, target=target)
        finally:
            self._objective = None

    def _run(self, tokens: torch.Tensor, labels: torch.Tensor, train: bool, grad_scale: float,
             position_ids: Optional[torch.Tensor], step: Optional[tuple[torch.Tensor, int]] = None,
             per_token: bool = False, target: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """One schedule step over this rank's batch: the summed loss (detached), on every pipeline rank; with
        ``per_token`` and no objective, each token's log-probability on the last stage's rank (``None`` elsewhere);
        with an objective, ``None``."""
        if self.check_inputs is not None:
            self.check_inputs(tokens, labels, position_ids)
        batch_size, seq_len = tokens.shape
        microbatches = self.microbatches(batch_size, train)
        # Checked on every rank before any collective (the first stage's own check would leave the
        # other stages waiting for its activations).
        check_sequence_length(seq_len, self.sequence_shards)
        if per_token:  # an objective normalizes its own loss (none without one: a forward for the outputs)
            self._scale = torch.tensor(float(grad_scale))
        elif step is None:
            global_tokens, dp_size = count_global_tokens(labels, self.meshes)
            self._scale = token_scale(global_tokens, dp_size) * grad_scale
        else:  # every token of the optimizer step weighs alike (normalize_by_global_tokens)
            step_global, dp_size = count_step_tokens(step[0], self.meshes)
            self._scale = token_scale(step_global, dp_size) * step[1] * grad_scale
        # The stages' buffers are sized by the micro-batch shape (static metadata, no shape inference
        # pass): one schedule per shape and mode, e.g. training, validation, a last smaller batch.
        outputs = per_token and self._objective is None
        key = (batch_size, seq_len, microbatches, train, per_token, outputs)
        if key not in self._schedules:
            self._schedules[key] = self._build(batch_size, seq_len, microbatches, tokens.device, train, per_token,
                                               outputs)
        schedule = self._schedules[key]
        for stage in self.stages:
            stage.seq_len = seq_len
        self._raw_losses = []
        self.busy_s, self.actions = 0.0, []
        args = (tokens,) if self.has_first else ()
        kwargs: dict[str, Any] = {"labels": labels} if self.has_last else {}
        if position_ids is not None:  # step() gives keyword arguments (per micro-batch) to every stage of the rank
            kwargs["position_ids"] = position_ids
        if per_token:
            kwargs["per_token"] = True  # not a tensor: every micro-batch's call gets it
        target = (target if per_token else labels) if self.has_last else None
        losses: list[torch.Tensor] = []
        run = schedule.step if train else schedule.eval
        # The zero-bubble schedules run a second backward pass (the weights') over the retained graph.
        replay = replayable_backward() if SCHEDULES[self.config.pipeline_schedule].zero_bubble else nullcontext()
        aux = self.aux_loss if train else None
        if aux is not None:
            self.last_aux_loss = None
            aux.start(grad_scale, microbatches)
        try:
            with replay:
                output = run(*args, target=target, losses=None if outputs else losses, return_outputs=outputs,
                             **kwargs)
        finally:
            if aux is not None:
                aux.stop()
        if per_token:
            if aux is not None:
                self.last_aux_loss = self._from_last_stage([self._aux_mean(tokens.device)], tokens.device)[0]
            return output if outputs and self.has_last else None
        total = torch.stack(self._raw_losses).sum() if self.has_last else torch.zeros((), device=tokens.device)
        shared = [total] if aux is None else [total, self._aux_mean(tokens.device)]
        shared = self._from_last_stage(shared, tokens.device)  # one broadcast: the loss and the auxiliary loss
        if aux is not None:
            self.last_aux_loss = shared[1]
        return shared[0]

    def _aux_mean(self, device: torch.device) -> torch.Tensor:
        """The running step's auxiliary loss on the last stage's rank (``coef`` × its micro-batches' mean)."""
        values = self.aux_loss.values if self.aux_loss is not None else []
        return torch.stack(values).mean() if self.has_last and values else torch.zeros((), device=device)

    def _from_last_stage(self, values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """``values`` (0-dim) as the last stage's rank holds them, on every pipeline rank: one broadcast."""
        import torch.distributed as dist

        shared = torch.stack([v.detach().to(device, torch.float32).reshape(()) for v in values]).contiguous()
        dist.broadcast(shared, src=self.last_stage_rank, group=self.pp_group)
        return shared


class RefuseCall:
    """The forward pre-hook of a pipelined model: calling it raises (its blocks are spread over the pipeline ranks,
    and nothing may run a backward behind a call that looks like a forward). It names the way to step the pipeline
    it holds, and is how the deprecated ``pipeline_of`` finds it."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        raise RuntimeError(
            f"This {type(module).__name__} is split into pipeline stages (pipeline_parallel_size > 1): this rank holds"
            " some of its blocks only, so calling it cannot compute anything. Step the pipeline instead:"
            " `pipeline = fabric.strategy.pipeline` (or `trainer.strategy.pipeline`; `parallelize_model(...).pipeline`"
            " without a strategy), then `pipeline.train_step(tokens, labels, grad_scale=1 / accumulate)` (forward and"
            " backward of every micro-batch; do not call backward) or `pipeline.eval_step(tokens, labels)`."
            " LlamaLightningModule does this under the Trainer. For logits (prediction, generation) load the"
            " checkpoint with pipeline_parallel_size=1."
        )


def pipeline_of(module: nn.Module) -> Optional[Pipeline]:
    """Deprecated (0.1.0's way; removed in 0.3): the ``Pipeline`` of a pipelined model (or of the first of its
    submodules that is one), else ``None``. Use the strategy's ``pipeline`` (``fabric.strategy.pipeline``,
    ``trainer.strategy.pipeline``) or the ``Parallelized.pipeline`` that ``parallelize_model`` returns."""
    warnings.warn(
        "lightning_2d.parallel.pipeline_of(model) is deprecated and will be removed in 0.3: use the strategy's"
        " `pipeline` (fabric.strategy.pipeline, trainer.strategy.pipeline) or parallelize_model(...).pipeline",
        DeprecationWarning,
        stacklevel=2,
    )
    for sub in module.modules():
        for hook in forward_pre_hooks(sub):
            if isinstance(hook, RefuseCall):
                return hook.pipeline
    return None


def parallelize_pipeline(
    model: nn.Module,
    meshes: ParallelMeshes,
    plan: ParallelPlan,
    config: ParallelConfig,
    parallelize_stage: Callable[[nn.Module, ParallelPlan], None],
) -> Pipeline:
    """Split ``model`` (meta device) into this rank's stages and parallelize each; returns the ``Pipeline``
    that runs them (``parallelize_model`` hands it on in its ``Parallelized`` result).

    Args:
        model: The model, not yet parallelized, of a family whose plan has ``pipeline_stages``.
        meshes: The meshes, the pipeline dimension above 1.
        plan: The model's plan (names relative to the model).
        config: The options.
        parallelize_stage: ``(stage, stage_plan) ->`` TP/SP, AC, compile and FSDP2 on one stage.
    """
    family = plan.pipeline_stages
    if family is None:
        raise ParallelConfigError([
            f"pipeline_parallel_size > 1 needs a model the library can split into stages; the plan of"
            f" {type(model).__name__} has no pipeline_stages (e.g. a Hugging Face decoder). Use LlamaLightningModule"
            " (or a lightning_2d Transformer), or pipeline_parallel_size=1"
        ])
    family.check(model)
    pp_mesh = meshes.get(PP_DIM)
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    split = pipeline_split(model, config, family)
    indices = stages_of_rank(pp_rank, pp_size, config.stages_per_rank, config.pipeline_placement)
    num_stages = len(split)
    mine = {name for i in indices for name in split[i]}
    dim = family.hidden_size(model)
    stages = [family.stage(model, split[i], first=i == 0, last=i == num_stages - 1) for i in indices]
    family.prune(model, mine, first=0 in indices, last=num_stages - 1 in indices)
    for stage in stages:
        parallelize_stage(stage, stage_plan(stage, plan))
    aux_loss = None
    if plan.aux_loss_coef is not None and plan.num_experts:  # a mixture of experts trained with transformers' loss
        aux_loss = PipelineAuxiliaryLoss(plan.num_experts, plan.aux_loss_coef, meshes)
        for stage, i in zip(stages, indices):
            aux_loss.attach(stage, first=i == 0, last=i == num_stages - 1)
    pipeline = Pipeline(stages, indices, meshes, config, dim=dim, split=[len(s) for s in split],
                        check_inputs=getattr(model, "check_inputs", None), aux_loss=aux_loss)
    # The stages are not submodules of the model (their modules are): the model's parameters,
    # state_dict and checkpoints keep the single-device names. The model keeps its class.
    model.register_forward_pre_hook(RefuseCall(pipeline), with_kwargs=True)
    return pipeline
