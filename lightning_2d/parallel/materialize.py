"""Materialize a meta-device model after parallelization, with layout-independent values."""

from __future__ import annotations

import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_2d.init import fill_block_
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


@torch.no_grad()
def materialize_model(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate ``model``'s meta tensors on ``device`` and initialize them.

    A model that describes its initialization (``param_init_specs()`` → ``{name: InitSpec}``, as
    ``lightning_2d.model.Transformer`` does) gets the same values at every ``(dp, tp)`` layout and
    on a single device. Other models fall back to their ``reset_parameters()`` methods (Lightning's
    behaviour), which does not give layout-independent values; a warning says so.
    """
    if not has_meta_tensors(model):
        return
    specs_fn = getattr(model, "param_init_specs", None)
    if specs_fn is None:
        rank_zero_warn(
            f"{type(model).__name__} has no `param_init_specs()`; initializing it with each module's"
            " `reset_parameters()`, whose values depend on the parallel layout. Define `param_init_specs()`"
            " for seed-reproducible weights across layouts."
        )
        _materialize_distributed_module(model, device)
        return

    model.to_empty(device=device)
    specs = specs_fn()
    missing = []
    for fqn, param in model.named_parameters():
        name = canonical_name(fqn)
        if name not in specs:
            missing.append(name)
            continue
        local, offset = local_block(param)
        fill_block_(local, specs[name], seed=seed, name=name, global_shape=param.shape, offset=offset)
    if missing:
        raise ValueError(f"{type(model).__name__}.param_init_specs() has no entry for: {', '.join(missing)}")
    init_buffers = getattr(model, "init_buffers", None)
    if callable(init_buffers):
        init_buffers(device)
