"""The Llama's parallel plan: Meta's module names, as data.

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

from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.models.llama.pipeline import LLAMA_PIPELINE_STAGES
from lightning_2d.models.lora_targets import HF_TO_LLAMA, LLAMA_TARGETS
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.expert import ExpertParallel, MoETensorParallel
from lightning_2d.parallel.styles import HeadShardedNorm, VocabParallelHead

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def llama_tensor_parallel_plan(
    sequence_parallel: bool = True, loss_parallel: bool = False, blocks: str = "layers",
    moe_layers: tuple[int, ...] = (), n_layers: int = 0, experts_tensor_parallel: bool = True, qk_norm: bool = False,
    route_slices: bool = False,
) -> dict[str, "ParallelStyle"]:
    """The tensor-parallel plan of a Meta-named Llama ``Transformer``.

    Args:
        sequence_parallel: Shard the residual stream and the norms along the sequence.
        loss_parallel: Leave the logits sharded over the vocabulary (``Shard(-1)`` DTensor) for a
            vocabulary-parallel cross-entropy.
        blocks: Name of the transformer-block container.
        moe_layers: The mixture-of-experts blocks (of ``n_layers``): their feed-forward takes
            ``MoETensorParallel``, the dense blocks' the column/row-wise SwiGLU plan, each block by its index.
        n_layers: The number of blocks (needed with ``moe_layers``).
        experts_tensor_parallel: Split the routed experts over the tensor-parallel ranks (off under expert
            parallelism: whole experts on each rank, split over the expert-parallel ranks instead).
        qk_norm: The attention normalizes each query and key head (Qwen3): ``HeadShardedNorm`` on this rank's heads.
        route_slices: Each tensor-parallel rank routes its own sequence slice to the experts
            (``experts_over_tensor_parallel``: ``MoETensorParallel(route_slices=True)``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
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
    # The dense feed-forwards: every block's (one pattern), or each dense block's by index beside MoE blocks.
    dense = [block] if not moe_layers else [f"{blocks}.{i}" for i in range(n_layers) if i not in moe_layers]
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        plan[f"{block}.attention_norm"] = SequenceParallel()
        plan[f"{block}.ffn_norm"] = SequenceParallel()
        # The attention and SwiGLU need the whole sequence: gather it at their entry.
        plan[f"{block}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        )
        for prefix in dense:
            plan[f"{prefix}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    for name in ("attention.wq", "attention.wk", "attention.wv"):
        plan[f"{block}.{name}"] = ColwiseParallel()
    plan[f"{block}.attention.wo"] = RowwiseParallel(output_layouts=between)
    if qk_norm:
        plan[f"{block}.attention.q_norm"] = HeadShardedNorm()
        plan[f"{block}.attention.k_norm"] = HeadShardedNorm()
    for prefix in dense:
        for name in ("feed_forward.w1", "feed_forward.w3"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.feed_forward.w2"] = RowwiseParallel(output_layouts=between)
    if moe_layers:
        for i in moe_layers:
            plan[f"{blocks}.{i}.feed_forward"] = MoETensorParallel(sequence_parallel, experts_tensor_parallel,
                                                                   route_slices=route_slices)
    return plan


def llama_plan(args: ModelArgs, config: ParallelConfig, module: str = "") -> ParallelPlan:
    """The Llama plan: Meta's module names and the head counts tensor parallelism must divide.

    Args:
        args: The model's shape.
        config: Sequence/loss parallel options shape the plan.
        module: Attribute holding the ``Transformer`` (``"model"`` in ``LlamaLightningModule``;
            ``""`` when the plan applies to the ``Transformer`` itself, as in Fabric).
    """
    return ParallelPlan(
        tensor_parallel=llama_tensor_parallel_plan(
            config.sequence_parallel, config.loss_parallel, moe_layers=args.moe_layers, n_layers=args.n_layers,
            experts_tensor_parallel=config.expert_parallel_size == 1, qk_norm=args.qk_norm,
            route_slices=bool(config.experts_over_tensor_parallel) and config.expert_parallel_size > 1
            and config.sequence_parallel and config.tensor_parallel_size != 1,
        ),
        blocks="layers",
        module=module,
        tp_divides={"n_heads": args.n_heads, "n_kv_heads": args.kv_heads},
        input_units=("tok_embeddings",),
        output_unit=("norm", "output"),
        blocks_use_randomness=False,  # no dropout in Llama
        num_blocks=args.n_layers,
        pipeline_stages=LLAMA_PIPELINE_STAGES,
        attention="layers.*.attention",
        tied_weights=(("tok_embeddings.weight", "output.weight"),) if args.tie_word_embeddings else (),
        num_experts=args.moe.num_experts if args.moe is not None and args.moe_layers else None,
        aux_loss_coef=args.moe.aux_loss_coef if args.moe is not None and args.moe.uses_aux_loss else None,
        expert_parallel=llama_expert_parallel_plan(args),
        adapter_targets=LLAMA_TARGETS,  # Meta's names; Hugging Face's accepted
        adapter_aliases=HF_TO_LLAMA,
    )


def llama_expert_parallel_plan(args: ModelArgs, blocks: str = "layers") -> dict[str, "ParallelStyle"]:
    """The expert-parallel plan of a Meta-named Llama ``Transformer``: each mixture-of-experts block's stacked routed
    experts (``feed_forward.experts``) split over the expert-parallel ranks, by block index (``ExpertParallel``);
    empty for a dense model."""
    if not args.moe_layers:
        return {}

    return {f"{blocks}.{i}.feed_forward.experts": ExpertParallel() for i in args.moe_layers}


def llama_validation_inputs(args: ModelArgs) -> dict[str, Any]:
    """What the registered checks may know of a Llama of ``args`` before its plan (``parallel.checks.INPUTS``):
    whether it has mixture-of-experts layers."""
    return {"experts": args.moe is not None and bool(args.moe_layers)}
