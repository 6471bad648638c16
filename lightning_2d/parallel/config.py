"""What to parallelize and how: the options (``ParallelConfig``) and the model's names (``ParallelPlan``).

Both are plain data, so a test (or a user) can inspect the plan that will be applied before any
process group exists. Constructing a ``ParallelConfig`` runs the options' own checks (``parallel/checks.py``,
registered below the class) and raises once, listing every problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol, Union

import torch

from lightning_2d.errors import Lightning2DError
from lightning_2d.parallel.checks import check, run_checks
from lightning_2d.parallel.options import documented, option
from lightning_2d.parallel.schedules import SCHEDULES, Schedule, ScheduleName, schedule_of
from lightning_2d.parallel.styles import is_sequence_parallel_style

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle

AC_MODES = ("none", "full", "selective")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
RESHARD_POLICIES = ("default", "always", "never")
FSDP_BACKENDS = ("fully_shard", "simple_fsdp")
NON_FINITE_POLICIES = ("raise", "skip", "off")
#: The oldest torch the pipeline runs on: the release it is tested with. Before it ``torch.distributed.pipelining``
#: lacked parts it relies on (schedules' ``eval()`` arrived in 2.9; static stage metadata and its warm-up vote later).
PIPELINE_MIN_TORCH = "2.13"
#: Derived from the schedules' table (``parallel/schedules.py``), for the readers of these names: schedule → the
#: stages each rank runs (``Schedule.stages``), and the zero-bubble ones.
PIPELINE_SCHEDULES: dict[str, str] = {s.name: s.stages for s in SCHEDULES.values()}
ZERO_BUBBLE_SCHEDULES = tuple(s.name for s in SCHEDULES.values() if s.zero_bubble)

#: Trainer/Fabric precision → (param_dtype, reduce_dtype) of FSDP2's MixedPrecisionPolicy.
PRECISION_TO_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "32-true": (torch.float32, torch.float32),
    "32": (torch.float32, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.float32),
}
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

#: What ``param_dtype``/``reduce_dtype`` may be (float16 would need a gradient scaler).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16")

#: A mesh size: a positive number of ranks, or ``"auto"`` (derived from the world size).
Size = Union[Literal["auto"], int]


class ParallelConfigError(Lightning2DError, ValueError):
    """A misconfiguration found before any process group or allocation; lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            "Invalid 2D parallel configuration:\n  - " + "\n  - ".join(self.problems)
        )


def float8_recipe_problems(recipe: str, fsdp_float8_all_gather: bool, name: str) -> list[str]:
    """The recipe is torchao's, and float8 all-gathers need one scale per weight (``name``: the option's name)."""
    if recipe not in FLOAT8_RECIPES:
        return [f"{name}={recipe!r} is not a float8 recipe; choose one of {', '.join(map(repr, FLOAT8_RECIPES))}"]
    if fsdp_float8_all_gather and recipe != "tensorwise":
        return [
            f"fsdp_float8_all_gather=True needs {name}='tensorwise' (one scale per weight), got {recipe!r}; use"
            " the tensorwise recipe or fsdp_float8_all_gather=False"
        ]
    return []


def raise_if_problems(problems: list[str]) -> None:
    """Raise every problem at once: a ``ParallelConfigError`` listing them, or, when each comes from checks declaring
    one other error (``@check(error=...)``, ``parallel/checks.py``), that error with their messages (one problem: its
    message alone, as the refusal always read). Either has the list as ``problems``."""
    if not problems:
        return
    errors = {getattr(problem, "error", None) for problem in problems}
    error = errors.pop() if len(errors) == 1 else None
    if error is None:
        raise ParallelConfigError(problems)
    raised = error("\n".join(problems))
    raised.problems = list(problems)  # type: ignore[attr-defined]
    raise raised


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    return DTYPE_NAMES[value]


