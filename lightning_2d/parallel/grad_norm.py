"""Gradient norm and clipping over parameters that live on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one DTensor, which fails
as soon as two parameters sit on different meshes (with sequence parallelism off, the norms are
sharded only over ``data_parallel`` while the projections are 2D). Here the norms are reduced per
``(mesh, placements)`` group to plain full values, then combined: the result is the norm of the
full (unsharded) gradient, equal to the single-device value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _group_key(t: torch.Tensor) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return (id(t.device_mesh), t.device_mesh, tuple(t.placements), t.dtype)
    return (None, None, None, t.dtype)


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pipeline_group: Any = None) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients as one plain tensor, identical on every rank.

    ``pipeline_group``: under pipeline parallelism each rank holds some stages' parameters only; the
    per-rank norms are then combined over this group (every stage's gradients count, as on one device).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        total = torch.tensor(0.0)
        return _combine_over_stages(total, norm_type, pipeline_group) if pipeline_group is not None else total
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=norm_type, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # reduces the partial norms over the mesh
        norms.append(norm.float())
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    total = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    return _combine_over_stages(total, norm_type, pipeline_group) if pipeline_group is not None else total


def _combine_over_stages(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    if norm_type == float("inf"):
        value = norm.float().reshape(1).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value.reshape(())
    value = norm.float().pow(norm_type).reshape(1)
    dist.all_reduce(value, group=group)
    return value.pow(1.0 / norm_type).reshape(())


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    pipeline_group: Any = None,
) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; returns the norm before clipping.

    With ``error_if_nonfinite`` a NaN/inf norm raises instead of scaling the gradients by NaN.
    ``pipeline_group``: see ``total_grad_norm`` (every pipeline rank must call this).
    """
    parameters = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(parameters, norm_type, pipeline_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}); the step would"
            " corrupt the weights. Lower the learning rate, check the data, or pass error_if_nonfinite=False."
        )
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    # Scale the local shards: a DTensor's gradient is its local tensor (to_local() aliases it
    # under no_grad), and a plain tensor factor needs no host sync.
    locals_ = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in parameters]
    for local in locals_:
        local.mul_(clip_coef.to(local.device, local.dtype))
    return total
