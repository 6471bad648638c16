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
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_2d.parallel.config import ParallelConfig, ParallelPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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


def is_sequence_parallel_style(style: "ParallelStyle", sequence_dim: int = 1) -> bool:
    """Whether ``style`` shards activations along the sequence: ``SequenceParallel``, or a style with
    a ``Shard(sequence_dim)`` input/output layout (row-wise outputs, ``PrepareModuleInput`` …)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if isinstance(style, (SequenceParallel, SequenceShardInput)):
        return True
    layouts: list[Any] = []
    for attr in ("input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts"):
        value = getattr(style, attr, None)
        layouts += list(value) if isinstance(value, (tuple, list)) else [value]
    for attr in ("input_kwarg_layouts", "desired_input_kwarg_layouts"):
        layouts += list((getattr(style, attr, None) or {}).values())
    return any(isinstance(p, Shard) and p.dim == sequence_dim for p in layouts)


class SequenceShardInput(ParallelStyle):
    """Enter sequence parallelism at a module: its first input (positional, or the keyword ``name``),
    replicated over the tensor-parallel ranks, becomes this rank's ``Shard(dim)`` slice.

    For models whose own code runs between the embedding and the first block on the whole
    sequence (Hugging Face decoders derive positions, the causal mask and the rotary tables from
    the embedding output's shape): the embedding stays replicated and the sequence is split at
    the first block instead. Forward slices locally (no communication); backward all-gathers
    the gradient, so each rank's vocabulary slice of the embedding sees every token's gradient.

    Args:
        name: Keyword under which the module may receive the input (``"hidden_states"``).
        dim: The sequence dimension.
    """

    def __init__(self, name: str = "hidden_states", dim: int = 1) -> None:
        super().__init__()
        self.name, self.dim = name, dim

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def shard(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            if x.shape[self.dim] % device_mesh.size():
                raise ValueError(
                    f"Input sequence length {x.shape[self.dim]} of {type(module).__name__} is not divisible by"
                    f" tensor_parallel_size ({device_mesh.size()}); sequence parallelism shards the sequence"
                    f" evenly. Use a multiple of {device_mesh.size()} or sequence_parallel=False."
                )
            full = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return full.redistribute(device_mesh, [Shard(self.dim)]).to_local()

        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (shard(args[0]), *args[1:]), kwargs
            if self.name in kwargs:
                return args, {**kwargs, self.name: shard(kwargs[self.name])}
            raise ValueError(
                f"SequenceShardInput on {type(module).__name__} found no positional input and no `{self.name}=`"
                " keyword to shard; pass SequenceShardInput(name=...) with the keyword the module receives."
            )

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


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


def check_sequence_length(seq_len: int, tp: int) -> None:
    """Sequence parallelism shards the sequence evenly over ``tp`` ranks: refuse another length up front."""
    if seq_len % tp:
        raise ValueError(
            f"Input sequence length {seq_len} is not divisible by tensor_parallel_size ({tp}); sequence parallelism"
            f" shards the sequence evenly. Use a sequence length that is a multiple of {tp} or sequence_parallel=False."
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: "DeviceMesh", plan: ParallelPlan, config: ParallelConfig) -> None:
    """Apply ``plan.tensor_parallel`` to ``model`` over ``tp_mesh`` (in place).

    Under sequence parallelism a forward pre-hook checks every input's sequence length, so an
    indivisible batch fails with a message instead of inside a collective.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, dict(plan.tensor_parallel))
    if config.sequence_parallel and not plan.has_sequence_parallel:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"sequence_parallel=True has no effect on {type(model).__name__}: its plan has no sequence-parallel"
            " styles (ParallelPlan.sequence_parallel is empty and tensor_parallel holds no SequenceParallel),"
            " so activations stay replicated over the tensor-parallel ranks. Add the sequence-parallel styles"
            " to ParallelPlan(sequence_parallel={...}), or set sequence_parallel=False to silence this."
        )
    elif config.sequence_parallel:
        tp, dim = tp_mesh.size(), plan.sequence_dim

        def check_input_sequence(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            # The first tensor input, positional or keyword (HF models take `input_ids=`).
            tokens = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            # Hidden states (a later pipeline stage's input) are already sharded along the sequence.
            if tokens is not None and not tokens.is_floating_point() and tokens.dim() > dim:
                check_sequence_length(tokens.shape[dim], tp)

        model.register_forward_pre_hook(check_input_sequence, with_kwargs=True)
