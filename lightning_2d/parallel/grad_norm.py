"""Gradient norm and clipping over parameters that live on different meshes, in one collective.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one DTensor, which fails
as soon as two parameters sit on different meshes (with sequence parallelism off, the norms are
sharded only over ``data_parallel`` while the projections are 2D), and reducing each ``(mesh, placements)`` group's
norm apart costs a collective per group and mesh dimension. Here every rank sums the ``p``-th powers of its local
gradient shards, each divided by the number of ranks holding the same shard (the sizes of the mesh dimensions it is
``Replicate()`` over, and the ranks of its pipeline stage outside its mesh), and one all-reduce over all ranks
(a ``MAX`` for the inf-norm, where copies need no weighting) gives the norm of the full (unsharded) gradient of every
stage, equal to the single-device value. A gradient still ``Partial()`` over a mesh dimension (its shards partial
sums, not parts) is reduced per group first, as before.
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


def _copies(grad: torch.Tensor, world: int, stages: int) -> int:
    """How many ranks hold the same values as this rank's part of ``grad``: those it is replicated over in its mesh,
    times the ranks of its pipeline stage outside its mesh (a plain tensor: every rank of the stage)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return max(world // stages, 1)
    mesh = grad.device_mesh
    copies = max(world // (mesh.size() * stages), 1)
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def _fused_total_norm(grads: list[torch.Tensor], norm_type: float, pipeline_group: Any) -> torch.Tensor:
    """``total_grad_norm`` in one all-reduce over every rank (module docstring)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    stages = dist.get_world_size(pipeline_group) if pipeline_group is not None else 1
    by_copies: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        by_copies.setdefault((_copies(g, world, stages), local.dtype), []).append(local)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.zeros((), dtype=torch.float32, device=device)
    for (copies, _), members in by_copies.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type=norm_type, foreach=True).float().to(device)
        value = torch.maximum(value, norm) if norm_type == float("inf") else value + norm.pow(norm_type) / copies
    value = value.reshape(1)
    dist.all_reduce(value, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
    return value.reshape(()) if norm_type == float("inf") else value.reshape(()).pow(1.0 / norm_type)


def _one_collective(grads: list[torch.Tensor]) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return not any(p.is_partial() for g in grads for p in getattr(g, "placements", ()))


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pipeline_group: Any = None) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients as one plain tensor, identical on every rank; in a multi-rank job every
    rank calls it (one all-reduce over all ranks).

    ``pipeline_group``: under pipeline parallelism each rank holds some stages' parameters only; every stage's
    gradients count, as on one device.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if _one_collective(grads):
        return _fused_total_norm(grads, float(norm_type), pipeline_group)
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
