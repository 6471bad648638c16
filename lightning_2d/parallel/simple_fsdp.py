"""SimpleFSDP: fully sharded data parallelism written as a DTensor parametrization (``fsdp_backend="simple_fsdp"``).

The second data-parallel backend beside FSDP2's ``fully_shard`` ("SimpleFSDP: Simpler Fully Sharded Data Parallel
with torch.compile", arXiv 2411.00284; torchtitan keeps it as an experiment). Every parameter is stored as a DTensor
sharded over the FSDP mesh exactly as ``fully_shard`` lays it out: ``Shard(0)`` over the data-parallel shard ranks
(``Replicate() × Shard(0)`` under HSDP), the tensor-parallel placements after it, ``_StridedShard(0)`` where tensor
parallelism shards dimension 0 too. The optimizer, gradient clipping, the non-finite guard and Distributed
Checkpoint therefore see the same parameters under both backends, and a checkpoint of one loads into the other.

Reading a parameter as a module attribute (``self.weight`` in a forward) gathers it: a ``redistribute`` to
``Replicate`` over the data-parallel mesh dimensions (cast to ``param_dtype`` first, so the all-gather moves the
compute dtype), whose backward reduce-scatters the gradient (all-reduces it across HSDP replicas) in
``reduce_dtype``, averaged over the data-parallel ranks as FSDP2 averages it. There are no hooks and no units: under
``torch.compile`` the collectives are ops in the graph, which inductor can bucket and reorder.

What differs from FSDP2, by construction:

- **Memory without activation checkpointing.** Autograd saves each gathered weight for its backward, so the
  whole unsharded model (in ``param_dtype``) is alive from its forward use to its backward: no resharding after
  forward. With activation checkpointing the gathers run again in the recomputation, and only the blocks'
  activations are kept, as with FSDP2's resharding.
- **Gradient accumulation.** Every micro-batch's backward reduces its gradients (the reduction is part of the
  autograd graph); the sharded gradients accumulate between micro-batches.
- **Parameter access outside a forward.** ``module.weight`` gathers (a collective every rank must join); the
  stored shard is read with ``named_parameters()``/``state_dict()`` (which never gather), or as an attribute
  inside ``sharded_parameters()`` (the backend's ``state_access()``), as this library's initialization and the
  strategies' checkpoint IO do.

Each wrapped module keeps its own mesh and policy (on the instance: the generated subclass, cached per class and
parameter names, holds none of it); a parameter registered under several names (a tied embedding and head) stays
one parameter, sharded once.

``SimpleFSDP`` is the backend object (``lightning_2d.parallel.fsdp_backend``): how it applies itself, its state
access, its inductor options and what the planner counts of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lightning_2d._compat import compute_local_shape_and_global_offset, concatenate_meshes, strided_shard
from lightning_2d.parallel.activation_checkpoint import recomputed_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
    from lightning_2d.parallel.fsdp import FSDPUnit
    from lightning_2d.parallel.meshes import ParallelMeshes
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

#: The instance attribute holding a wrapped module's ``GatherPolicy``.
POLICY_ATTRIBUTE = "_simple_fsdp_policy"

_gathering = True


@contextmanager
def sharded_parameters() -> Iterator[None]:
    """Within the context, a wrapped module's parameter attributes are the stored shards (``Parameter`` DTensors),
    not gathered: for initialization, re-tying and inspection outside a forward. Not for a forward: its weights
    would be the shards."""
    global _gathering
    previous, _gathering = _gathering, False
    try:
        yield
    finally:
        _gathering = previous


@dataclass(frozen=True, eq=False)
class GatherPolicy:
    """How a wrapped module's parameters are gathered for compute and their gradients reduced.

    Args:
        dp_mesh: The FSDP mesh (1-D; 2-D ``(replicate, shard)`` under HSDP).
        dp_placements: The parameters' placements on it (``(Shard(0),)``; ``(Replicate(), Shard(0))``).
        param_dtype: The dtype gathered in (the shard is cast before the all-gather); ``None``: the stored dtype.
        reduce_dtype: The dtype gradients are reduced in; ``None``: the gradient's own.
    """

    dp_mesh: "DeviceMesh"
    dp_placements: tuple["Placement", ...]
    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]

    def gather(self, param: "DTensor") -> torch.Tensor:
        """``param`` replicated over the data-parallel dims: a plain tensor, or a DTensor on the tensor-parallel
        mesh for a tensor-parallel parameter. Its backward reduces the gradient to ``param``'s shards."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        n = self.dp_mesh.ndim
        extra = param.device_mesh.ndim - n  # tensor-parallel dims after the data-parallel ones
        if extra == 0:
            sharded = param
        else:  # view this rank's shard as a DTensor over the data-parallel dims only (its TP-local shape)
            local_shape, _ = _local_shape_and_offset(param.shape, _inner_mesh(param, n), param.placements[n:])
            sharded = DTensor.from_local(param.to_local(), self.dp_mesh, self.dp_placements, run_check=False,
                                         shape=torch.Size(local_shape), stride=_contiguous_stride(local_shape))
        replicated = sharded.redistribute(self.dp_mesh, (Replicate(),) * n, forward_dtype=self.param_dtype,
                                          backward_dtype=self.reduce_dtype)
        # The gradient arrives as this rank's partial sum: averaged over the data-parallel ranks when reduced.
        local = replicated.to_local(grad_placements=(Partial("avg"),) * n)
        if extra == 0:
            return local
        return DTensor.from_local(local, _inner_mesh(param, n), param.placements[n:], run_check=False,
                                  shape=param.shape, stride=param.stride())


