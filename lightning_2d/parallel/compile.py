"""Per-block ``torch.compile``: the blocks are identical, so one compilation serves them all."""

from __future__ import annotations

import torch
from torch import nn

from lightning_2d._compat import raise_dynamo_cache_limit
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.modules import get_submodule_container, replace_blocks


def apply_compile(model: nn.Module, plan: ParallelPlan, config: ParallelConfig) -> None:
    """Compile each block of ``plan.blocks`` with ``fullgraph=True`` (after AC, before FSDP).

    Compiling blocks rather than the whole model keeps FSDP's per-block hooks outside the graphs
    and lets each block reuse the first one's compiled code.
    """
    blocks = get_submodule_container(model, plan.blocks)
    # Each block is a separate module object, so dynamo caches an entry per block.
    raise_dynamo_cache_limit(len(blocks) + 8)
    replace_blocks(blocks, lambda i, block: torch.compile(block, fullgraph=True))