@documented
@dataclass
class ParallelConfig:
    """Options of the 2D (FSDP2 × tensor/sequence parallel) strategy: the parallel layout.

    Each field's docstring is the option's documentation everywhere: the strategies' signatures and
    docstrings, the CLI's ``--help`` and the docs' table (docs/strategy.md) are built from these fields (with the
    strategy-only options of ``lightning_2d.integration.strategy_options.StrategyOptions``).

    The strategies build one from their arguments; a script without a strategy (``parallelize_model``, the planner)
    builds its own. What needs the world or the model (sizes that divide them) is checked later, by
    ``validate_parallel_dims``.

    Raises:
        ParallelConfigError: Options out of their range or contradicting each other (every problem in one message,
            with its fix); a ``Lightning2DError`` and a ``ValueError``.

    Example:
        ```python
        from lightning_2d import ParallelConfig

        config = ParallelConfig(tensor_parallel_size=8, activation_checkpointing="selective")
        config.resolve_dtypes("bf16-mixed").param_dtype  # torch.bfloat16
        ```
    """

    data_parallel_size: Size = option("auto", position=0)
    """Number of data-parallel ranks (replicas × FSDP shards; each sees different batches), or ``"auto"``: the
    world size divided by ``tensor_parallel_size × context_parallel_size × pipeline_parallel_size`` (the number of
    nodes when both sizes are auto). FSDP shards over ``data_parallel_size / data_parallel_replicate_size`` of them."""
    tensor_parallel_size: Size = option("auto", position=1)
    """Size of the tensor-parallel mesh dimension, or ``"auto"``: the world size divided by
    ``data_parallel_size × context_parallel_size × pipeline_parallel_size`` (the devices of one node when both sizes
    are auto).
    Tensor-parallel groups are consecutive ranks, so they stay inside a node."""
    data_parallel_replicate_size: int = option(1, position=2)
    """HSDP: the data-parallel ranks form this many replica groups; FSDP shards parameters, gradients and
    optimizer state inside each group of ``data_parallel_size / data_parallel_replicate_size`` ranks (typically
    one node's, so its all-gathers stay on NVLink) and gradients are all-reduced across the groups. ``1``
    (default): plain FSDP over all data-parallel ranks."""
    sequence_parallel: bool = option(True, position=8)
    """Shard norms and residual activations along the sequence between the tensor-parallel regions (Megatron
    SP). Needs the sequence length divisible by the tensor-parallel size."""
    loss_parallel: bool = option(False, position=9)
    """For models that return logits (``fused_loss=False``, or your own): keep the logits sharded over the
    vocabulary and compute the cross-entropy on the shards (saves ``(tp-1)/tp`` of the logits memory). The
    model's loss must be computed inside ``lightning_2d.parallel.loss.loss_parallel_context()``;
    ``LlamaLightningModule`` does it. The fused Llama loss is always vocabulary-parallel."""
    activation_checkpointing: Literal["none", "full", "selective"] = option("none", position=10)
    """``"none"``, ``"full"`` (recompute each block) or ``"selective"`` (see ``selective_ac_option``)."""
    selective_ac_option: Union[str, int] = option("op", position=11)
    """For ``"selective"``: ``"op"`` (save matmul/attention outputs, recompute the rest) or an integer ``N``
    (fully checkpoint every N-th block)."""
    compile: bool = option(False, position=12)
    """``torch.compile`` each transformer block (after activation checkpointing, before FSDP)."""
    param_dtype: Optional[Union[str, torch.dtype]] = option(None, position=13, shown="from ``precision``")
    """Dtype FSDP2 all-gathers parameters in for compute (its ``MixedPrecisionPolicy``), e.g. ``"bfloat16"`` or
    ``"float32"``; ``None`` derives it from the precision (bf16 for ``bf16-mixed``/``bf16-true``, fp32 for
    ``32-true``)."""
    reduce_dtype: Optional[Union[str, torch.dtype]] = option(None, position=14)
    """Dtype of FSDP2's gradient reduce-scatter (its ``MixedPrecisionPolicy``); ``None`` means fp32."""
    reshard_after_forward: Literal["default", "always", "never"] = option("default", position=15)
    """``"default"`` (free each unit's gathered parameters after its forward, except the output unit's — final
    norm and head — and the last block's, which backward needs first (torchtitan's); under a zero-bubble pipeline schedule none, as ``"never"``: its
    split backward needs them), ``"always"`` or ``"never"`` (ZeRO-2-like: more memory, fewer all-gathers)."""
    float8: Union[bool, Literal["emulate"]] = option(False, position=17)
    """Train the block projections in float8 (torchao's ``Float8Linear``; GPUs with CUDA compute capability
    >= 8.9, ``pip install "lightning-2d[float8]"``), with torchao's float8 tensor-parallel styles.
    ``"emulate"``: the same float8 rounding computed in high precision on any device (tests, debugging; slower
    than not converting)."""
    float8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = option("tensorwise", position=18)
    """torchao's scaling recipe: ``"tensorwise"`` (fastest), ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (more
    accurate)."""
    fsdp_float8_all_gather: bool = option(False, position=19)
    """FSDP2 all-gathers the float8 weights in float8 (half the bytes of bf16; ``"tensorwise"`` only); their
    scales are computed after each optimizer step."""
    async_tensor_parallel: bool = option(False, position=20)
    """Overlap the sequence-parallel all-gathers and reduce-scatters with the matmuls (inductor's
    micro-pipelined TP over symmetric memory). Needs CUDA, NCCL, ``compile=True``, ``sequence_parallel=True``
    and ``tensor_parallel_size > 1``."""
    reduce_every_micro_batch: bool = option(False, position=16)
    """With gradient accumulation, reduce-scatter the gradients after every micro-batch (least memory) instead
    of once, after the last micro-batch (the default: ``n - 1`` of ``n`` reduce-scatters saved, but between
    micro-batches each rank holds its unsharded gradients, ``4 × parameters / tensor_parallel_size`` bytes).
    Under pipeline parallelism it applies to the pipeline's micro-batches: by default every FSDP unit of a
    rank's stages stays gathered and keeps its unsharded gradient from its first backward to the end of the
    step (torch's ``PipelineStage``); with this option each micro-batch's backward reshards and
    reduce-scatters (an all-gather and a reduce-scatter per unit and micro-batch)."""
    non_finite: Literal["raise", "skip", "off"] = option("raise", position=25)
    """What a step whose loss or gradients are NaN/inf on any rank does, decided by all ranks together before
    the update (``lightning_2d.parallel.guard``): ``"raise"`` stops every rank naming the step and the ranks;
    ``"skip"`` drops that step's gradients everywhere (weights and optimizer state unchanged) and goes on;
    ``"off"`` checks nothing per step (no extra gradient read or all-gather: benchmarks), as plain Lightning
    does. The first loss and the weights at every save are checked under every policy: a checkpoint is never
    saved from NaN/inf weights."""
    context_parallel_size: int = option(1, position=29)
    """Context parallelism: each sequence is split over this many ranks, each holding ``2`` of its ``2 ×
    context_parallel_size`` chunks (one early, one late: the same causal-attention work on each), and every
    attention layer all-gathers keys and values across them (``lightning_2d.parallel.context``). Divides the
    activations by this size; FSDP shards over data-shard × context ranks. The sequence length must be a multiple of
    ``2 × context_parallel_size`` (× ``tensor_parallel_size`` under sequence parallelism). ``1`` (default): off."""
    fsdp_backend: Literal["fully_shard", "simple_fsdp"] = option("fully_shard", position=30)
    """How parameters are sharded over the data-parallel ranks: ``"fully_shard"`` (FSDP2: units with hooks that
    all-gather, reshard and reduce-scatter) or ``"simple_fsdp"`` (SimpleFSDP, ``lightning_2d.parallel.simple_fsdp``:
    each parameter gathered on use by a DTensor redistribute whose backward reduce-scatters, so that under
    ``compile=True`` the collectives are graph ops the compiler can bucket and reorder). The same sharded
    parameters and checkpoints under both. Under ``"simple_fsdp"`` a block's gathered weights are freed after its
    forward only when activation checkpointing recomputes that block (else autograd keeps them to its backward),
    and every micro-batch's backward (a pipeline's too) reduces its gradients."""
    expert_parallel_size: int = option(1, position=31)
    """Expert parallelism for mixture-of-experts models: each layer's routed experts are split over this many ranks,
    carved out of the data-shard × context ranks (which must be a multiple of it), and each token travels to its
    experts' ranks and back by all-to-all (``lightning_2d.parallel.expert``); the experts are FSDP-sharded over the
    remaining ``data-shard × context / expert_parallel_size`` ranks. Must divide the model's number of experts.
    ``1`` (default): every rank holds every expert (FSDP-sharded, or tensor-parallel under ``tensor_parallel_size``)."""
    experts_over_tensor_parallel: bool = option(False, position=32)
    """Expert parallelism's groups take in the tensor-parallel ranks: ``expert_parallel_size`` is ``k ×
    tensor_parallel_size``, ``k`` dividing the data-shard × context ranks, and under sequence parallelism each
    tensor-parallel rank routes its own slice of the sequence to the experts (the router and shared experts on the
    slice too), so no expert's work is repeated (torchtitan's expert parallelism borrowing the tensor-parallel
    ranks). ``False`` (default): the expert-parallel ranks come out of the data-shard × context ranks only, and every
    tensor-parallel rank computes its group's experts whole, on the same tokens: their FLOPs repeated
    ``tensor_parallel_size`` times (their memory is not)."""
    pipeline_parallel_size: int = option(1, position=3)
    """Number of pipeline stages' ranks (``torch.distributed.pipelining``): the transformer blocks are split
    into stages, consecutive stages on consecutive pipeline ranks, each stage tensor-parallel and FSDP-sharded
    on its own ``(data_parallel, tensor_parallel)`` sub-mesh. The outermost mesh dimension (across nodes).
    ``1`` (default): no pipeline."""
    pipeline_schedule: ScheduleName = option("1F1B", position=4)
    """``"1F1B"`` (default), ``"GPipe"`` (all forwards, then all backwards: more activation memory),
    ``"Interleaved1F1B"`` (several stages per rank, a smaller bubble), or a zero-bubble schedule, which splits
    each backward into its input and weight halves and runs weight halves in the bubble:
    ``"InterleavedZeroBubble"`` (stages in a loop, like Interleaved1F1B), ``"ZBVZeroBubble"`` and
    ``"DualPipeV"`` (2 stages per rank in a V: rank ``r`` holds stages ``r`` and ``2·pp - 1 - r``; DualPipeV needs
    ``2 × pipeline_parallel_size`` micro-batches). The zero-bubble schedules keep every FSDP unit gathered from
    forward to backward (``reshard_after_forward="default"``) and refuse ``compile``, per-op selective activation
    checkpointing and ``reduce_every_micro_batch``."""
    pipeline_microbatches: Optional[int] = option(None, position=5)
    """Micro-batches each batch is split into (must divide the per-rank batch size; at least
    ``pipeline_parallel_size`` for the 1F1B schedules). ``None``: one sequence per micro-batch (the batch size).
    The idle fraction (bubble) of 1F1B/GPipe is about ``(p - 1) / (m + p - 1)`` for ``p`` stages and ``m``
    micro-batches."""
    pipeline_stages_per_rank: Optional[int] = option(None, position=6)
    """Stages each pipeline rank holds: ``1`` for ``"1F1B"``/``"GPipe"``, at least 2 for ``"Interleaved1F1B"`` and
    ``"InterleavedZeroBubble"``, exactly 2 for ``"ZBVZeroBubble"``/``"DualPipeV"`` (``None``: 1, or 2 for the
    others)."""
    pipeline_layers_per_stage: Optional[list[int]] = option(None, position=7)
    """Transformer blocks of each stage, in order (``[9, 8, 8, 7]``); ``None``: a balanced split by compute, the
    output head counted in the last stage."""

    def __post_init__(self) -> None:
        if self.activation_checkpointing == "selective" and _is_digits(self.selective_ac_option):
            self.selective_ac_option = int(self.selective_ac_option)  # "2" from a command line: every 2nd block
        raise_if_problems(self.problems())
        self.param_dtype = _dtype(self.param_dtype)
        self.reduce_dtype = _dtype(self.reduce_dtype)

    def problems(self) -> list[str]:
        """The options' own problems (no world size or model needed): every registered check that needs no input."""
        return run_checks(vars(self))

    @property
    def schedule(self) -> Schedule:
        """The ``pipeline_schedule``'s facts (``parallel/schedules.py``)."""
        return SCHEDULES[self.pipeline_schedule]

    @property
    def num_pipeline_stages(self) -> int:
        """Stages of the pipeline: ``pipeline_parallel_size × stages per rank``."""
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pipeline_schedule, self.pipeline_stages_per_rank)

    @property
    def zero_bubble(self) -> bool:
        """Whether a pipeline runs a zero-bubble schedule (each backward split into an input and a weight pass)."""
        return self.pipeline_parallel_size > 1 and self.schedule.zero_bubble

    @property
    def reshard_policy(self) -> str:
        """The ``reshard_after_forward`` policy applied: ``"default"`` is ``"never"`` under a zero-bubble schedule.

        Their input pass collects the weights to differentiate later from the stage's ``parameters()`` when
        it starts; a unit resharded after forward shows its sharded parameters then, which are not in the
        graph, and its weight gradients are silently never computed (measured: every block but the first
        stage's lost them). Under a pipeline every unit stays gathered from its first backward to the end of
        the step anyway (``PipelineStage``), so the peak is the same.
        """
        if self.reshard_after_forward == "default" and self.zero_bubble:
            return "never"
        return self.reshard_after_forward

    @property
    def pipeline_placement(self) -> str:
        """Where the stages go: ``"v"`` for the V-shaped schedules (rank ``r`` holds stages ``r`` and
        ``2·pp - 1 - r``), else ``"loop"`` (stage ``s`` on rank ``s % pp``)."""
        return self.schedule.placement

    def block_count_problems(self, num_blocks: int) -> list[str]:
        """The pipeline's stages against the model's ``num_blocks`` transformer blocks."""
        return block_count_problems(
            self.pipeline_parallel_size, self.pipeline_schedule, self.pipeline_stages_per_rank,
            self.pipeline_layers_per_stage, num_blocks,
        )

    def microbatch_problems(self, microbatches: int, batch_size: Optional[int], schedule_checks: bool = True) -> list[str]:
        """What the schedule needs of the micro-batch count (and the batch size, when known)."""
        return microbatch_problems(
            self.pipeline_parallel_size, self.pipeline_schedule, self.pipeline_stages_per_rank, microbatches,
            batch_size, schedule_checks,
        )

    def resolve_dtypes(self, precision: str) -> ParallelConfig:
        """A copy whose ``param_dtype``/``reduce_dtype`` are filled in from the Trainer/Fabric ``precision``."""
        param_dtype, reduce_dtype = PRECISION_TO_DTYPES[str(precision)]
        return replace(self, param_dtype=self.param_dtype or param_dtype, reduce_dtype=self.reduce_dtype or reduce_dtype)


