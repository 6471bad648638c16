"""FSDP units as the planner sees them: read off a parallelized model, and how many are gathered at once.

``_units`` lists the ``fully_shard`` groups ``apply_fully_shard`` made (a ``Transformer`` or a pipeline stage
view), with their sharded and unsharded sizes on the planned rank; ``gathered_peak`` simulates FSDP2's
all-gathers and prefetches unit by unit over a forward and a backward to find the most unsharded
parameters alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.names import EP_DIM


@dataclass
class FSDPUnit:
    """One ``fully_shard`` group as the planner sees it.

    Args:
        name: Module name(s).
        kind: ``"input"``, ``"block"``, ``"output"`` or ``"root"`` (see ``reshard_after_forward_by_unit``).
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


def simple_fsdp_gathered_peak(units: list[FSDPUnit], recomputed: set[str]) -> int:
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


def recomputed_blocks(units: list[FSDPUnit], activation_checkpointing: str, selective_ac_option: Any) -> set[str]:
    """The block units whose forward activation checkpointing runs again in backward (``apply_activation_checkpointing``:
    every block under ``"full"`` and per-op ``"selective"``, whose policy recomputes all but the matmul and attention
    outputs, the gathers included; every N-th under ``selective_ac_option=N``)."""
    blocks = [u.name for u in units if u.kind == "block"]
    if activation_checkpointing == "none":
        return set()
    if activation_checkpointing == "selective" and selective_ac_option != "op":
        every = int(selective_ac_option)
        return {name for i, name in enumerate(blocks) if (i + 1) % every == 0}
    return set(blocks)


def _units(model: nn.Module, plan: Any, dims: ParallelDims, gather_dtype: torch.dtype,
           backend: str = "fully_shard") -> list[FSDPUnit]:
    """The FSDP units ``apply_fully_shard`` made on ``model`` (a ``Transformer`` or a pipeline stage view),
    in forward order, with their sizes on the planned rank (FSDP shard 0: the padded size). Under ``backend=
    "simple_fsdp"`` the same module groups, whose parameters SimpleFSDP gathers where they are used."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_2d.ops.nf4 import is_nf4, nf4_bytes
    from lightning_2d.parallel.simple_fsdp import is_simple_fsdp

    from lightning_2d.parallel.fsdp import _only_embeddings
    from lightning_2d.parallel.modules import get_named_submodules, get_submodule_container
    from lightning_2d.parallel.ties import holds_shared_outside, shared_parameters

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
                if is_nf4(local):  # QLoRA's base: FSDP gathers the 4-bit codes, scalers and factors
                    gathered += nf4_bytes(full, local.dtype)
                    continue
                # float8 all-gather: torchao's weight wrappers gather in float8 (one byte)
                itemsize = 1 if "Float8" in type(local).__name__ else gather_dtype.itemsize
                gathered += full * itemsize
        return sharded, unsharded, gathered, trained

    seen: set[int] = set()
    units: list[FSDPUnit] = []
    groups: list[tuple[str, str, list[nn.Module]]] = []
    for name, module in zip(plan.input_units, get_named_submodules(model, plan.input_units, "input_units")):
        groups.append((name, "input", [module]))
    for name, block in get_submodule_container(model, plan.blocks).named_children():
        groups.append((f"{plan.blocks}.{name}", "block", [block]))
    output = get_named_submodules(model, plan.output_unit, "output_unit")
    groups.append(("+".join(plan.output_unit), "output", output))
    groups.append(("(root)", "root", [model]))
    ties = shared_parameters(model)  # once for every unit, as apply_fully_shard
    for name, kind, modules in groups:
        if kind != "root" and modules and holds_shared_outside(modules, model, ties):
            continue  # holds a tied weight (embedding = head): apply_fully_shard leaves it to the root unit
        if backend == "simple_fsdp":
            holders = [m for group in modules for m in group.modules() if any(True for _ in m.parameters(False))]
            if not all(is_simple_fsdp(m) for m in holders):
                raise RuntimeError(f"{name} holds parameters SimpleFSDP did not wrap after parallelize_model")
        elif not all(isinstance(m, FSDPModule) for m in modules):
            raise RuntimeError(
                f"{name} is not an FSDP unit after parallelize_model; the planner assumes apply_fully_shard's units"
            )
        sharded, unsharded, gathered, trained = sizes(modules, seen)
        if unsharded:
            in_backward = not (kind == "input" and all(_only_embeddings(m) for m in modules))
            units.append(FSDPUnit(name, kind, sharded, gathered, unsharded, in_backward,
                                  None if trained == unsharded else trained))
    return units
