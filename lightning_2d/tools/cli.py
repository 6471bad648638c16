"""``lightning-2d``: LightningCLI over the LM modules (``LlamaLightningModule`` by default) and ``TextDataModule``.

    lightning-2d fit --config recipes/debug_cpu.yaml
    lightning-2d fit --config recipes/debug_cpu.yaml --print_config
    lightning-2d fit --trainer.strategy=model_parallel_2d --trainer.devices=4 --trainer.accelerator=cpu

The model is any ``CausalLMModule``: a recipe's ``model:`` section without ``class_path`` configures
``LlamaLightningModule``; ``class_path: lightning_2d.hf.HFCausalLMModule`` trains a Hugging Face
decoder (``recipes/hf_llama_cpu.yaml``).

Subcommands (``COMMANDS``, listed by ``lightning-2d --help``): ``fit``, ``validate``, ``test``, ``predict``
(LightningCLI's; a ``TokenThroughputMonitor`` is always on, ``--throughput.*`` configures it), and ours (``TOOLS``):
``plan`` (dry run on a simulated world, ``lightning_2d.tools.planner``), ``benchmark [--compare]``
(``lightning_2d.tools.benchmark``), ``prepare-data --config RECIPE`` (tokenize the corpus before training,
``lightning_2d.tools.prepare``) and ``export CHECKPOINT OUT_DIR`` (Hugging Face Llama directory,
``lightning_2d.checkpoint.hf``).

The library's own errors (``Lightning2DError``: a configuration, data, a checkpoint it refuses) print as one
line, ``lightning-2d COMMAND: error: MESSAGE``, with exit code 1 (options that do not parse: 2, argparse's);
``LIGHTNING_2D_TRACEBACK=1`` shows the traceback instead. What can be checked before any process starts is
checked there: the options, the layout, the vocabulary, the token cache, and that ``--ckpt_path`` is a complete
and intact checkpoint.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn, Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_2d.integration.trainer_strategy  # noqa: F401  (registers the "model_parallel_2d" strategy name)
from lightning_2d.checkpoint import Integrity, check_ckpt_path
from lightning_2d.data import ChatDataModule, PreferenceDataModule, TextDataModule
from lightning_2d.errors import Lightning2DError
from lightning_2d.integration.callbacks import TokenThroughputMonitor
from lightning_2d.integration.module import CausalLMModule
from lightning_2d.integration.strategy_base import ModelParallel2DBase


class Lightning2DCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        # Recipes written for the Llama module keep working without a class_path.
        parser.set_defaults({"model": {"class_path": "lightning_2d.LlamaLightningModule"}})
        # And recipes written for raw text without one (ChatDataModule and others are named by class_path).
        parser.set_defaults({"data": {"class_path": "lightning_2d.TextDataModule"}})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # Right after parsing, before anything is built or launched: a --ckpt_path that cannot be resumed from
        # (mistyped, interrupted, damaged). Next, LightningCLI torch.loads a checkpoint *file* whole to read its
        # hyper-parameters: a damaged one would fail there with torch's traceback.
        subcommand = self.config.get("subcommand")
        #: What that check read whole: handed to the strategy (``instantiate_classes``), whose rank 0 runs in this
        #: process and so does not read it again.
        self.checkpoint_integrity = Integrity()
        if subcommand:
            check_ckpt_path(self.config[subcommand].get("ckpt_path"), self.checkpoint_integrity)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        strategy = self.trainer.strategy
        if isinstance(strategy, ModelParallel2DBase):
            strategy.checkpoint_integrity = self.checkpoint_integrity

    def _check_before_launch(self) -> None:
        # Before any process is launched: a model that cannot embed every token id, a big corpus without its
        # token cache.
        if isinstance(self.datamodule, (TextDataModule, ChatDataModule, PreferenceDataModule)):
            if isinstance(self.model, CausalLMModule):
                self.datamodule.check_model(self.model.vocab_size)
            # A big corpus without a cache fails before any process starts; a small chat or preference data set is
            # encoded now
            # (its bad rows reported here).
            self.datamodule.check_prepared()

    def before_fit(self) -> None:
        self._check_before_launch()

    def before_validate(self) -> None:
        self._check_before_launch()

    def before_test(self) -> None:
        self._check_before_launch()

    def before_predict(self) -> None:
        self._check_before_launch()


#: What every ``lightning-2d`` parser builds (``fit`` …, and the recipe the tools read, ``tools/recipe.py``): any ``CausalLMModule``
#: (``LlamaLightningModule`` when a recipe gives no ``class_path``) and any data module (``TextDataModule`` when a recipe
#: gives no ``class_path``; ``ChatDataModule`` for instruction fine-tuning).
MODEL_AND_DATA = {"model_class": CausalLMModule, "datamodule_class": LightningDataModule, "subclass_mode_model": True,
                  "subclass_mode_data": True}


#: The parser's description (``lightning-2d fit --help`` and the like).
DESCRIPTION = (
    "Train Llama-family models with FSDP/HSDP x tensor/sequence x pipeline x context parallelism as a Lightning"
    " strategy. `lightning-2d --help` lists every command; add --help after any of them for its options."
)


def cli_main(args: Optional[list[str]] = None, run: bool = True) -> Lightning2DCLI:
    """Build (and with ``run=True`` run) the CLI: LightningCLI's ``fit``, ``validate``, ``test`` and ``predict``.

    Args:
        args: The arguments after ``lightning-2d`` (``["fit", "--config", "recipe.yaml"]``); ``None`` reads
            ``sys.argv``.
        run: Run the subcommand; ``False``: only parse (``args`` then without a subcommand) and build the model, the
            data and the Trainer, returned on the CLI (``cli.model``, ``cli.datamodule``, ``cli.trainer``).

    Returns:
        The ``Lightning2DCLI``.
    """
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


#: Every ``lightning-2d`` subcommand, as ``lightning-2d --help`` lists it: LightningCLI's, then ``TOOLS``.
COMMANDS = {
    "fit": "train (--config RECIPE.yaml; --ckpt_path to resume)",
    "validate": "the validation loop over a checkpoint (--ckpt_path)",
    "test": "the test loop over a checkpoint (--ckpt_path)",
    "predict": "next-token predictions and losses over a checkpoint (--ckpt_path)",
    "plan": "check a recipe's layout and estimate its memory per device on a simulated world, without GPUs",
    "benchmark": "time a recipe's run: step time, tokens/s, MFU, memory (--compare: beside Lightning's, torch's)",
    "prepare-data": "tokenize a recipe's corpus into the token cache with every local core, before training",
    "export": "write a Hugging Face directory (safetensors + config.json; a LoRA checkpoint: a peft folder) from a checkpoint",
}

#: ``LIGHTNING_2D_TRACEBACK=1``: the library's errors raise with their traceback instead of printing one line.
TRACEBACK_VARIABLE = "LIGHTNING_2D_TRACEBACK"


def help_text() -> str:
    """What ``lightning-2d --help`` (or no arguments) prints: every subcommand, one line each."""
    width = max(map(len, COMMANDS)) + 2
    commands = "\n".join(f"  {name:<{width}}{line}" for name, line in COMMANDS.items())
    return f"""usage: lightning-2d COMMAND [OPTIONS]   (or: python -m lightning_2d COMMAND [OPTIONS])