def _is_digits(value: Any) -> bool:
    return isinstance(value, str) and value.isdigit()


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def stages_per_rank(pipeline_schedule: str, pipeline_stages_per_rank: Optional[int]) -> int:
    """The stages each rank holds: ``pipeline_stages_per_rank``, or the schedule's default (1, or 2)."""
    if pipeline_stages_per_rank is not None:
        return pipeline_stages_per_rank
    schedule = schedule_of(pipeline_schedule)
    return schedule.default_stages_per_rank if schedule is not None else 1


# ---- the options' own checks (``parallel/checks.py``): each reads the options its parameters name ---------------
@check
def size_options(
    data_parallel_size: Any, tensor_parallel_size: Any, data_parallel_replicate_size: Any, context_parallel_size: Any,
    expert_parallel_size: Any = 1,
) -> list[str]:
    """The mesh sizes are positive integers (``data_parallel_size``/``tensor_parallel_size``: or ``"auto"``)."""
    problems = []
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if value != "auto" and not _is_positive_int(value):
            problems.append(f"{name} must be a positive integer or 'auto', got {value!r}")
    for name, value in (("data_parallel_replicate_size", data_parallel_replicate_size),
                        ("context_parallel_size", context_parallel_size),
                        ("expert_parallel_size", expert_parallel_size)):
        if not _is_positive_int(value):
            problems.append(f"{name} must be a positive integer, got {value!r}")
    return problems