def _inner_mesh(param: "DTensor", dp_dims: int) -> "DeviceMesh":
    names = param.device_mesh.mesh_dim_names
    assert names is not None
    return param.device_mesh[names[dp_dims:]]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _local_shape_and_offset(shape: Any, mesh: "DeviceMesh", placements: Any) -> Any:
    return compute_local_shape_and_global_offset(shape, mesh, placements)


@lru_cache(maxsize=None)
def _wrapped_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with each of ``names`` a property that gathers the stored parameter. Cached per class and names:
    the mesh and policy are read from the instance (torchtitan cached them in the class, so later modules of the
    same class silently took the first one's, torchtitan #2754)."""

    def gathered(name: str) -> property:
        def get(self: nn.Module) -> Any:
            # Module.__getattr__ looks the registered parameters up (the property hides them from getattr).
            param = nn.Module.__getattr__(self, name)
            if not _gathering or param is None:
                return param
            return getattr(self, POLICY_ATTRIBUTE).gather(param)

        return property(get)

    attrs = {name: gathered(name) for name in names}
    attrs["__module__"] = cls.__module__
    return type(f"SimpleFSDP{cls.__name__}", (cls,), attrs)


def is_simple_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters gathered by ``apply_simple_fsdp``."""
    return hasattr(module, POLICY_ATTRIBUTE)


def simple_fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``apply_simple_fsdp`` wrapped."""
    return [m for m in model.modules() if is_simple_fsdp(m)]


def _dp_layout(dp_mesh: "DeviceMesh") -> tuple[tuple["Placement", ...], int]:
    """The parameters' placements on the FSDP mesh and the index of its shard dimension."""
    from torch.distributed.tensor import Replicate, Shard

    if dp_mesh.ndim == 1:
        return (Shard(0),), 0
    if dp_mesh.ndim == 2:  # HSDP: replicas × shards
        return (Replicate(), Shard(0)), 1
    raise ValueError(f"SimpleFSDP shards over a 1-D mesh (FSDP) or a 2-D one (HSDP), got {dp_mesh.ndim} dims")


def _shard_parameter(param: torch.Tensor, dp_mesh: "DeviceMesh", placements: tuple["Placement", ...],
                     shard_dim: int) -> nn.Parameter:
    """``param`` (a plain tensor, or a DTensor on the tensor-parallel mesh) as ``fully_shard`` stores it: this rank's
    chunk of dim 0 of its (tensor-parallel) local tensor, a DTensor over the data-parallel (+ tensor-parallel) mesh.
    Local slicing only (no collective): works on the meta device."""
    from torch.distributed.tensor import DTensor

    shards = dp_mesh.size(shard_dim)
    rank = dp_mesh.get_local_rank(shard_dim)
    if isinstance(param, DTensor):
        inner = param.placements
        # Dim 0 already split by tensor parallelism: this rank's chunk is of its TP-local rows (as fully_shard).
        split = math.prod(param.device_mesh.size(i) for i, p in enumerate(inner) if p.is_shard(0))
        mine = strided_shard(0, split) if split > 1 else placements[shard_dim]
        full_placements = (*placements[:shard_dim], mine, *inner)
        mesh = concatenate_meshes([dp_mesh, param.device_mesh])
        source = param.to_local()
    else:
        full_placements, mesh, source = placements, dp_mesh, param
    chunks = torch.chunk(source.detach(), shards, dim=0) if source.dim() else (source.detach(),)
    local = chunks[rank] if rank < len(chunks) else source.detach().narrow(0, 0, 0)
    sharded = DTensor.from_local(local.contiguous(), mesh, full_placements, run_check=False,
                                 shape=param.shape, stride=param.stride())
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def data_parallel(model: nn.Module, dp_mesh: "DeviceMesh", param_dtype: Optional[torch.dtype] = None,
                  reduce_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Shard every parameter of ``model`` over ``dp_mesh`` and gather it on access (see the module docstring).

    Args:
        model: The model, tensor-parallel, checkpoint-wrapped and compiled as configured (on the meta device or
            real); modules wrapped already are left as they are.
        dp_mesh: The FSDP mesh: 1-D (``fully_shard``), or 2-D ``(replicate, shard)`` (HSDP).
        param_dtype: The dtype parameters are gathered in for compute (``None``: as stored).
        reduce_dtype: The dtype gradients are reduced in (``None``: the gradient's own).

    Returns:
        ``model``, changed in place.
    """
    placements, shard_dim = _dp_layout(dp_mesh)
    policy = GatherPolicy(dp_mesh, placements, param_dtype, reduce_dtype)
    new: dict[int, nn.Parameter] = {}  # id(original) -> its sharded parameter: a tie stays one parameter
    for module in list(model.modules()):
        if is_simple_fsdp(module):
            continue
        own = list(module.named_parameters(recurse=False, remove_duplicate=False))
        if not own:
            continue
        for name, param in own:
            if id(param) not in new:
                new[id(param)] = _shard_parameter(param, dp_mesh, placements, shard_dim)
            module.register_parameter(name, new[id(param)])
        # A subclass swapped in, as fully_shard swaps in its FSDPModule subclass: the state-dict keys stay the
        # module's own (torch's parametrize would rename them to ``parametrizations.<name>.original``, breaking
        # the checkpoint format both backends share), and dynamo traces the property like any attribute.
        module.__class__ = _wrapped_class(type(module), tuple(name for name, _ in own))
        setattr(module, POLICY_ATTRIBUTE, policy)
    return model


def apply_simple_fsdp(model: nn.Module, dp_mesh: "DeviceMesh", plan: "ParallelPlan", config: "ParallelConfig") -> None:
    """The data-parallel step of ``parallelize_model`` under ``fsdp_backend="simple_fsdp"`` (in place of
    ``apply_fully_shard``): ``data_parallel`` with the config's resolved ``param_dtype``/``reduce_dtype``. The plan's
    units play no part: every parameter is gathered where it is used."""
    data_parallel(model, dp_mesh, param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)


def simple_fsdp_gathered_peak(units: list["FSDPUnit"], recomputed: set[str]) -> int:
    """The most bytes of gathered parameters alive at once under SimpleFSDP: a weight gathered in forward stays
    alive to its backward (autograd saves it for the gradient of its input), unless activation checkpointing
    recomputes its block (``recomputed``: unit names): then it lives only while that block computes, in forward
    and again in the recomputation.

    Args:
        units: The module groups (as ``apply_fully_shard`` would make them), in forward order.
        recomputed: The names of the blocks activation checkpointing recomputes (``recomputed_blocks``).
    """
    kept = sum(u.gathered_bytes for u in units if u.name not in recomputed)
    return kept + max((u.gathered_bytes for u in units if u.name in recomputed), default=0)


#: Inductor's passes over SimpleFSDP's collectives (torch 2.13 names), which run on any device: one all-gather per
#: block's weights in forward and one reduce-scatter per block's gradients in backward, and the collectives moved
#: to overlap the computation before/after them.
SIMPLE_FSDP_INDUCTOR_OPTIONS = {
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "reorder_for_compute_comm_overlap": True,
}
#: The overlap scheduler that places the buckets by a roofline estimate of the GPU (it imports triton): CUDA only.
CUDA_OVERLAP_OPTIONS = {"aten_distributed_optimizations.enable_overlap_scheduling": True}


def _on_nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logging.getLogger(__name__).info(message)


class SimpleFSDP:
    """``fsdp_backend="simple_fsdp"``: every parameter a sharded DTensor gathered where it is read
    (``apply_simple_fsdp``). Reading one as an attribute outside a forward is a collective, so whoever walks the
    modules for their state (the checkpoint IO, initialization) does so inside ``state_access()``."""

    name = "simple_fsdp"
    #: The owner's method that replaces ``step`` (``lightning_2d.parallel.hooks``).
    hook = "apply_simple_fsdp"
    step = staticmethod(apply_simple_fsdp)

    def apply(self, model: nn.Module, meshes: "ParallelMeshes", plan: "ParallelPlan", config: "ParallelConfig",
              step: Optional[Callable[..., None]] = None, experts: Sequence[nn.Module] = ()) -> None:
        """Shard ``model`` over ``meshes.fsdp`` with ``step`` (``apply_simple_fsdp``, or the owner's replacement);
        the plan's ``experts`` (expert parallelism's modules, their parameters ``Shard(0)`` DTensors over the
        ``expert_parallel`` mesh) first, over the ranks holding the same experts (``meshes.expert_fsdp``), as
        ``fully_shard`` shards them (``parallel.expert.shard_experts``): each parameter a DTensor over
        ``(expert_fsdp…, expert_parallel)``, gathered over ``expert_fsdp`` where it is read and its gradient averaged
        there (the exchange's ``1 / EP`` scale makes that the whole data × context average). The model's other
        parameters then skip the modules wrapped already."""
        if experts:
            for module in experts:
                data_parallel(module, meshes.expert_fsdp, param_dtype=config.param_dtype,
                              reduce_dtype=config.reduce_dtype)
        (step or self.step)(model, meshes.fsdp, plan, config)

    def state_access(self) -> AbstractContextManager[Any]:
        """``sharded_parameters()``: attribute reads are the stored shards (torch's state-dict APIs ``getattr`` down
        to every parameter), never a gather."""
        return sharded_parameters()

    def gradient_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """Nothing to switch: every micro-batch's backward reduces its gradients (the reduction is part of the
        autograd graph); the sharded gradients accumulate between micro-batches."""
        return nullcontext()

    def inductor_options(self) -> Optional[dict[str, Any]]:
        """The inductor options of the compiled blocks: the collective bucketing and reordering passes, plus the
        overlap scheduler when the job runs on CUDA (said once, else skipped)."""
        options: dict[str, Any] = dict(SIMPLE_FSDP_INDUCTOR_OPTIONS)
        if _on_nccl():
            options.update(CUDA_OVERLAP_OPTIONS)
        else:
            _say_once(
                "SimpleFSDP under compile: the collectives are bucketed and reordered; inductor's overlap scheduler"
                " is left off (it estimates collective and compute times from a GPU roofline, which needs CUDA and"
                " NCCL)"
            )
        return options

    # ---- what the planner counts -------------------------------------------------------------------------------
    def unit_problem(self, name: str, modules: list[nn.Module]) -> Optional[str]:
        """Why the planner cannot read module group ``name`` as wrapped by this backend, else ``None``."""
        holders = [m for group in modules for m in group.modules() if any(True for _ in m.parameters(False))]
        if all(is_simple_fsdp(m) for m in holders):
            return None
        return f"{name} holds parameters SimpleFSDP did not wrap after parallelize_model"

    def buffer_bytes(self, units: list["FSDPUnit"], config: "ParallelConfig", accumulate_grad_batches: int,
                     pipeline_in_flight: Optional[int] = None) -> tuple[int, int]:
        """The gathered weights' and the accumulated unsharded gradients' peak bytes on one rank (the latter 0:
        every micro-batch's backward reduces, the sharded gradients accumulate). Arguments as
        ``FullyShard.buffer_bytes``."""
        recomputed = recomputed_blocks(units, config.activation_checkpointing, config.selective_ac_option)
        if pipeline_in_flight is None:
            return simple_fsdp_gathered_peak(units, recomputed), 0
        # Every micro-batch's forward gathers its stage's weights and its backward reduces them: each micro-batch
        # in flight keeps the gathered weights of the blocks not recomputed (an upper bound when the rank runs
        # several stages: all of its stages' counted per micro-batch in flight).
        kept = sum(u.gathered_bytes for u in units if u.name not in recomputed)
        return kept * max(pipeline_in_flight, 1) + simple_fsdp_gathered_peak(
            [u for u in units if u.name in recomputed], recomputed), 0

    def pipeline_notes(self, config: "ParallelConfig", accumulate_grad_batches: int) -> list[str]:
        """What the planner's report says of this backend's buffers under a pipeline."""
        return [
            "pipeline under SimpleFSDP: every micro-batch's forward gathers its stage's weights and its backward"
            " reduces its gradients; each micro-batch in flight keeps the gathered weights of the blocks"
            " activation checkpointing does not recompute (counted × the micro-batches in flight)"
        ]

    def all_gather_row(self, param_dtype: str, activation_checkpointing: str, pipeline_keeps: bool) -> str:
        """The report's row of the gathered weights."""
        kept = "kept to backward" + ("; recomputed blocks' only while they compute"
                                     if activation_checkpointing != "none" else "")
        return f"SimpleFSDP gathered weights ({param_dtype}, {kept})"
