"""What would make a layout that does not fit fit: each change with its estimated need (``suggestions_for``).

Variants of the layout (full activation checkpointing, a larger tensor-parallel size, a deeper pipeline, no
replica groups, smaller micro-batches, more nodes) are estimated by scaling the report's states and FSDP
buffers and re-running the activation model, not by planning each one again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.pipeline import balanced_split
from lightning_2d.tools.planner.activations import ActivationModel
from lightning_2d.tools.planner.models import PlannedArgs
from lightning_2d.tools.planner.report import GIB, PlanReport
from lightning_2d.tools.planner.schedules import pipeline_activation_estimate


def suggestions_for(
    report: PlanReport,
    args: PlannedArgs,
    dims: ParallelDims,
    config: ParallelConfig,
    activations: ActivationModel,
    seq_len: int,
    micro_batch_size: int,
    pipeline: Optional[tuple[list[int], int, int]] = None,
) -> list[str]:
    """Changes that bring the estimate under the device memory, each with its (approximate) need.

    A variant's states (parameters, gradients, optimizer) scale with ``1 / (world / replicas)`` (the
    model is split over pipeline × FSDP × TP ranks), its FSDP buffers with ``1 / tensor_parallel_size``,
    and its activations are re-estimated by the activation model.

    Under a pipeline (``pipeline``: the split, the reported pipeline rank and the micro-batches) the
    activations are those of the reported rank's stages; the FSDP buffers (the rank's stages gathered
    and their unsharded gradients) also scale with ``1 / pipeline_parallel_size``, and a deeper
    pipeline is tried (the balanced split ``pipeline_split`` makes, its fullest rank's activations).

    Each change alone is tried in turn (``_ONE_CHANGE``); when none of them fits, all the levers together.
    """
    variants = _Variants(report, args, dims, config, activations, seq_len, micro_batch_size, pipeline)
    out = [line for suggest in _ONE_CHANGE for line in suggest(variants)]
    if not any(line.endswith("(fits)") for line in out):
        out += _all_levers(variants)
    return out


@dataclass(frozen=True)
class _Layout:
    """What a suggestion may change of the reported layout."""

    ac_mode: str
    tp: int
    n_nodes: int
    micro: int
    replicas: int
    pp_size: int
    loss_parallel: bool


class _Variants:
    """The reported layout and its variants' estimated needs (see ``suggestions_for``)."""

    def __init__(self, report: PlanReport, args: PlannedArgs, dims: ParallelDims, config: ParallelConfig,
                 activations: ActivationModel, seq_len: int, micro_batch_size: int,
                 pipeline: Optional[tuple[list[int], int, int]]) -> None:
        self.report, self.args, self.dims, self.config = report, args, dims, config
        self.activations, self.seq_len, self.micro_batch_size, self.pipeline = (
            activations, seq_len, micro_batch_size, pipeline)
        self.memory = report.device_memory_bytes
        # A preference loss's frozen reference copy (and a teacher) is sharded as the trained model: it scales as its
        # states do.
        self.states = (report.param_bytes + report.grad_bytes + report.optimizer_bytes + report.reference_bytes
                       + report.teacher_bytes)
        self.fixed = report.buffer_bytes + report.reserve_bytes
        self.nodes, self.devices = report.num_nodes, report.devices_per_node
        self.ac, self.option = config.activation_checkpointing, config.selective_ac_option
        self.pp, self.per_rank = dims.pp, config.stages_per_rank
        self.layout = _Layout(ac_mode=self.ac, tp=dims.tp, n_nodes=self.nodes, micro=micro_batch_size,
                              replicas=dims.dp_replicate, pp_size=self.pp, loss_parallel=config.loss_parallel)
        self._peaks: dict[tuple[str, int, int, int, bool], int] = {}  # fewest_nodes asks for the same over and over

    def microbatches_for(self, size: int) -> int:
        """The pipeline micro-batches per step of a ``size``-rank pipeline."""
        return self.config.pipeline_microbatches or size * self.per_rank

    def activation(self, ac_mode: str, tp: int, micro: int, pp_size: int, loss_parallel: bool) -> int:
        """A variant's activation peak (under a pipeline its reported rank's, or a deeper one's fullest rank's)."""
        key = (ac_mode, tp, micro, pp_size, loss_parallel)
        if key not in self._peaks:
            self._peaks[key] = self._activation(*key)
        return self._peaks[key]

    def _activation(self, ac_mode: str, tp: int, micro: int, pp_size: int, loss_parallel: bool) -> int:
        config, activations = self.config, self.activations
        model = ActivationModel.for_layout(
            self.args, tp=tp, sequence_parallel=config.sequence_parallel, seq_len=self.seq_len, micro_batch_size=micro,
            act_dtype=config.param_dtype, loss_chunk_size=activations.loss_chunk_size, cp=activations.cp,
            loss_parallel=loss_parallel, reference_forward=activations.reference_forward,
        )
        if activations.teacher_dim:  # the teacher's forward scaled with the tokens and the tensor-parallel shards
            model = replace(model, teacher_dim=activations.teacher_dim,
                            distillation_buffers=activations.distillation_buffers,
                            distillation_chunk=activations.distillation_chunk,
                            teacher_forward=activations.teacher_forward * model.tokens * activations.tp
                            // (activations.tokens * tp))
        mode_option = self.option if ac_mode == self.ac else "op"
        if self.pipeline is None:
            return model.estimate(ac_mode, mode_option).peak
        split, rank, m = self.pipeline
        ranks = [rank]
        if pp_size != self.pp:  # another split: its fullest rank
            assert isinstance(self.args, ModelArgs)  # only our Llama splits into stages
            split, ranks = _balanced_split_of(self.args, pp_size * self.per_rank), list(range(pp_size))
            m = self.microbatches_for(pp_size)
        return max(
            pipeline_activation_estimate(
                model, split, pp=pp_size, pp_rank=k, schedule=config.pipeline_schedule, microbatches=m,
                activation_checkpointing=ac_mode, selective_ac_option=mode_option,
            ).peak
            for k in ranks
        )

    def need(self, **changes: Any) -> float:
        """The estimated need of the reported layout with ``changes`` (``_Layout``'s fields)."""
        v, report, dims = replace(self.layout, **changes), self.report, self.dims
        # states ∝ (model / pp) / (dp_shard × tp) = model × replicas / world, whatever the pipeline
        shards_before = self.nodes * self.devices // dims.dp_replicate
        shards_after = v.n_nodes * self.devices // v.replicas
        # Under a pipeline the gathered units and their gradients are a whole stage's: 1 / pp. The
        # reduce-scatter buffer is one unit's (a block's) whatever the pipeline.
        staged = report.all_gather_bytes + report.accumulation_bytes
        scaled_buffers = (staged * self.pp / v.pp_size + report.reduce_scatter_bytes) * dims.tp / v.tp
        activations_needed = self.activation(v.ac_mode, v.tp, v.micro, v.pp_size, v.loss_parallel)
        return self.states * shards_before / shards_after + scaled_buffers + activations_needed + self.fixed

    def fits(self, total: float) -> str:
        """A suggestion's estimate, as it reads."""
        return f"needs ~{total / GIB:.1f} GiB" + (" (fits)" if total <= self.memory else "")

    def layout_ok(self, n_nodes: int, tp: int, pp_size: Optional[int] = None, replicas: Optional[int] = None) -> bool:
        """Whether the world of ``n_nodes`` splits into the sizes (the reported pipeline and replicas by default)."""
        pp_size = self.pp if pp_size is None else pp_size
        replicas = self.dims.dp_replicate if replicas is None else replicas
        world = n_nodes * self.devices
        return world % (tp * pp_size) == 0 and (world // (tp * pp_size)) % replicas == 0

    def fewest_nodes(self, ac_mode: str, tp: int) -> Optional[int]:
        """The fewest nodes, more than now, on which the layout with ``ac_mode`` and ``tp`` fits (``None``: none)."""
        for n in range(self.nodes + 1, 64 * self.nodes + 1024):
            if self.layout_ok(n, tp) and self.need(ac_mode=ac_mode, tp=tp, n_nodes=n) <= self.memory:
                return n
        return None

    @functools.cached_property
    def valid_tps(self) -> list[int]:
        """The tensor-parallel sizes above the reported one that the model and the world allow."""
        args, devices = self.args, self.devices
        return [
            d for d in range(self.dims.tp + 1, devices + 1)
            if devices % d == 0 and args.n_heads % d == 0 and args.kv_heads % d == 0
            and not (self.config.sequence_parallel and self.seq_len % d) and self.layout_ok(self.nodes, d)
        ]


def _reduce_every_micro_batch(v: _Variants) -> list[str]:
    accumulation = v.report.accumulation_bytes
    if not accumulation:
        return []
    if v.pipeline is None:
        return [f"--reduce-every-micro-batch (reduce-scatter after each micro-batch): "
                f"{v.fits(v.need() - accumulation)}"]
    # Under a pipeline it also frees the gathered units between micro-batches. What stays gathered then: about a
    # unit and the next one (the largest unit's, in param_dtype).
    pd, rd = v.config.param_dtype.itemsize, v.config.reduce_dtype.itemsize
    freed = accumulation + v.report.all_gather_bytes - 2 * v.report.reduce_scatter_bytes * pd // (pd + rd)
    return [f"--reduce-every-micro-batch (reshard and reduce-scatter after each pipeline micro-batch): "
            f"{v.fits(v.need() - freed)}"]


def _loss_parallel(v: _Variants) -> list[str]:
    if v.activations.architecture.fused_loss or v.dims.tp <= 1 or v.config.loss_parallel:
        return []
    # The logits (and their gradients) of the whole vocabulary on every tensor-parallel rank otherwise.
    return [f"--loss-parallel (the loss on vocabulary-sharded logits): {v.fits(v.need(loss_parallel=True))}"]


def _full_checkpointing(v: _Variants) -> list[str]:
    return [] if v.ac == "full" else [f"--activation-checkpointing full: {v.fits(v.need(ac_mode='full'))}"]


def _larger_tensor_parallel(v: _Variants) -> list[str]:
    if not v.valid_tps:
        return []
    return [f"--tensor-parallel-size {v.valid_tps[0]}: {v.fits(v.need(tp=v.valid_tps[0]))}"]


def _deeper_pipeline(v: _Variants) -> list[str]:
    """A deeper pipeline: each rank's stages (gathered with their gradients) shrink."""
    if v.pipeline is None or v.config.pipeline_layers_per_stage is not None:
        return []

    def schedule_ok(size: int) -> bool:  # the library's rules for the micro-batch count
        try:
            variant = replace(v.config, pipeline_parallel_size=size)
        except ParallelConfigError:
            return False
        return not variant.microbatch_problems(v.microbatches_for(size), None)

    deeper = range(v.pp + 1, v.args.n_layers // v.per_rank + 1)
    sizes = [q for q in deeper if v.layout_ok(v.nodes, v.dims.tp, q) and schedule_ok(q)][:8]
    # The smallest that fits, else the one needing least, if it needs less than now: more stages
    # also mean more micro-batches in flight on the first ranks, which may outweigh them.
    needs = {q: v.need(pp_size=q) for q in sizes}
    fitting = [q for q in sizes if needs[q] <= v.memory]
    best = fitting[0] if fitting else min(sizes, key=needs.__getitem__, default=None)
    if best is None or not needs[best] < v.need():
        return []
    dp = v.nodes * v.devices // (best * v.dims.tp)
    return [f"--pipeline-parallel-size {best} (data parallel {dp}): {v.fits(needs[best])}"]


def _no_replicas(v: _Variants) -> list[str]:
    if v.dims.dp_replicate <= 1:
        return []
    return [
        f"--data-parallel-replicate-size 1 (shard over all {v.dims.dp} data-parallel ranks instead of"
        f" {v.dims.dp_shard}): {v.fits(v.need(replicas=1))}"
    ]


def _smaller_micro_batches(v: _Variants) -> list[str]:
    if v.micro_batch_size <= 1:
        return []
    return [f"--micro-batch-size 1 (accumulate gradients for the same global batch): {v.fits(v.need(micro=1))}"]


def _more_nodes(v: _Variants) -> list[str]:
    more = v.fewest_nodes(v.ac, v.dims.tp)
    if more is None:
        return []
    return [f"--num-nodes {more} ({more * v.devices} devices): {v.fits(v.need(n_nodes=more))}"]


#: The suggestions of one change each, in the order they are printed.
_ONE_CHANGE = (_reduce_every_micro_batch, _loss_parallel, _full_checkpointing, _larger_tensor_parallel,
               _deeper_pipeline, _no_replicas, _smaller_micro_batches, _more_nodes)


def _all_levers(v: _Variants) -> list[str]:
    """Nothing alone is enough: all three levers together (full checkpointing, the largest tensor-parallel size,
    the fewest nodes), or what no number of nodes removes."""
    tp = v.valid_tps[-1] if v.valid_tps else v.dims.tp
    flags = ("--activation-checkpointing full " if v.ac != "full" else "") + (
        f"--tensor-parallel-size {tp} " if tp != v.dims.tp else "")
    more = v.fewest_nodes("full", tp)
    if more is not None:
        return [f"{flags}--num-nodes {more} ({more * v.devices} devices): "
                f"{v.fits(v.need(ac_mode='full', tp=tp, n_nodes=more))}"]
    rest = v.need(ac_mode="full", tp=tp, n_nodes=10**6) - v.fixed
    return [
        f"{flags.strip() or 'this layout'}: activations and FSDP buffers alone take ~{rest / GIB:.1f} GiB,"
        " which no number of nodes removes: shorten --seq-len or lower --micro-batch-size"
    ]


def _balanced_split_of(args: ModelArgs, stages: int) -> list[int]:
    """``pipeline_split``'s balanced split computed from the shapes, without a model: the same parameter
    counts (``block_costs_of``) given to the same ``balanced_split``."""
    d, kv_dim = args.dim, args.kv_heads * args.head_dim
    block = float(d * (2 * d + 2 * kv_dim) + 3 * d * args.ffn_hidden_dim + 2 * d)
    head = float(args.vocab_size * d + d)  # final norm + output
    return balanced_split([block] * args.n_layers, stages, last_extra=head, first_extra=args.vocab_size * d * 0.1)
