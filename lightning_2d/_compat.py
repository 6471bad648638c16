"""Every private (``_``-prefixed) torch and Lightning API lightning_2d uses, in one place.

Each entry of ``PRIVATE_APIS`` names the API, what we use it for, the versions it was checked on and what
replaces it when it goes away. Code elsewhere in the package calls the functions below (or overrides the
hooks listed here) and touches no private name of torch or Lightning itself; ``tests/unit/test_compat.py``
checks that each API still exists in the installed versions and that no other module reaches for one,
so an upgrade shows what broke here, in one list, before any job runs.

The bottom layer: it imports torch and Lightning only, and those lazily (importing this is free).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

#: The versions every entry below was checked on (CI installs these).
CHECKED_ON = "torch 2.13.0, lightning 2.6.6"


@dataclass(frozen=True)
class PrivateAPI:
    """One private API we rely on.

    Args:
        module: Where it lives (importable).
        name: Its attribute path in ``module`` (``"DeviceMesh._flatten"``).
        used_for: Why we need it.
        replacement: What to do when it disappears.
        kind: ``"call"`` (we call or read it), ``"override"`` (a private hook our subclass overrides, the way
            Lightning's own strategies extend theirs) or ``"subclass"`` (a private base class we extend).
    """

    module: str
    name: str
    used_for: str
    replacement: str
    kind: str = "call"

    def resolve(self) -> Any:
        """The object itself (raises ``ImportError``/``AttributeError`` when an upgrade removed it)."""
        obj: Any = importlib.import_module(self.module)
        path = self.module
        for part in self.name.split("."):
            path = f"{path}.{part}"
            try:
                obj = getattr(obj, part)
            except AttributeError:
                # A submodule its package does not import by itself (torch 2.11's `torch.distributed._symmetric_memory`).
                if not isinstance(obj, ModuleType):
                    raise
                obj = importlib.import_module(path)
        return obj


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # ---- torch -------------------------------------------------------------------------------------
    PrivateAPI("torch.distributed._functional_collectives", "AsyncCollectiveTensor",
               "recognize a block input still waiting on its collective (the embedding's reduce-scatter under"
               " sequence parallelism), so the compiled blocks all see plain tensors and share one graph",
               "a public type test if one appears; else keep the clone for every tensor subclass input"),
    PrivateAPI("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu",
               "one block of the context-parallel ring (its output and log-sum-exp, merged across blocks)",
               "a public SDPA that returns the log-sum-exp, or FlexAttention with return_lse on CPU"),
    PrivateAPI("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
               "the gradients of one ring block given the merged output and log-sum-exp",
               "as above"),
    PrivateAPI("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
               "the block range of a DTensor shard for the layout-independent init and the vocabulary-parallel loss",
               "DTensor's public offset API if one appears; else compute it from the placements (Shard/_StridedShard)"),
    PrivateAPI("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
               "activation checkpointing of a block (torchtitan does the same)",
               "torch.utils.checkpoint in a wrapper module of our own (keep the _checkpoint_wrapped_module prefix)"),
    PrivateAPI("torch", "_foreach_norm", "one fused max-norm over every gradient shard (the non-finite guard)",
               "torch.linalg.vector_norm per tensor, stacked (slower, same result)"),
    PrivateAPI("torch.distributed.device_mesh", "DeviceMesh._flatten",
               "the flattened data_parallel dim (replicate × shard) of the N-D mesh, as torchtitan does",
               "build the data_parallel group with dist.new_group and a separate 1-D DeviceMesh"),
    PrivateAPI("torch.distributed.device_mesh", "DeviceMesh._unflatten",
               "expert parallelism's (expert_data_shard, expert_parallel) mesh carved from the data-shard × context"
               " ranks, sharing the root (fully_shard over the experts needs one root), as torchtitan does",
               "a second DeviceMesh over the same ranks (init_device_mesh with the mesh tensor reshaped) if FSDP"
               " accepts it; else plain new_group groups"),
    PrivateAPI("torch", "_C._current_graph_task_id",
               "a mixture-of-experts layer counts its routed tokens once per forward, not again when activation"
               " checkpointing recomputes it inside backward (the id is -1 outside a backward)",
               "count the tokens from the step's router statistics after the forward instead"),
    PrivateAPI("torch.distributed.device_mesh", "DeviceMesh._concatenate",
               "SimpleFSDP's parameters over the data-parallel × tensor-parallel mesh, as fully_shard lays them out"
               " (FSDP2 calls it for the same)",
               "slice the root mesh by the FSDP and tensor-parallel dim names"),
    PrivateAPI("torch.distributed.tensor.placement_types", "_StridedShard",
               "SimpleFSDP's data-parallel placement of a parameter whose dim 0 tensor parallelism shards too (as"
               " fully_shard's; Distributed Checkpoint reads it)",
               "the public placement torch gives for it; else shard the tensor-parallel dim 1 instead"),
    PrivateAPI("torch.distributed.distributed_c10d", "_set_pg_timeout",
               "the strategy's timeout on every group of the mesh (init_device_mesh gives sub-groups the default)",
               "create the mesh's groups with dist.new_group(timeout=...) and DeviceMesh.from_group"),
    PrivateAPI("torch.distributed.distributed_c10d", "ProcessGroup._get_backend",
               "reading a group's timeout back (tests and the mesh check)", "drop the read-back check"),
    PrivateAPI("torch.distributed.distributed_c10d", "_get_default_store",
               "the job's rendezvous store for the watchdog's heartbeats",
               "a TCPStore of our own on MASTER_ADDR:MASTER_PORT+1"),
    PrivateAPI("torch", "_assert_async", "refusing out-of-vocabulary labels without a host sync on CUDA",
               "a host-side check (one sync per step)"),
    PrivateAPI("torch", "_dynamo.config.cache_size_limit",
               "room for one compiled graph per block (compile per block)", "torch.compiler's public limit option"),
    PrivateAPI("torch", "_dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint",
               "compiled mixture-of-experts blocks under activation checkpointing: the routing statistics the"
               " forward writes, not written again by the recompute (as the eager recompute skips them)",
               "routing statistics returned through the blocks' outputs instead of written"),
    PrivateAPI("torch._inductor.config", "_micro_pipeline_tp", "async tensor parallelism (inductor's pass)",
               "torch.distributed.tensor.experimental's public async-TP switch"),
    PrivateAPI("torch.distributed", "_symmetric_memory", "async tensor parallelism needs symmetric memory",
               "the public symmetric-memory module"),
    PrivateAPI("torch.testing._internal.distributed.fake_pg", "FakeStore",
               "the planner's simulated world (a fake process group of N ranks in one process)",
               "a public fake backend, or run the planner on a real gloo world"),
    PrivateAPI("torch.utils", "_pytree", "only its logger's name, quieted while torchao imports",
               "drop the quieting"),
    PrivateAPI("torch.distributed.pipelining", "ScheduleLoopedBFS._calculate_single_rank_operations",
               "forward-only steps over stages placed in a V (pipeline.VForwardOnly: LoopedBFS's forwards on the V's"
               " stages; the V schedules' own eval() fails in torch 2.13)",
               "the V schedules' eval() once it skips their backward actions, or a forward-only order loaded"
               " through a public schedule-IR API", kind="override"),
    PrivateAPI("torch.distributed.tensor.parallel", "ParallelStyle._apply",
               "our ParallelStyles (VocabParallelHead, SequenceShardInput): the method a custom style defines",
               "the public hook of ParallelStyle, if it is renamed", kind="override"),
    PrivateAPI("torch.distributed.tensor.parallel", "ColwiseParallel._prepare_output_fn",
               "VocabParallelHead passes its fused loss (a plain tensor) through the output hook",
               "a forward hook of our own after ColwiseParallel's", kind="override"),
    PrivateAPI("torch.nn", "Module._forward_pre_hooks",
               "the deprecated pipeline_of(model) finds the pipeline in the hook that refuses calling a pipelined"
               " model (0.1.0's public way; the strategy's `pipeline` replaces it)",
               "drop pipeline_of (deprecated until 0.3)"),
    PrivateAPI("torch.distributed", "_functional_collectives",
               "the benchmark's --collectives: DTensor's collectives are wrapped there for one step to name their"
               " issuer (AsyncCollectiveTensor above lives there too)",
               "profile with with_stack=True and read the stacks of the _c10d_functional events instead"),
    PrivateAPI("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup",
               "the benchmark's --collectives: the FSDP2 unit (its _module_fqn, read with a default) whose"
               " all-gather or reduce-scatter is on the stack",
               "label FSDP2's collectives without their unit"),
    # ---- Lightning ---------------------------------------------------------------------------------
    PrivateAPI("lightning.fabric.utilities.optimizer", "_optimizers_to_device",
               "optimizer state onto the device after setup (as Lightning's ModelParallelStrategy.setup does)",
               "a loop over optimizer.state moving tensors"),
    PrivateAPI("lightning.fabric.strategies.strategy", "_BackwardSyncControl",
               "fabric.no_backward_sync with FSDP2 (Fabric's strategies extend it the same way)",
               "a context manager of our own behind fabric.no_backward_sync", kind="subclass"),
    PrivateAPI("lightning.fabric.utilities.types", "_Stateful",
               "which objects of a fabric.save state are restored through load_state_dict",
               "a hasattr check for state_dict/load_state_dict"),
    PrivateAPI("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher",
               "the Trainer's launcher with validation before any process starts (ValidatingLauncher)",
               "validate in setup_environment only (in every rank, after spawn)", kind="subclass"),
    PrivateAPI("lightning.pytorch.strategies", "ModelParallelStrategy._configure_launcher",
               "choosing that launcher (how every Lightning strategy picks its launcher)",
               "the launcher argument of a future public API", kind="override"),
    PrivateAPI("lightning.fabric.strategies", "ModelParallelStrategy._configure_launcher",
               "refusing a bad layout when Fabric is constructed, before any process starts",
               "validate in setup_environment only", kind="override"),
    PrivateAPI("lightning.pytorch.strategies", "ModelParallelStrategy._setup_distributed",
               "the process group, as Lightning's setup_environment does before its own 2D mesh",
               "init_process_group ourselves from the cluster environment"),
    PrivateAPI("lightning.fabric.strategies", "ModelParallelStrategy._setup_distributed",
               "the same for Fabric", "init_process_group ourselves from the cluster environment"),
    PrivateAPI("lightning.pytorch.strategies", "ModelParallelStrategy._device_mesh",
               "the N-D mesh in the attribute Lightning's device_mesh property reads", "override device_mesh"),
    PrivateAPI("lightning.pytorch.strategies", "ModelParallelStrategy._timeout",
               "the timeout the user passed", "keep our own copy of the argument"),
    PrivateAPI("lightning.pytorch.strategies", "ModelParallelStrategy._save_distributed_checkpoint",
               "sharded or full checkpoints, as the user chose", "keep our own copy of the argument"),
    PrivateAPI("lightning.pytorch.strategies", "Strategy._precision_plugin",
               "the precision plugin before Lightning's connector wraps it", "the precision_plugin property"),
    PrivateAPI("lightning.pytorch", "LightningModule._trainer",
               "the Trainer of a module, None outside fit (the trainer property raises instead)",
               "try/except around the trainer property"),
    PrivateAPI("lightning.pytorch", "LightningModule._device_mesh",
               "the mesh in LightningModule.device_mesh, for configure_model (as Lightning's strategy sets it)",
               "the public setter if one appears"),
)

# torch 2.13's DeviceMesh, ModelParallelStrategy and LightningModule create some of the attributes above in
# __init__ (they are instance attributes, absent from the class): ``test_compat`` checks those on instances.
INSTANCE_ATTRIBUTES = frozenset({
    "ModelParallelStrategy._device_mesh", "ModelParallelStrategy._timeout",
    "ModelParallelStrategy._save_distributed_checkpoint", "Strategy._precision_plugin",
    "LightningModule._trainer", "LightningModule._device_mesh", "Module._forward_pre_hooks",
})


# ---- torch -------------------------------------------------------------------------------------------
def forward_pre_hooks(module: "torch.nn.Module") -> list[Any]:
    """The forward pre-hooks registered on ``module`` (torch keeps them in a private dict)."""
    return list(module._forward_pre_hooks.values())


def compute_local_shape_and_global_offset(shape: Any, mesh: "DeviceMesh", placements: Any) -> Any:
    """This rank's shard shape and offset of a DTensor of global ``shape`` (DCP's computation)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    return compute(shape, mesh, placements)


