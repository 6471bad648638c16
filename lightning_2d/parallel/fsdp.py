"""FSDP2 (``fully_shard``) over the data-parallel mesh: the units, their reshard policy, the switch that defers
gradient reduction during accumulation, and ``FullyShard``, the ``fsdp_backend="fully_shard"`` backend object
(``lightning_2d.parallel.fsdp_backend``): how it applies itself and what the planner counts of it (``FSDPUnit``,
``gathered_peak``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from lightning_2d.ops.weights import weight_format
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.expert import shard_experts
from lightning_2d.parallel.modules import get_named_submodules, get_submodule_container
from lightning_2d.parallel.ties import holds_shared_outside, shared_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_2d.parallel.meshes import ParallelMeshes


def reshard_after_forward_by_unit(policy: str) -> dict[str, bool]:
    """Whether each kind of FSDP unit frees its gathered parameters after its forward.

    ``"default"`` (torchtitan's choice): every unit but the output unit and the last block. Backward starts with the
    output head and then the last block, so regathering them right after forward would be wasted (one all-gather
    each per step, the hand-written plan's saving too); each other block's gather in backward is prefetched while
    the unit after it computes.
    """
    if policy == "default":
        return {"input": True, "block": True, "last_block": False, "output": False, "root": True}
    reshard = policy == "always"
    return {"input": reshard, "block": reshard, "last_block": reshard, "output": reshard, "root": reshard}


def apply_fully_shard(
    model: nn.Module,
    dp_mesh: "DeviceMesh",
    plan: ParallelPlan,
    config: ParallelConfig,
) -> None:
    """Shard ``model`` with FSDP2 over ``dp_mesh``: input units, each block, the output unit, the root.

    Each unit's parameters are all-gathered only while it runs (and, for the output unit under the
    default policy, until its backward), and its all-gather overlaps the previous unit's compute.
    Parameters already tensor-parallel become 2D DTensors over ``(data_parallel, tensor_parallel)``.
    What no unit holds stays in the root unit, and so does a unit holding a tied parameter also used outside it
    (``lightning_2d.parallel.ties``: the shared embedding/head weight is gathered once for both uses).

    Args:
        model: The model (already tensor-parallel, checkpoint-wrapped and compiled as configured).
        dp_mesh: The data-parallel sub-mesh.
        plan: Names the block container, ``input_units`` and ``output_unit``.
        config: ``reshard_after_forward`` policy (``ParallelConfig.reshard_policy``), and ``param_dtype`` (the dtype parameters are
            gathered in for compute) and ``reduce_dtype`` (gradients are reduce-scattered in), as
            resolved against the precision by ``ParallelConfig.resolve_dtypes``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    reshard = reshard_after_forward_by_unit(config.reshard_policy)
    ties = shared_parameters(model)  # once for every unit
    # torch's one-rank FSDP2 shortcut (torch 2.11 and 2.13) copies one all-gather input per parameter; a weight
    # gathered in parts (QLoRA's NF4: codes, scalers, factors) fails ("expected 3, got 1"). On one rank nothing is
    # sharded: FSDP leaves such weights alone, plain tensors in their module.
    ignored = {p for p in model.parameters() if not weight_format(p).gathers_as_one} if dp_mesh.size() == 1 else set()

    def shard(module: nn.Module | list[nn.Module], kind: str) -> None:
        if kind != "root" and holds_shared_outside(module, model, ties):
            return  # a tied weight used outside this unit too (embedding = head): the root unit holds it
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard[kind],
                    ignored_params=ignored or None)

    for module in get_named_submodules(model, plan.input_units, "input_units"):
        shard(module, "input")
        if only_embeddings(module) and hasattr(module, "set_unshard_in_backward"):
            # An embedding's backward reads the token ids, not its weight: no all-gather in backward.
            module.set_unshard_in_backward(False)
    blocks = list(get_submodule_container(model, plan.blocks).children())
    for i, block in enumerate(blocks):
        shard(block, "last_block" if i == len(blocks) - 1 else "block")
    output_unit = get_named_submodules(model, plan.output_unit, "output_unit")
    if output_unit:
        shard(output_unit, "output")
    shard(model, "root")


