"""How our Llama splits into pipeline stages (``ParallelPlan.pipeline_stages`` of ``llama_plan``).

``lightning_2d.parallel.pipeline`` cuts the blocks into stages, places them and runs the schedules; it
asks the model family (this module) which blocks there are, what they cost, how a stage of them runs
and what a rank that does not hold a module drops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_2d.models.llama.model import Transformer
from lightning_2d.parallel.config import ParallelConfigError


def block_costs_of(model: nn.Module, block_names: list[str]) -> tuple[list[float], float, float]:
    """Parameter counts of each block, of the head (+ final norm) and of the embedding: a proxy for their
    compute per token (each parameter of a matmul costs 6 FLOPs per token in training; an embedding
    lookup costs next to nothing, so it counts for memory only, at a tenth)."""
    blocks = [float(sum(p.numel() for p in model.layers[name].parameters())) for name in block_names]
    head = float(sum(p.numel() for m in (model.norm, model.output) for p in m.parameters()))
    embed = float(sum(p.numel() for p in model.tok_embeddings.parameters())) * 0.1
    return blocks, head, embed


class PipelineStageModule(nn.Module):
    """One pipeline stage of a Llama ``Transformer``: references to its blocks (and the embedding /
    final norm + head for the first / last stage), with the ``Transformer``'s attribute names so the
    parallel plan applies to it unchanged.

    ``forward(x, labels=None, position_ids=None)``: token ids (first stage) or hidden states ``(B, T_local, dim)``
    in; hidden states out, or for the last stage the summed cross-entropy of ``labels`` (0-dim fp32).
    ``position_ids``: each packed document's positions (every stage gets them), as ``Transformer.forward``: the
    stage builds their attention mask once per call (one micro-batch) with the model's ``build_attention_mask``.
    """

    def __init__(self, model: nn.Module, block_names: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({name: model.layers[name] for name in block_names})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.is_first, self.is_last = first, last
        self._owner = [model]  # a list: not registered as a submodule (the model holds this stage)
        self.seq_len = 0  # the full sequence length of the running batch (set by the pipeline)

    def forward(
        self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T_local, dim)
        if position_ids is None:
            rope = self._owner[0].rope[: self.seq_len]
            for layer in self.layers.values():
                h = layer(h, rope)
        else:  # packed documents kept apart, as Transformer.forward: one mask per micro-batch for the stage's layers
            owner = self._owner[0]
            rope = owner.rope[position_ids]
            mask = owner.build_attention_mask(position_ids, h.dtype)  # the model's (context parallelism's) builder
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        if self.output is None:
            return h
        assert labels is not None, "the last stage computes the loss: it needs the labels"
        # 0-dim fp32: the summed cross-entropy; per_token: (B, T) each token's log-probability of its label
        return self.output(self.norm(h), labels=labels, per_token=per_token)


class LlamaPipelineStages:
    """``lightning_2d.parallel.pipeline.PipelineStages`` for a ``Transformer``: blocks ``layers.N``, the
    embedding with the first stage, the final norm and fused head with the last."""

    def check(self, model: nn.Module) -> None:
        if not isinstance(model, Transformer):
            raise ParallelConfigError([
                f"pipeline_parallel_size > 1 splits lightning_2d.Transformer into stages by its blocks; the"
                f" model to parallelize is {type(model).__name__}. Use LlamaLightningModule (or a Transformer), or"
                " pipeline_parallel_size=1"
            ])

    def block_names(self, model: nn.Module) -> list[str]:
        return list(model.layers.keys())

    def block_costs(self, model: nn.Module, block_names: list[str]) -> tuple[list[float], float, float]:
        return block_costs_of(model, block_names)

    def stage(self, model: nn.Module, block_names: list[str], first: bool, last: bool) -> nn.Module:
        return PipelineStageModule(model, block_names, first=first, last=last)

    def prune(self, model: nn.Module, kept_blocks: set[str], first: bool, last: bool) -> None:
        for name in list(model.layers.keys()):
            if name not in kept_blocks:
                del model.layers[name]
        if not first:
            model.tok_embeddings = None
        if not last:
            model.norm = None
            model.output = None

    def hidden_size(self, model: nn.Module) -> int:
        return model.args.dim


#: The one instance ``llama_plan`` puts in its plans.
LLAMA_PIPELINE_STAGES = LlamaPipelineStages()