def checkpoint_wrapper(module: Any, **kwargs: Any) -> Any:
    """torch's activation-checkpointing wrapper (non-reentrant unless told otherwise)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def foreach_norm(tensors: list["torch.Tensor"], ord: float) -> list["torch.Tensor"]:
    """One fused norm kernel over many tensors."""
    import torch

    return list(torch._foreach_norm(tensors, ord))


def flatten_mesh_dims(mesh: "DeviceMesh", dims: tuple[str, ...], name: str) -> "DeviceMesh":
    """``mesh[dims]`` flattened into one dimension called ``name`` (reachable as ``mesh[name]``)."""
    return mesh[dims]._flatten(name)


def unflatten_mesh(mesh: "DeviceMesh", sizes: tuple[int, ...], names: tuple[str, ...]) -> "DeviceMesh":
    """The 1-D ``mesh`` as a mesh of ``sizes`` (the last varying fastest) named ``names``, on the same root."""
    return mesh._unflatten(0, sizes, names)


def in_backward() -> bool:
    """Whether this runs inside a backward pass (an activation-checkpointing recompute, say)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def concatenate_meshes(meshes: list["DeviceMesh"]) -> "DeviceMesh":
    """One mesh spanning ``meshes`` (sub-meshes of one root, in order): the data-parallel × tensor-parallel mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def strided_shard(dim: int, split_factor: int) -> Any:
    """The placement sharding ``dim`` of each of ``split_factor`` chunks already split by an inner mesh dim."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Set ``timeout`` on an existing process group."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def group_timeout(group: Any, device: "torch.device") -> Optional[timedelta]:
    """The timeout of ``group``'s backend for ``device``."""
    return group._get_backend(device).options._timeout