def only_embeddings(module: nn.Module) -> bool:
    holders = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return bool(holders) and all(isinstance(m, nn.Embedding) for m in holders)


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the context, FSDP2 units under ``module`` reduce gradients in backward only if ``enabled``.

    With ``enabled=False`` (non-final micro-batches of gradient accumulation) each unit keeps its
    unsharded gradient and adds the next micro-batch's to it; the reduce-scatter runs once, in the
    backward of the final micro-batch. Both strategies use this (Trainer: ``block_backward_sync``,
    Fabric: ``no_backward_sync``).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


@dataclass
class FSDPUnit:
    """One ``fully_shard`` group as the planner sees it (under another backend, the same module group).

    Args:
        name: Module name(s).
        kind: ``"input"``, ``"block"``, ``"last_block"``, ``"output"`` or ``"root"`` (see
            ``reshard_after_forward_by_unit``).
        sharded_numel: Elements this rank holds (FSDP-padded local shards).
        gathered_bytes: Bytes of its unsharded parameters on this rank (in the all-gather dtype).
        unsharded_numel: Elements of its unsharded parameters on this rank.
        unshard_in_backward: Whether backward all-gathers it again (an embedding's does not).
        trained_numel: Of ``unsharded_numel``, the elements that get gradients (under LoRA the adapters': a frozen
            weight has no gradient to reduce or accumulate); ``None``: all of them.
    """

    name: str
    kind: str
    sharded_numel: int
    gathered_bytes: int
    unsharded_numel: int
    unshard_in_backward: bool = True
    trained_numel: int | None = None

    @property
    def gradient_numel(self) -> int:
        """Unsharded elements with a gradient (reduced, accumulated)."""
        return self.unsharded_numel if self.trained_numel is None else self.trained_numel


def gathered_peak(units: list[FSDPUnit], reshard: dict[str, bool]) -> int:
    """The most bytes of unsharded parameters alive at once over a forward and a backward.

    While a unit computes, the next one's all-gather is in flight (FSDP2's implicit prefetch in
    forward, its default one-unit prefetch in backward). A unit whose kind does not reshard after
    forward stays gathered until its backward; every unit reshards after its backward.

    Args:
        units: In forward order.
        reshard: ``reshard_after_forward_by_unit(policy)``.
    """
    gathered: set[int] = set()
    peak = 0

    def size(indices: set[int]) -> int:
        return sum(units[i].gathered_bytes for i in indices)

    for i, unit in enumerate(units):
        gathered.add(i)
        prefetch = {i + 1} if i + 1 < len(units) else set()
        peak = max(peak, size(gathered | prefetch))
        if reshard[unit.kind]:
            gathered.discard(i)
    order = [i for i in reversed(range(len(units))) if units[i].unshard_in_backward or i in gathered]
    for k, i in enumerate(order):
        gathered.add(i)
        prefetch = {order[k + 1]} if k + 1 < len(order) and units[order[k + 1]].unshard_in_backward else set()
        peak = max(peak, size(gathered | prefetch))
        gathered.discard(i)
    return peak


