"""LlamaLightningModule under a plain single-device Trainer (the parity reference) and its schedule."""

from __future__ import annotations

import math
from dataclasses import asdict

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_2d import LlamaLightningModule, ModelArgs
from lightning_2d.integration.module import warmup_cosine_schedule


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    f = warmup_cosine_schedule(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert warmup_cosine_schedule(0, 10, 0.0)(0) == 1.0


def batches(n: int, seq_len: int = 16) -> list[dict[str, torch.Tensor]]:
    # A learnable pattern: every sequence counts upward modulo the vocabulary.
    out = []
    for i in range(n):
        seq = (torch.arange(seq_len + 1) + i) % 256
        labels = seq[1:].clone()
        labels[:2] = -100
        out.append({"input_ids": seq[:-1], "labels": labels})
    return out


def test_single_device_training_lowers_the_loss_and_logs_perplexity():
    L.seed_everything(0)
    module = LlamaLightningModule("debug", learning_rate=3e-3, warmup_steps=2, max_steps=30)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=30, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
    )
    train = DataLoader(batches(64), batch_size=8)
    trainer.validate(module, DataLoader(batches(8), batch_size=4))
    before = float(trainer.callback_metrics["val_loss"])
    trainer.fit(module, train, DataLoader(batches(8), batch_size=4))
    after = float(trainer.callback_metrics["val_loss"])
    assert after < before - 1.0
    assert float(trainer.callback_metrics["val_perplexity"]) == pytest.approx(math.exp(after), rel=1e-5)
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in optimizer.param_groups[1]["params"])  # norms are not decayed


def test_loss_ignores_masked_labels_and_averages_over_tokens():
    module = LlamaLightningModule("debug", init_seed=0)
    module.configure_model()
    batch = {"input_ids": torch.randint(0, 256, (2, 8)), "labels": torch.randint(0, 256, (2, 8))}
    batch["labels"][0, :5] = -100
    loss, mean, tokens = module._loss(batch)
    logits = module(batch["input_ids"])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert tokens.item() == 11
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(mean, expected)


def test_model_args_and_overrides():
    args = ModelArgs.from_name("debug", n_layers=1)
    assert LlamaLightningModule(args).model_args.n_layers == 1
    assert LlamaLightningModule("debug", model_overrides={"dim": 64}).model_args.dim == 64
    module = LlamaLightningModule("debug", init_seed=5)
    module.configure_model()
    other = LlamaLightningModule("debug", init_seed=5)
    other.configure_model()
    assert torch.equal(module.model.output.weight, other.model.output.weight)


def test_rope_scaling_given_as_an_object_is_kept_as_plain_data_in_the_hyper_parameters(tmp_path):
    """Checkpoints load weights-only: a RopeScaling in model / model_overrides is stored as its dict."""
    from lightning_2d import RopeScaling
    from lightning_2d.hf import checkpoint_model_args

    scaling = RopeScaling(original_max_position_embeddings=32)
    by_override = LlamaLightningModule("debug", model_overrides={"rope_scaling": scaling, "n_layers": 1})
    by_args = LlamaLightningModule(ModelArgs.from_name("debug", rope_scaling=scaling))
    assert by_override.hparams["model_overrides"] == {"rope_scaling": asdict(scaling), "n_layers": 1}
    for module in (by_override, by_args):
        assert module.model_args.rope_scaling == scaling
        torch.save(dict(module.hparams), tmp_path / "hparams.pt")
        hparams = torch.load(tmp_path / "hparams.pt", weights_only=True)  # would refuse a pickled RopeScaling
        assert checkpoint_model_args({"hyper_parameters": hparams}) == module.model_args
