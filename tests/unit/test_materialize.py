"""Materializing a meta-device model never leaves a tensor without values; a NaN first loss stops the run.

Single process, plain tensors (the sharded path is the same code on each rank's local shards and is
exercised by every distributed job).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_2d import LlamaLightningModule, ModelArgs, ModelParallel2DStrategy, Transformer
from lightning_2d.integration.strategy_base import NonFiniteLossError
from lightning_2d.parallel.materialize import MaterializationError, materialize_model

CPU = torch.device("cpu")


class ScaleNorm(nn.Module):
    """Like Hugging Face's LlamaRMSNorm: a parameter and no ``reset_parameters()``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Rotary(nn.Module):
    """Like Hugging Face's rotary embedding: a non-persistent buffer computed in ``__init__``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = ScaleNorm(8)
        self.rotary = Rotary(8)


def meta(factory):
    with torch.device("meta"):
        return factory()


def test_modules_without_reset_parameters_are_named_not_left_as_garbage():
    model = meta(Tiny)
    with pytest.warns(UserWarning, match="no `param_init_specs\\(\\)`"), pytest.raises(MaterializationError) as err:
        materialize_model(model, CPU, seed=0)
    message = str(err.value)
    assert "2 tensor(s) of Tiny built on the meta device were left without values" in message
    assert "norm.weight (parameter of ScaleNorm): ScaleNorm has no reset_parameters()" in message
    assert "rotary.inv_freq (non-persistent buffer of Rotary)" in message
    assert "init_buffers(self, device)" in message and "proj." not in message  # Linear resets itself


def test_init_specs_with_a_buffer_no_route_fills_raise():
    class Specs(Tiny):
        def param_init_specs(self):
            return Transformer(ModelArgs.from_name("debug")).param_init_specs()  # names none of Tiny's

    with pytest.raises(KeyError, match="no InitSpec for parameter 'proj.weight'"):
        materialize_model(meta(Specs), CPU, seed=0)


def test_a_model_whose_hooks_fill_everything_materializes_and_keeps_real_tensors():
    class Complete(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("step", torch.zeros((), dtype=torch.long))

        def init_buffers(self, device):
            self.norm.weight.fill_(1.0)  # a parameter can be filled here too
            self.rotary.inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, device=device).float() / 8))

    model = meta(Complete)
    model.step = torch.tensor(41)  # a real tensor in a meta model keeps its value
    with pytest.warns(UserWarning):
        materialize_model(model, CPU, seed=0)
    assert model.step.item() == 41 and torch.equal(model.norm.weight, torch.ones(8))
    assert torch.isfinite(model.proj.weight).all() and torch.isfinite(model.rotary.inv_freq).all()


def test_the_llama_model_materializes_completely_from_its_specs():
    model = meta(lambda: Transformer(ModelArgs.from_name("debug")))
    materialize_model(model, CPU, seed=3)
    reference = Transformer(ModelArgs.from_name("debug"))
    reference.init_weights(seed=3)
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(got, want), name
    assert torch.equal(model.rope, reference.rope)


def test_a_nan_first_loss_stops_before_the_first_optimizer_step(tmp_path):
    class Broken(LlamaLightningModule):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * float("nan")

    module = Broken("debug", warmup_steps=1, max_steps=2, init_seed=0)
    tokens = torch.randint(0, 256, (4, 17))
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ModelParallel2DStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    try:
        with pytest.raises(NonFiniteLossError, match="The loss of the first training step is not finite"):
            trainer.fit(module, DataLoader(data, batch_size=2))
        assert trainer.global_step == 0  # no optimizer step on top of it
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # the 1-process group the failed fit left behind
            dist.destroy_process_group()


def test_a_users_init_specs_written_from_the_public_names_give_seeded_values():
    """What the README tells a user to write: ``param_init_specs()`` returning ``lightning_2d.InitSpec``s (the
    methods listed in ``lightning_2d.ModelInitHooks``), imported from the front door."""
    from lightning_2d import InitSpec, ModelInitHooks

    class Specified(Tiny):
        def param_init_specs(self) -> dict[str, InitSpec]:
            return {"proj.weight": InitSpec("trunc_normal", std=0.02), "proj.bias": InitSpec("constant"),
                    "norm.weight": InitSpec("constant", value=1.0)}

        def init_buffers(self, device):
            self.rotary.inv_freq = torch.ones(4, device=device)

    first, second = meta(Specified), meta(Specified)
    assert isinstance(first, ModelInitHooks)
    materialize_model(first, CPU, seed=5)
    materialize_model(second, CPU, seed=5)
    assert torch.equal(first.proj.weight, second.proj.weight) and first.proj.weight.abs().max() <= 0.06
    assert torch.equal(first.norm.weight, torch.ones(8)) and torch.equal(first.proj.bias, torch.zeros(8))
