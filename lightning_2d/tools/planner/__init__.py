"""``lightning-2d plan``: check a layout and estimate its per-device memory on a simulated world, without GPUs.

    lightning-2d plan --model llama3-8b --num-nodes 1 --devices 8 --tensor-parallel-size 8
    lightning-2d plan --model llama3-405b --num-nodes 64 --devices 8 --tensor-parallel-size 8 \\
        --activation-checkpointing full --seq-len 8192 --micro-batch-size 1 --precision bf16-mixed --json
    lightning-2d plan --model llama3-405b --num-nodes 64 --devices 8 --tensor-parallel-size 8 \\
        --pipeline-parallel-size 8 --pipeline-microbatches 16 --activation-checkpointing full --seq-len 8192

``--model`` is a ``ModelArgs`` preset or a Hugging Face Llama-family ``config.json`` (or its directory):
that model is built by ``transformers`` on the meta device and planned with the built-in plan, as
``HFCausalLMModule`` trains it (``models``; its activations: ``activations.Architecture``).

One process plays rank 0 (under a pipeline, one rank of each pipeline rank) of a world of
``num_nodes × devices`` ranks: a *fake* process group (no communication,
``torch.testing._internal.distributed.fake_pg``) lets the real code run. The layout is resolved and
checked by the real rules (``validate_parallel_dims``, every problem in one ``ParallelConfigError``),
the real mesh is built (``ParallelDims.build_mesh``), the Llama ``Transformer`` is built on the meta
device and parallelized by the real ``parallelize_model`` (pipeline split → TP/SP → activation
checkpointing → compile → FSDP2). Nothing is allocated: the per-device sizes are read from the local
shards of the DTensor parameters.

What the estimate holds, per device (rank 0, whose FSDP shards are the padded size every rank allocates;
under a pipeline, see below):

* **parameters**: the local shards, in their stored dtype (fp32; bf16 under ``bf16-true``).
* **gradients**: the same shapes and dtype (FSDP2 reduce-scatters into the parameter's dtype).
* **optimizer state**: AdamW's ``exp_avg`` and ``exp_avg_sq``, two tensors like each parameter.
* **FSDP all-gather buffers**: the unsharded parameters of the units gathered at once, in
  ``param_dtype``: a unit and the next one (implicit forward prefetch, explicit backward prefetch)
  plus, under the ``default`` reshard policy, the output unit kept gathered from its forward to its
  backward (simulated unit by unit, see ``gathered_peak``).
* **FSDP reduce-scatter buffers**: the largest unit's unsharded gradients (``param_dtype``) and the
  reduce-scatter input (``reduce_dtype``) that FSDP2 keeps until the next unit's reduction.
* **gradient accumulation** (``accumulate_grad_batches > 1`` without ``reduce_every_micro_batch``):
  every unit's unsharded gradients, accumulated in ``reduce_dtype`` between micro-batches.
* **activations**: what autograd saves, tensor by tensor, for the model's forward and backward
  (``ActivationModel``), at its peak.

Everything is counted as live at once, which is conservative: gradients only exist from backward
on (``zero_grad(set_to_none=True)``) and the activation peak falls before most of them exist.
Not included: the CUDA context, NCCL and cuBLAS workspaces and allocator fragmentation, which the
``reserve`` (``--reserve-gib``) stands for.

**Under pipeline parallelism** (``pipeline_parallel_size`` p > 1) the pipeline ranks hold different
stages (the first the embedding, the last the final norm and head; the interleaved schedules several
stages per rank in a loop, ZBVZeroBubble and DualPipeV two in a V: rank 0 holds the first and the last), so every pipeline rank ``k`` is planned, played by global rank ``k·dp·tp``: the real
``parallelize_model`` prunes the model to its stages and shards each stage view as its own FSDP root.
The report's per-device figures are the fullest pipeline rank's (it decides the verdict); ``pipeline``
lists them all. Per pipeline rank:

* **parameters, gradients, optimizer state**: its pruned model's local shards.
* **FSDP buffers**: torch's ``PipelineStage`` runs every micro-batch's backward without resharding
  and without gradient reduction (``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)``) and reduce-scatters once after the last one. From its first
  backward to the end of the step each unit of the rank's stages therefore stays gathered
  (``param_dtype``) and holds its unsharded gradient (``reduce_dtype``): all of them are counted,
  whatever ``reshard_after_forward`` says; the reduce-scatter buffer is the largest unit's, as without
  a pipeline. Under ``reduce_every_micro_batch`` the library hides the stage from that handling
  (each micro-batch's backward reshards and reduce-scatters): the FSDP buffers are then those of no pipeline.
* **activations** (``pipeline_activation_estimate``): a pipeline micro-batch is ``micro_batch_size``
  sequences, ``m = pipeline_microbatches`` of them per step (when not set, ``m = p × stages per rank``
  is assumed and a note says so; at run time it defaults to the per-rank batch size). Each stage is
  the ``ActivationModel`` of its blocks (the fused loss only on the last stage). The rank's forwards
  and backwards are walked in the schedule's order: GPipe keeps all ``m`` micro-batches in flight,
  1F1B ``min(p - k, m)``, Interleaved1F1B its warm-up forwards + 1 stage-chunks (torch's
  ``_get_warmup_ops``); the zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) keep
  a micro-batch from its forward to its *weight* pass (the input pass retains the graph), in their own
  orders (``schedule_order``, checked against torch's action lists). At the peak one micro-batch is at its own peak and every other one in flight
  keeps its saved tensors (on the last stage also the loss's hidden-state gradient and fp32 head-gradient
  accumulator) and, before the last stage, its stage output. Always there: the receive buffers that
  ``PipelineStage`` allocates for every micro-batch, activations on non-first stages and gradients on
  non-last ones.

Approximate under a pipeline: the unit buffers, the gradients and the activation peak are counted at
once, though the gathered units and gradients are complete only after a micro-batch's backward and
the steady state's peak micro-batch count is reached around it; token ids are counted for the
micro-batches in flight, not for the whole batch each rank loads (a few MiB).

The Python API: ``plan_run(...) -> PlanReport`` (``report.as_dict()``, ``format_report(report)``).

The package, one module per job: ``models`` (a preset or a Hugging Face config: its plan, its meta-device
model), ``activations`` (the activation model of one micro-batch), ``schedules``
(the pipeline schedules' order and micro-batches in flight), ``units`` (FSDP units and the all-gather
peak), ``world`` (the fake world: the real code on a meta model, its shards measured), ``estimate``
(``plan_run``: validation, per-rank estimate, verdict), ``suggestions`` (what would make it fit),
``report`` (``PlanReport`` and its table) and ``cli`` (``lightning-2d plan``).
"""

