"""Parallel styles of our own, next to torch's ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel``:
an output head that also computes its fused loss on vocabulary shards, entering sequence parallelism at a
block instead of the embedding, and a norm applied to each attention head of this rank's heads (Qwen3's
``q_norm``/``k_norm``); ``is_sequence_parallel_style`` tells a plan's sequence-parallel entries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from lightning_2d.parallel.loss import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_log_probs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class VocabParallelHead(ColwiseParallel):
    """``ColwiseParallel`` for an output head that can also return its fused loss.

    The weight is sharded over the vocabulary as by ``ColwiseParallel``. Called for logits, the
    head behaves exactly like it (``output_layouts``: gathered or vocabulary-sharded). A head
    with a ``linear_cross_entropy`` attribute (``lightning_2d.models.llama.model.VocabProjection``) gets the
    vocabulary-parallel version of it, so ``head(hidden, labels=labels)`` returns the summed
    cross-entropy computed on the shards; that plain 0-dim tensor passes through unchanged. So does its
    ``linear_log_probs`` (``per_token=True``: each token's log-probability, a plain tensor).
    """

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        module = super()._apply(module, device_mesh)
        if hasattr(module, "linear_cross_entropy"):
            module.linear_cross_entropy = vocab_parallel_linear_cross_entropy
        if hasattr(module, "linear_log_probs"):
            module.linear_log_probs = vocab_parallel_linear_log_probs
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

    if isinstance(style, SequenceShardInput):
        return True
    if isinstance(style, SequenceParallel):  # sharded along its own dim: HeadShardedNorm's is the heads'
        return any(isinstance(p, Shard) and p.dim == sequence_dim for p in style.sequence_sharding)
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


def gather_sequence_around(module: nn.Module, device_mesh: "DeviceMesh", sequence_parallel: bool,
                           dim: int = 1) -> None:
    """Run ``module`` on the whole sequence on every tensor-parallel rank: its first input gathered from this rank's
    sequence slice (``Shard(1)``, a plain tensor or a DTensor) under sequence parallelism, and its output cut back to
    the slice. The gather's backward keeps this rank's slice of the gradient (no reduce-scatter) and the cut's
    gathers it: the module's gradients are whole and equal on every rank, as its computation is. Without sequence
    parallelism the input is whole already (a DTensor's local tensor is taken). ``dim``: the sequence's dimension
    (0 for tokens flattened to ``(tokens, D)``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather_input(_module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if isinstance(x, DTensor):
            x = x.redistribute(device_mesh, [Replicate()]).to_local()
        elif sequence_parallel:
            x = DTensor.from_local(x, device_mesh, [Shard(dim)], run_check=False)
            x = x.redistribute(device_mesh, [Replicate()]).to_local()
        return (x, *rest)

    module.register_forward_pre_hook(gather_input)
    if sequence_parallel:
        def scatter_output(_module: nn.Module, _args: tuple, out: Any) -> Any:
            tensor = out[0] if isinstance(out, tuple) else out
            full = DTensor.from_local(tensor, device_mesh, [Replicate()], run_check=False)
            local = full.redistribute(device_mesh, [Shard(dim)]).to_local()
            return (local, *out[1:]) if isinstance(out, tuple) else local

        module.register_forward_hook(scatter_output)


class WholeOnEachRank(ParallelStyle):
    """A module computed whole on every tensor-parallel rank, on the whole sequence (``gather_sequence_around``):
    its parameters stay plain (FSDP-sharded over the data-parallel ranks only). For a Hugging Face mixture-of-experts
    block (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``): the same routing and experts on every rank, so
    their gradients agree; the experts' FLOPs are repeated on each rank, their memory is not split.

    Args:
        sequence_parallel: The module's input and output are sequence slices.
    """

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        gather_sequence_around(module, device_mesh, self.sequence_parallel)
        return module


class HeadShardedNorm(SequenceParallel):
    """A norm applied to each attention head, on this rank's heads: Qwen3's ``self_attn.q_norm``/``k_norm``
    (an RMSNorm over ``head_dim``, between ``q_proj``/``k_proj`` and the rotary embedding).

    The projections before it are column-wise sharded by heads, so its input ``(batch, seq, heads, head_dim)``
    holds ``heads / tp`` heads on each rank. Its weight, shared by every head, becomes a ``Replicate()``
    DTensor over the tensor-parallel mesh; the input is taken as ``Shard(heads_dim)`` of the whole
    ``(batch, seq, heads, head_dim)`` activation (no communication), and the output is handed on as this
    rank's plain tensor, as the projection's was. The weight's gradient is then a sum over the local heads,
    a ``Partial()`` DTensor: reduced over the tensor-parallel ranks (every rank's heads contribute) when it
    meets the ``Replicate()`` parameter (FSDP2 redistributes it before its reduce-scatter). A plain tensor
    weight would instead keep each rank's own heads' share, and the ranks' weights would drift apart.

    torch's ``SequenceParallel(sequence_dim=2)`` (what torchtitan's Qwen3 plan uses) with a local output; a
    class of its own so that a plan reads what it does and ``is_sequence_parallel_style`` does not take the
    heads for the sequence: it applies with and without sequence parallelism.

    Args:
        heads_dim: The heads dimension of the norm's input (``2`` in ``(batch, seq, heads, head_dim)``).
    """

    def __init__(self, heads_dim: int = 2) -> None:
        super().__init__(sequence_dim=heads_dim, use_local_output=True)