class FullyShard:
    """``fsdp_backend="fully_shard"``: FSDP2's units with hooks that all-gather, reshard and reduce-scatter
    (``apply_fully_shard``). A parameter read as an attribute is the stored shard: state access needs nothing."""

    name = "fully_shard"
    #: The owner's method that replaces ``step`` (``lightning_2d.parallel.hooks``).
    hook = "apply_fully_shard"
    step = staticmethod(apply_fully_shard)

    def apply(self, model: nn.Module, meshes: "ParallelMeshes", plan: ParallelPlan, config: ParallelConfig,
              step: Optional[Callable[..., None]] = None, experts: Sequence[nn.Module] = ()) -> None:
        """Shard ``model`` over ``meshes.fsdp`` with ``step`` (``apply_fully_shard``, or the owner's replacement);
        the plan's ``experts`` first, over their own mesh (each block's unit then leaves them out)."""
        if experts:
            shard_experts(list(experts), meshes.expert_fsdp, config, reshard=config.reshard_policy != "never")
        (step or self.step)(model, meshes.fsdp, plan, config)

    def state_access(self) -> AbstractContextManager[Any]:
        """Nothing to do: FSDP2's parameters are the stored shards between its hooks."""
        return nullcontext()

    def gradient_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """``gradient_sync``: without it, the units keep their unsharded gradients between micro-batches."""
        return gradient_sync(module, enabled)

    def inductor_options(self) -> Optional[dict[str, Any]]:
        """None: FSDP2's hooks stay outside the compiled blocks, whose graphs hold no collective of its own."""
        return None

    # ---- what the planner counts -------------------------------------------------------------------------------
    def unit_problem(self, name: str, modules: list[nn.Module]) -> Optional[str]:
        """Why the planner cannot read module group ``name`` as this backend's unit, else ``None``."""
        from torch.distributed.fsdp import FSDPModule

        if all(isinstance(m, FSDPModule) for m in modules):
            return None
        return f"{name} is not an FSDP unit after parallelize_model; the planner assumes apply_fully_shard's units"

    def buffer_bytes(self, units: list[FSDPUnit], config: ParallelConfig, accumulate_grad_batches: int,
                     pipeline_in_flight: Optional[int] = None) -> tuple[int, int]:
        """The all-gather buffers' and the accumulated unsharded gradients' peak bytes on one rank.

        Args:
            units: The rank's units (all its stages' under a pipeline), in forward order.
            config: The options, dtypes resolved.
            accumulate_grad_batches: Micro-batches per optimizer step.
            pipeline_in_flight: Under a pipeline, the micro-batches in flight on the rank; ``None``: no pipeline.
        """
        reduce_bytes = config.reduce_dtype.itemsize
        if pipeline_in_flight is not None and not config.reduce_every_micro_batch:
            # PipelineStage runs each micro-batch's backward with set_reshard_after_backward(False) and
            # set_requires_gradient_sync(False) and reduce-scatters once after the last (perform_reduce_grad):
            # from its first backward to the end of the step every unit stays gathered and keeps its
            # unsharded gradient, upcast to reduce_dtype by FSDP2 between backwards.
            return sum(u.gathered_bytes for u in units), sum(u.gradient_numel for u in units) * reduce_bytes
        # Under a pipeline with reduce_every_micro_batch, each micro-batch's backward reshards and reduce-scatters
        # (the stage hidden from PipelineStage's FSDP handling, lightning_2d.parallel.pipeline): FSDP's peaks as
        # without a pipeline.
        all_gather = gathered_peak(units, reshard_after_forward_by_unit(config.reshard_policy))
        accumulation = 0
        if pipeline_in_flight is None and accumulate_grad_batches > 1 and not config.reduce_every_micro_batch:
            # FSDP2 without gradient sync accumulates each unit's unsharded gradient in reduce_dtype.
            accumulation = sum(u.gradient_numel for u in units) * reduce_bytes
        return all_gather, accumulation

    def pipeline_notes(self, config: ParallelConfig, accumulate_grad_batches: int) -> list[str]:
        """What the planner's report says of this backend's buffers under a pipeline."""
        if config.reduce_every_micro_batch:
            return [
                "pipeline: reduce_every_micro_batch: each micro-batch's backward reshards and reduce-scatters (FSDP"
                " buffers as without a pipeline; an all-gather and a reduce-scatter per unit and micro-batch)"
            ]
        return [
            "pipeline: torch's PipelineStage keeps each FSDP unit of this rank's stages unsharded from its first"
            " backward to the end of the step and accumulates its unsharded gradients (reduce_dtype) over the"
            " micro-batches, reduce-scattered once at the end: both are counted for every unit"
            + (", every batch (accumulate_grad_batches adds nothing)" if accumulate_grad_batches > 1 else "")
            + "; --reduce-every-micro-batch trades that memory for a reduce-scatter per micro-batch"
        ]

    def all_gather_row(self, param_dtype: str, activation_checkpointing: str, pipeline_keeps: bool) -> str:
        """The report's row of the all-gather buffers (``pipeline_keeps``: a pipeline keeps every unit gathered)."""
        return f"FSDP all-gather buffers ({param_dtype}{'; a pipeline keeps every unit' if pipeline_keeps else ''})"