@check
def activation_checkpointing_options(activation_checkpointing: Any, selective_ac_option: Any) -> list[str]:
    """``activation_checkpointing`` is a mode; under ``"selective"``, ``selective_ac_option`` is ``"op"`` or N."""
    if activation_checkpointing not in AC_MODES:
        return [
            f"activation_checkpointing={activation_checkpointing!r} is not a mode; choose one of"
            f" {', '.join(repr(m) for m in AC_MODES)}"
        ]
    is_int = isinstance(selective_ac_option, int) and not isinstance(selective_ac_option, bool)
    valid = selective_ac_option == "op" or (is_int and selective_ac_option >= 1)
    if activation_checkpointing == "selective" and not valid:
        return [
            f"selective_ac_option={selective_ac_option!r} is invalid; use 'op' (per-op selective"
            " checkpointing) or a positive integer N (checkpoint every N-th block)"
        ]
    return []


@check
def reshard_option(reshard_after_forward: Any) -> list[str]:
    """``reshard_after_forward`` is a policy."""
    if reshard_after_forward not in RESHARD_POLICIES:
        return [
            f"reshard_after_forward={reshard_after_forward!r} is not a policy; choose one of"
            f" {', '.join(repr(p) for p in RESHARD_POLICIES)}"
        ]
    return []


@check
def fsdp_backend_option(fsdp_backend: Any) -> list[str]:
    """``fsdp_backend`` is a backend."""
    if fsdp_backend not in FSDP_BACKENDS:
        return [f"fsdp_backend={fsdp_backend!r} is not a backend; choose one of {', '.join(map(repr, FSDP_BACKENDS))}"]
    return []


@check
def simple_fsdp_resharding(fsdp_backend: Any, reshard_after_forward: Any, activation_checkpointing: Any) -> list[str]:
    """Under SimpleFSDP resharding is the recomputation of activation checkpointing (no hook frees a weight)."""
    if fsdp_backend != "simple_fsdp":
        return []
    if reshard_after_forward == "always" and activation_checkpointing == "none":
        return [
            "fsdp_backend='simple_fsdp' with reshard_after_forward='always' and activation_checkpointing='none':"
            " SimpleFSDP has no hook to free a gathered weight after forward (autograd keeps it for the backward);"
            " it reshards by recomputing the gather. Set activation_checkpointing='full' (or 'selective'), or"
            " reshard_after_forward='default'"
        ]
    if reshard_after_forward == "never" and activation_checkpointing != "none":
        return [
            f"fsdp_backend='simple_fsdp' with reshard_after_forward='never' and"
            f" activation_checkpointing={activation_checkpointing!r}: the recomputation of a checkpointed block"
            " gathers its weights again, so they cannot stay gathered; use reshard_after_forward='default', or"
            " activation_checkpointing='none'"
        ]
    return []


@check
def simple_fsdp_composition(fsdp_backend: Any, float8: Any, fsdp_float8_all_gather: Any) -> list[str]:
    """What SimpleFSDP cannot run with: FSDP2's float8 all-gather (a ``fully_shard`` extension point)."""
    if fsdp_backend != "simple_fsdp" or not (float8 and fsdp_float8_all_gather is True):
        return []
    return [
        f"fsdp_backend='simple_fsdp' with float8={float8!r} and fsdp_float8_all_gather=True: the float8 all-gather"
        " is FSDP2's (torchao's weight subclass hooks fully_shard's all-gather, fsdp_pre_all_gather); SimpleFSDP"
        " gathers with a DTensor redistribute, in param_dtype, and casts to float8 after it; use"
        " fsdp_float8_all_gather=False, or fsdp_backend='fully_shard'"
    ]


#: The first torch whose compiled full activation checkpointing fails under SimpleFSDP (measured: 2.13.0 on CPU, one
#: rank and 2 × 2; 2.11 passed on an H200, ``tests/gpu/results/2026-12-04_h200``).
SIMPLE_FSDP_COMPILED_FULL_AC_FAILS_FROM = (2, 13)


