"""What every variant trains, the same way: this rank's synthetic tokens (the same samples whatever the
layout), the seeded initial weights, and AdamW with ``LlamaLightningModule``'s hyper-parameters and
schedule for the hand-written variants.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lightning_2d.integration.module import LlamaLightningModule, fused_adamw, warmup_cosine_schedule
from lightning_2d.models.llama.model import Transformer
from lightning_2d.ops.init import SeededInit
from lightning_2d.parallel.materialize import local_block
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.tools.benchmark.settings import BenchmarkSettings


class SyntheticTokens(torch.utils.data.Dataset):
    """This data-parallel rank's batches of random tokens, drawn up front (not in the timed loop).

    Sample ``i`` of the global stream is drawn from a generator seeded by ``(seed, i)``, so a
    sample's tokens do not depend on the layout; data-parallel rank ``r`` takes, of each global
    batch, the ``r``-th slice of ``local_batch_size`` samples.

    Args:
        settings: Shape, steps and seed.
        dp_rank: This rank's index in the data-parallel dimension.
    """

    def __init__(self, settings: BenchmarkSettings, dp_rank: int) -> None:
        local, vocab = settings.local_batch_size, settings.model_args.vocab_size
        rows = []
        for step in range(settings.total_steps):
            for j in range(local):
                index = step * settings.global_batch_size + dp_rank * local + j
                g = torch.Generator().manual_seed(settings.seed * 1_000_003 + index)
                rows.append(torch.randint(0, vocab, (settings.seq_len + 1,), generator=g))
        self.tokens = torch.stack(rows)  # (steps · local_batch, seq_len + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def synthetic_loader(settings: BenchmarkSettings, rank: int) -> torch.utils.data.DataLoader:
    """The loader of global ``rank``: tensor-parallel groups are consecutive ranks, so its data-parallel
    index is ``rank // tp`` (the same in Lightning's mesh and in ``init_device_mesh((dp, tp))``)."""
    dataset = SyntheticTokens(settings, dp_rank=rank // settings.tp)
    return torch.utils.data.DataLoader(dataset, batch_size=settings.local_batch_size, shuffle=False)


def adamw_defaults() -> dict[str, Any]:
    """``LlamaLightningModule``'s optimizer hyper-parameters (its constructor defaults): one source of truth."""
    parameters = inspect.signature(LlamaLightningModule.__init__).parameters
    names = ("learning_rate", "weight_decay", "betas", "eps", "fused", "warmup_steps", "min_lr_ratio")
    return {name: parameters[name].default for name in names}


def lr_warmup_steps(settings: BenchmarkSettings) -> int:
    return max(1, settings.warmup)


def build_adamw(
    model: torch.nn.Module, device: torch.device, settings: BenchmarkSettings
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule for the hand-written variants, following ``LlamaLightningModule.configure_optimizers``:
    weight decay on matrices only, fused on CUDA and CPU and foreach elsewhere, linear warm-up then cosine."""
    hp = adamw_defaults()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    fused = fused_adamw(hp["fused"], device)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp["learning_rate"],
        betas=tuple(hp["betas"]),
        eps=hp["eps"],
        fused=fused,
        foreach=None if fused else True,
    )
    schedule = warmup_cosine_schedule(lr_warmup_steps(settings), settings.total_steps, hp["min_lr_ratio"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


@torch.no_grad()
def load_seeded_init(model: Transformer, seed: int) -> None:
    """Overwrite each rank's shards with the values ``Transformer.init_weights(seed)`` gives the full
    model, and recompute the rotary table: every variant then starts from the same weights."""
    source = SeededInit(model.param_init_specs(), seed)
    device = torch.device("cpu")
    for name, param in model.named_parameters():
        local, offset = local_block(param)
        source.fill_block_(local, canonical_name(name), tuple(param.shape), offset)
        device = local.device
    model.init_buffers(device)