def default_store() -> Any:
    """The default process group's store (the job's rendezvous store)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def cpu_flash_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", mask: "torch.Tensor",
                        scale: float) -> tuple["torch.Tensor", "torch.Tensor"]:
    """CPU SDPA's flash kernel: the output and each query's log-sum-exp ``(B, H, T)`` (fp32); grouped-query
    key/value heads as they are; an additive ``mask``. A row the mask hides entirely gets 0 for both."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def cpu_flash_attention_backward(grad: "torch.Tensor", q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                                 out: "torch.Tensor", lse: "torch.Tensor", mask: "torch.Tensor",
                                 scale: float) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """The gradients of ``q``, ``k``, ``v`` through ``cpu_flash_attention``, given the (final) output and log-sum-exp."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)


def is_async_collective_tensor(x: Any) -> bool:
    """Whether ``x`` is the result of a functional collective not yet waited on (what a tensor-parallel style
    with ``use_local_output`` returns right after an asynchronous redistribute)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return isinstance(x, AsyncCollectiveTensor)


def assert_async(condition: "torch.Tensor", message: str) -> None:
    """Fail with ``message`` when ``condition`` is false, without a host sync (checked on the device)."""
    import torch

    torch._assert_async(condition, message)


def raise_dynamo_cache_limit(at_least: int) -> None:
    """Let dynamo keep at least ``at_least`` compiled graphs per code object."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, at_least)


def skip_checkpoint_side_effects_in_recompute() -> None:
    """Compiled checkpointed regions may write module state in their forward (a mixture of experts' routing
    statistics); their recompute in backward does not write it again (dynamo's checkpoint would otherwise refuse the
    region and run it eagerly)."""
    import torch._dynamo

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def has_symmetric_memory() -> bool:
    """Whether this torch build has symmetric memory (async tensor parallelism)."""
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401
    except ImportError:
        return False
    return True


def symmetric_memory() -> Any:
    """torch's symmetric-memory module."""
    from torch.distributed import _symmetric_memory

    return _symmetric_memory


