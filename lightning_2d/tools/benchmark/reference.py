"""The 2D code the ``lightning`` and ``plain`` variants write by hand, as PyTorch's 2D example and
torchtitan do: the Llama TP/SP plan and FSDP2 per block (``reference_2d_plan``), its mixed-precision policy,
the model built with it, and a plain mean cross-entropy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lightning_2d.models.llama.model import Transformer
from lightning_2d.parallel.config import PRECISION_TO_DTYPES
from lightning_2d.tools.benchmark.settings import BenchmarkSettings

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def reference_2d_plan(
    model: Transformer, tp_mesh: "DeviceMesh", dp_mesh: "DeviceMesh", mp_policy: "MixedPrecisionPolicy"
) -> None:
    """The Llama 2D layout written by hand, as in PyTorch's 2D example and torchtitan's ``parallelize_llama``.

    Tensor parallel with sequence parallelism: the embedding is sharded over the vocabulary and
    emits sequence shards, every block gathers the sequence at the attention/feed-forward entry,
    shards ``wq/wk/wv/w1/w3`` by columns and ``wo/w2`` by rows (back to sequence shards), norms
    run on the shards, the logits are gathered. Then FSDP2 per block (each but the last reshards
    after forward) and at the root. The model's attention reads its local head count from the
    shapes, so no head count is rewritten.

    Args:
        model: A ``Transformer`` (on the meta device, or materialized).
        tp_mesh: The tensor-parallel sub-mesh.
        dp_mesh: The data-parallel sub-mesh.
        mp_policy: FSDP2's mixed-precision policy.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def reference_mp_policy(precision: str) -> "MixedPrecisionPolicy":
    """FSDP2's policy for ``precision``, the same dtypes ``ModelParallel2DStrategy`` derives by default."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype, reduce_dtype = PRECISION_TO_DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def build_reference_model(settings: BenchmarkSettings, tp_mesh: "DeviceMesh", dp_mesh: "DeviceMesh") -> Transformer:
    """The hand-written variants' model: built on the meta device, then ``reference_2d_plan``."""
    with torch.device("meta"):
        model = Transformer(settings.model_args)
    if settings.precision == "bf16-true":
        model.to(torch.bfloat16)  # the shards themselves are bf16, as under ModelParallel2DStrategy
    reference_2d_plan(model, tp_mesh, dp_mesh, reference_mp_policy(settings.precision))
    return model


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The hand-written variants' loss: the mean over this rank's tokens (FSDP averages over replicas)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