@check
def simple_fsdp_compiled_checkpointing(fsdp_backend: Any, compile: Any, activation_checkpointing: Any) -> list[str]:
    """SimpleFSDP's gathers inside a compiled, fully checkpointed block: torch 2.13's AOTAutograd saves a
    ``DeviceMesh`` among the tensors for backward and fails every forward ("expected all tensors_saved_with_vc_check to
    be Tensors"); selective checkpointing compiles."""
    if fsdp_backend != "simple_fsdp" or compile is not True or activation_checkpointing != "full":
        return []
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < SIMPLE_FSDP_COMPILED_FULL_AC_FAILS_FROM:
        return []
    return [
        f"fsdp_backend='simple_fsdp' with compile=True and activation_checkpointing='full' fails in torch"
        f" {torch.__version__} (its compiled checkpoint saves a DeviceMesh among the tensors for backward: \"expected all"
        " tensors_saved_with_vc_check to be Tensors\"); use activation_checkpointing='selective' (compiles), or"
        " fsdp_backend='fully_shard', or compile=False"
    ]


@check
def boolean_options(
    sequence_parallel: Any, loss_parallel: Any, compile: Any, fsdp_float8_all_gather: Any,
    async_tensor_parallel: Any, reduce_every_micro_batch: Any,
) -> list[str]:
    """The on/off options are booleans."""
    values = dict(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, compile=compile,
                  fsdp_float8_all_gather=fsdp_float8_all_gather, async_tensor_parallel=async_tensor_parallel,
                  reduce_every_micro_batch=reduce_every_micro_batch)
    return [
        f"{name} must be True or False, got {value!r} ({type(value).__name__})"
        for name, value in values.items() if not isinstance(value, bool)
    ]


@check
def dtype_options(param_dtype: Any, reduce_dtype: Any) -> list[str]:
    """``param_dtype``/``reduce_dtype`` name a dtype FSDP2 × TP can use here."""
    problems = []
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and not isinstance(value, torch.dtype) and value not in DTYPE_NAMES:
            problems.append(f"{name}={value!r} is not a dtype; use one of {', '.join(SUPPORTED_DTYPE_NAMES)}")
        elif value is not None and _dtype(value) not in SUPPORTED_DTYPES:
            problems.append(
                f"{name}={value!r} is not supported: float16 needs a gradient scaler, which FSDP2 × TP does not"
                " offer here (as precision='16-mixed'); use 'bfloat16' (same memory, no scaling) or 'float32'"
            )
    return problems


@check
def float8_options(float8: Any, float8_recipe: Any, fsdp_float8_all_gather: Any) -> list[str]:
    """``float8`` is a mode, ``float8_recipe`` torchao's, and ``fsdp_float8_all_gather`` needs both."""
    problems = []
    if float8 not in (True, False, "emulate"):
        problems.append(f"float8={float8!r} is invalid; use True, False or 'emulate' (no float8 hardware needed)")
    problems += float8_recipe_problems(float8_recipe, fsdp_float8_all_gather, "float8_recipe")
    if fsdp_float8_all_gather and not float8:
        problems.append("fsdp_float8_all_gather=True needs float8=True; set both or neither")
    return problems


@check
def non_finite_option(non_finite: Any) -> list[str]:
    """``non_finite`` is a policy."""
    if non_finite not in NON_FINITE_POLICIES:
        return [
            f"non_finite={non_finite!r} is not a policy; choose 'raise' (stop, naming the step and"
            " ranks), 'skip' (drop the step's gradients on every rank and go on) or 'off' (no per-step check)"
        ]
    return []


def _pipeline_is_valid(pipeline_parallel_size: Any, pipeline_schedule: Any) -> bool:
    """Whether the pipeline's size and schedule are valid (``pipeline_options`` reports them otherwise)."""
    return _is_positive_int(pipeline_parallel_size) and schedule_of(pipeline_schedule) is not None


@check
def pipeline_options(pipeline_parallel_size: Any, pipeline_schedule: Any) -> list[str]:
    """``pipeline_parallel_size`` is positive (and runs on this torch), ``pipeline_schedule`` is a schedule."""
    pp = pipeline_parallel_size
    if not _is_positive_int(pp):
        return [f"pipeline_parallel_size must be a positive integer, got {pp!r}"]
    problems = []
    if pp > 1 and torch.__version__ < PIPELINE_MIN_TORCH:
        problems.append(
            f"pipeline_parallel_size={pp} needs torch >= {PIPELINE_MIN_TORCH} (the release lightning_2d's pipeline is"
            f" tested with; torch.distributed.pipelining changed before it), found {torch.__version__}; upgrade"
            " torch or use pipeline_parallel_size=1"
        )
    if schedule_of(pipeline_schedule) is None:
        problems.append(
            f"pipeline_schedule={pipeline_schedule!r} is not a schedule; choose one of"
            f" {', '.join(map(repr, SCHEDULES))}"
        )
    return problems


@check
def pipeline_counts(
    pipeline_parallel_size: Any, pipeline_schedule: Any, pipeline_microbatches: Any, pipeline_stages_per_rank: Any
) -> list[str]:
    """``pipeline_microbatches`` and ``pipeline_stages_per_rank`` are positive (when given)."""
    if not _pipeline_is_valid(pipeline_parallel_size, pipeline_schedule):
        return []
    return [
        f"{name} must be a positive integer, got {value!r}"
        for name, value in (("pipeline_microbatches", pipeline_microbatches),
                            ("pipeline_stages_per_rank", pipeline_stages_per_rank))
        if value is not None and not _is_positive_int(value)
    ]


@check
def stages_per_rank_option(
    pipeline_parallel_size: Any, pipeline_schedule: Any, pipeline_stages_per_rank: Any
) -> list[str]:
    """``pipeline_stages_per_rank`` is what the schedule runs (``Schedule.stages``)."""
    per_rank, name = pipeline_stages_per_rank, pipeline_schedule
    if not _pipeline_is_valid(pipeline_parallel_size, name) or per_rank is None or not _is_positive_int(per_rank):
        return []
    stages = SCHEDULES[name].stages
    if stages == "single" and per_rank != 1:
        return [
            f"pipeline_schedule={name!r} runs one stage per rank, but pipeline_stages_per_rank={per_rank}; use"
            " pipeline_schedule='Interleaved1F1B' for several stages per rank, or pipeline_stages_per_rank=1"
        ]
    if stages == "multi" and per_rank < 2:
        return [
            f"pipeline_schedule={name!r} interleaves several stages per rank, but pipeline_stages_per_rank={per_rank};"
            " use 2 or more (the default), or pipeline_schedule='1F1B'"
        ]
    if stages == "v" and per_rank != 2:
        return [
            f"pipeline_schedule={name!r} places exactly 2 stages on each rank, in a V (rank r holds stages r and"
            f" 2·pp - 1 - r), but pipeline_stages_per_rank={per_rank}; use 2 (the default), or"
            " pipeline_schedule='InterleavedZeroBubble' for another count"
        ]
    return []


