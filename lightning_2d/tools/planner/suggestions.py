"""What would make a layout that does not fit fit: each change with its estimated need (``suggestions_for``).

Variants of the layout (full activation checkpointing, a larger tensor-parallel size, a deeper pipeline, no
replica groups, smaller micro-batches, more nodes) are estimated by scaling the report's states and FSDP
buffers and re-running the activation model, not by planning each one again.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

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
    """
    memory = report.device_memory_bytes
    states = report.param_bytes + report.grad_bytes + report.optimizer_bytes
    accumulation = report.accumulation_bytes
    fixed = report.buffer_bytes + report.reserve_bytes
    nodes, devices = report.num_nodes, report.devices_per_node
    ac, option = config.activation_checkpointing, config.selective_ac_option
    pp, per_rank = dims.pp, config.stages_per_rank

    def microbatches_for(size: int) -> int:
        return config.pipeline_microbatches or size * per_rank

    @functools.lru_cache(maxsize=None)  # fewest_nodes asks for the same activations over and over
    def activation(ac_mode: str, tp: int, micro: int, pp_size: int, loss_parallel: bool = config.loss_parallel) -> int:
        model = ActivationModel.for_layout(
            args, tp=tp, sequence_parallel=config.sequence_parallel, seq_len=seq_len, micro_batch_size=micro,
            act_dtype=config.param_dtype, loss_chunk_size=activations.loss_chunk_size, cp=activations.cp,
            loss_parallel=loss_parallel,
        )
        mode_option = option if ac_mode == ac else "op"
        if pipeline is None:
            return model.estimate(ac_mode, mode_option).peak
        split, rank, m = pipeline
        ranks = [rank]
        if pp_size != pp:  # another split: its fullest rank
            assert isinstance(args, ModelArgs)  # only our Llama splits into stages
            split, ranks = _balanced_split_of(args, pp_size * per_rank), list(range(pp_size))
            m = microbatches_for(pp_size)
        return max(
            pipeline_activation_estimate(
                model, split, pp=pp_size, pp_rank=k, schedule=config.pipeline_schedule, microbatches=m,
                activation_checkpointing=ac_mode, selective_ac_option=mode_option,
            ).peak
            for k in ranks
        )

    def need(ac_mode: str = ac, tp: int = dims.tp, n_nodes: int = nodes, micro: int = micro_batch_size,
             replicas: int = dims.dp_replicate, pp_size: int = pp, loss_parallel: bool = config.loss_parallel) -> float:
        # states ∝ (model / pp) / (dp_shard × tp) = model × replicas / world, whatever the pipeline
        shards_before = nodes * devices // dims.dp_replicate
        shards_after = n_nodes * devices // replicas
        # Under a pipeline the gathered units and their gradients are a whole stage's: 1 / pp. The
        # reduce-scatter buffer is one unit's (a block's) whatever the pipeline.
        staged = report.all_gather_bytes + accumulation
        scaled_buffers = (staged * pp / pp_size + report.reduce_scatter_bytes) * dims.tp / tp
        activations_needed = activation(ac_mode, tp, micro, pp_size, loss_parallel)
        return states * shards_before / shards_after + scaled_buffers + activations_needed + fixed

    def fits(total: float) -> str:
        return f"needs ~{total / GIB:.1f} GiB" + (" (fits)" if total <= memory else "")

    def layout_ok(n_nodes: int, tp: int, pp_size: int = pp, replicas: int = dims.dp_replicate) -> bool:
        world = n_nodes * devices
        return world % (tp * pp_size) == 0 and (world // (tp * pp_size)) % replicas == 0

    def fewest_nodes(ac_mode: str, tp: int) -> Optional[int]:
        for n in range(nodes + 1, 64 * nodes + 1024):
            if layout_ok(n, tp) and need(ac_mode, tp, n) <= memory:
                return n
        return None

    out: list[str] = []
    if accumulation and pipeline is None:
        out.append(f"--reduce-every-micro-batch (reduce-scatter after each micro-batch): {fits(need() - accumulation)}")
    elif accumulation:  # under a pipeline it also frees the gathered units between micro-batches
        # What stays gathered then: about a unit and the next one (the largest unit's, in param_dtype).
        pd, rd = config.param_dtype.itemsize, config.reduce_dtype.itemsize
        freed = accumulation + report.all_gather_bytes - 2 * report.reduce_scatter_bytes * pd // (pd + rd)
        out.append(f"--reduce-every-micro-batch (reshard and reduce-scatter after each pipeline micro-batch): "
                   f"{fits(need() - freed)}")
    if not activations.architecture.fused_loss and dims.tp > 1 and not config.loss_parallel:
        # The logits (and their gradients) of the whole vocabulary on every tensor-parallel rank otherwise.
        out.append(f"--loss-parallel (the loss on vocabulary-sharded logits): {fits(need(loss_parallel=True))}")
    if ac != "full":
        out.append(f"--activation-checkpointing full: {fits(need('full'))}")
    valid_tps = [
        d for d in range(dims.tp + 1, devices + 1)
        if devices % d == 0 and args.n_heads % d == 0 and args.kv_heads % d == 0
        and not (config.sequence_parallel and seq_len % d) and layout_ok(nodes, d)
    ]
    if valid_tps:
        out.append(f"--tensor-parallel-size {valid_tps[0]}: {fits(need(tp=valid_tps[0]))}")
    if pipeline is not None and config.pipeline_layers_per_stage is None:
        # A deeper pipeline: each rank's stages (gathered with their gradients) shrink.
        def schedule_ok(size: int) -> bool:  # the library's rules for the micro-batch count
            try:
                variant = replace(config, pipeline_parallel_size=size)
            except ParallelConfigError:
                return False
            return not variant.microbatch_problems(microbatches_for(size), None)

        deeper = range(pp + 1, args.n_layers // per_rank + 1)
        sizes = [q for q in deeper if layout_ok(nodes, dims.tp, q) and schedule_ok(q)][:8]
        # The smallest that fits, else the one needing least, if it needs less than now: more stages
        # also mean more micro-batches in flight on the first ranks, which may outweigh them.
        needs = {q: need(pp_size=q) for q in sizes}
        fitting = [q for q in sizes if needs[q] <= memory]
        best = fitting[0] if fitting else min(sizes, key=needs.__getitem__, default=None)
        if best is not None and needs[best] < need():
            dp = nodes * devices // (best * dims.tp)
            out.append(f"--pipeline-parallel-size {best} (data parallel {dp}): {fits(needs[best])}")
    if dims.dp_replicate > 1:
        out.append(
            f"--data-parallel-replicate-size 1 (shard over all {dims.dp} data-parallel ranks instead of"
            f" {dims.dp_shard}): {fits(need(replicas=1))}"
        )
    if micro_batch_size > 1:
        out.append(f"--micro-batch-size 1 (accumulate gradients for the same global batch): {fits(need(micro=1))}")
    more = fewest_nodes(ac, dims.tp)
    if more is not None:
        out.append(f"--num-nodes {more} ({more * devices} devices): {fits(need(n_nodes=more))}")
    if not any(line.endswith("(fits)") for line in out):
        # Nothing alone is enough: all three levers together.
        tp = valid_tps[-1] if valid_tps else dims.tp
        flags = ("--activation-checkpointing full " if ac != "full" else "") + (
            f"--tensor-parallel-size {tp} " if tp != dims.tp else "")
        more = fewest_nodes("full", tp)
        if more is not None:
            out.append(f"{flags}--num-nodes {more} ({more * devices} devices): {fits(need('full', tp, more))}")
        else:
            rest = need("full", tp, 10**6) - fixed
            out.append(
                f"{flags.strip() or 'this layout'}: activations and FSDP buffers alone take ~{rest / GIB:.1f} GiB,"
                " which no number of nodes removes: shorten --seq-len or lower --micro-batch-size"
            )
    return out


def _balanced_split_of(args: ModelArgs, stages: int) -> list[int]:
    """``pipeline_split``'s balanced split computed from the shapes, without a model: the same parameter
    counts (``block_costs_of``) given to the same ``balanced_split``."""
    d, kv_dim = args.dim, args.kv_heads * args.head_dim
    block = float(d * (2 * d + 2 * kv_dim) + 3 * d * args.ffn_hidden_dim + 2 * d)
    head = float(args.vocab_size * d + d)  # final norm + output
    return balanced_split([block] * args.n_layers, stages, last_extra=head, first_extra=args.vocab_size * d * 0.1)
