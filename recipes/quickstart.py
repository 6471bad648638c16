"""Quick start: train the ``debug`` Llama in 2D (FSDP × TP) with the Trainer.

    python recipes/quickstart.py                       # 4 CPU processes, (dp, tp) = (2, 2)
    python recipes/quickstart.py --accelerator gpu --devices 8 --tensor-parallel-size 8 --model llama3-8b

The text is the Python standard library's own source, read as bytes (vocabulary 256 = the
``debug`` model's), so it runs anywhere with no download.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy


class StdlibBytes(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes from the standard library's ``.py`` files."""

    def __init__(self, seq_len: int, max_bytes: int = 4_000_000) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.glob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
        n = (len(tokens) - 1) // (seq_len + 1)
        self.windows = tokens[: n * (seq_len + 1)].view(n, seq_len + 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.windows[i]
        return {"input_ids": window[:-1], "labels": window[1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a Llama model with ModelParallel2DStrategy.")
    parser.add_argument("--model", default="debug")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel replica")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    L.seed_everything(42)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallel2DStrategy(tensor_parallel_size=args.tensor_parallel_size),
        max_steps=args.max_steps,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
    )
    module = LlamaLightningModule(args.model, learning_rate=3e-3, warmup_steps=10)
    loader = DataLoader(StdlibBytes(args.seq_len), batch_size=args.batch_size)
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        print(f"final train_loss: {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