from lightning_2d.tools.planner.activations import (
    DEFAULT_LOSS_CHUNK_SIZE,
    NORM_BACKWARD_BYTES,
    ActivationEstimate,
    ActivationModel,
)
from lightning_2d.tools.planner.cli import add_parallel_config_options, build_parser, main
from lightning_2d.tools.planner.estimate import DEFAULT_DEVICE_MEMORY_GIB, DEFAULT_RESERVE_GIB, plan_run
from lightning_2d.tools.planner.report import ADAMW_STATES, GIB, PlanReport, format_report
from lightning_2d.tools.planner.schedules import pipeline_activation_estimate, schedule_order
from lightning_2d.tools.planner.suggestions import suggestions_for as suggestions_for  # the tests call it
from lightning_2d.parallel.fsdp import FSDPUnit, gathered_peak
from lightning_2d.tools.planner.world import fake_world

__all__ = [
    "ADAMW_STATES",
    "DEFAULT_DEVICE_MEMORY_GIB",
    "DEFAULT_LOSS_CHUNK_SIZE",
    "DEFAULT_RESERVE_GIB",
    "GIB",
    "NORM_BACKWARD_BYTES",
    "ActivationEstimate",
    "ActivationModel",
    "FSDPUnit",
    "PlanReport",
    "add_parallel_config_options",
    "build_parser",
    "fake_world",
    "format_report",
    "gathered_peak",
    "main",
    "pipeline_activation_estimate",
    "plan_run",
    "schedule_order",
]
