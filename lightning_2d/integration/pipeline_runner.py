"""The pipeline part of the Trainer strategy: a pipelined training step inside Lightning's loop.

Under pipeline parallelism the model's call in ``training_step`` runs the backward too (the schedule does,
micro-batch by micro-batch), but Lightning zeroes the gradients *after* the training step (right before
its backward). ``TrainerPipelineRunner`` zeroes them before the step (where Lightning would, at the first
batch of each accumulation window) and holds them aside from the step's end until ``backward``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_2d.parallel.pipeline import Pipeline


class TrainerPipelineRunner:
    """Runs ``pipeline``'s training steps in the Trainer's automatic optimization."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        #: Gradients a pipelined training step computed, held from its end to ``backward``.
        self.held: tuple = ()

    def before_training_step(self, batch_idx: int, accumulate_grad_batches: int, optimizers: list[Any]) -> None:
        self.pipeline.grad_scale = 1.0 / accumulate_grad_batches  # Lightning divides the loss by it before backward
        if batch_idx % accumulate_grad_batches == 0:
            for optimizer in optimizers:
                optimizer.zero_grad()

    def after_training_step(self, module: nn.Module) -> None:
        self.held = tuple((p, p.grad) for p in module.parameters() if p.grad is not None)
        for param, _ in self.held:
            param.grad = None

    def before_backward(self) -> None:
        held, self.held = self.held, ()
        for param, grad in held:  # Lightning's zero_grad ran since the step's end
            param.grad = grad if param.grad is None else param.grad.add_(grad)
