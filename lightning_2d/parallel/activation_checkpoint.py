"""Activation checkpointing of transformer blocks: full, per-op selective, or every N-th block."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_2d._compat import checkpoint_wrapper
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.modules import get_submodule_container, replace_blocks

if TYPE_CHECKING:
    from lightning_2d.parallel.fsdp import FSDPUnit


def _ops(*names: str) -> set[Any]:
    """The aten/c10d ops among ``names`` that exist in this PyTorch build."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return found


#: Outputs kept by per-op selective AC (torchtitan's list): matmuls (float8 ones are
#: ``_scaled_mm``; a Linear with a bias, as Qwen2's q/k/v projections, is an ``addmm``) and attention
#: are expensive to recompute, a reduce-scatter's output costs communication. Everything else is
#: recomputed.
SELECTIVE_AC_SAVE_LIST = _ops(
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)


def _selective_op_context_fn() -> Callable[[], Any]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # With and without a bias: torchtitan's models have none, but the q/k/v projections of a Qwen2 would
    # otherwise be neither saved nor counted (its block then kept wo and w3 instead of wq, wv, w1, w2).
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    def context_fn() -> Any:
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            key = "recompute" if ctx.is_recompute else "forward"
            if func in matmuls:
                counts[key] += 1
            # Save every other matmul: halves what the block keeps for a partial recompute of
            # the projections (as torchtitan does). Count in forward and recompute alike so both
            # passes take the same decisions.
            save = func in SELECTIVE_AC_SAVE_LIST and not (func in matmuls and counts[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


#: torch's dropout modules, by their public names (their private base ``_DropoutNd`` is not API);
#: ``tests/unit/test_compat.py`` checks that the list covers every subclass of that base.
DROPOUT_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)


def uses_randomness(block: nn.Module, plan: ParallelPlan) -> bool:
    """Whether recomputing ``block`` must replay its random draws (``plan.blocks_use_randomness``,
    else: it holds a dropout module with ``p > 0``)."""
    if plan.blocks_use_randomness is not None:
        return plan.blocks_use_randomness
    return any(isinstance(m, DROPOUT_MODULES) and m.p > 0 for m in block.modules())


def _wrap(block: nn.Module, plan: ParallelPlan, **kwargs: Any) -> nn.Module:
    # preserve_rng_state saves and restores the CPU and device generator states around every
    # recomputed block so dropout draws the same masks twice; a block without randomness (Llama)
    # skips that cost, as torchtitan does.
    return checkpoint_wrapper(block, preserve_rng_state=uses_randomness(block, plan), **kwargs)


def apply_activation_checkpointing(model: nn.Module, plan: ParallelPlan, config: ParallelConfig) -> None:
    """Wrap the blocks named by ``plan.blocks`` according to ``config.activation_checkpointing``."""
    mode = config.activation_checkpointing
    if mode == "none":
        return
    blocks = get_submodule_container(model, plan.blocks)
    if mode == "full":
        replace_blocks(blocks, lambda i, block: _wrap(block, plan))
    elif config.selective_ac_option == "op":
        context_fn = _selective_op_context_fn()
        replace_blocks(blocks, lambda i, block: _wrap(block, plan, context_fn=context_fn))
    else:
        every = int(config.selective_ac_option)
        replace_blocks(blocks, lambda i, block: _wrap(block, plan) if (i + 1) % every == 0 else block)


def recomputed_blocks(units: list["FSDPUnit"], activation_checkpointing: str, selective_ac_option: Any) -> set[str]:
    """The block units whose forward activation checkpointing runs again in backward (``apply_activation_checkpointing``:
    every block under ``"full"`` and per-op ``"selective"``, whose policy recomputes all but the matmul and attention
    outputs, the gathers included; every N-th under ``selective_ac_option=N``)."""
    blocks = [u.name for u in units if u.kind in ("block", "last_block")]
    if activation_checkpointing == "none":
        return set()
    if activation_checkpointing == "selective" and selective_ac_option != "op":
        every = int(selective_ac_option)
        return {name for i, name in enumerate(blocks) if (i + 1) % every == 0}
    return set(blocks)
