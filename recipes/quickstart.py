"""Quick start: train a Llama model in 2D (FSDP × TP) with the Trainer, from Python.

    python recipes/quickstart.py                       # 4 CPU processes, (dp, tp) = (2, 2)
    python recipes/quickstart.py --pipeline-parallel-size 2 --tensor-parallel-size 1   # 2 stages × dp 2
    python recipes/quickstart.py --context-parallel-size 2 --tensor-parallel-size 1    # sequences over 2 ranks × dp 2
    python recipes/quickstart.py --accelerator gpu --devices 8 --tensor-parallel-size 8 \
        --model llama3-8b --tokenizer /path/to/tokenizer.json --data "/data/*.jsonl" --seq-len 8192

Without --data the text is the Python standard library's own source (no download), read with the
byte-level tokenizer (vocabulary 256 = the ``debug`` model's). The yaml recipes do the same
through the CLI: ``lightning-2d fit --config recipes/debug_cpu.yaml``.
"""

from __future__ import annotations

import argparse

import lightning as L

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy, TextDataModule, TokenThroughputMonitor
from lightning_2d.parallel.config import PIPELINE_SCHEDULES


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a Llama model with ModelParallel2DStrategy.")
    parser.add_argument("--model", default="debug")
    parser.add_argument("--data", nargs="*", default=None, help="text/JSONL/Parquet files or globs")
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline ranks (1: no pipeline)")
    parser.add_argument("--pipeline-schedule", default="1F1B", choices=list(PIPELINE_SCHEDULES))
    parser.add_argument("--context-parallel-size", type=int, default=1, help="ranks each sequence is split over")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel replica")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    L.seed_everything(42)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallel2DStrategy(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,  # the blocks split into stages
            pipeline_schedule=args.pipeline_schedule,
            context_parallel_size=args.context_parallel_size,
        ),
        max_steps=args.max_steps,
        log_every_n_steps=10,
        callbacks=[TokenThroughputMonitor()],
        logger=False,
        enable_checkpointing=False,
    )
    module = LlamaLightningModule(args.model, learning_rate=3e-3, warmup_steps=10)
    data = TextDataModule(args.data, tokenizer=args.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size)
    data.prepare()  # tokenize with every core before the processes start (a no-op once cached)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        print(f"final train_loss: {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
