"""``plan_run``: a layout checked and its per-device memory estimated for one training step, without GPUs.

The planner's arguments are checked together with the layout (``validate_parallel_dims``, every problem at
once), each planned rank is built in the simulated world (``world.plan_rank_shards``), and its states, FSDP buffers
(the FSDP backend's ``buffer_bytes``) and activations (``ActivationModel``, under a pipeline
``pipeline_activation_estimate``) are added up; the fullest rank decides the ``PlanReport``'s verdict, with
``suggestions`` when it does not fit. Preference tuning adds its reference model (``_Reference``): a frozen copy's
parameters, and the activations of its forward without a graph. Distillation adds its teacher (``_Teacher``): its
shards under its own plan, its all-gathers, and its forward and the fused divergence inside the student's head.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Union

import torch

from lightning_2d.models.hf_decoders import hf_moe_layers
from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.ops.distillation import DistillationConfig, DistillationConfigError
from lightning_2d.ops.lora import LoRA, LoRAConfigError
from lightning_2d.ops.preference import PreferenceConfigError, PreferenceLoss
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError, raise_if_problems
from lightning_2d.parallel.dims import ParallelDims, validate_parallel_dims
from lightning_2d.parallel.converters import ModelConverters
from lightning_2d.parallel.fsdp import FSDPUnit, reshard_after_forward_by_unit
from lightning_2d.parallel.distillation import TeacherFacts
from lightning_2d.parallel.frozen import frozen_dtype
from lightning_2d.parallel.fsdp_backend import fsdp_backend
from lightning_2d.tools.planner.activations import DEFAULT_LOSS_CHUNK_SIZE, ActivationEstimate, ActivationModel
from lightning_2d.tools.planner.models import (
    HFDecoderArgs,
    PlannedArgs,
    validation_inputs_of,
    max_seq_len_field,
    model_fields,
    plan_of,
    read_model,
)
from lightning_2d.tools.planner.report import ADAMW_STATES, GIB, PlanReport
from lightning_2d.tools.planner.schedules import pipeline_activation_estimate
from lightning_2d.tools.planner.suggestions import suggestions_for
from lightning_2d.tools.planner.world import RetryWithout, plan_rank_shards, RankShards

#: H100 / A100 80GB: the nominal size. ``torch.cuda.get_device_properties().total_memory`` reports
#: ~79.1 GiB on an H100 SXM; what the CUDA context takes out of it is part of the reserve.
DEFAULT_DEVICE_MEMORY_GIB = 80.0
#: What the estimate does not see: the CUDA context (~0.5 GiB), NCCL and cuBLAS workspaces and
#: the caching allocator's fragmentation.
DEFAULT_RESERVE_GIB = 2.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run_problems(args: Optional[PlannedArgs], seq_len: Optional[int], micro_batch_size: int, device_memory_gib: float,
                  reserve_gib: float, loss_chunk_size: Optional[int], accumulate_grad_batches: int) -> list[str]:
    """The problems of the planner's own arguments (the layout's are ``_validate``'s)."""
    problems = []
    if seq_len is None:  # neither given nor known: the model's problem is reported instead
        pass
    elif seq_len < 1:
        problems.append(f"seq_len must be a positive number of tokens, got {seq_len}")
    elif args is not None and seq_len > args.max_seq_len:
        name = max_seq_len_field(args)
        problems.append(
            f"seq_len ({seq_len}) exceeds the model's {name} ({args.max_seq_len}); use a shorter sequence or"
            f" raise it with --model-overrides '{{\"{name}\": {seq_len}}}'"
        )
    if micro_batch_size < 1:
        problems.append(f"micro_batch_size must be a positive number of sequences, got {micro_batch_size}")
    if device_memory_gib <= 0:
        problems.append(f"device_memory_gib must be positive, got {device_memory_gib}")
    if reserve_gib < 0:
        problems.append(f"reserve_gib must be >= 0, got {reserve_gib}")
    if loss_chunk_size is not None and loss_chunk_size < 1:
        problems.append(f"loss_chunk_size must be a positive number of tokens or None, got {loss_chunk_size}")
    if accumulate_grad_batches < 1:
        problems.append(f"accumulate_grad_batches must be a positive integer, got {accumulate_grad_batches}")
    return problems


def _validate(
    config: ParallelConfig,
    args: Optional[PlannedArgs],
    problems: list[str],
    *,
    num_nodes: int,
    devices: int,
    precision: str,
    seq_len: Optional[int],
    lora: Optional[LoRA] = None,
    preference: Optional[PreferenceLoss] = None,
    distillation: Optional[dict[str, Any]] = None,
) -> ParallelDims:
    """``validate_parallel_dims`` for the target (CUDA) world, with what the module training ``args`` says of itself
    (``validation_inputs_of``: ``lora``, ``preference`` …), merged with the planner's own problems."""
    if num_nodes < 1 or devices < 1:
        problems.append(f"num_nodes ({num_nodes}) and devices ({devices}) must be positive integers")
        raise ParallelConfigError(problems)
    found: list[str] = []
    try:
        dims = validate_parallel_dims(
            config,
            world_size=num_nodes * devices,
            devices_per_node=devices,
            plan=plan_of(args, config) if args is not None else None,
            precision=precision,
            seq_len=seq_len,
            num_nodes=num_nodes,
            device_type="cuda",  # the target's rules (float8, async TP), not this machine's
            device_index=None,  # no GPU to ask for its compute capability
            **{**(validation_inputs_of(args, lora, preference) if args is not None else {}), **(distillation or {})},
        )
    except ValueError as err:  # a ParallelConfigError, or the error a check declares (LoRA's)
        if not hasattr(err, "problems"):
            raise
        found = err.problems
    raise_if_problems(problems + found)
    return dims