@check
def zero_bubble_options(
    pipeline_parallel_size: Any, pipeline_schedule: Any, compile: Any, activation_checkpointing: Any,
    selective_ac_option: Any, reduce_every_micro_batch: Any, reshard_after_forward: Any,
) -> list[str]:
    """What the zero-bubble schedules (each backward split into an input and a weight pass) cannot run with."""
    if not _pipeline_is_valid(pipeline_parallel_size, pipeline_schedule) or pipeline_parallel_size == 1:
        return []
    name, problems = pipeline_schedule, []
    if not SCHEDULES[name].zero_bubble:
        return []
    if compile:
        problems.append(
            f"pipeline_schedule={name!r} splits each backward into its input and weight halves, which torch 2.13"
            " does not support for compiled modules (the schedule raises on torch.compile'd stages); use"
            " compile=False, or pipeline_schedule='Interleaved1F1B'"
        )
    if activation_checkpointing == "selective" and selective_ac_option == "op":
        problems.append(
            f"pipeline_schedule={name!r} runs a second backward pass (the weights') over each micro-batch's graph,"
            " which per-op selective activation checkpointing refuses (torch: \"Trying to backward an extra"
            " time ... under selective activation checkpoint\"); use activation_checkpointing='full' (or"
            " selective_ac_option=N: every N-th block fully checkpointed), or pipeline_schedule='Interleaved1F1B'"
        )
    problems += _zero_bubble_sharding_problems(name, reduce_every_micro_batch, reshard_after_forward)
    return problems


def _zero_bubble_sharding_problems(name: str, reduce_every_micro_batch: Any, reshard_after_forward: Any) -> list[str]:
    """The FSDP settings a split backward cannot run with (``zero_bubble_options``)."""
    problems = []
    if reduce_every_micro_batch:
        problems.append(
            f"pipeline_schedule={name!r} with reduce_every_micro_batch=True: each micro-batch's input pass would"
            " end in FSDP's reduce-scatter and reshard, before its weight pass computed the weight gradients"
            " (torch fails looking the gathered weights up); use reduce_every_micro_batch=False, or"
            " pipeline_schedule='Interleaved1F1B'"
        )
    if reshard_after_forward == "always":
        problems.append(
            f"pipeline_schedule={name!r} with reshard_after_forward='always': the split backward finds the weights"
            " to differentiate among the stage's parameters before its first unit is gathered again, so the"
            " resharded units' weight gradients would never be computed; use reshard_after_forward='default'"
            " (which keeps them gathered under these schedules) or 'never'"
        )
    return problems


@check
def layers_per_stage_option(
    pipeline_parallel_size: Any, pipeline_schedule: Any, pipeline_stages_per_rank: Any, pipeline_layers_per_stage: Any
) -> list[str]:
    """``pipeline_layers_per_stage`` gives one positive block count per stage."""
    layers, pp = pipeline_layers_per_stage, pipeline_parallel_size
    if layers is None or not _pipeline_is_valid(pp, pipeline_schedule):
        return []
    if not isinstance(layers, (list, tuple)) or not all(_is_positive_int(n) for n in layers):
        return [f"pipeline_layers_per_stage must be a list of positive block counts, one per stage, got {layers!r}"]
    per_rank = stages_per_rank(pipeline_schedule, pipeline_stages_per_rank)
    if len(layers) != pp * per_rank:
        return [
            f"pipeline_layers_per_stage has {len(layers)} entries but the pipeline has {pp * per_rank} stages"
            f" (pipeline_parallel_size {pp} × {per_rank} per rank); give one block count per stage"
        ]
    return []


@check
def microbatches_option(
    pipeline_parallel_size: Any, pipeline_schedule: Any, pipeline_stages_per_rank: Any, pipeline_microbatches: Any
) -> list[str]:
    """A given ``pipeline_microbatches`` is a count the schedule runs (``microbatch_problems``)."""
    pp, given = pipeline_parallel_size, pipeline_microbatches
    if not _pipeline_is_valid(pp, pipeline_schedule) or pp == 1 or not isinstance(given, int):
        return []
    return microbatch_problems(pp, pipeline_schedule, pipeline_stages_per_rank, given, batch_size=None)


def block_count_problems(
    pipeline_parallel_size: int, pipeline_schedule: str, pipeline_stages_per_rank: Optional[int],
    pipeline_layers_per_stage: Optional[list[int]], num_blocks: int,
) -> list[str]:
    """The pipeline's stages against the model's ``num_blocks`` transformer blocks."""
    per_rank = stages_per_rank(pipeline_schedule, pipeline_stages_per_rank)
    stages, layers = pipeline_parallel_size * per_rank, pipeline_layers_per_stage
    if num_blocks < stages:
        return [
            f"the model has {num_blocks} transformer blocks, fewer than the {stages} pipeline stages"
            f" (pipeline_parallel_size {pipeline_parallel_size} × {per_rank} per rank): every"
            " stage needs at least one block; use a smaller pipeline_parallel_size or fewer stages per rank"
        ]
    if isinstance(layers, (list, tuple)) and sum(layers) != num_blocks:
        return [
            f"pipeline_layers_per_stage {list(layers)} adds up to {sum(layers)} blocks but the model has"
            f" {num_blocks}; the counts must add up to the model's blocks"
        ]
    return []


