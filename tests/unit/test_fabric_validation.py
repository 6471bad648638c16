"""The Fabric strategy validates like the Trainer strategy: at construction, before any process."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_2d import ParallelConfigError
from lightning_2d.fabric import FabricFSDP2Precision, ModelParallel2DStrategy


def test_bad_layout_fails_when_fabric_is_constructed():
    with pytest.raises(ParallelConfigError, match=r"\(1 × 3 = 3\) must equal the world size \(4 "):
        L.Fabric(accelerator="cpu", devices=4, strategy=ModelParallel2DStrategy(tensor_parallel_size=3))


def test_bad_options_fail_at_strategy_construction():
    with pytest.raises(ParallelConfigError, match=r"activation_checkpointing='fulll' is not a mode"):
        ModelParallel2DStrategy(activation_checkpointing="fulll")


def test_bf16_mixed_uses_fsdp2_casting_not_autocast():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallel2DStrategy(), precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, FabricFSDP2Precision)
    assert fabric.strategy.precision.precision == "bf16-mixed"


def test_the_strategy_by_name():
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy="model_parallel_2d")
    assert isinstance(fabric.strategy, ModelParallel2DStrategy)
    config = fabric.strategy.parallel_config
    assert (config.data_parallel_size, config.tensor_parallel_size) == ("auto", "auto")  # the defaults
