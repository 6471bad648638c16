"""The planner's report: ``PlanReport`` (a layout's sizes, per-device memory and verdict) and its table.

``PlanReport.as_dict`` is the ``--json`` output; ``format_report`` the human-readable table of
``lightning-2d plan`` (with one line per pipeline rank under a pipeline).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_2d.parallel.fsdp_backend import fsdp_backend

GIB = 2**30
#: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` (like the parameter; the step counts are scalars).
ADAMW_STATES = 2


@dataclass
class PlanReport:
    """A layout's resolved sizes and per-device memory estimate (bytes), with the verdict.

    Under pipeline parallelism the pipeline ranks hold different parts of the model: the per-device
    fields are those of the pipeline rank with the largest total (which decides the verdict), and
    ``pipeline`` lists every pipeline rank.

    Args:
        model: Preset name, with the overridden ``ModelArgs`` fields named.
        model_args: ``ModelArgs`` fields.
        total_params: Parameters of the whole model.
        num_nodes: Nodes simulated.
        devices_per_node: Devices (ranks) per node.
        world_size: ``num_nodes × devices_per_node``.
        dims: ``data_parallel_replicate``, ``data_parallel_shard``, ``tensor_parallel`` (and ``data_parallel``;
            ``pipeline_parallel`` when above 1).
        precision: Trainer precision.
        param_dtype: Dtype FSDP gathers parameters in (and activations are computed in).
        reduce_dtype: Dtype of the gradient reduce-scatter.
        seq_len: Tokens per sequence.
        micro_batch_size: Sequences per micro-batch and device.
        accumulate_grad_batches: Micro-batches per optimizer step.
        parallel_config: The ``ParallelConfig`` fields (dtypes as names).
        params_per_device: Parameter elements on this device (padded shards).
        param_bytes: Their bytes.
        grad_bytes: Sharded gradients.
        optimizer_bytes: AdamW states.
        buffer_bytes: Module buffers (the rotary table).
        all_gather_bytes: FSDP's unsharded parameters at their peak.
        reduce_scatter_bytes: FSDP's unsharded gradients and reduce-scatter input at their peak.
        accumulation_bytes: Unsharded gradients kept between micro-batches (deferred reduction).
        activation_bytes: Activation peak.
        activation_phase: Where the activation peak is.
        activation_parts: The peak's parts and the last block's saved tensors.
        total_bytes: The sum of the above (the estimated peak of allocated memory).
        reserve_bytes: Added for what the estimate does not see.
        device_memory_bytes: The device's memory.
        fits: ``total + reserve <= device memory``.
        headroom_bytes: ``device memory - total - reserve`` (negative when it does not fit).
        suggestions: Changes that would make it fit (empty when it fits).
        notes: What was simulated differently from a real run.
        seconds: Wall time of the planning.
        trained_params_per_device: Of ``params_per_device``, the elements with gradients and optimizer state (under
            LoRA the adapters'); ``None``: all of them.
        preference: The preference loss planned (its ``loss_type``), ``None`` for next-token training.
        reference: Its reference model: ``"copy"`` (a frozen copy beside the trained model), ``"adapters_off"``
            (the trained model with its adapters off) or ``None`` (none).
        reference_params_per_device: The frozen copy's parameter elements on this device (its shards; 0 without one).
        reference_bytes: Their bytes, and its buffers' (part of ``total_bytes``).
        reference_dtype: What its parameters are stored in (``param_dtype``: a frozen model keeps no fp32 copy).
        teacher: Distillation's teacher (its name), ``None`` without one.
        distillation: The divergence it is distilled with (``DistillationConfig.loss``), ``None`` without a teacher.
        teacher_params: The teacher's parameters (the whole model).
        teacher_params_per_device: Its parameter elements on this device (its shards under its own plan).
        teacher_bytes: Their bytes in ``teacher_dtype`` and its buffers' (part of ``total_bytes``).
        teacher_dtype: What its parameters are stored in (``param_dtype``, as a reference's).
        pipeline: One dict per pipeline rank (empty without a pipeline): ``pipeline_rank``,
            ``global_rank`` (the rank planned), ``stages`` (indices), ``blocks`` (per stage),
            ``embedding`` / ``head`` (whether it holds them), ``params_per_device``, ``microbatches``,
            ``in_flight`` (micro-batches or stage-chunks in flight at its activation peak), and the
            ``param``, ``grad``, ``optimizer``, ``buffer``, ``all_gather``, ``reduce_scatter``, ``accumulation``,
            ``activation`` and ``total`` bytes (the parts add up to the total).
    """

    model: str
    model_args: dict[str, Any]
    total_params: int
    num_nodes: int
    devices_per_node: int
    world_size: int
    dims: dict[str, int]
    precision: str
    param_dtype: str
    reduce_dtype: str
    seq_len: int
    micro_batch_size: int
    accumulate_grad_batches: int
    parallel_config: dict[str, Any]
    params_per_device: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    accumulation_bytes: int
    activation_bytes: int
    activation_phase: str
    activation_parts: dict[str, Any]
    total_bytes: int
    reserve_bytes: int
    device_memory_bytes: int
    fits: bool
    headroom_bytes: int
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    pipeline: list[dict[str, Any]] = field(default_factory=list)
    trained_params_per_device: Optional[int] = None
    preference: Optional[str] = None
    reference: Optional[str] = None
    reference_params_per_device: int = 0
    reference_bytes: int = 0
    reference_dtype: Optional[str] = None
    teacher: Optional[str] = None
    distillation: Optional[str] = None
    teacher_params: int = 0
    teacher_params_per_device: int = 0
    teacher_bytes: int = 0
    teacher_dtype: Optional[str] = None

    @property
    def trained_per_device(self) -> int:
        return self.params_per_device if self.trained_params_per_device is None else self.trained_params_per_device

    @property
    def verdict(self) -> str:
        """``fits with X GiB headroom`` or ``does not fit: needs Y GiB of Z GiB``."""
        needed = (self.total_bytes + self.reserve_bytes) / GIB
        if self.fits:
            return f"fits with {self.headroom_bytes / GIB:.1f} GiB headroom"
        return f"does not fit: needs {needed:.1f} GiB of {self.device_memory_bytes / GIB:.1f} GiB"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the verdict, and the byte sizes in GiB too (``*_gib``)."""
        out = asdict(self)
        out["verdict"] = self.verdict
        for entry in (out, *out["pipeline"]):
            for name in [k for k in entry if k.endswith("_bytes")]:
                entry[name.removesuffix("_bytes") + "_gib"] = round(entry[name] / GIB, 3)
        return out


#: The head's line of each preference reference (``PlanReport.reference``).
REFERENCE_LINES = {
    "copy": "a frozen copy of the model, sharded as it is, no gradients or optimizer state; its forward without a"
            " graph each micro-batch",
    "adapters_off": "the model with its adapters off (no copy); its forward without a graph each micro-batch",
    None: "none (a reference-free loss)",
}


def _gib(n: float) -> str:
    return f"{n / GIB:9.2f}"


def format_report(report: PlanReport) -> str:
    """The human-readable table of ``lightning-2d plan``: the run, the per-device memory, under a pipeline the
    table of its ranks, the verdict, the suggestions and the notes."""
    pipeline = report.pipeline
    worst = max(pipeline, key=lambda r: r["total_bytes"]) if pipeline else None
    out = _run_lines(report, worst) + [""] + _memory_table(report, worst)
    if worst is not None:
        out += ["", f"activation peak: {report.activation_phase}", ""] + _pipeline_table(pipeline, worst)
    out += ["", f"verdict: {report.verdict}"]
    if report.suggestions:
        out.append("try (estimates):")
        out += [f"  {s}" for s in report.suggestions]
    out += [f"note: {n}" for n in report.notes]
    out.append(f"(planned in {report.seconds:.1f} s)")
    return "\n".join(out)


def _stored(report: PlanReport) -> str:
    """The dtype the parameters, gradients and optimizer states are stored in."""
    return "bf16" if report.precision == "bf16-true" else "fp32"


def _run_lines(report: PlanReport, worst: Optional[dict[str, Any]]) -> list[str]:
    """The report's head: the model and world, the layout, the training step and (``worst``: its fullest rank)
    the pipeline."""
    d = report.dims
    c = report.parallel_config
    tp = d["tensor_parallel"]
    sp = " (sequence parallel)" if c["sequence_parallel"] and tp > 1 else ""
    ac = c["activation_checkpointing"]
    if ac == "selective":
        ac += f" ({c['selective_ac_option']})"
    pd, rd = report.param_dtype, report.reduce_dtype
    out = [
        f"lightning-2d plan: {report.model}, {report.total_params / 1e9:.2f} B parameters,"
        f" on {report.num_nodes} node(s) x {report.devices_per_node} device(s) = {report.world_size} ranks",
        "layout:   " + (f"pipeline_parallel {d['pipeline_parallel']} x " if report.pipeline else "")
        + f"data_parallel_replicate {d['data_parallel_replicate']} x data_parallel_shard"
        f" {d['data_parallel_shard']} x "
        + (f"context_parallel {d['context_parallel']} x " if "context_parallel" in d else "")
        + f"tensor_parallel {tp}{sp}"
        + (f"; experts: expert_parallel {d['expert_parallel']} (of the data-shard x context"
           + (" x tensor ranks: each tensor rank routes its sequence slice" if c.get("experts_over_tensor_parallel")
              else " ranks") + "), FSDP over the rest; activations at worst-case routing"
           if "expert_parallel" in d else ""),
        f"training: {report.precision} (params {_stored(report)}, compute {pd}, reduce {rd}),"
        f" seq_len {report.seq_len}, micro batch {report.micro_batch_size}"
        + (f" x {report.accumulate_grad_batches} accumulated" if report.accumulate_grad_batches > 1 else "")
        + f", activation checkpointing {ac}, reshard {c['reshard_after_forward']}",
    ]
    if report.preference is not None:
        out.append(f"preference: {report.preference}, reference: " + REFERENCE_LINES[report.reference])
    if report.teacher is not None:
        out.append(f"distillation: {report.distillation} from the teacher {report.teacher}"
                   f" ({report.teacher_params / 1e9:.3g}B parameters, frozen, sharded by its own plan)")
    if worst is not None:
        stages = sum(len(r["stages"]) for r in report.pipeline)
        out.append(
            f"pipeline: {c['pipeline_schedule']}, {stages} stages ({len(worst['stages'])} per rank),"
            f" {worst['microbatches']} micro-batches of {report.micro_batch_size} sequence(s) per step"
        )
    return out


def _memory_rows(report: PlanReport) -> list[tuple[str, str, str]]:
    """The per-device table's rows: label, elements and GiB of each part of the estimate."""
    stored = _stored(report)
    pd, rd = report.param_dtype, report.reduce_dtype
    parts = report.activation_parts
    pipeline = report.pipeline
    keeps_fewer = bool(report.parallel_config.get("reduce_every_micro_batch"))  # units reshard per micro-batch
    rows: list[tuple[str, str, str]] = [
        (f"parameters ({stored}, sharded)", f"{report.params_per_device:,}", _gib(report.param_bytes)),
        (f"gradients ({stored}, sharded)", f"{report.trained_per_device:,}", _gib(report.grad_bytes)),
        (f"optimizer state (AdamW, 2 x {stored})", f"{ADAMW_STATES * report.trained_per_device:,}",
         _gib(report.optimizer_bytes)),
    ]
    if report.reference_bytes:
        rows.append((f"reference model (frozen copy, {report.reference_dtype}, sharded)",
                     f"{report.reference_params_per_device:,}", _gib(report.reference_bytes)))
    if report.teacher_bytes:
        rows.append((f"teacher model (frozen, {report.teacher_dtype}, sharded)",
                     f"{report.teacher_params_per_device:,}", _gib(report.teacher_bytes)))
    rows += [
        (_all_gather_row(report, pd, pipeline and not keeps_fewer), "", _gib(report.all_gather_bytes)),
        (f"FSDP reduce-scatter buffers ({pd} + {rd})", "", _gib(report.reduce_scatter_bytes)),
    ]
    if report.accumulation_bytes:
        rows.append((f"unsharded gradients between micro-batches ({rd})", "", _gib(report.accumulation_bytes)))
    # Under a pipeline the peak's description is long: it goes below the table.
    peak = f"{parts['in_flight']} in flight, see below" if pipeline else report.activation_phase
    rows += [
        (f"activations (peak: {peak})", "", _gib(report.activation_bytes)),
        ("  saved by the blocks", "", _gib(parts["saved_by_blocks"])),
        ("  head, loss and inputs", "", _gib(parts["head_loss_and_inputs"])),
        ("  transient at the peak", "", _gib(parts["transient"])),
    ]
    if pipeline:
        rows += [
            ("  stage outputs kept for backward", "", _gib(parts["stage_outputs"])),
            ("  pipeline receive buffers", "", _gib(parts["pipeline_receive_buffers"])),
        ]
    return rows + [("buffers (rotary table)", "", _gib(report.buffer_bytes))]


def _memory_table(report: PlanReport, worst: Optional[dict[str, Any]]) -> list[str]:
    """The per-device table (under a pipeline its fullest rank ``worst``'s), against the device memory."""
    rows = _memory_rows(report)
    width = max(len(r[0]) for r in rows) + 2
    line = "-" * (width + 32)
    where = f" (pipeline rank {worst['pipeline_rank']}, the fullest)" if worst is not None else ""
    out = [f"{'per device' + where:<{width}}{'elements':>20}{'GiB':>12}", line]
    out += [f"{label:<{width}}{count:>20}{size:>12}" for label, count, size in rows]
    return out + [
        line,
        f"{'estimated peak':<{width}}{'':>20}{_gib(report.total_bytes):>12}",
        f"{'reserve (CUDA context, NCCL, fragmentation)':<{width}}{'':>20}{_gib(report.reserve_bytes):>12}",
        f"{'device memory':<{width}}{'':>20}{_gib(report.device_memory_bytes):>12}",
    ]


def _pipeline_table(pipeline: list[dict[str, Any]], worst: dict[str, Any]) -> list[str]:
    """One line per pipeline rank: what it holds and its estimate (``*``: the rank detailed above)."""
    header = (f"{'pipeline rank':>13}  {'stages':<10}{'blocks':<12}{'holds':<18}{'params/device':>15}"
              f"{'in flight':>11}{'activations GiB':>17}{'total GiB':>11}")
    lines = [header, "-" * len(header)]
    for r in pipeline:
        holds = "+".join(n for n, held in (("embedding", r["embedding"]), ("head", r["head"])) if held) or "-"
        mark = " *" if r is worst else ""
        lines.append(
            f"{r['pipeline_rank']:>13}  {','.join(map(str, r['stages'])):<10}{','.join(map(str, r['blocks'])):<12}"
            f"{holds:<18}{r['params_per_device']:>15,}{r['in_flight']:>11}{_gib(r['activation_bytes']):>17}"
            f"{_gib(r['total_bytes']):>11}{mark}"
        )
    return lines


def _all_gather_row(report: Any, param_dtype: str, pipeline_keeps: bool) -> str:
    config = report.parallel_config
    backend = fsdp_backend(config.get("fsdp_backend", "fully_shard"))  # the option's default if left out
    return backend.all_gather_row(param_dtype, config.get("activation_checkpointing", "none"), pipeline_keeps)
