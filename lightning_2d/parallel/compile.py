"""Per-block ``torch.compile``: the blocks are identical, so one compilation serves them all."""

from __future__ import annotations

import torch
from torch import nn

from lightning_2d._compat import (
    is_async_collective_tensor,
    raise_dynamo_cache_limit,
    skip_checkpoint_side_effects_in_recompute,
)
from lightning_2d.ops.moe import MoE
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.fsdp_backend import fsdp_backend
from lightning_2d.parallel.modules import get_submodule_container, replace_blocks


def apply_compile(model: nn.Module, plan: ParallelPlan, config: ParallelConfig) -> None:
    """Compile each block of ``plan.blocks`` with ``fullgraph=True`` (after AC, before FSDP).

    Compiling blocks rather than the whole model keeps FSDP's per-block hooks outside the graphs
    and lets each block reuse the first one's compiled code.

    A mixture-of-experts block (``ops.moe.MoE`` inside) compiles whole in bfloat16; its experts' call runs eagerly,
    one graph break per block, where ``grouped_mm`` has no compiled path (float32) or a parallel style's hooks
    around the experts take host values (expert parallelism's split sizes) or run in-place collectives
    (``GroupedExperts.eager_under_compile``), so such blocks compile without ``fullgraph``. Under activation
    checkpointing the routing statistics the forward writes are not written again by the compiled recompute
    (``skip_checkpoint_side_effects_in_recompute``: the eager recompute skips them too); a checkpointed block that
    breaks runs eagerly (dynamo compiles no checkpointed region with a break inside).
    """
    blocks = get_submodule_container(model, plan.blocks)
    # Each block is a separate module object, so dynamo caches an entry per block.
    raise_dynamo_cache_limit(len(blocks) + 8)
    # The FSDP backend's passes over its collectives, where they are graph ops (FSDP2's hooks stay outside).
    options = fsdp_backend(config.fsdp_backend).inductor_options()
    if config.activation_checkpointing != "none" and any(has_experts(block) for block in blocks.children()):
        skip_checkpoint_side_effects_in_recompute()
    replace_blocks(blocks, lambda i, block: _plain_inputs(
        torch.compile(block, fullgraph=not has_experts(block), options=options)))


def has_experts(block: nn.Module) -> bool:
    """Whether ``block`` holds a mixture-of-experts layer (compiled without ``fullgraph``: see ``apply_compile``)."""
    return any(isinstance(m, MoE) for m in block.modules())


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