def plan_run(
    model: Union[str, Mapping[str, Any], ModelArgs] = "llama3-8b",
    *,
    model_name: Optional[str] = None,
    num_nodes: int = 1,
    devices: int = 8,
    config: Optional[ParallelConfig] = None,
    precision: str = "bf16-mixed",
    seq_len: Optional[int] = None,
    micro_batch_size: int = 1,
    accumulate_grad_batches: int = 1,
    model_overrides: Optional[dict[str, Any]] = None,
    loss_chunk_size: Optional[int] = DEFAULT_LOSS_CHUNK_SIZE,
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    document_mask: bool = False,
    lora: Union[LoRA, Mapping[str, Any], None] = None,
    preference: Union[PreferenceLoss, Mapping[str, Any], None] = None,
    teacher: Union[str, Mapping[str, Any], ModelArgs, None] = None,
    distillation: Union[DistillationConfig, Mapping[str, Any], None] = None,
) -> PlanReport:
    """Check a layout and estimate its per-device memory for one training step, without GPUs.

    Runs the real validation, mesh and ``parallelize_model`` for rank 0 of a simulated world of
    ``num_nodes × devices`` ranks (a fake process group, torn down before returning, also on error),
    on a meta-device Llama — or the Hugging Face decoder of a ``config.json``, built by ``transformers`` and
    parallelized with the built-in plan as ``HFCausalLMModule`` trains it —, then adds the activation model
    (``ActivationModel``; for a Hugging Face decoder the same per-block formula with its family's differences,
    ``activations.Architecture``, and its unfused loss). Under pipeline
    parallelism it does so for one rank of every pipeline rank (global rank ``k·dp·tp``), whose stages
    differ, adds the schedule's micro-batches in flight (``pipeline_activation_estimate``) and reports
    the fullest one.

    Args:
        model: A ``ModelArgs`` preset (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``debug``, ...), or a
            Hugging Face Llama-family decoder (``model_type`` in ``HF_DECODER_TYPES``): the path of its
            ``config.json``, a directory holding one, or the config's fields as a mapping. An unknown name, a
            file that is not a JSON config or another ``model_type`` is a problem, found before anything is built.
            Or ``ModelArgs`` themselves (as a recipe's ``LlamaLightningModule`` resolved them).
        model_name: The report's name of the model (default: the preset, the config's path).
        num_nodes: Nodes of the target cluster.
        devices: Devices (processes) per node.
        config: The strategy's options (``ParallelConfig()``: both sizes ``"auto"``).
        precision: Trainer precision: ``32-true``, ``bf16-mixed`` (default) or ``bf16-true``.
        seq_len: Tokens per sequence; ``None``: the model's ``max_seq_len`` (a config's ``max_position_embeddings``).
        micro_batch_size: Sequences per device and micro-batch (also per pipeline micro-batch).
        accumulate_grad_batches: Micro-batches per optimizer step (the Trainer's option). Above 1, FSDP
            keeps every unit's unsharded gradients between micro-batches unless
            ``config.reduce_every_micro_batch`` (under a pipeline the schedule reduces after every batch).
        model_overrides: ``ModelArgs`` fields to change (``{"n_layers": 2}``), or the config's
            (``{"num_hidden_layers": 2}``).
        loss_chunk_size: Tokens per chunk of the fused loss (``LlamaLightningModule``'s ``loss_chunk_size``).
        device_memory_gib: Memory of one device in GiB (default 80: H100/A100 80GB; an H200 has 141 GB = 131 GiB).
        reserve_gib: GiB set aside for what the estimate does not see (CUDA context, NCCL, fragmentation).
        document_mask: The batches keep packed documents apart (``TextDataModule(document_mask=True)``): each
            micro-batch builds a FlexAttention block mask for its layers (counted; context parallelism builds one too).
        lora: Low-rank adapters as the modules' ``lora=`` adds them (``lightning_2d.LoRA`` or its dict): the frozen
            base is counted as parameters only (no gradient, optimizer state or reduce-scatter buffer), the adapters
            in full; the activations as full fine-tuning's, less what only the frozen norms' and head's weight
            gradients would need.
        preference: Preference tuning as the modules' ``preference=`` trains (``lightning_2d.PreferenceLoss`` or its
            dict): against a frozen copy (``reference`` ``"copy"``, or ``"auto"`` without ``lora``) its parameters
            are counted as the trained model's shards in their stored dtype (no gradient, optimizer state or
            reduce-scatter buffer), and its all-gathers while it runs; against the model with its adapters off
            nothing more is held; either reference adds its forward without a graph to each micro-batch (a candidate
            activation peak, ``ActivationModel.reference_forward``). A reference-free loss (``simpo``, ``orpo``) is
            planned as next-token training.
        teacher: Distillation's teacher as the modules' ``teacher=`` reads it: a preset, a Hugging Face folder (or its
            ``config.json``), ``ModelArgs``, or a dict of ``model``, ``init_from``, ``model_overrides``. Counted as a
            frozen model under its own plan on the student's meshes: its shards in the dtype FSDP computes in (no
            gradient, optimizer state or reduce-scatter buffer), its all-gathers while it runs (with the student's
            output unit gathered), and, inside the student's head, its forward without a graph and the fused
            divergence's chunk buffers (candidate activation peaks).
        distillation: How the student learns from it (``lightning_2d.DistillationConfig`` or its dict; ``None`` with
            a teacher: the defaults).

    Returns:
        The report (``as_dict()`` for JSON, ``format_report`` for the table).

    Raises:
        ParallelConfigError: every problem of the layout (and of the planner's arguments) at once.
    """
    start = time.perf_counter()
    run = _read_run(
        model, model_overrides, lora, preference, config if config is not None else ParallelConfig(),
        teacher=teacher, distillation=distillation,
        num_nodes=num_nodes,
        devices=devices, precision=precision, seq_len=seq_len, micro_batch_size=micro_batch_size,
        accumulate_grad_batches=accumulate_grad_batches, loss_chunk_size=loss_chunk_size,
        device_memory_gib=device_memory_gib, reserve_gib=reserve_gib,
    )
    # The model converters the module asks for (LoRA's adapters …), as parallelize_and_materialize makes them.
    converters = ModelConverters.of(plan_of(run.args, run.config), validation_inputs_of(run.args, run.lora))
    run, shards, notes = _plan_shards(run)
    teacher_shard = _teacher_shard(run)
    activations = _activation_model(run, document_mask, converters)
    plans = [_plan_rank(shard, k, run, activations, teacher_shard) for k, shard in enumerate(shards)]
    # The verdict is the fullest device's: under a pipeline, the pipeline rank with the largest total.
    worst = max(plans, key=lambda p: p.total)
    notes += _notes(run, converters, worst)
    verdict = _Verdict.of(worst.total, device_memory_gib, reserve_gib)
    report = _report(run, _report_name(model, model_name, model_overrides, run.args), plans, worst, verdict, notes)
    if run.teacher is not None:
        report.teacher = run.teacher_name
        report.distillation = run.distillation.loss if run.distillation is not None else None
        report.teacher_params = teacher_shard.model_numel if teacher_shard is not None else 0
    if not report.fits:
        report.suggestions = suggestions_for(
            report, run.args, run.dims, run.config, activations, run.seq_len, run.micro_batch_size,
            pipeline=(worst.shard.split, worst.pp_rank, run.microbatches) if run.dims.pp > 1 else None,
        )
    report.seconds = round(time.perf_counter() - start, 3)
    return report


