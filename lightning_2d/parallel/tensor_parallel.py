"""Tensor and sequence parallelism: applying a plan (``ParallelPlan.tensor_parallel``) over the
tensor-parallel mesh, and the sequence-length check sequence parallelism needs. The styles of our own
are in ``styles``; each model family's plan lives with the family (``lightning_2d.models``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_2d.errors import Lightning2DWarning
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.lora import has_adapters, with_adapter_placements

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_sequence_length(seq_len: int, tp: int) -> None:
    """Sequence parallelism shards the sequence evenly over ``tp`` ranks: refuse another length up front."""
    if seq_len % tp:
        raise ValueError(
            f"Input sequence length {seq_len} is not divisible by tensor_parallel_size ({tp}); sequence parallelism"
            f" shards the sequence evenly. Use a sequence length that is a multiple of {tp} or sequence_parallel=False."
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: "DeviceMesh", plan: ParallelPlan, config: ParallelConfig) -> None:
    """Apply ``plan.tensor_parallel`` to ``model`` over ``tp_mesh`` (in place); LoRA adapters of a column- or
    row-wise layer get the placements of ``lightning_2d.parallel.lora``.

    Under sequence parallelism a forward pre-hook checks every input's sequence length, so an
    indivisible batch fails with a message instead of inside a collective.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    styles = dict(plan.tensor_parallel)
    parallelize_module(model, tp_mesh, with_adapter_placements(styles) if has_adapters(model) else styles)
    if config.sequence_parallel and not plan.has_sequence_parallel:
        import warnings

        warnings.warn(
            f"sequence_parallel=True has no effect on {type(model).__name__}: its plan has no sequence-parallel"
            " styles (ParallelPlan.sequence_parallel is empty and tensor_parallel holds no SequenceParallel),"
            " so activations stay replicated over the tensor-parallel ranks. Add the sequence-parallel styles"
            " to ParallelPlan(sequence_parallel={...}), or set sequence_parallel=False to silence this.",
            Lightning2DWarning,
            stacklevel=2,
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