def microbatch_problems(
    pipeline_parallel_size: int, pipeline_schedule: str, pipeline_stages_per_rank: Optional[int], microbatches: int,
    batch_size: Optional[int], schedule_checks: bool = True,
) -> list[str]:
    """What the schedule needs of the micro-batch count (and the batch size, when known)."""
    problems = []
    if batch_size is not None and batch_size % microbatches:
        fits = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        problems.append(
            f"pipeline_microbatches ({microbatches}) must divide the per-rank batch size ({batch_size}); use one"
            f" of {', '.join(map(str, fits))} or change the batch size"
        )
    if schedule_checks:
        stages = pipeline_parallel_size * stages_per_rank(pipeline_schedule, pipeline_stages_per_rank)
        problems += _schedule_microbatch_problems(pipeline_schedule, pipeline_parallel_size, stages, microbatches)
    return problems


def _schedule_microbatch_problems(name: str, pp: int, stages: int, microbatches: int) -> list[str]:
    """The schedule's own rules on the micro-batch count (``Schedule.min_microbatches`` and the interleaved ones')."""
    problems, least = [], SCHEDULES[name].min_microbatches
    if least == "pipeline_parallel_size" and microbatches < pp:
        problems.append(
            f"pipeline_schedule={name!r} needs at least pipeline_parallel_size ({pp}) micro-batches, got"
            f" {microbatches}; raise pipeline_microbatches (or the batch size), or use 'GPipe'"
        )
    if name == "Interleaved1F1B" and microbatches >= pp and microbatches % pp:
        problems.append(
            f"pipeline_schedule='Interleaved1F1B' needs the micro-batch count ({microbatches}) to be a multiple"
            f" of pipeline_parallel_size ({pp})"
        )
    rounds = max(1, microbatches // pp)
    if name == "InterleavedZeroBubble" and microbatches % rounds:
        fits = [k for k in range(microbatches - 1, 0, -1) if k % max(1, k // pp) == 0][:1]
        problems.append(
            f"pipeline_schedule='InterleavedZeroBubble' runs the micro-batches in rounds of about"
            f" pipeline_parallel_size ({pp}): {microbatches} micro-batches make {rounds} rounds, which must divide"
            f" them; use a multiple of {pp}, or at most {pp} (e.g. {fits[0] if fits else pp})"
        )
    if least == "stages" and microbatches < stages:
        problems.append(
            f"pipeline_schedule={name!r} needs at least as many micro-batches as stages ({stages}:"
            f" 2 × pipeline_parallel_size {pp}), got {microbatches}; raise pipeline_microbatches (or the batch"
            " size), or use 'ZBVZeroBubble'"
        )
    return problems


class PipelineStages(Protocol):
    """What a model family tells the pipeline about its models (``ParallelPlan.pipeline_stages``): the
    library splits by blocks and runs schedules; the family knows its modules (our Llama:
    ``lightning_2d.models.llama.pipeline``)."""

    def check(self, model: "nn.Module") -> None:
        """Raise ``ParallelConfigError`` for a model this family cannot split."""

    def block_names(self, model: "nn.Module") -> list[str]:
        """The blocks, in order."""

    def block_costs(self, model: "nn.Module", block_names: list[str]) -> tuple[list[float], float, float]:
        """A compute proxy per block, for the head (counted in the last stage) and the embedding (first)."""

    def stage(self, model: "nn.Module", block_names: list[str], first: bool, last: bool) -> "nn.Module":
        """A module running ``block_names`` (+ the embedding if ``first``, the head and loss if ``last``):
        ``forward(x, labels=None)`` takes token ids or hidden states, returns hidden states or the summed loss;
        it has a ``seq_len`` attribute (the batch's full sequence length, set by the pipeline)."""

    def prune(self, model: "nn.Module", kept_blocks: set[str], first: bool, last: bool) -> None:
        """Drop from ``model`` (meta device) every module this rank's stages do not hold, keeping names."""

    def hidden_size(self, model: "nn.Module") -> int:
        """The width of the hidden states passed between stages."""


@dataclass
class ParallelPlan:
    """Where the parallelism goes in a model: module names, not code.

    ``LlamaLightningModule`` provides the Llama plan; for another architecture pass a plan to the
    strategy (or define ``parallel_plan(config)`` on your LightningModule).

    Args:
        tensor_parallel: Module name pattern (relative to the model; ``*`` matches one name level,
            as in ``layers.*.attention.wq``) → ``torch.distributed.tensor.parallel`` style.
            Applied with ``parallelize_module`` in insertion order. Empty: no tensor parallelism
            (the model is then only FSDP-sharded, whatever ``tensor_parallel_size`` says — the
            strategy refuses ``tensor_parallel_size > 1`` with an empty plan).
        sequence_parallel: Styles that replace or add to ``tensor_parallel`` when the strategy's
            ``sequence_parallel`` option is on (norms as ``SequenceParallel()``, row-wise outputs
            as ``Shard(1)``, ``PrepareModuleInput`` gathering the sequence before attention/MLP),
            so that one static plan serves both settings. Empty, and no ``SequenceParallel``
            style in ``tensor_parallel``: the plan has no sequence-parallel form, and
            ``sequence_parallel=True`` has no effect (a warning says so). A plan whose
            ``tensor_parallel`` already holds sequence-parallel styles is refused under
            ``sequence_parallel=False`` (move those styles here).
        blocks: Name of the ``ModuleDict``/``ModuleList`` holding the repeated blocks: the unit of
            activation checkpointing, compilation and FSDP sharding.
        module: Attribute of the LightningModule that holds the model (``"model"``), or ``""``
            when the plan applies to the module passed in itself (Fabric).
        tp_divides: Named sizes the tensor-parallel size must divide (``{"n_heads": 32}``);
            checked before any process group is created.
        sequence_dim: Dimension of the model input that sequence parallelism shards (for the
            sequence-length check).
        input_units: Modules run before the blocks (the token embedding), each sharded as its own
            FSDP unit so its parameters are gathered only while it runs, not for the whole forward.
        output_unit: Modules run after the blocks (final norm, output head), sharded together as one
            FSDP unit. Backward needs them first, so the ``"default"`` reshard policy keeps them
            gathered from the end of forward to their backward (one all-gather saved per step).
            Modules named in neither stay in the root unit (gathered for the whole forward).
        blocks_use_randomness: Whether the blocks draw random numbers (dropout), so that activation
            checkpointing must replay the random state in recomputation; ``None``: detected from
            dropout modules with ``p > 0``.
        num_blocks: How many blocks the model has, when known before it is built (the pipeline split
            is then checked before any process starts).
        pipeline_stages: How the model splits into pipeline stages by its blocks
            (``lightning_2d.parallel.pipeline.PipelineStages``; ``llama_plan`` gives our Llama's), or
            ``None``: the model cannot be pipelined (refused before any process starts when
            ``pipeline_parallel_size > 1``).
        attention: ``fnmatch`` pattern of the attention modules (``"layers.*.attention"``) whose
            ``attend(q, k, v, mask)`` core context parallelism replaces (with the model's ``build_attention_mask``),
            or ``None``: the model's attention cannot be split over the sequence (refused before any process starts
            when ``context_parallel_size > 1``).
        tied_weights: Groups of parameter names that are one parameter (``(("tok_embeddings.weight",
            "output.weight"),)`` for tied embeddings), so that what cannot keep a tie (pipeline stages) is refused
            before any process starts; ``parallelize_model`` keeps every tie it finds in the model itself
            (``lightning_2d.parallel.ties``).
        num_experts: The routed experts of each mixture-of-experts layer (``lightning_2d.ops.moe.MoE``), which
            ``expert_parallel_size`` must divide (checked before any process starts); ``None``: no such layers
            (``expert_parallel_size > 1`` is refused).
        aux_loss_coef: The weight of the mixture of experts' auxiliary load-balancing loss
            (``ops.moe.MoEArgs.uses_aux_loss``), which reads the routing of every block of a step at once, so every
            block must run in one process each step (pipeline stages are refused); ``None``: no such loss.
        whole_experts: The model type of a model whose mixture-of-experts layers run whole on every rank
            (``parallel.styles.WholeOnEachRank``: a Hugging Face decoder's, whose experts the library cannot split),
            which the family's check names when it refuses ``expert_parallel_size > 1``; ``None``: none such.
        expert_parallel: Module name pattern (as in ``tensor_parallel``) → style, applied over the
            ``expert_parallel`` mesh under ``expert_parallel_size > 1`` (``parallel.expert.apply_expert_parallel``,
            after tensor parallelism): each names one layer's stacked routed experts, with
            ``parallel.expert.ExpertParallel()`` (every parameter split on its first, expert, dimension; the tokens
            exchanged around it). The modules named are FSDP-sharded by themselves over the experts' mesh
            (``ParallelMeshes.expert_fsdp``). Empty: the model's experts cannot be split (``expert_parallel_size >
            1`` is refused before any process starts).
        adapter_targets: The linear layers that take adapters when the adapters' settings name none (``LoRA.targets``
            is ``None``), by their last name or a dotted suffix: the family's attention and MLP projections
            (``lightning_2d.models.lora_targets``), read by the adapters' converter (``parallel.lora.LoRAAdapters``).
            Empty: the settings must name their targets.
        adapter_aliases: Other names of those layers that the settings may use (Hugging Face's ``q_proj`` → our
            ``wq``).

    A plan is data and is not checked when built: the strategy checks it against the options and the world before
    any process starts (a ``ParallelConfigError`` naming each problem) and against the model at ``setup``.

    Example:
        A plan for a GPT-style model (``recipes/custom_model_plan.py``, with its sequence-parallel form):

        ```python
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        from lightning_2d import ModelParallel2DStrategy, ParallelPlan

        plan = ParallelPlan(
            tensor_parallel={
                "blocks.*.attn.qkv": ColwiseParallel(),
                "blocks.*.attn.proj": RowwiseParallel(),
                "blocks.*.mlp.fc": ColwiseParallel(),
                "blocks.*.mlp.proj": RowwiseParallel(),
            },
            blocks="blocks",          # the ModuleList of repeated blocks: the AC, compile and FSDP unit
            module="net",             # the LightningModule's attribute holding the model
            tp_divides={"n_heads": 12},
        )
        strategy = ModelParallel2DStrategy(tensor_parallel_size=4, sequence_parallel=False, plan=plan)
        ```
    """

    tensor_parallel: dict[str, "ParallelStyle"] = field(default_factory=dict)
    sequence_parallel: dict[str, "ParallelStyle"] = field(default_factory=dict)
    blocks: str = "layers"
    module: str = "model"
    tp_divides: dict[str, int] = field(default_factory=dict)
    sequence_dim: int = 1
    input_units: tuple[str, ...] = ()
    output_unit: tuple[str, ...] = ()
    blocks_use_randomness: Optional[bool] = None
    num_blocks: Optional[int] = None
    pipeline_stages: Optional["PipelineStages"] = None
    attention: Optional[str] = None
    tied_weights: tuple[tuple[str, ...], ...] = ()
    num_experts: Optional[int] = None
    aux_loss_coef: Optional[float] = None
    whole_experts: Optional[str] = None
    expert_parallel: dict[str, "ParallelStyle"] = field(default_factory=dict)
    adapter_targets: tuple[str, ...] = ()
    adapter_aliases: dict[str, str] = field(default_factory=dict)

    @property
    def supports_pipeline(self) -> bool:
        """Whether the model can be split into pipeline stages (the plan has ``pipeline_stages``)."""
        return self.pipeline_stages is not None

    def sequence_parallel_entries(self) -> list[str]:
        """Names in ``tensor_parallel`` whose style only makes sense under sequence parallelism."""
        return [name for name, style in self.tensor_parallel.items() if is_sequence_parallel_style(style)]

    @property
    def has_sequence_parallel(self) -> bool:
        """Whether the plan has a sequence-parallel form (an overlay, or such styles in ``tensor_parallel``)."""
        return bool(self.sequence_parallel) or bool(self.sequence_parallel_entries())

    def tensor_parallel_styles(self, sequence_parallel: bool) -> dict[str, "ParallelStyle"]:
        """The styles to apply: ``tensor_parallel`` with the ``sequence_parallel`` overlay when on
        (a replaced name keeps its position, new names come last)."""
        if not sequence_parallel:
            return dict(self.tensor_parallel)
        return {**self.tensor_parallel, **self.sequence_parallel}
