"""``lightning-2d``: LightningCLI over the LM modules (``LlamaLightningModule`` by default) and ``TextDataModule``.

    lightning-2d fit --config recipes/debug_cpu.yaml
    lightning-2d fit --config recipes/debug_cpu.yaml --print_config
    lightning-2d fit --trainer.strategy=model_parallel_2d --trainer.devices=4 --trainer.accelerator=cpu

The model is any ``CausalLMModule``: a recipe's ``model:`` section without ``class_path`` configures
``LlamaLightningModule``; ``class_path: lightning_2d.hf.HFCausalLMModule`` trains a Hugging Face
decoder (``recipes/hf_llama_cpu.yaml``).

Subcommands: ``fit``, ``validate``, ``test``, ``predict``. A ``ThroughputMonitor`` is always on
(``--throughput.*`` configures it). The other subcommands (``TOOLS``): ``export CHECKPOINT
OUT_DIR`` (Hugging Face Llama directory, ``lightning_2d.checkpoint.hf``), ``benchmark [--compare]``
(``lightning_2d.tools.benchmark``), ``plan`` (dry run on a simulated world, ``lightning_2d.tools.planner``) and
``prepare-data --config RECIPE`` (tokenize the corpus before training, ``lightning_2d.tools.prepare``).
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_2d.integration.trainer_strategy  # noqa: F401  (registers the "model_parallel_2d" strategy name)
from lightning_2d.data import TextDataModule
from lightning_2d.integration.callbacks import ThroughputMonitor
from lightning_2d.integration.module import CausalLMModule


class Lightning2DCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ThroughputMonitor, "throughput")
        # Recipes written for the Llama module keep working without a class_path.
        parser.set_defaults({"model": {"class_path": "lightning_2d.LlamaLightningModule"}})

    def _check_vocabulary(self) -> None:
        # Before any process is launched: a model that cannot embed every token id fails here.
        if isinstance(self.datamodule, TextDataModule) and isinstance(self.model, CausalLMModule):
            self.datamodule.check_model(self.model.vocab_size)
        if isinstance(self.datamodule, TextDataModule):
            self.datamodule.check_prepared()  # a big corpus without a cache fails before any process starts

    def before_fit(self) -> None:
        self._check_vocabulary()

    def before_validate(self) -> None:
        self._check_vocabulary()

    def before_test(self) -> None:
        self._check_vocabulary()

    def before_predict(self) -> None:
        self._check_vocabulary()


#: What every ``lightning-2d`` parser builds (``fit`` … and ``prepare-data``): any ``CausalLMModule``
#: (``LlamaLightningModule`` when a recipe gives no ``class_path``) and a ``TextDataModule``.
MODEL_AND_DATA = {"model_class": CausalLMModule, "datamodule_class": TextDataModule, "subclass_mode_model": True}


#: Shown by ``lightning-2d --help``: the subcommands that are not LightningCLI's.
DESCRIPTION = (
    "Train Llama models with 2D parallelism (FSDP2 x tensor/sequence parallel). Besides the Trainer"
    " subcommands below: `lightning-2d export CHECKPOINT OUT_DIR` writes a Hugging Face Llama directory"
    " from a checkpoint; `lightning-2d benchmark [--compare]` times a model/layout (step time,"
    " tokens/s, TFLOP/s, MFU, memory), with --compare side by side with Lightning's ModelParallelStrategy"
    " and a plain torch loop; `lightning-2d plan --model llama3-70b --num-nodes 4 --devices 8` checks a"
    " layout and estimates its per-device memory on a simulated world, without GPUs; `lightning-2d"
    " prepare-data --config RECIPE.yaml` tokenizes a recipe's corpus with every local core before"
    " training. Add --help after any of them for its options."
)


def cli_main(args: Optional[list[str]] = None, run: bool = True) -> Lightning2DCLI:
    """Build (and with ``run=True`` run) the CLI; ``args=None`` reads ``sys.argv``."""
    return Lightning2DCLI(
        **MODEL_AND_DATA,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION},
    )


#: ``lightning-2d NAME ...`` subcommands that are not LightningCLI's: NAME → the module whose
#: ``main(argv)`` runs it (imported only when used).
TOOLS = {
    "export": "lightning_2d.tools.export",
    "benchmark": "lightning_2d.tools.benchmark",
    "plan": "lightning_2d.tools.planner",
    "prepare-data": "lightning_2d.tools.prepare",
}


def version_line() -> str:
    """``lightning-2d VERSION (torch X, lightning Y, Python Z)``: what a bug report needs first."""
    import platform
    from importlib.metadata import version

    import lightning
    import torch

    return (f"lightning-2d {version('lightning-2d')} (torch {torch.__version__}, lightning {lightning.__version__},"
            f" Python {platform.python_version()})")


def main() -> None:
    """The ``lightning-2d`` console script."""
    if len(sys.argv) == 2 and sys.argv[1] in ("--version", "-V"):
        print(version_line())
        return
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        import importlib

        importlib.import_module(TOOLS[sys.argv[1]]).main(sys.argv[2:])
        return
    cli_main()


if __name__ == "__main__":
    main()
