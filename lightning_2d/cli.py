"""``lightning-2d``: LightningCLI over ``LlamaLightningModule`` and ``TextDataModule``.

    lightning-2d fit --config recipes/debug_cpu.yaml
    lightning-2d fit --config recipes/debug_cpu.yaml --print_config
    lightning-2d fit --trainer.strategy=model_parallel_2d --trainer.devices=4 --trainer.accelerator=cpu

Subcommands: ``fit``, ``validate``, ``test``, ``predict``. A ``ThroughputMonitor`` is always on
(``--throughput.*`` configures it).
"""

from __future__ import annotations

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


def cli_main(args: Optional[list[str]] = None, run: bool = True) -> Lightning2DCLI:
    """Build (and with ``run=True`` run) the CLI; ``args=None`` reads ``sys.argv``."""
    return Lightning2DCLI(
        LlamaLightningModule,
        TextDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def main() -> None:
    """The ``lightning-2d`` console script."""
    cli_main()


if __name__ == "__main__":
    main()