def enable_micro_pipeline_tp() -> None:
    """Turn on inductor's micro-pipelined tensor parallelism (process-wide, as torch offers it)."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True


def fake_store() -> Any:
    """A store for torch's ``fake`` backend (importing it registers the backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


#: The logger torch's pytree module warns through (quieted while torchao imports).
PYTREE_LOGGER = "torch.utils._pytree"


# ---- Lightning ---------------------------------------------------------------------------------------
def optimizers_to_device(optimizers: Any, device: "torch.device") -> None:
    """Move the optimizers' state to ``device``."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def backward_sync_control_class() -> type:
    """Fabric's base class of ``no_backward_sync`` controls."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    return _BackwardSyncControl


def is_stateful(obj: Any) -> bool:
    """Whether Fabric treats ``obj`` as stateful (``state_dict``/``load_state_dict``)."""
    from lightning.fabric.utilities.types import _Stateful

    return isinstance(obj, _Stateful)


def subprocess_script_launcher_class() -> type:
    """The Trainer's launcher that starts the other ranks as copies of the script."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return _SubprocessScriptLauncher


def setup_distributed(strategy: Any) -> None:
    """Lightning's process-group set-up of a ``ModelParallelStrategy`` (ranks, seed, ``init_process_group``)."""
    strategy._setup_distributed()


