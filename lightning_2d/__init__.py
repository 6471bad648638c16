"""lightning_2d: FSDP2/HSDP × tensor/sequence × pipeline × context parallel training as a Lightning strategy."""

from typing import Any

import lightning_2d.integration.fabric_strategy  # noqa: F401  (registers "model_parallel_2d" for Fabric too)
from lightning_2d.data import ChatDataModule, PreferenceDataModule, TextDataModule
from lightning_2d.integration.callbacks import TokenThroughputMonitor
from lightning_2d.integration.module import LlamaLightningModule
from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy
from lightning_2d.models.llama.model import ModelArgs, RopeScaling, Transformer
from lightning_2d.ops.distillation import DistillationConfig
from lightning_2d.ops.init import InitSpec
from lightning_2d.ops.lora import LoRA
from lightning_2d.ops.preference import PreferenceLoss
from lightning_2d.parallel import ParallelConfig, ParallelConfigError, ParallelPlan
from lightning_2d.parallel.hooks import ModelInitHooks

__version__ = "0.1.0"

__all__ = [
    "ChatDataModule",
    "DistillationConfig",
    "InitSpec",
    "LlamaLightningModule",
    "LoRA",
    "ModelArgs",
    "ModelInitHooks",
    "ModelParallel2DStrategy",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelPlan",
    "PreferenceDataModule",
    "PreferenceLoss",
    "RopeScaling",
    "TextDataModule",
    "TokenThroughputMonitor",
    "Transformer",
]


def __getattr__(name: str) -> Any:
    # 0.1.0's name, which shadowed Lightning's own `lightning.pytorch.callbacks.ThroughputMonitor` (another class,
    # other arguments): still importable, with a warning, until 0.3.
    if name == "ThroughputMonitor":
        import warnings

        warnings.warn(
            "lightning_2d.ThroughputMonitor is renamed TokenThroughputMonitor (the old name is Lightning's own"
            " lightning.pytorch.callbacks.ThroughputMonitor, another class); it will be removed in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return TokenThroughputMonitor
    raise AttributeError(f"module 'lightning_2d' has no attribute {name!r}")
