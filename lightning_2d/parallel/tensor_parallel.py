"""Tensor and sequence parallelism: the Llama plan as data, and the function that applies a plan.

The plan follows PyTorch's 2D Llama example and torchtitan: the embedding is sharded over the
vocabulary, attention and feed-forward input projections column-wise (each rank computes
``n_heads / tp`` heads and ``hidden / tp`` SwiGLU features), their output projections row-wise.
With sequence parallelism the activations between those regions stay sharded along the sequence
(``Shard(1)``) and the norms run on the shards; the all-reduce of plain TP becomes a
reduce-scatter + all-gather pair that moves the same bytes but keeps ``1/tp`` of the
activations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_2d.parallel.config import ParallelConfig, ParallelPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


class VocabParallelHead(ColwiseParallel):
    """``ColwiseParallel`` for an output head that can also return its fused loss.

    The weight is sharded over the vocabulary as by ``ColwiseParallel``. Called for logits, the
    head behaves exactly like it (``output_layouts``: gathered or vocabulary-sharded). A head
    with a ``linear_cross_entropy`` attribute (``lightning_2d.model.VocabProjection``) gets the
    vocabulary-parallel version of it, so ``head(hidden, labels=labels)`` returns the summed
    cross-entropy computed on the shards; that plain 0-dim tensor passes through unchanged.
    """

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        from lightning_2d.parallel.loss import vocab_parallel_linear_cross_entropy

        module = super()._apply(module, device_mesh)
        if hasattr(module, "linear_cross_entropy"):
            module.linear_cross_entropy = vocab_parallel_linear_cross_entropy
        return module

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(outputs, DTensor):  # the fused loss, already reduced over the shards
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def llama_tensor_parallel_plan(
    sequence_parallel: bool = True, loss_parallel: bool = False, blocks: str = "layers"
) -> dict[str, "ParallelStyle"]:
    """The tensor-parallel plan of a Meta-named Llama ``Transformer``.

    Args:
        sequence_parallel: Shard the residual stream and the norms along the sequence.
        loss_parallel: Leave the logits sharded over the vocabulary (``Shard(-1)`` DTensor) for a
            vocabulary-parallel cross-entropy.
        blocks: Name of the transformer-block container.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    logits = Shard(-1) if loss_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": VocabParallelHead(input_layouts=between, output_layouts=logits, use_local_output=not loss_parallel),
    }
    block = f"{blocks}.*"
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        plan[f"{block}.attention_norm"] = SequenceParallel()
        plan[f"{block}.ffn_norm"] = SequenceParallel()
        # The attention and SwiGLU need the whole sequence: gather it at their entry.
        plan[f"{block}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        )
        plan[f"{block}.feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"{block}.{name}"] = ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=between)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: "DeviceMesh", plan: ParallelPlan, config: ParallelConfig) -> None:
    """Apply ``plan.tensor_parallel`` to ``model`` over ``tp_mesh`` (in place).

    Under sequence parallelism a forward pre-hook checks every input's sequence length, so an
    indivisible batch fails with a message instead of inside a collective.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, dict(plan.tensor_parallel))
    if config.sequence_parallel:
        tp, dim = tp_mesh.size(), plan.sequence_dim

        def check_sequence_length(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            # The first tensor input, positional or keyword (HF models take `input_ids=`).
            tokens = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            if tokens is not None and tokens.dim() > dim and tokens.shape[dim] % tp:
                raise ValueError(
                    f"Input sequence length {tokens.shape[dim]} is not divisible by tensor_parallel_size ({tp});"
                    f" sequence parallelism shards the sequence evenly. Use a sequence length that is a multiple"
                    f" of {tp} or sequence_parallel=False."
                )

        model.register_forward_pre_hook(check_sequence_length, with_kwargs=True)
