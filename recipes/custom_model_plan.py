"""2D-parallelize a model that is not Llama, without subclassing the strategy.

    python recipes/custom_model_plan.py            # 4 CPU processes, (dp, tp) = (2, 2)
    python recipes/custom_model_plan.py --devices 8 --accelerator gpu

The model below uses its own module names (``blocks.N.attn.q``, ``blocks.N.mlp.fc`` …). Two ways
to tell the strategy what to do with it, both shown here:

1. a ``ParallelPlan`` passed to the strategy: module name patterns → tensor-parallel styles, the
   styles that sequence parallelism replaces or adds (applied only under the strategy's
   ``sequence_parallel=True``, so ``--no-sequence-parallel`` needs no second plan), the name of the
   block container (the unit of activation checkpointing and FSDP sharding), and the sizes the
   tensor-parallel degree must divide (checked before any process starts);
2. a LightningModule method named like a parallelize step (``apply_tensor_parallel``,
   ``apply_activation_checkpointing``, ``apply_compile``, ``apply_fully_shard``) replaces that step.
   Here ``apply_activation_checkpointing`` checkpoints only the MLP of each block.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.utils.data import DataLoader

from lightning_2d import ModelParallel2DStrategy, ParallelPlan


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: a tensor-parallel rank holds n_heads / tp heads
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), Attention(dim, n_heads)
        self.ln_2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, n_heads: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# 1. The plan: which modules are tensor-parallel, where the blocks are, what tp must divide.
PLAN = ParallelPlan(
    tensor_parallel={
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
    },
    # Under sequence_parallel=True: the residual stream between the blocks stays split along the
    # sequence (Shard(1)) from the embedding to the head, the LayerNorms run on the slices, and the
    # attention and MLP gather the whole sequence at their entry.
    sequence_parallel={
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "blocks.*.ln_1": SequenceParallel(),
        "blocks.*.ln_2": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    },
    blocks="blocks",
    module="net",  # the LightningModule attribute holding the model
    tp_divides={"n_heads": 4},
)


class TinyGPTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: TinyGPT | None = None
        self.checkpointed: list[str] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = TinyGPT()  # identical on every rank thanks to seed_everything

    # 2. A hook: replaces the strategy's activation-checkpointing step (same arguments).
    def apply_activation_checkpointing(self, model: nn.Module, plan: ParallelPlan, config) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.get_submodule(plan.blocks)):
            block.mlp = checkpoint_wrapper(block.mlp)
            self.checkpointed.append(f"{plan.blocks}.{i}.mlp")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def describe(module: nn.Module) -> list[str]:
    lines = []
    for name, p in module.named_parameters():
        placements = getattr(p, "placements", None)
        mesh = getattr(p, "device_mesh", None)
        dims = mesh.mesh_dim_names if mesh is not None else None
        lines.append(f"{name}: {list(dims) if dims else '-'} {[repr(pl) for pl in placements or ()]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    args = parser.parse_args()

    L.seed_everything(0)
    # Byte sequences that count up from a random start (each next byte is the previous + 1): a pattern to
    # learn, so the loss falls below that of uniform random bytes (ln 256) within a few steps.
    data = (torch.randint(0, 256, (64, 1)) + torch.arange(33)) % 256
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallel2DStrategy(
            tensor_parallel_size=args.tensor_parallel_size, sequence_parallel=args.sequence_parallel,
            activation_checkpointing="full",
            plan=PLAN,
        ),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    module = TinyGPTModule()
    trainer.fit(module, DataLoader(data, batch_size=4))
    if trainer.is_global_zero:
        print("checkpointed:", ", ".join(module.checkpointed))
        print("\n".join(describe(module.net)))
        print(f"final loss: {float(trainer.callback_metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