@dataclass(frozen=True)
class _Run:
    """What ``plan_run`` plans, its arguments read and validated: the model, the layout and the training step."""

    args: PlannedArgs
    lora: Optional[LoRA]
    preference: Optional[PreferenceLoss]
    dims: ParallelDims
    #: The options, dtypes resolved (without compile and float8 where the meta device could not set them up).
    config: ParallelConfig
    num_nodes: int
    devices: int
    precision: str
    seq_len: int
    micro_batch_size: int
    accumulate_grad_batches: int
    loss_chunk_size: Optional[int]
    teacher: Optional[PlannedArgs] = None
    teacher_name: Optional[str] = None
    distillation: Optional[DistillationConfig] = None

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per step (1 without a pipeline)."""
        return _pipeline_microbatches(self.config) if self.dims.pp > 1 else 1

    @property
    def reference(self) -> Optional[str]:
        """The preference loss's reference model: ``"copy"``, ``"adapters_off"``, or ``None`` (none, or no preference
        loss)."""
        return self.preference.reference_mode(adapters=self.lora is not None) if self.preference is not None else None


def _read_run(
    model: Union[str, Mapping[str, Any], ModelArgs],
    model_overrides: Optional[dict[str, Any]],
    lora: Union[LoRA, Mapping[str, Any], None],
    preference: Union[PreferenceLoss, Mapping[str, Any], None],
    config: ParallelConfig,
    *,
    num_nodes: int,
    devices: int,
    precision: str,
    seq_len: Optional[int],
    micro_batch_size: int,
    accumulate_grad_batches: int,
    loss_chunk_size: Optional[int],
    device_memory_gib: float,
    reserve_gib: float,
    teacher: Union[str, Mapping[str, Any], ModelArgs, None] = None,
    distillation: Union[DistillationConfig, Mapping[str, Any], None] = None,
) -> _Run:
    """``plan_run``'s arguments read (the model, its adapters, its preference loss) and checked with the layout, every
    problem at once.

    Raises:
        ParallelConfigError: every problem of the layout and of the planner's arguments.
    """
    problems: list[str] = []
    try:
        lora = LoRA.of(lora)
    except LoRAConfigError as err:
        problems.append(str(err))
        lora = None
    try:
        preference = PreferenceLoss.of(preference)
    except PreferenceConfigError as err:
        problems.append(str(err))
        preference = None
    args = read_model(model, model_overrides, problems)
    teacher_args, teacher_name, distillation = _read_teacher(teacher, distillation, problems)
    if seq_len is None and args is not None:
        seq_len = args.max_seq_len
    problems += _run_problems(args, seq_len, micro_batch_size, device_memory_gib, reserve_gib, loss_chunk_size,
                              accumulate_grad_batches)
    facts = None
    if teacher_args is not None:
        facts = TeacherFacts(teacher_name or "teacher", teacher_args.vocab_size,
                             plan_of(teacher_args, ParallelConfig()).tp_divides)
    dims = _validate(config, args, problems, num_nodes=num_nodes, devices=devices, precision=precision, seq_len=seq_len,
                     lora=lora, preference=preference,
                     distillation={"teacher": facts, "distillation": distillation,
                                   **({"vocab_size": args.vocab_size} if args is not None else {})}
                     if teacher is not None or distillation is not None else None)
    assert args is not None and seq_len is not None
    return _Run(
        args=args, lora=lora, preference=preference, dims=dims, config=config.resolve_dtypes(precision), num_nodes=num_nodes, devices=devices,
        precision=precision, seq_len=seq_len, micro_batch_size=micro_batch_size,
        accumulate_grad_batches=accumulate_grad_batches, loss_chunk_size=loss_chunk_size,
        teacher=teacher_args, teacher_name=teacher_name, distillation=distillation,
    )


def _read_teacher(
    teacher: Union[str, Mapping[str, Any], ModelArgs, None],
    distillation: Union[DistillationConfig, Mapping[str, Any], None],
    problems: list[str],
) -> tuple[Optional[PlannedArgs], Optional[str], Optional[DistillationConfig]]:
    """The teacher as the modules read ``teacher=`` (a preset, a folder, ``ModelArgs``, or a dict of ``model``,
    ``init_from``, ``model_overrides``), its name, and the distillation settings (the defaults with a teacher and
    none given); what is wrong appended to ``problems`` (the teacher's prefixed ``teacher:``)."""
    try:
        if isinstance(distillation, Mapping):
            distillation = DistillationConfig(**distillation)
        elif distillation is None and teacher is not None:
            distillation = DistillationConfig()
    except (DistillationConfigError, TypeError) as err:
        problems.append(f"distillation: {err}")
        distillation = None
    if teacher is None:
        return None, None, distillation
    overrides = None
    if isinstance(teacher, Mapping):
        given = dict(teacher)
        overrides = given.get("model_overrides") or None
        teacher = given.get("model") or given.get("init_from")
        if isinstance(teacher, Mapping):  # ModelArgs' fields, as the module keeps them in its hyperparameters
            teacher = ModelArgs(**teacher)
    if teacher is None:
        problems.append("teacher: needs a model (a preset or a model folder) or an init_from folder")
        return None, None, distillation
    found: list[str] = []
    args = read_model(teacher, overrides, found)
    problems.extend(p.replace("model:", "teacher:", 1) for p in found)
    name = args.name if isinstance(args, HFDecoderArgs) else "ModelArgs" if isinstance(teacher, ModelArgs) else str(teacher)
    return args, name + (f" with {overrides}" if overrides else ""), distillation


def _teacher_shard(run: _Run) -> Optional[RankShards]:
    """What the teacher holds on rank 0, built and parallelized by its own plan on the student's meshes (no
    converters: a teacher is never adapted; distillation refuses a pipeline, so one rank stands for all)."""
    if run.teacher is None:
        return None
    return plan_rank_shards(run.teacher, run.dims, run.config, run.precision, run.loss_chunk_size)


def _plan_shards(run: _Run) -> tuple[_Run, list[RankShards], list[str]]:
    """What each planned rank holds (``plan_rank_shards``), with the run as planned and its note.

    Pipeline rank k is played by global rank k·dp·cp·tp (its FSDP, context and TP coordinates 0: the padded
    shards). Where compile or float8 cannot be set up on the meta device, the layout (validated) is planned
    without them, and a note says so.
    """
    ranks = [k * run.dims.dp * run.dims.cp * run.dims.tp for k in range(run.dims.pp)]

    def shards_of(config: ParallelConfig) -> list[RankShards]:
        return [plan_rank_shards(run.args, run.dims, config, run.precision, run.loss_chunk_size, rank, run.lora)
                for rank in ranks]

    try:
        return run, shards_of(run.config), []
    except RetryWithout as err:
        note = f"compile/float8 could not be set up on the meta device ({err}); validated, but planned without them"
        run = replace(run, config=replace(run.config, compile=False, float8=False, fsdp_float8_all_gather=False))
        return run, shards_of(run.config), [note]


def _activation_model(run: _Run, document_mask: bool, converters: ModelConverters) -> ActivationModel:
    """One micro-batch of the whole model on one device (``ActivationModel.for_layout``)."""
    config = run.config
    model = ActivationModel.for_layout(
        run.args, tp=run.dims.tp, sequence_parallel=config.sequence_parallel, seq_len=run.seq_len,
        micro_batch_size=run.micro_batch_size, act_dtype=config.param_dtype, loss_chunk_size=run.loss_chunk_size,
        cp=run.dims.cp, loss_parallel=config.loss_parallel, document_mask=document_mask,
        frozen_base=converters.freezes(), expert_parallel=config.expert_parallel_size,
        reference_forward=run.reference is not None, experts_over_tensor=config.experts_over_tensor_parallel,
    )
    return replace(model, **_teacher_activations(run, document_mask))


def _teacher_activations(run: _Run, document_mask: bool) -> dict[str, Any]:
    """``ActivationModel``'s distillation fields: the teacher's width and its forward's peak without a graph (its own
    blocks on this layout, ``reference_forward_transient`` without a head: its head runs in the fused divergence),
    the divergence's buffers and chunk."""
    if run.teacher is None or run.distillation is None:
        return {}
    config = run.config
    teacher = ActivationModel.for_layout(
        run.teacher, tp=run.dims.tp, sequence_parallel=config.sequence_parallel, seq_len=run.seq_len,
        micro_batch_size=run.micro_batch_size, act_dtype=config.param_dtype, cp=run.dims.cp,
        document_mask=document_mask, expert_parallel=config.expert_parallel_size, has_head=False,
        experts_over_tensor=config.experts_over_tensor_parallel,
    )
    return {
        "teacher_dim": run.teacher.dim,
        "teacher_forward": teacher.reference_forward_transient(),
        "distillation_buffers": 4 if run.distillation.loss == "jsd" else 3,
        "distillation_chunk": run.distillation.chunk_size,
    }


def _notes(run: _Run, converters: ModelConverters, worst: _RankPlan) -> list[str]:
    """What the estimate assumes: of compile, float8, the pipeline, a Hugging Face decoder and the converters."""
    notes: list[str] = []
    if run.config.compile:
        notes.append("activations are estimated for eager blocks; compiled blocks usually save less")
    if run.config.float8:
        notes.append("float8: activations are estimated as in bf16 (torchao keeps the high-precision inputs)")
    if run.dims.pp > 1:
        notes += _pipeline_notes(run.config, run.microbatches, run.accumulate_grad_batches)
    if isinstance(run.args, HFDecoderArgs):
        notes += _hf_notes(run.args, run.seq_len, run.micro_batch_size)
    if run.preference is not None:
        notes.append(_preference_note(run))
    if run.teacher is not None:
        notes.append(
            f"distillation ({run.distillation.loss if run.distillation else '?'}): the teacher ({run.teacher_name}) is"
            " frozen beside the student, sharded by its own plan on the same meshes and stored in param_dtype (no"
            " gradients, optimizer state or reduce-scatter buffers); its forward without a graph and the fused"
            " divergence's chunks run inside the student's head call (the activation peak names them when largest)")
    return notes + converters.plan_notes(worst.shard.optimized_numel, worst.shard.numel)


def _preference_note(run: _Run) -> str:
    """What the estimate assumes of a preference loss's reference and head."""
    loss = f"preference ({run.preference.loss_type})" if run.preference is not None else "preference"
    if run.reference is None:
        return f"{loss}: reference-free, planned as next-token training (the chosen and rejected sequences are tokens)"
    held = {
        "copy": "a frozen copy beside the trained model: its parameters counted as the trained model's shards, stored"
                " in param_dtype (no gradients, optimizer state or reduce-scatter buffers), its all-gathers a unit and"
                " the next at a time while the trained model's output unit and last block stay gathered",
        "adapters_off": "the trained model with its adapters switched off: nothing more is held, its units gathered"
                        " again as in the trained forward",
    }[run.reference]
    when = ("runs between the trained forward and its backward" if run.dims.pp == 1 else
            "runs before the schedule, its stages beside the trained ones (counted as if between a micro-batch's"
            " forward and backward: an upper bound)")
    return (f"{loss}: the reference is {held}; its forward without a graph {when} (the activation peak names it when"
            " it is the largest). The trained head is estimated as the fused loss's (the per-token head keeps no fp32"
            " head-gradient accumulator from its forward)")


@dataclass(frozen=True)
class _Verdict:
    """The fullest device's estimate against its memory."""

    reserve: int
    memory: int
    headroom: int

    @classmethod
    def of(cls, total: int, device_memory_gib: float, reserve_gib: float) -> _Verdict:
        reserve = int(reserve_gib * GIB)
        memory = int(device_memory_gib * GIB)
        return cls(reserve=reserve, memory=memory, headroom=memory - total - reserve)


def _report_name(model: Union[str, Mapping[str, Any], ModelArgs], model_name: Optional[str],
                 model_overrides: Optional[dict[str, Any]], args: PlannedArgs) -> str:
    """The report's name of the model, with the fields overridden."""
    name = model_name or (args.name if isinstance(args, HFDecoderArgs) else str(model))
    return name if not model_overrides else f"{name} (overridden: {', '.join(sorted(model_overrides))})"


def _activation_parts(estimate: ActivationEstimate, pipeline: bool) -> dict[str, Any]:
    """The report's ``activation_parts``: the peak's parts (a pipeline's buffers too) and the blocks' modes."""
    parts: dict[str, Any] = {
        "saved_by_blocks": estimate.saved_by_blocks,
        "head_loss_and_inputs": estimate.head_and_loss,
        "transient": estimate.transient,
    }
    if pipeline:
        parts |= {
            "pipeline_receive_buffers": estimate.receive_buffers,
            "stage_outputs": estimate.stage_outputs,
            "in_flight": estimate.in_flight,
        }
    return parts | {"last_block_saved": estimate.block_saved, "block_modes": _count_modes(estimate.block_modes)}


def _report(run: _Run, name: str, plans: list[_RankPlan], worst: _RankPlan, verdict: _Verdict, notes: list[str]
            ) -> PlanReport:
    """The ``PlanReport`` of the fullest rank ``worst`` (and, under a pipeline, of every one in ``plans``)."""
    args, dims, estimate = run.args, run.dims, worst.activations
    return PlanReport(
        model=name,
        model_args=model_fields(args),
        # A Hugging Face decoder: the model transformers built, counted (biases, per-head norms, a tie once).
        total_params=plans[0].shard.model_numel if isinstance(args, HFDecoderArgs) else args.num_params(),
        num_nodes=run.num_nodes,
        devices_per_node=run.devices,
        world_size=dims.world_size,
        dims={**dims.as_dict(), "data_parallel": dims.dp},
        precision=run.precision,
        param_dtype=_dtype_name(run.config.param_dtype),
        reduce_dtype=_dtype_name(run.config.reduce_dtype),
        seq_len=run.seq_len,
        micro_batch_size=run.micro_batch_size,
        accumulate_grad_batches=run.accumulate_grad_batches,
        parallel_config=_config_dict(run.config, dims),
        params_per_device=worst.shard.numel,
        trained_params_per_device=worst.shard.trained_numel,
        param_bytes=worst.shard.param_bytes,
        grad_bytes=worst.grad_bytes,
        optimizer_bytes=worst.optimizer_bytes,
        buffer_bytes=worst.shard.buffer_bytes,
        all_gather_bytes=worst.all_gather,
        reduce_scatter_bytes=worst.reduce_scatter,
        accumulation_bytes=worst.accumulation,
        activation_bytes=estimate.peak,
        activation_phase=estimate.phase,
        activation_parts=_activation_parts(estimate, dims.pp > 1),
        total_bytes=worst.total,
        reserve_bytes=verdict.reserve,
        device_memory_bytes=verdict.memory,
        fits=verdict.headroom >= 0,
        headroom_bytes=verdict.headroom,
        notes=notes,
        pipeline=[p.as_dict(run.microbatches) for p in plans] if dims.pp > 1 else [],
        preference=run.preference.loss_type if run.preference is not None else None,
        reference=run.reference,
        reference_params_per_device=worst.reference_numel,
        reference_bytes=worst.reference_bytes,
        reference_dtype=_dtype_name(worst.reference_dtype) if worst.reference_dtype is not None else None,
        teacher_params_per_device=worst.teacher_numel,
        teacher_bytes=worst.teacher_bytes,
        teacher_dtype=_dtype_name(worst.teacher_dtype) if worst.teacher_dtype is not None else None,
    )


@dataclass
class _RankPlan:
    """One pipeline rank's estimate (the only one without a pipeline)."""

    pp_rank: int
    global_rank: int
    shard: RankShards
    grad_bytes: int
    optimizer_bytes: int
    all_gather: int
    reduce_scatter: int
    accumulation: int
    activations: ActivationEstimate
    reference_numel: int = 0  # a preference loss's frozen reference copy (``_Reference``)
    reference_bytes: int = 0
    reference_dtype: Optional[torch.dtype] = None
    teacher_numel: int = 0  # distillation's teacher (``_Reference.of_teacher``)
    teacher_bytes: int = 0
    teacher_dtype: Optional[torch.dtype] = None

    @property
    def total(self) -> int:
        return (self.shard.param_bytes + self.grad_bytes + self.optimizer_bytes + self.shard.buffer_bytes
                + self.reference_bytes + self.teacher_bytes + self.all_gather + self.reduce_scatter + self.accumulation
                + self.activations.peak)

    def as_dict(self, microbatches: int) -> dict[str, Any]:
        """The report's per-pipeline-rank entry (JSON-ready)."""
        stages, split = self.shard.stage_indices, self.shard.split
        return {
            "pipeline_rank": self.pp_rank,
            "global_rank": self.global_rank,
            "stages": list(stages),
            "blocks": [split[s] for s in stages],
            "embedding": 0 in stages,
            "head": len(split) - 1 in stages,
            "params_per_device": self.shard.numel,
            "microbatches": microbatches,
            "in_flight": self.activations.in_flight,
            "activation_phase": self.activations.phase,
            "param_bytes": self.shard.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "buffer_bytes": self.shard.buffer_bytes,
            "all_gather_bytes": self.all_gather,
            "reduce_scatter_bytes": self.reduce_scatter,
            "accumulation_bytes": self.accumulation,
            "reference_bytes": self.reference_bytes,
            "teacher_bytes": self.teacher_bytes,
            "activation_bytes": self.activations.peak,
            "total_bytes": self.total,
        }


def _hf_notes(args: HFDecoderArgs, seq_len: int, micro_batch_size: int) -> list[str]:
    """What the estimate of a Hugging Face decoder assumes (see ``activations.Architecture``)."""
    notes = [
        f"{args.model_type} from {args.name}: parameters and shards are the transformers model's under the built-in"
        " plan; activations follow the Llama per-block formula with its differences (SDPA without a mask keeps keys"
        " and values at their own heads"
        + (", per-head q/k norms" if args.architecture.head_norms else "")
        + "), and the loss as HFCausalLMModule computes it: the logits of the whole sequence"
        " and F.cross_entropy (no fused loss)"
    ]

    if sparse := hf_moe_layers(args.config):
        notes.append(
            f"{len(sparse)} of {args.n_layers} blocks are mixtures of experts, run whole on every tensor-parallel rank"
            " (the experts not split by features): their activations as transformers' loop over the experts computes"
            " them (the router's fp32 scores; each assignment's input, gate, up, product and output), for the"
            " k experts of every token"
        )
    window = getattr(args.config, "sliding_window", None)
    if (sliding := args.sliding_layers) and window is not None and window < seq_len:  # else the mask is skipped
        mask = micro_batch_size * seq_len * seq_len
        notes.append(
            f"{sliding} of {args.n_layers} layers attend within a sliding window of {window} tokens: estimated as"
            " causal layers; under"
            f" SDPA they also keep the boolean mask transformers builds ({mask / 2**30:.2f} GiB per micro-batch, one"
            " for all of them) and their keys and values repeated to the query heads, which is not counted"
        )
    return notes


def _pipeline_microbatches(config: ParallelConfig) -> int:
    """The micro-batches per step the estimate assumes: the given count, else one per stage."""
    return config.pipeline_microbatches or config.num_pipeline_stages


def _pipeline_notes(config: ParallelConfig, microbatches: int, accumulate_grad_batches: int) -> list[str]:
    notes = []
    if config.pipeline_microbatches is None:
        notes.append(
            f"pipeline: pipeline_microbatches is not set; assumed {microbatches} (pipeline_parallel_size x stages per"
            " rank) micro-batches of micro_batch_size sequences per step. At run time it defaults to the per-rank"
            " batch size (one sequence per micro-batch); pass --pipeline-microbatches for the count you will use"
        )
    return notes + fsdp_backend(config.fsdp_backend).pipeline_notes(config, accumulate_grad_batches)


def _plan_rank(shard: RankShards, pp_rank: int, run: _Run, activations: ActivationModel,
               teacher_shard: Optional[RankShards] = None) -> _RankPlan:
    """States, FSDP buffers and activations of one planned rank.

    Args:
        shard: What the rank holds.
        pp_rank: Its pipeline rank (0 without a pipeline).
        run: The run: its mesh sizes, options (dtypes resolved), precision (the stored dtype), micro-batches per
            optimizer step and pipeline micro-batches per step.
        activations: One micro-batch of the whole model on one device.
        teacher_shard: Distillation's teacher on this rank (``_teacher_shard``), else ``None``.
    """
    dims, config = run.dims, run.config
    param_dtype, reduce_dtype = config.param_dtype, config.reduce_dtype
    stored = torch.bfloat16 if run.precision == "bf16-true" else torch.float32
    units = shard.units
    # The reduce-scatter's input is the unit's unsharded gradients: its trained parameters' (a frozen base has none).
    reduce_scatter = max((u.gradient_numel * (param_dtype.itemsize + reduce_dtype.itemsize) for u in units), default=0)
    if dims.pp > 1:
        estimate = pipeline_activation_estimate(
            activations, shard.split, pp=dims.pp, pp_rank=pp_rank, schedule=config.pipeline_schedule,
            microbatches=run.microbatches, activation_checkpointing=config.activation_checkpointing,
            selective_ac_option=config.selective_ac_option,
        )
    else:
        estimate = activations.estimate(config.activation_checkpointing, config.selective_ac_option)
    all_gather, accumulation = fsdp_backend(config.fsdp_backend).buffer_bytes(
        units, config, run.accumulate_grad_batches, pipeline_in_flight=estimate.in_flight if dims.pp > 1 else None)
    reference = _Reference.of(run, shard)
    teacher = _Reference.of_teacher(run, shard, teacher_shard)
    return _RankPlan(
        pp_rank=pp_rank,
        global_rank=pp_rank * dims.dp * dims.cp * dims.tp,
        shard=shard,
        grad_bytes=shard.optimized_numel * stored.itemsize,
        optimizer_bytes=ADAMW_STATES * shard.optimized_numel * stored.itemsize,
        all_gather=max(all_gather, reference.gathered, teacher.gathered),
        reduce_scatter=reduce_scatter,
        accumulation=accumulation,
        activations=estimate,
        reference_numel=reference.numel,
        reference_bytes=reference.nbytes,
        reference_dtype=reference.dtype,
        teacher_numel=teacher.numel,
        teacher_bytes=teacher.nbytes,
        teacher_dtype=teacher.dtype,
    )


@dataclass(frozen=True)
class _Reference:
    """What a preference loss's reference model holds on a planned rank besides the trained model (``of``)."""

    numel: int = 0  #: its parameter elements (local shards)
    nbytes: int = 0  #: its parameters' bytes (in ``dtype``) and its buffers'
    gathered: int = 0  #: the all-gather buffers while it runs forward, with the trained model's still gathered
    dtype: Optional[torch.dtype] = None  #: what its parameters are stored in

    @classmethod
    def of(cls, run: _Run, shard: RankShards) -> _Reference:
        """A frozen copy (``reference="copy"``): built and parallelized as the trained model is (the same plan and
        meshes, no converters: ``copy`` excludes ``lora``), so its shards are the trained model's (``shard``) and so
        are its buffers (its own rotary table); its parameters stored in the dtype FSDP computes in
        (``parallel.frozen.frozen_dtype``: bf16 under ``bf16-mixed``). Under pipeline parallelism the copy is cut
        into the trained model's stages on the same ranks, so ``shard`` (this rank's stages) is its part too. Nothing
        for the model with its adapters off (the same parameters, gathered again as in the trained forward) or a
        reference-free loss."""
        if run.reference != "copy":
            return cls()
        dtype = frozen_dtype(run.config, run.precision)
        return cls(numel=shard.numel, nbytes=shard.numel * dtype.itemsize + shard.buffer_bytes,
                   gathered=_frozen_forward_gathers(shard.units, run.config, pipelined=run.dims.pp > 1), dtype=dtype)

    @classmethod
    def of_teacher(cls, run: _Run, shard: RankShards, teacher: Optional[RankShards]) -> _Reference:
        """Distillation's teacher: a frozen model of its own shape and plan on the student's meshes (``teacher``: its
        shards on this rank), stored as a reference copy is (``frozen_dtype``), its units gathered a unit and the next
        at a time inside the student's head call, the student's output unit gathered then (``shard``'s units)."""
        if teacher is None:
            return cls()
        dtype = frozen_dtype(run.config, run.precision)
        return cls(numel=teacher.numel, nbytes=teacher.numel * dtype.itemsize + teacher.buffer_bytes,
                   gathered=_frozen_forward_gathers(shard.units, run.config, frozen=teacher.units), dtype=dtype)


def _frozen_forward_gathers(units: list[FSDPUnit], config: ParallelConfig, pipelined: bool = False,
                            frozen: Optional[list[FSDPUnit]] = None) -> int:
    """FSDP2's all-gather buffers while a frozen copy of the model of ``units`` runs forward right after the trained
    model's: the trained units its reshard policy keeps gathered until their backward (the output unit under
    ``"default"``), and the copy's unit with the next one prefetched (a frozen model reshards every unit after its
    forward: ``parallel.frozen.parallelize_frozen``). Under a pipeline (``pipelined``) the copy's stages run before
    the schedule, when every trained unit is resharded (``PipelineStage`` reshards them after the last backward).
    Under SimpleFSDP 0: each weight is gathered at its use, and without a graph freed after it. ``frozen``: the frozen
    model's own units where it is not a copy (a teacher), else ``units``."""
    if config.fsdp_backend != "fully_shard" or not units:
        return 0
    reshard = reshard_after_forward_by_unit(config.reshard_policy)
    kept = 0 if pipelined else sum(u.gathered_bytes for u in units if not reshard[u.kind])
    own = units if frozen is None else frozen
    pairs = [u.gathered_bytes + (own[i + 1].gathered_bytes if i + 1 < len(own) else 0)
             for i, u in enumerate(own)]
    return kept + max(pairs)


def _config_dict(config: ParallelConfig, dims: ParallelDims) -> dict[str, Any]:
    out = {}
    for f in fields(ParallelConfig):
        value = getattr(config, f.name)
        out[f.name] = _dtype_name(value) if isinstance(value, torch.dtype) else value
    out["data_parallel_size"], out["tensor_parallel_size"] = dims.dp, dims.tp
    return out


def _count_modes(modes: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for mode in modes:
        counts[mode] = counts.get(mode, 0) + 1
    return counts
