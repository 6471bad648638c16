"""The precision part of the 2D strategies: FSDP2's ``MixedPrecisionPolicy`` casts instead of autocast.

Lightning's extension point for the job is the precision plugin; the strategies put one of these in place of
Lightning's stock plugins (``fsdp2_precision``) when they are constructed, and keep a plugin the user wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d.parallel.grad_norm import clip_grad_norm_
from lightning_2d.parallel.pipeline import Pipeline

#: Where a plugin asks for the pipeline (the strategy's ``pipeline``); ``None`` without one.
PipelineSource = Callable[[], Optional[Pipeline]]


def _no_pipeline() -> Optional[Pipeline]:
    return None


def _nothing_deferred() -> None:
    return None


#: Lightning's stock plugins (autocast, module conversion), which give way to FSDP2's policy.
STOCK_PLUGINS = (Precision, MixedPrecision, HalfPrecision, FabricPrecision, FabricMixedPrecision, FabricHalfPrecision)


class FSDP2Precision(Precision):
    """Precision under the 2D strategies (Trainer and Fabric): FSDP2's ``MixedPrecisionPolicy`` casts.

    ``bf16-mixed``: parameters stay fp32 (sharded) for the optimizer; FSDP all-gathers them in
    bf16 and reduce-scatters gradients in fp32 (autocast on top would only add casts).
    ``bf16-true``: the shards themselves are bf16. ``32-true``: no casting. Gradient clipping
    computes the true global norm over DTensor gradients on any mix of meshes.

    This is the Trainer's plugin; ``FabricFSDP2Precision`` is the same for Fabric (a Trainer plugin's
    ``backward`` calls ``LightningModule.backward``, so one class cannot serve both).

    Args:
        precision: The precision string.
        pipeline: Asked for the pipeline when clipping (the strategy's ``pipeline``, given by the strategy that
            constructs the plugin): under pipeline parallelism the norm spans every stage's gradients.
        gradients_ready: Called before clipping reads the gradients (the strategy's ``finish_gradients``: the
            deferred tensor-parallel reductions, ``parallel.grad_sync``; a manual-optimization loop may clip before
            the optimizer step runs them).
    """

    def __init__(self, precision: str, pipeline: PipelineSource = _no_pipeline,
                 gradients_ready: Callable[[], None] = _nothing_deferred) -> None:
        self.precision = precision  # type: ignore[assignment]  # Lightning types it as a Literal of names
        self._pipeline_source = pipeline
        self._gradients_ready = gradients_ready

    @property
    def pipeline(self) -> Optional[Pipeline]:
        """The strategy's pipeline now (``None`` without pipeline parallelism)."""
        return self._pipeline_source()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._gradients_ready()
        pipeline = self.pipeline
        group = pipeline.pp_group if pipeline is not None else None
        clip_grad_norm_(self.main_params(optimizer), clip_val, pipeline_group=group)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._gradients_ready()
        super().clip_grad_by_value(optimizer, clip_val)


class FabricFSDP2Precision(FabricPrecision):
    """``FSDP2Precision`` for Fabric: FSDP2's policy casts; clipping is the strategy's (``clip_gradients_norm``).
    ``pipeline``: as ``FSDP2Precision``'s (``fabric.backward`` is refused under a pipeline); ``gradients_ready``: as
    there (the strategy's ``clip_gradients_norm`` and ``optimizer_step`` call it themselves)."""

    def __init__(self, precision: str, pipeline: PipelineSource = _no_pipeline,
                 gradients_ready: Callable[[], None] = _nothing_deferred) -> None:
        self.precision = precision  # type: ignore[assignment]  # Lightning types it as a Literal of names
        self._pipeline_source = pipeline
        self._gradients_ready = gradients_ready

    @property
    def pipeline(self) -> Optional[Pipeline]:
        """The strategy's pipeline now (``None`` without pipeline parallelism)."""
        return self._pipeline_source()

    @override
    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self.pipeline is not None:
            raise RuntimeError(
                "fabric.backward under pipeline parallelism: `fabric.strategy.pipeline.train_step(tokens, labels,"
                " grad_scale=1 / accumulate)` already ran the forward and backward of every micro-batch, and"
                " its loss has no graph. Drop the fabric.backward call (recipes/fabric_pretrain.py shows the loop)."
            )
        super().backward(tensor, model, *args, **kwargs)


def fsdp2_precision(plugin: Any, fsdp2_class: type, pipeline: PipelineSource = _no_pipeline,
                    gradients_ready: Callable[[], None] = _nothing_deferred) -> Any:
    """The plugin the strategy runs with: ``fsdp2_class`` (of ``plugin``'s precision, asking ``pipeline`` for the
    pipeline, calling ``gradients_ready`` before clipping) in place of one of Lightning's stock plugins; a custom
    plugin the user passed is kept."""
    if type(plugin) in STOCK_PLUGINS:
        return fsdp2_class(plugin.precision, pipeline=pipeline, gradients_ready=gradients_ready)
    return plugin
