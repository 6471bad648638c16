"""Per-block ``torch.compile``: the blocks are identical, so one compilation serves them all."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from lightning_2d._compat import is_async_collective_tensor, raise_dynamo_cache_limit
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
    options = inductor_options(config)
    replace_blocks(blocks, lambda i, block: _plain_inputs(torch.compile(block, fullgraph=True, options=options)))


#: Inductor's passes over SimpleFSDP's collectives (torch 2.13 names), which run on any device: one all-gather per
#: block's weights in forward and one reduce-scatter per block's gradients in backward, and the collectives moved
#: to overlap the computation before/after them.
SIMPLE_FSDP_INDUCTOR_OPTIONS = {
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "reorder_for_compute_comm_overlap": True,
}
#: The overlap scheduler that places the buckets by a roofline estimate of the GPU (it imports triton): CUDA only.
CUDA_OVERLAP_OPTIONS = {"aten_distributed_optimizations.enable_overlap_scheduling": True}


def inductor_options(config: ParallelConfig) -> Optional[dict[str, Any]]:
    """The inductor options of the compiled blocks: under ``fsdp_backend="simple_fsdp"`` the collective bucketing
    and reordering passes, plus the overlap scheduler when the job runs on CUDA (said once, else skipped)."""
    if config.fsdp_backend != "simple_fsdp":
        return None
    options: dict[str, Any] = dict(SIMPLE_FSDP_INDUCTOR_OPTIONS)
    if _on_nccl():
        options.update(CUDA_OVERLAP_OPTIONS)
    else:
        _say_once(
            "SimpleFSDP under compile: the collectives are bucketed and reordered; inductor's overlap scheduler is"
            " left off (it estimates collective and compute times from a GPU roofline, which needs CUDA and NCCL)"
        )
    return options


def _on_nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logging.getLogger(__name__).info(message)


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
