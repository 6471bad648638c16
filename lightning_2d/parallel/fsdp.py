"""FSDP2 (``fully_shard``) over the data-parallel mesh, per block and at the root."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.modules import get_submodule_container

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_fully_shard(
    model: nn.Module,
    dp_mesh: "DeviceMesh",
    plan: ParallelPlan,
    config: ParallelConfig,
) -> None:
    """Shard each block of ``plan.blocks``, then the root, with FSDP2 over ``dp_mesh``.

    Each block is its own FSDP group, so one block's parameters are all-gathered at a time and
    its all-gather overlaps the previous block's compute. Parameters already tensor-parallel
    become 2D DTensors over ``(data_parallel, tensor_parallel)``.

    Args:
        model: The model (already tensor-parallel, checkpoint-wrapped and compiled as configured).
        dp_mesh: The data-parallel sub-mesh.
        plan: Names the block container.
        config: ``reshard_after_forward`` policy, and ``param_dtype`` (the dtype parameters are
            gathered in for compute) and ``reduce_dtype`` (gradients are reduce-scattered in), as
            resolved against the precision by ``ParallelConfig.resolve_dtypes``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Under TP the root returns the logits as a view of the local shard (ColwiseParallel's
    # to_local), which FSDP2 warns about on every step in case the caller edits it in place.
    # The loss only reads the logits.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    blocks = list(get_submodule_container(model, plan.blocks).children())
    for index, block in enumerate(blocks):
        if config.reshard_after_forward == "default":
            # Backward needs the last block first: keeping it gathered saves one all-gather.
            reshard = index < len(blocks) - 1
        else:
            reshard = config.reshard_after_forward == "always"
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=config.reshard_after_forward != "never")
