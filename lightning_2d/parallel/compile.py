"""Per-block ``torch.compile``: the blocks are identical, so one compilation serves them all."""

from __future__ import annotations

import torch
from torch import nn

from lightning_2d._compat import is_async_collective_tensor, raise_dynamo_cache_limit
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.fsdp_backend import fsdp_backend
from lightning_2d.parallel.modules import get_submodule_container, replace_blocks


def apply_compile(model: nn.Module, plan: ParallelPlan, config: ParallelConfig) -> None:
    """Compile each block of ``plan.blocks`` with ``fullgraph=True`` (after AC, before FSDP).

    Compiling blocks rather than the whole model keeps FSDP's per-block hooks outside the graphs
    and lets each block reuse the first one's compiled code.
    """
    blocks = get_submodule_container(model, plan.blocks)
    # Each block is a separate module object, so dynamo caches an entry per block.
    raise_dynamo_cache_limit(len(blocks) + 8)
    # The FSDP backend's passes over its collectives, where they are graph ops (FSDP2's hooks stay outside).
    options = fsdp_backend(config.fsdp_backend).inductor_options()
    replace_blocks(blocks, lambda i, block: _plain_inputs(torch.compile(block, fullgraph=True, options=options)))


def _plain_inputs(compiled: nn.Module) -> nn.Module:
    """Under sequence parallelism the first block receives the embedding's output still waiting on its
    reduce-scatter (an ``AsyncCollectiveTensor``), every later block a plain tensor (the residual sum waited
    on it): dynamo guards on the type, so the first block's graph would be compiled a second time for the
    others. A pre-hook hands every block a plain tensor (``clone`` waits and stays in the autograd graph; one
    activation-sized copy per step), so all blocks share one graph."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        plain = tuple(a.clone() if is_async_collective_tensor(a) else a for a in args)
        return plain, {k: v.clone() if is_async_collective_tensor(v) else v for k, v in kwargs.items()}

    compiled.register_forward_pre_hook(hook, with_kwargs=True)
    return compiled
