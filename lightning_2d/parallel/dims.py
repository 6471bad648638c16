"""Mesh sizes: resolve ``"auto"``, check them against the world and the model, build the mesh.

Everything but ``build_device_mesh`` runs before the process group exists, so a bad layout is
reported in one message instead of a hang or a deep traceback from a collective. ``validate_parallel_dims`` runs
the registered checks (``parallel/checks.py``): the options' own (``parallel/config.py``), LoRA's
(``parallel/lora.py``, imported here so that they register in this order) and, below, those needing the world, the
model, the batch or the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from lightning_2d._compat import group_timeout, set_group_timeout
from lightning_2d.parallel import distillation as _distillation_checks  # noqa: F401 - registers distillation's checks
from lightning_2d.parallel import frozen as _frozen_checks  # noqa: F401 - registers the frozen model's check
from lightning_2d.parallel import lora as _lora_checks  # noqa: F401 - registers LoRA's checks (parallel/lora.py)
from lightning_2d.parallel import preference as _preference_checks  # noqa: F401 - registers preference's checks
from lightning_2d.parallel.async_tensor_parallel import symmetric_memory_available
from lightning_2d.parallel.checks import INPUTS, check, run_checks
from lightning_2d.parallel.config import (
    SUPPORTED_PRECISIONS,
    ParallelConfig,
    ParallelPlan,
    block_count_problems,
    microbatch_problems,
    raise_if_problems,
)
from lightning_2d.parallel.float8 import float8_device_problem, float8_off_cuda_problem, float8_torchao_problem
from lightning_2d.parallel.names import (  # noqa: F401 (re-exported)
    CP_DIM,
    DP_CP_DIM,
    DP_DIM,
    DP_REPLICATE_DIM,
    DP_SHARD_CP_DIM,
    DP_SHARD_DIM,
    EP_DIM,
    EP_SHARD_DIM,
    MESH_DIMS,
    PP_DIM,
    TP_DIM,
)
from lightning_2d.parallel.meshes import ParallelMeshes, as_meshes, build_meshes
from lightning_2d.parallel.ties import tied_pipeline_message

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_choices(values: list[int]) -> str:
    return values[0].__str__() if len(values) == 1 else ", ".join(map(str, values[:-1])) + f" or {values[-1]}"


@dataclass(frozen=True)
class ParallelDims:
    """Resolved mesh sizes: ``pp × dp_replicate × dp_shard × cp × tp == world_size``.

    The one owner of the device mesh: both strategies (and the planner) call ``build_mesh``.
    Rank ``r`` sits at ``(pp, replicate, shard, context, tensor)`` in row-major order (the last varies fastest):
    tensor-parallel groups are consecutive ranks (inside a node: the most traffic, every layer), then context
    groups (keys and values every layer, smaller), then FSDP shard groups, then replicas, then pipeline stages
    (outermost: their point-to-point traffic is the lightest). Every dimension is in the mesh, size 1 allowed
    (``ParallelMeshes``); ``as_dict`` lists the layout's (``pipeline_parallel``/``context_parallel`` only above 1).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    #: Expert parallelism's groups take in the tensor-parallel ranks (``experts_over_tensor_parallel``).
    ep_over_tp: bool = False

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas × shards (the sampler's ``num_replicas``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The root mesh's dimension names, every one at every layout (``MESH_DIMS``: ``pipeline_parallel`` first,
        ``context_parallel`` before ``tensor_parallel``)."""
        return MESH_DIMS

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The root mesh's sizes, in ``mesh_dims`` order (1 for a dimension the layout does not use)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str, timeout: Optional[timedelta] = None) -> ParallelMeshes:
        """The meshes of this layout (``lightning_2d.parallel.meshes``): the root with every dimension of
        ``mesh_dims`` (size 1 allowed), the flattened ``data_parallel`` … and FSDP's. Needs the default process group.

        Args:
            device_type: ``"cuda"``, ``"cpu"`` …
            timeout: Given to every process group of the mesh. ``init_device_mesh`` creates its groups
                with the backend's default (30 minutes for gloo, 10 for NCCL), not the default group's
                timeout: without this a rank stuck in a ``tensor_parallel`` or ``data_parallel``
                collective would wait that long whatever the strategy's ``timeout`` says.
        """
        meshes = build_meshes(device_type, dict(zip(self.mesh_dims, self.mesh_shape)), expert_parallel=self.ep,
                              over_tensor=self.ep_over_tp)
        if timeout is not None:  # every named mesh's group (an alias's is its mesh's: set once)
            groups = [*meshes.root.get_all_groups(), *(meshes.get(name).get_group() for name in meshes.names)]
            set_group_timeouts(groups, timeout)
        return meshes

    def fsdp_mesh(self, mesh: "ParallelMeshes | DeviceMesh") -> "DeviceMesh":
        """What FSDP2 shards over (``fsdp_mesh_of``)."""
        return fsdp_mesh_of(mesh)

    def as_dict(self) -> dict[str, int]:
        """The layout's sizes (what checkpoints and the planner record): ``pipeline_parallel`` and
        ``context_parallel`` only when above 1."""
        sizes = {"data_parallel_replicate": self.dp_replicate, "data_parallel_shard": self.dp_shard}
        sizes.update({CP_DIM: self.cp} if self.cp > 1 else {})
        sizes["tensor_parallel"] = self.tp
        sizes.update({EP_DIM: self.ep} if self.ep > 1 else {})
        return {PP_DIM: self.pp, **sizes} if self.pp > 1 else sizes


def set_group_timeouts(groups: list[Any], timeout: timedelta) -> None:
    """``timeout`` on each process group (the fake backend has none to set)."""
    for group in {id(g): g for g in groups}.values():
        try:
            set_group_timeout(group, timeout)
        except (RuntimeError, AttributeError, ValueError):  # a backend without timeouts (fake, custom)
            pass


def group_timeouts(mesh: "ParallelMeshes | DeviceMesh") -> dict[str, Optional[timedelta]]:
    """Mesh dim name (root and flattened) → its process group's timeout (where the backend tells it), for checks
    and tests."""
    import torch

    meshes = as_meshes(mesh)
    assert meshes is not None
    device = torch.device("cpu" if meshes.root.device_type == "cpu" else "cuda")
    out: dict[str, Optional[timedelta]] = {}
    for name in meshes.names:
        try:
            out[name] = group_timeout(meshes.get(name).get_group(), device)
        except (RuntimeError, AttributeError):
            out[name] = None
    return out


def fsdp_mesh_of(mesh: "ParallelMeshes | DeviceMesh") -> "DeviceMesh":
    """The FSDP mesh (``ParallelMeshes.fsdp``) of the meshes ``ParallelDims.build_mesh`` builds, of their root, or
    of Lightning's 2D mesh: the flattened data-parallel dimension, ``(replicate, shard)`` under HSDP; with context
    parallelism its shards are data-shard × context ranks (the parameters are the same on every context rank: they
    shard them too)."""
    meshes = as_meshes(mesh)
    assert meshes is not None
    return meshes.fsdp


def resolve_parallel_dims(config: ParallelConfig, world_size: int, devices_per_node: int) -> tuple[int, int]:
    """Fill in ``"auto"`` sizes (without validating the result).

    Both auto: tensor parallel within a node, data parallel across nodes. One auto: the other
    divides the world size (when it divides evenly; otherwise the given size is kept and the
    validation reports the mismatch).
    """
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    for size in (config.pipeline_parallel_size, config.context_parallel_size):
        if isinstance(size, int) and size > 1 and world_size % size == 0:
            world_size //= size  # the ranks of one pipeline stage (or context group) share data and tensor parallelism
    if dp == "auto" and tp == "auto":
        tp = min(devices_per_node, world_size)
        dp = max(1, world_size // tp)
    elif dp == "auto":
        dp = world_size // tp if world_size % tp == 0 else max(1, world_size // tp)
    elif tp == "auto":
        tp = world_size // dp if world_size % dp == 0 else max(1, world_size // dp)
    return int(dp), int(tp)


def validate_parallel_dims(
    config: ParallelConfig,
    *,
    world_size: int,
    devices_per_node: int,
    plan: ParallelPlan | None = None,
    precision: str | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    num_nodes: int = 1,
    device_type: str | None = None,
    device_index: int | None = None,
    **inputs: Any,
) -> ParallelDims:
    """Resolve the mesh sizes and run every check whose inputs are known (``parallel/checks.py``), at once.

    Args:
        config: The strategy's options.
        world_size: Total number of processes.
        devices_per_node: Processes per node.
        plan: The model's plan (its ``tp_divides`` sizes are checked); ``None`` skips model checks.
        precision: The Trainer/Fabric precision string; ``None`` skips the check.
        seq_len: The training sequence length, when known ahead (checked under sequence parallel).
        batch_size: The per-rank batch size, when known ahead (checked against the pipeline's micro-batches).
        num_nodes: Number of nodes (for the hint on where tensor-parallel groups land).
        device_type: The accelerator's device type (``"cuda"``, ``"cpu"``); ``None`` skips the
            hardware checks of float8 and async tensor parallelism.
        device_index: This process's CUDA device, once chosen: checks that it has float8 tensor
            cores (this initializes CUDA in the process, so not before processes are forked).
        inputs: The other inputs of ``parallel.checks.INPUTS`` known here, by name: what the trained module or model
            says of itself (``owner``, ``lora``, ``experts``, ``hf_config`` …) and the datamodule's
            ``document_mask``; ``None``: unknown.

    Raises:
        ParallelConfigError: listing every problem, with the values and a fix.
    """
    if unknown := sorted(set(inputs) - set(INPUTS) | set(inputs) & {"dp", "tp"}):  # dp/tp: resolved here
        raise TypeError(f"validate_parallel_dims got {unknown}, which are not inputs it takes by name")
    options = vars(config)
    raise_if_problems(run_checks(options))  # the options' own: the sizes must be valid to be resolved
    dp, tp = resolve_parallel_dims(config, world_size, devices_per_node)
    known = dict(
        inputs, world_size=world_size, devices_per_node=devices_per_node, num_nodes=num_nodes, dp=dp, tp=tp,
        plan=plan, precision=precision, seq_len=seq_len, batch_size=batch_size, device_type=device_type,
        device_index=device_index,
    )
    raise_if_problems(run_checks(options, known))
    replicas = config.data_parallel_replicate_size
    return ParallelDims(dp_replicate=replicas, dp_shard=dp // replicas, tp=tp, pp=config.pipeline_parallel_size,
                        cp=config.context_parallel_size, ep=config.expert_parallel_size,
                        ep_over_tp=bool(config.experts_over_tensor_parallel) and config.expert_parallel_size > 1)


# ---- the checks that need the world, the model or the hardware (``parallel/checks.py``), in report order ----------
@check
def replica_groups(data_parallel_replicate_size: int, dp: int) -> list[str]:
    """``data_parallel_replicate_size`` divides the resolved ``data_parallel_size``."""
    if dp % data_parallel_replicate_size:
        return [
            f"data_parallel_replicate_size ({data_parallel_replicate_size}) must divide the data-parallel size ({dp}):"
            f" FSDP shards inside each of the replica groups; use one of {_fmt_choices(_divisors(dp))}"
        ]
    return []


@check
def world_size_factors(
    data_parallel_size: Any, tensor_parallel_size: Any, pipeline_parallel_size: int, context_parallel_size: int,
    dp: int, tp: int, world_size: int, devices_per_node: int, num_nodes: int,
) -> list[str]:
    """``pipeline_parallel_size × context_parallel_size × data_parallel_size × tensor_parallel_size`` is the world
    (the first factor that does not fit is named)."""
    pp, cp = pipeline_parallel_size, context_parallel_size
    world = f"{num_nodes} node(s) × {devices_per_node} device(s)"
    if pp > 1 and world_size % pp:
        return [
            f"pipeline_parallel_size ({pp}) must divide the world size ({world_size} = {world}); use one of"
            f" {_fmt_choices(_divisors(world_size))}"
        ]
    if cp > 1 and (world_size // pp) % cp:
        return [
            f"context_parallel_size ({cp}) must divide the world size{f' / pipeline_parallel_size ({pp})' if pp > 1 else ''}"
            f" ({world_size // pp}; {world}); use one of {_fmt_choices(_divisors(world_size // pp))}"
        ]
    if dp * tp * pp * cp == world_size:
        return []
    given = f"data_parallel_size={data_parallel_size!r} → {dp}, tensor_parallel_size={tensor_parallel_size!r} → {tp}"
    return [_world_product_message(pp, cp, dp, tp, world_size, world, given)]


def _world_product_message(pp: int, cp: int, dp: int, tp: int, world_size: int, world: str, given: str) -> str:
    """``world_size_factors``' message when the sizes' product is not the world: the sizes and the valid pairs."""
    per_stage = world_size // (pp * cp)
    pairs = ", ".join(f"({d}, {per_stage // d})" for d in _divisors(per_stage))
    names, sizes = "data_parallel_size × tensor_parallel_size", f"{dp} × {tp}"
    if cp > 1:
        names, sizes = f"context_parallel_size × {names}", f"{cp} × {sizes}"
    if pp > 1:
        names, sizes = f"pipeline_parallel_size × {names}", f"{pp} × {sizes}"
    fixed = " and ".join(f"{n}={v}" for n, v in (("pipeline_parallel_size", pp), ("context_parallel_size", cp)) if v > 1)
    return (
        f"{names} ({sizes} = {pp * cp * dp * tp}) must equal the world size ({world_size} = {world}) [{given}];"
        f" valid (dp, tp) pairs{f' with {fixed}' if fixed else ''}: {pairs}"
    )


@check
def expert_parallel_layout(
    expert_parallel_size: int, data_parallel_replicate_size: int, context_parallel_size: int, dp: int, tp: int,
    experts_over_tensor_parallel: bool = False,
) -> list[str]:
    """Expert parallelism's ranks come out of the data-shard × context ranks (over the tensor-parallel ranks too:
    ``expert_groups_over_tensor``)."""
    ep, replicas = expert_parallel_size, data_parallel_replicate_size
    shards = dp // replicas * context_parallel_size
    if ep == 1 or dp % replicas or experts_over_tensor_parallel or shards % ep == 0:
        return []
    fits = tp > 1 and ep % tp == 0 and shards % (ep // tp) == 0
    hint = (f", or experts_over_tensor_parallel=True (the groups then take in the tensor_parallel_size {tp} ranks,"
            " each routing its sequence slice)") if fits else ""
    return [
        f"expert_parallel_size ({ep}) must divide the data-shard × context ranks ({shards} = data_parallel_size {dp} /"
        f" data_parallel_replicate_size {replicas} × context_parallel_size {context_parallel_size}): the experts are"
        f" split over ranks that hold different tokens; use one of {_fmt_choices(_divisors(shards))}{hint}"
    ]


@check
def expert_groups_over_tensor(
    expert_parallel_size: int, data_parallel_replicate_size: int, context_parallel_size: int, dp: int, tp: int,
    experts_over_tensor_parallel: bool = False,
) -> list[str]:
    """With ``experts_over_tensor_parallel`` each expert group is ``k`` data-shard × context ranks with all their
    tensor-parallel ranks."""
    ep, replicas = expert_parallel_size, data_parallel_replicate_size
    shards = dp // replicas * context_parallel_size
    if not experts_over_tensor_parallel or ep == 1 or tp == 1 or dp % replicas:
        return []
    if ep % tp == 0 and shards % (ep // tp) == 0:
        return []
    return [
        f"expert_parallel_size ({ep}) with experts_over_tensor_parallel=True must be k × tensor_parallel_size ({tp})"
        f" with k dividing the data-shard × context ranks ({shards} = data_parallel_size {dp} /"
        f" data_parallel_replicate_size {replicas} × context_parallel_size {context_parallel_size}): each group is k"
        f" of those ranks with all their tensor-parallel ranks; use one of"
        f" {_fmt_choices([k * tp for k in _divisors(shards)])}"
    ]


@check
def experts_over_tensor_parallel_layout(experts_over_tensor_parallel: bool, expert_parallel_size: int, tp: int,
                                        sequence_parallel: bool) -> list[str]:
    """Expert parallelism over the tensor-parallel ranks needs both, and sequence parallelism: each tensor-parallel
    rank routes the tokens of its own sequence slice."""
    if not experts_over_tensor_parallel:
        return []
    if expert_parallel_size == 1 or tp == 1:
        return [
            f"experts_over_tensor_parallel=True with expert_parallel_size={expert_parallel_size} and"
            f" tensor_parallel_size={tp}: it makes the expert-parallel groups take in the tensor-parallel ranks, so"
            " both must be above 1; set experts_over_tensor_parallel=False"
        ]
    if not sequence_parallel:
        return [
            "experts_over_tensor_parallel=True with sequence_parallel=False: each tensor-parallel rank routes its own"
            " slice of the sequence, which only sequence parallelism gives it (without it every tensor-parallel"
            " rank holds the same tokens); set sequence_parallel=True, or experts_over_tensor_parallel=False"
        ]
    return []


@check
def expert_parallel_model(expert_parallel_size: int, plan: ParallelPlan) -> list[str]:
    """The model has mixture-of-experts layers whose experts ``expert_parallel_size`` divides, and its plan names them
    (``plan.expert_parallel``). (Experts the plan runs whole on every rank, ``plan.whole_experts``, are their
    family's to refuse: ``models.hf_decoders``.)"""
    ep = expert_parallel_size
    if ep == 1 or plan.whole_experts is not None:
        return []
    if plan.num_experts is None:
        return [
            f"expert_parallel_size={ep} but the model has no mixture-of-experts layers (its plan names no"
            " num_experts); use expert_parallel_size=1, or a model with experts (model: debug-moe, mixtral-8x7b …)"
        ]
    if not plan.expert_parallel:
        return [f"expert_parallel_size={ep} but the plan names no experts to split (ParallelPlan.expert_parallel is"
                " empty): name each layer's stacked experts there (module name → ExpertParallel(), as llama_plan"
                " does), or use expert_parallel_size=1"]
    if plan.num_experts % ep:
        return [
            f"expert_parallel_size ({ep}) must divide the model's {plan.num_experts} experts per layer (each rank"
            f" holds the same number); use one of {_fmt_choices(_divisors(plan.num_experts))}"
        ]
    return []


@check
def context_parallel_attention(context_parallel_size: int, plan: ParallelPlan) -> list[str]:
    """``context_parallel_size > 1`` needs a plan naming the attention modules it replaces."""
    cp = context_parallel_size
    if cp == 1 or plan.attention is not None:
        return []
    return [
        f"context_parallel_size={cp} splits every sequence over {cp} ranks, whose attention layers must exchange"
        " keys and values; lightning_2d does it for its Llama Transformer (LlamaLightningModule), and this"
        " model's plan names no attention modules it can replace (ParallelPlan.attention=None: e.g. a Hugging"
        " Face decoder, whose attention implementation cannot take it). Use context_parallel_size=1, or"
        " LlamaLightningModule"
    ]


@check
def context_parallel_seq_len(
    context_parallel_size: int, sequence_parallel: bool, tp: int, seq_len: int, plan: ParallelPlan | None = None
) -> list[str]:
    """The sequence splits into ``2 × context_parallel_size`` equal chunks (× ``tensor_parallel_size`` under SP)."""
    cp = context_parallel_size
    sp = sequence_parallel and tp > 1 and (plan is None or plan.has_sequence_parallel)
    unit = 2 * cp * (tp if sp else 1)
    if cp == 1 or seq_len % unit == 0:
        return []
    why = f"2 × context_parallel_size ({cp})" + (f" × tensor_parallel_size ({tp}, sequence parallelism)" if sp else "")
    return [
        f"sequence length ({seq_len}) must be a multiple of {why} = {unit}: each context rank holds 2 of"
        f" {2 * cp} equal chunks (load balance for causal attention); use a sequence length that is a multiple"
        f" of {unit}, e.g. {max(unit, seq_len // unit * unit)}, or a smaller context_parallel_size"
    ]


@check
def pipeline_split_problems(
    pipeline_parallel_size: int, pipeline_schedule: str, pipeline_stages_per_rank: int | None,
    pipeline_layers_per_stage: list[int] | None, plan: ParallelPlan,
) -> list[str]:
    """The pipeline against the model: its plan says it splits, keeps no tie across stages, has enough blocks."""
    if pipeline_parallel_size == 1:
        return []
    if not plan.supports_pipeline:
        return [
            f"pipeline_parallel_size={pipeline_parallel_size} splits a model into stages by its blocks, which"
            " lightning_2d does for its Llama Transformer (LlamaLightningModule); this model's plan does not say it"
            " can be split (ParallelPlan.supports_pipeline=False: e.g. a Hugging Face decoder). Use"
            " pipeline_parallel_size=1, or LlamaLightningModule"
        ]
    problems: list[str] = []
    if plan.tied_weights:
        problems.append(tied_pipeline_message(plan.tied_weights))
    if plan.num_blocks is not None:
        problems += block_count_problems(
            pipeline_parallel_size, pipeline_schedule, pipeline_stages_per_rank, pipeline_layers_per_stage,
            plan.num_blocks,
        )
    return problems


@check
def pipeline_batch(
    pipeline_parallel_size: int, pipeline_schedule: str, pipeline_stages_per_rank: int | None,
    pipeline_microbatches: int | None, batch_size: int, plan: ParallelPlan | None = None,
) -> list[str]:
    """The per-rank batch splits into ``pipeline_microbatches`` (``None``: as many as its sequences, which the
    schedule must then run; a given count's own needs are checked with the options). Not for a model that cannot
    be pipelined (``pipeline_split_problems`` says so)."""
    if pipeline_parallel_size == 1 or (plan is not None and not plan.supports_pipeline):
        return []
    given = pipeline_microbatches
    return microbatch_problems(
        pipeline_parallel_size, pipeline_schedule, pipeline_stages_per_rank, given or batch_size, batch_size,
        schedule_checks=given is None,
    )


@check
def tensor_parallel_plan(sequence_parallel: bool, tp: int, plan: ParallelPlan, world_size: int) -> list[str]:
    """``tensor_parallel_size > 1`` needs plan entries; its size divides the plan's ``tp_divides``; sequence-parallel
    styles stay in the plan's overlay under ``sequence_parallel=False``."""
    if tp == 1:
        return []
    problems = []
    if not plan.tensor_parallel:
        problems.append(
            f"tensor_parallel_size is {tp} but the model's parallel plan has no tensor-parallel entries;"
            " pass plan=ParallelPlan(tensor_parallel={...}) or use tensor_parallel_size=1"
        )
    if not sequence_parallel and (sp_entries := plan.sequence_parallel_entries()):
        problems.append(
            f"sequence_parallel=False, but the plan's tensor_parallel holds sequence-parallel styles"
            f" ({', '.join(sp_entries[:4])}{', …' if len(sp_entries) > 4 else ''}), which shard activations"
            " along the sequence anyway; move them to ParallelPlan(sequence_parallel={...}) so the option"
            " switches them, or use sequence_parallel=True"
        )
    for name, size in plan.tp_divides.items():
        if size % tp:
            fits = [d for d in _divisors(size) if d <= max(world_size, 1) and world_size % d == 0] or [1]
            problems.append(f"tensor_parallel_size ({tp}) must divide {name} ({size}); try {_fmt_choices(fits)}")
    return problems


@check
def sequence_parallel_seq_len(
    sequence_parallel: bool, tp: int, seq_len: int, plan: ParallelPlan | None = None
) -> list[str]:
    """Under sequence parallelism (when the plan has a sequence-parallel form) ``tensor_parallel_size`` divides the
    sequence length."""
    applies = sequence_parallel and (plan is None or plan.has_sequence_parallel)
    if not applies or tp == 1 or seq_len % tp == 0:
        return []
    return [
        f"sequence length ({seq_len}) must be divisible by tensor_parallel_size ({tp}) under sequence"
        f" parallelism; use a sequence length that is a multiple of {tp} or sequence_parallel=False"
    ]


# float8 and async tensor parallelism (``parallel/float8.py``) on this hardware, checked in two places: in the
# launching process without ``device_index`` (the package, the device type, the options together), and in each rank
# with it, whose GPU's compute capability is read then (CUDA initialized before a fork would break it). torchao and
# CUDA are only touched when these options are on.
@check
def float8_device(float8: Any, device_type: str, device_index: int | None = None) -> list[str]:
    """``float8`` needs torchao and, unless emulated, float8 tensor cores: CUDA, and this process's GPU once known."""
    if not float8:
        return []

    problems = [problem for problem in (float8_torchao_problem(),) if problem is not None]
    if float8 == "emulate":  # the same rounding in high precision: any device
        return problems
    if device_type != "cuda":
        problems.append(float8_off_cuda_problem(device_type))
    elif device_index is not None and (device := float8_device_problem(device_index)) is not None:
        problems.append(device)
    return problems


@check
def float8_emulated_over_gloo(float8: Any, sequence_parallel: bool, tp: int, device_type: str) -> list[str]:
    """Emulated float8 off CUDA under sequence parallelism: its styles would all-gather float8 over gloo."""
    if float8 != "emulate" or device_type == "cuda" or not sequence_parallel or tp == 1:
        return []
    return [
        f"float8='emulate' with sequence_parallel=True and tensor_parallel_size {tp} on {device_type!r}: the float8"
        " tensor-parallel styles all-gather activations already cast to float8, and gloo cannot carry float8 tensors."
        " Set sequence_parallel=False for emulated float8 off CUDA."
    ]


@check
def async_tensor_parallel_options(
    async_tensor_parallel: bool, compile: bool, sequence_parallel: bool, tp: int
) -> list[str]:
    """Async tensor parallelism rewrites the sequence-parallel collectives of compiled graphs."""
    if not async_tensor_parallel:
        return []
    problems = []
    if not compile:
        problems.append("async_tensor_parallel=True needs compile=True: the overlap is an inductor pass"
                        " (torch._inductor.config._micro_pipeline_tp) that only rewrites compiled graphs. Set"
                        " compile=True or async_tensor_parallel=False.")
    if tp == 1:
        problems.append("async_tensor_parallel=True with tensor_parallel_size=1: there is no tensor-parallel"
                        " communication to overlap. Use tensor_parallel_size > 1 or async_tensor_parallel=False.")
    if not sequence_parallel:
        problems.append("async_tensor_parallel=True with sequence_parallel=False: async TP overlaps the"
                        " all-gather/reduce-scatter pairs of sequence parallelism with the matmuls and leaves plain"
                        " TP's all-reduces as they are, so it would do nothing. Set sequence_parallel=True or"
                        " async_tensor_parallel=False.")
    return problems


@check
def async_tensor_parallel_device(async_tensor_parallel: bool, device_type: str) -> list[str]:
    """Async tensor parallelism needs CUDA with NCCL, and torch's symmetric memory."""
    if not async_tensor_parallel:
        return []
    import torch
    import torch.distributed as dist

    problems = []
    if device_type != "cuda":
        problems.append(f"async_tensor_parallel=True needs CUDA GPUs with NCCL (symmetric memory), but the accelerator"
                        f" is {device_type!r}. Set async_tensor_parallel=False.")
    elif not (dist.is_available() and dist.is_nccl_available()):
        problems.append(f"async_tensor_parallel=True needs NCCL, which this torch build ({torch.__version__}) lacks."
                        " Install a CUDA build of torch or set async_tensor_parallel=False.")
    if not symmetric_memory_available():
        problems.append(f"async_tensor_parallel=True needs symmetric memory (torch.distributed._symmetric_memory),"
                        f" which torch {torch.__version__} does not provide. Upgrade torch or set"
                        " async_tensor_parallel=False.")
    return problems


@check
def supported_precision(precision: str) -> list[str]:
    """The Trainer's/Fabric's precision is one FSDP2 × TP runs here."""
    if str(precision) in SUPPORTED_PRECISIONS:
        return []
    return [
        f"precision={precision!r} is not supported by the 2D strategy; choose one of"
        f" {', '.join(SUPPORTED_PRECISIONS)} (fp16 needs gradient scaling, which FSDP2 × TP does not offer here)"
    ]


def cuda_index(device: "torch.device") -> int | None:
    """The CUDA device index of ``device`` (for the float8 hardware check), else ``None``."""
    return device.index if device.type == "cuda" else None


def build_device_mesh(dims: ParallelDims, device_type: str) -> "DeviceMesh":
    """The root ``DeviceMesh`` of ``dims.build_mesh(device_type)`` (Lightning's ``strategy.device_mesh``)."""
    return dims.build_mesh(device_type).root


def _destroy_process_group() -> None:
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Models, FSDP states and meshes that hold the process groups often sit in reference cycles
        # (module hooks): left to the collector, they may be freed during interpreter finalization,
        # where destroying a gloo group aborts the process. Free them now, while it is safe.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def destroy_process_group_at_exit() -> None:
    """Tear the process group down when the interpreter exits (registered once per process).

    Lightning leaves the group alive after ``fit`` (a later ``test`` reuses it). Left to the
    interpreter's shutdown, gloo's threads can abort a process that finished training ("terminate
    called without an active exception").
    """
    import atexit

    atexit.unregister(_destroy_process_group)
    atexit.register(_destroy_process_group)
