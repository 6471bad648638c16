"""FSDP2 (``fully_shard``) over the data-parallel mesh: the units, their reshard policy, and the
switch that defers gradient reduction during accumulation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn

from lightning_2d.ops.nf4 import is_nf4
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.modules import get_named_submodules, get_submodule_container
from lightning_2d.parallel.ties import holds_shared_outside, shared_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def reshard_after_forward_by_unit(policy: str) -> dict[str, bool]:
    """Whether each kind of FSDP unit frees its gathered parameters after its forward.

    ``"default"`` (torchtitan's choice): every unit but the output unit. Backward starts with the
    output head, so regathering it right after forward would be wasted; each block's gather in
    backward is prefetched while the unit after it computes.
    """
    if policy == "default":
        return {"input": True, "block": True, "output": False, "root": True}
    reshard = policy == "always"
    return {"input": reshard, "block": reshard, "output": reshard, "root": reshard}


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
    # torch's one-rank FSDP2 shortcut (torch 2.11 and 2.13) copies one all-gather input per parameter; an NF4 weight
    # (QLoRA) has three (codes, scalers, factors) and fails ("expected 3, got 1"). On one rank nothing is sharded:
    # FSDP leaves the NF4 weights alone, plain tensors in their module.
    ignored = {p for p in model.parameters() if is_nf4(p)} if dp_mesh.size() == 1 else set()

    def shard(module: nn.Module | list[nn.Module], kind: str) -> None:
        if kind != "root" and holds_shared_outside(module, model, ties):
            return  # a tied weight used outside this unit too (embedding = head): the root unit holds it
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard[kind],
                    ignored_params=ignored or None)

    for module in get_named_submodules(model, plan.input_units, "input_units"):
        shard(module, "input")
        if _only_embeddings(module) and hasattr(module, "set_unshard_in_backward"):
            # An embedding's backward reads the token ids, not its weight: no all-gather in backward.
            module.set_unshard_in_backward(False)
    for block in get_submodule_container(model, plan.blocks).children():
        shard(block, "block")
    output_unit = get_named_submodules(model, plan.output_unit, "output_unit")
    if output_unit:
        shard(output_unit, "output")
    shard(model, "root")


def _only_embeddings(module: nn.Module) -> bool:
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
