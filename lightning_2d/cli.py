"""``lightning-2d``: LightningCLI over ``LlamaLightningModule`` and ``TextDataModule``.

    lightning-2d fit --config recipes/debug_cpu.yaml
    lightning-2d fit --config recipes/debug_cpu.yaml --print_config
    lightning-2d fit --trainer.strategy=model_parallel_2d --trainer.devices=4 --trainer.accelerator=cpu

Subcommands: ``fit``, ``validate``, ``test``, ``predict``. A ``ThroughputMonitor`` is always on
(``--throughput.*`` configures it). And ``lightning-2d export CHECKPOINT OUT_DIR`` writes a
Hugging Face Llama directory from a checkpoint; ``lightning-2d benchmark [--compare]`` times a
model/layout (see ``lightning_2d.benchmark``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_2d  # noqa: F401  (registers the "model_parallel_2d" strategy name)
from lightning_2d.callbacks import ThroughputMonitor
from lightning_2d.data import TextDataModule
from lightning_2d.module import LlamaLightningModule


class Lightning2DCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ThroughputMonitor, "throughput")

    def _check_vocabulary(self) -> None:
        # Before any process is launched: a model that cannot embed every token id fails here.
        if isinstance(self.datamodule, TextDataModule) and isinstance(self.model, LlamaLightningModule):
            self.datamodule.check_model(self.model.model_args.vocab_size)

    def before_fit(self) -> None:
        self._check_vocabulary()

    def before_validate(self) -> None:
        self._check_vocabulary()

    def before_test(self) -> None:
        self._check_vocabulary()

    def before_predict(self) -> None:
        self._check_vocabulary()


#: Shown by ``lightning-2d --help``: the subcommands that are not LightningCLI's.
DESCRIPTION = (
    "Train Llama models with 2D parallelism (FSDP2 x tensor/sequence parallel). Besides the Trainer"
    " subcommands below: `lightning-2d export CHECKPOINT OUT_DIR` writes a Hugging Face Llama directory"
    " from a checkpoint, and `lightning-2d benchmark [--compare]` times a model/layout (step time,"
    " tokens/s, TFLOP/s, MFU, memory), with --compare side by side with Lightning's ModelParallelStrategy"
    " and a plain torch loop. Add --help after either for its options."
)


def cli_main(args: Optional[list[str]] = None, run: bool = True) -> Lightning2DCLI:
    """Build (and with ``run=True`` run) the CLI; ``args=None`` reads ``sys.argv``."""
    return Lightning2DCLI(
        LlamaLightningModule,
        TextDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION},
    )


def export_main(argv: list[str]) -> None:
    """``lightning-2d export CHECKPOINT OUT_DIR``: a checkpoint → Hugging Face Llama directory."""
    import argparse

    from lightning_2d.hf import export_hf
    from lightning_2d.parallel.config import DTYPE_NAMES

    parser = argparse.ArgumentParser(
        prog="lightning-2d export",
        description="Write model.safetensors + config.json (Hugging Face Llama layout) from a sharded or"
        " full LlamaLightningModule checkpoint. Needs no GPU and no process group.",
    )
    parser.add_argument("checkpoint", help="checkpoint folder (sharded) or file (full)")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="default: as stored")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of this size")
    args = parser.parse_args(argv)
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else None
    out = export_hf(Path(args.checkpoint), Path(args.out_dir), dtype=dtype, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"Wrote {out} (load with transformers.LlamaForCausalLM.from_pretrained)")


def main() -> None:
    """The ``lightning-2d`` console script."""
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        export_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "benchmark":
        from lightning_2d.benchmark import main as benchmark_main

        benchmark_main(sys.argv[2:])
        return
    cli_main()


if __name__ == "__main__":
    main()
