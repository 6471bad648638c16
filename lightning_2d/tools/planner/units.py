"""FSDP units as the planner sees them, read off a parallelized model.

``fsdp_units`` lists the ``fully_shard`` groups ``apply_fully_shard`` made (a ``Transformer`` or a pipeline stage
view), with their sharded and unsharded sizes on the planned rank. How many are gathered at once is the FSDP
backend's to say (``FSDPBackend.buffer_bytes``; FSDP2's ``gathered_peak`` simulates its all-gathers and prefetches
unit by unit over a forward and a backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_2d.ops.weights import weight_format
from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.fsdp import FSDPUnit, only_embeddings, gathered_peak
from lightning_2d.parallel.fsdp_backend import FSDPBackend
from lightning_2d.parallel.modules import get_named_submodules, get_submodule_container
from lightning_2d.parallel.names import EP_DIM
from lightning_2d.parallel.ties import holds_shared_outside, shared_parameters

__all__ = ["FSDPUnit", "gathered_peak"]  # the planner's names since 0.1.0, now the FSDP backends'


def fsdp_units(model: nn.Module, plan: Any, dims: ParallelDims, gather_dtype: torch.dtype,
           backend: FSDPBackend) -> list[FSDPUnit]:
    """The FSDP units ``apply_fully_shard`` made on ``model`` (a ``Transformer`` or a pipeline stage view),
    in forward order, with their sizes on the planned rank (FSDP shard 0: the padded size). Under another
    ``backend`` the same module groups, each checked to be what that backend made of it (``unit_problem``)."""
    def sizes(modules: list[nn.Module], exclude: set[int]) -> tuple[int, int, int, int]:
        sharded = unsharded = gathered = trained = 0
        for module in modules:
            for param in module.parameters():
                if id(param) in exclude:
                    continue
                exclude.add(id(param))
                local = param.to_local() if hasattr(param, "to_local") else param
                # Shard 0 has FSDP's padded size (dim 0 rounded up to a multiple of the
                # shard group), which every rank allocates; the gathered tensor is that × the group.
                numel = local.numel()
                # A mixture of experts' experts under expert parallelism: FSDP gathers them over the ranks holding the
                # same experts (data-shard × context / expert-parallel), the rest over the data-shard ranks.
                mesh_dims = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
                full = numel * (dims.dp_shard * dims.cp // dims.ep if EP_DIM in mesh_dims else dims.dp_shard)
                sharded += numel
                unsharded += full
                trained += full if param.requires_grad else 0
                # As its format is gathered: QLoRA's NF4 base as its 4-bit codes, scalers and factors; float8's weight
                # wrappers in float8 (one byte); the rest in the gather dtype.
                gathered += weight_format(local).gathered_bytes(full, local.dtype, gather_dtype)
        return sharded, unsharded, gathered, trained

    seen: set[int] = set()
    units: list[FSDPUnit] = []
    groups: list[tuple[str, str, list[nn.Module]]] = []
    for name, module in zip(plan.input_units, get_named_submodules(model, plan.input_units, "input_units")):
        groups.append((name, "input", [module]))
    blocks = list(get_submodule_container(model, plan.blocks).named_children())
    for i, (name, block) in enumerate(blocks):
        groups.append((f"{plan.blocks}.{name}", "last_block" if i == len(blocks) - 1 else "block", [block]))
    output = get_named_submodules(model, plan.output_unit, "output_unit")
    groups.append(("+".join(plan.output_unit), "output", output))
    groups.append(("(root)", "root", [model]))
    ties = shared_parameters(model)  # once for every unit, as apply_fully_shard
    for name, kind, modules in groups:
        if kind != "root" and modules and holds_shared_outside(modules, model, ties):
            continue  # holds a tied weight (embedding = head): apply_fully_shard leaves it to the root unit
        problem = backend.unit_problem(name, modules)
        if problem is not None:
            raise RuntimeError(problem)
        sharded, unsharded, gathered, trained = sizes(modules, seen)
        if unsharded:
            in_backward = not (kind == "input" and all(only_embeddings(m) for m in modules))
            units.append(FSDPUnit(name, kind, sharded, gathered, unsharded, in_backward,
                                  None if trained == unsharded else trained))
    return units
