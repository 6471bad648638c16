"""The Fabric strategy validates like the Trainer strategy: at construction, before any process; a frozen model given
to it (a reference, a teacher) is told apart from the trained one and kept out of optimizers and checkpoints."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_2d import LoRA, ModelArgs, ParallelConfigError, ParallelPlan, Transformer
from lightning_2d.fabric import FabricFSDP2Precision, ModelParallel2DStrategy
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.converters import ModelConverters
from lightning_2d.parallel.frozen import held_frozen


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


# ---- a frozen model beside the trained one (a DPO reference, a teacher) -------------------------------------------
def _meta_llama(frozen: bool) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_name("debug"))
    return model.requires_grad_(not frozen)


def test_a_model_with_every_parameter_frozen_and_no_adapters_is_held_frozen():
    plan = ParallelPlan(module="")
    assert held_frozen(_meta_llama(frozen=True), ModelConverters())
    assert not held_frozen(_meta_llama(frozen=False), ModelConverters())
    assert not held_frozen(nn.Identity(), ModelConverters())  # nothing to hold
    adapted = _meta_llama(frozen=True)
    adapted.lora = LoRA(rank=4)  # adapters declared on a frozen base: they train
    assert not held_frozen(adapted, ModelConverters.of(llama_plan(adapted.args, ParallelConfig()), {"lora": adapted.lora}))
    assert held_frozen(_meta_llama(frozen=True), ModelConverters.of(plan, {}))


def test_a_frozen_model_gets_no_optimizer_and_stays_out_of_checkpoints():
    strategy = ModelParallel2DStrategy()
    reference, policy = _meta_llama(frozen=True), _meta_llama(frozen=False)
    with pytest.raises(ValueError, match=r"fabric.setup\(Transformer, optimizer\): no parameter of Transformer requires"
                                         r" a gradient.*Set it up alone: `reference = fabric.setup\(reference\)`"):
        strategy.setup_module_and_optimizers(reference, [torch.optim.SGD(reference.parameters(), lr=0.1)])
    strategy.frozen_modules.add(reference)  # as setup_module leaves it (parallelized by parallelize_frozen)
    with pytest.raises(ValueError, match=r"holds 2 parameter\(s\) of the frozen model Transformer set up by"
                                         r" fabric.setup \(e.g. 'tok_embeddings.weight'\).*requires_grad\]`"):
        strategy.setup_optimizer(torch.optim.SGD([*reference.tok_embeddings.parameters(), *reference.norm.parameters()],
                                                 lr=0.1))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    assert strategy.setup_optimizer(optimizer) is optimizer
    with pytest.raises(ValueError, match=r"fabric.save: state\['reference'\] is a frozen model held beside the trained"
                                         r" one, which no checkpoint keeps.*Leave it out of the state"):
        strategy.save_checkpoint("ckpt", {"model": policy, "reference": reference})

