"""Materialize a meta-device model after parallelization, with layout-independent values."""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_2d.init import SeededInit
from lightning_2d.parallel.modules import canonical_name


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """The tensor this rank holds of ``param`` and where it sits in the full parameter.

    For a plain tensor: itself at offset ``None`` (the whole). For a DTensor: its local shard
    and the global offset of that shard (the same computation Distributed Checkpoint uses).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param, None
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(shape):  # pragma: no cover - a layout we do not know how to address
        raise NotImplementedError(
            f"Cannot address the local shard of a DTensor with placements {param.placements}: local shape"
            f" {tuple(local.shape)} differs from the computed {tuple(shape)}"
        )
    return local, tuple(offset)


class WeightSource(Protocol):
    """Where a materialized parameter's values come from, block by block."""

    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: tuple[int, ...], offset: Optional[tuple[int, ...]]
    ) -> None: ...


@torch.no_grad()
def materialize_model(
    model: nn.Module, device: torch.device, seed: int, weights: Optional[WeightSource] = None
) -> None:
    """Allocate ``model``'s meta tensors on ``device`` and fill each rank's blocks.

    ``weights`` supplies the values (e.g. ``lightning_2d.hf.HFWeights`` reads them from a Hugging
    Face directory). Without it, a model that describes its initialization (``param_init_specs()``
    → ``{name: InitSpec}``, as ``lightning_2d.model.Transformer`` does) gets its seeded init, the
    same at every ``(dp, tp)`` layout and on a single device. Other models fall back to their
    ``reset_parameters()`` methods (Lightning's behaviour), whose values depend on the layout; a
    warning says so.
    """
    if not has_meta_tensors(model):
        return
    specs_fn = getattr(model, "param_init_specs", None)
    if weights is None and specs_fn is None:
        rank_zero_warn(
            f"{type(model).__name__} has no `param_init_specs()`; initializing it with each module's"
            " `reset_parameters()`, whose values depend on the parallel layout. Define `param_init_specs()`"
            " for seed-reproducible weights across layouts."
        )
        _materialize_distributed_module(model, device)
        return

    model.to_empty(device=device)
    source = weights if weights is not None else SeededInit(specs_fn(), seed)
    for fqn, param in model.named_parameters():
        local, offset = local_block(param)
        source.fill_block_(local, canonical_name(fqn), tuple(param.shape), offset)
    init_buffers = getattr(model, "init_buffers", None)
    if callable(init_buffers):
        init_buffers(device)
