"""lightning_2d: 2D parallel training (FSDP2 × tensor/sequence parallel) as a Lightning strategy."""

from lightning_2d.callbacks import ThroughputMonitor
from lightning_2d.data import TextDataModule
from lightning_2d.model import ModelArgs, Transformer
from lightning_2d.module import LlamaLightningModule
from lightning_2d.parallel import ParallelConfig, ParallelConfigError, ParallelPlan
from lightning_2d.strategy import ModelParallel2DStrategy

__version__ = "0.1.0"

__all__ = [
    "LlamaLightningModule",
    "ModelArgs",
    "ModelParallel2DStrategy",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelPlan",
    "TextDataModule",
    "ThroughputMonitor",
    "Transformer",
]
