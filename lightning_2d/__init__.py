"""lightning_2d: 2D parallel training (FSDP2 × tensor/sequence parallel) as a Lightning strategy."""

from lightning_2d.data import TextDataModule
from lightning_2d.integration.callbacks import ThroughputMonitor
from lightning_2d.integration.module import LlamaLightningModule
from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy
from lightning_2d.models.llama.model import ModelArgs, RopeScaling, Transformer
from lightning_2d.parallel import ParallelConfig, ParallelConfigError, ParallelPlan

__version__ = "0.1.0"

__all__ = [
    "LlamaLightningModule",
    "ModelArgs",
    "ModelParallel2DStrategy",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelPlan",
    "RopeScaling",
    "TextDataModule",
    "ThroughputMonitor",
    "Transformer",
]