Train Llama-family models with FSDP/HSDP x tensor/sequence x pipeline x context parallelism as a Lightning strategy.

commands:
{commands}

options:
  {'-h, --help':<{width}}show this list and exit
  {'-V, --version':<{width}}print the library's, torch's, Lightning's and Python's versions

`lightning-2d COMMAND --help` shows a command's options (e.g. `lightning-2d fit --help`).
A refused input (a configuration, data, a checkpoint) prints `lightning-2d COMMAND: error: ...` and exits
with 1 (options that do not parse, and layouts `plan` refuses: 2); {TRACEBACK_VARIABLE}=1 shows the traceback instead."""


def version_line() -> str:
    """``lightning-2d VERSION (torch X, lightning Y, Python Z)``: what a bug report needs first."""
    import platform
    from importlib.metadata import version

    import lightning
    import torch

    return (f"lightning-2d {version('lightning-2d')} (torch {torch.__version__}, lightning {lightning.__version__},"
            f" Python {platform.python_version()})")


def _refuse(command: Optional[str], err: BaseException) -> NoReturn:
    """``lightning-2d COMMAND: error: MESSAGE`` on stderr, exit code 1: the message names the value and the fix,
    a traceback would only bury it."""
    print(f"lightning-2d{' ' + command if command else ''}: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None


def show_traceback() -> bool:
    """Whether ``LIGHTNING_2D_TRACEBACK`` asks for tracebacks (set, and not ``0``/``false``/``no``)."""
    return os.environ.get(TRACEBACK_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def main(argv: Optional[list[str]] = None) -> None:
    """The ``lightning-2d`` console script.

    Args:
        argv: The arguments after ``lightning-2d`` (``None``: ``sys.argv[1:]``, which LightningCLI then reads
            itself, as Lightning's launcher re-runs the command line in each rank).

    Raises:
        SystemExit: After ``--help`` (status 0) or no arguments (2); options that do not parse (2, argparse's); one of
            the library's errors (``Lightning2DError``: 1, its message printed as one line), unless
            ``LIGHTNING_2D_TRACEBACK`` is set, which raises the error itself.

    Example:
        ```python
        from lightning_2d.tools.cli import main

        main(["fit", "--config", "recipes/debug_cpu.yaml", "--trainer.max_steps=10"])  # `lightning-2d fit ...`
        main(["plan", "--model", "llama3-8b", "--devices", "8", "--tensor-parallel-size", "8"])
        ```
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(help_text(), file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)  # as argparse: help exits 0, no command is a usage error
    if len(args) == 1 and args[0] in ("--version", "-V"):
        print(version_line())
        return
    command = next((a for a in args if a in COMMANDS), None)
    try:
        if args[0] in TOOLS:
            import importlib

            importlib.import_module(TOOLS[args[0]]).main(args[1:])
        else:
            cli_main(None if argv is None else args)
    except Lightning2DError as err:
        if show_traceback():
            raise
        _refuse(command, err)


if __name__ == "__main__":
    main()