def set_strategy_mesh(strategy: Any, mesh: "DeviceMesh") -> None:
    """The mesh Lightning's ``strategy.device_mesh`` returns."""
    strategy._device_mesh = mesh


def strategy_timeout(strategy: Any) -> Optional[timedelta]:
    """The ``timeout`` given to the strategy."""
    return strategy._timeout


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """The ``save_distributed_checkpoint`` given to the strategy."""
    return bool(strategy._save_distributed_checkpoint)


def set_saves_distributed_checkpoint(strategy: Any, value: bool) -> None:
    """Change ``save_distributed_checkpoint`` of a running strategy (tests and fixtures)."""
    strategy._save_distributed_checkpoint = value


def trainer_precision_plugin(strategy: Any) -> Any:
    """The Trainer strategy's precision plugin as given (before the property's defaulting)."""
    return strategy._precision_plugin


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or ``None`` (the ``trainer`` property raises then)."""
    return getattr(module, "_trainer", None)


def set_module_mesh(module: Any, mesh: "DeviceMesh") -> None:
    """The mesh a LightningModule's ``device_mesh`` returns (for ``configure_model``)."""
    module._device_mesh = mesh


def functional_collectives() -> ModuleType:
    """``torch.distributed._functional_collectives``: the collectives DTensor issues (wrapped, for one step, by the
    benchmark's ``--collectives``)."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def fsdp_unit_of(obj: Any) -> Optional[str]:
    """The FSDP2 unit (its module's qualified name, ``""`` for the root) when ``obj`` is FSDP2's parameter group
    of one unit (the ``self`` of a frame in FSDP2's all-gather or reduce-scatter), else ``None``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if not isinstance(obj, FSDPParamGroup):
        return None
    return getattr(obj, "_module_fqn", None)
