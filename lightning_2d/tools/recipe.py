"""One recipe for every tool: what ``lightning-2d fit --config RECIPE.yaml [--x.y=z ...]`` would launch, read by
``plan``, ``benchmark`` and ``prepare-data`` from the same files and dotted options.

The recipe is parsed by ``fit``'s own parser (``Lightning2DCLI``: the same defaults, types, ``class_path`` forms
and override order), then only what the tools need is built: the LightningModule (which resolves the model:
a preset, ``ModelArgs`` fields, ``init_from``'s ``config.json``, a Hugging Face config) and the strategy (which
checks its options into a ``ParallelConfig``). No Trainer, no data module, no process group: a GPU recipe is
read on a laptop. ``tests/unit/test_recipe_tools.py`` builds the real ``fit`` objects for every shipped recipe
and checks that they agree with ``RecipeRun``.

    lightning-2d plan --config recipes/llama3_8b_1node.yaml --trainer.devices=4
    lightning-2d benchmark --config recipes/debug_cpu.yaml --steps 5
    lightning-2d prepare-data --config recipes/debug_cpu.yaml --data.seq_len=512
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser

from lightning_2d.data import ChatDataModule, PreferenceDataModule, TextDataModule
from lightning_2d.errors import Lightning2DError
from lightning_2d.integration.hf_module import HFCausalLMModule
from lightning_2d.integration.module import LlamaLightningModule
from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy
from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.parallel.config import ParallelConfigError
from lightning_2d.tools.cli import MODEL_AND_DATA, Lightning2DCLI

#: The top-level keys of a ``fit`` recipe; ``--KEY...`` options of these go to ``fit``'s parser.
RECIPE_KEYS = ("config", "trainer", "model", "data", "seed_everything", "ckpt_path", "optimizer", "lr_scheduler",
               "throughput")

#: Shown in each tool's ``--help``.
RECIPE_HELP = (
    "A `lightning-2d fit` recipe and its dotted overrides, read exactly as `fit` reads them (the same files,"
    " defaults and precedence: later options win): -c/--config RECIPE.yaml (repeatable), then any fit option such"
    " as --trainer.devices=4 or --trainer.strategy.init_args.tensor_parallel_size=2. The other sections of the"
    " recipe are checked and ignored. This tool reads: {keys}."
)


class RecipeError(Lightning2DError, ValueError):
    """A recipe (or an override) that ``fit`` would refuse, or that this tool cannot use; one message."""


def split_argv(argv: list[str], own: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """``argv`` split into (the tool's own options, the recipe's: ``--config`` files and ``fit``'s options).

    A recipe option is ``-c``/``--config`` or ``--KEY`` / ``--KEY.sub...`` for a top-level ``KEY`` of a recipe
    (``RECIPE_KEYS``), with its value (``--k=v`` or ``--k v``); the tool's own flags (``own``, e.g. ``plan``'s
    ``--model``) are never taken for the recipe's, but their dotted forms (``--model.model``) are. Order is kept.
    """
    tool: list[str] = []
    recipe: list[str] = []
    i = 0
    while i < len(argv):
        option = argv[i]
        name, has_value, _ = option.partition("=")
        key = name[2:].split(".", 1)[0] if name.startswith("--") else ""
        dotted = "." in name
        is_recipe = name == "-c" or (key in RECIPE_KEYS and (dotted or name not in own))
        if not is_recipe:
            tool.append(option)
            i += 1
            continue
        if has_value or i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            recipe.append(option)
            i += 1
        else:
            recipe.append(f"{name}={argv[i + 1]}")
            i += 2
    return tool, recipe


#: The data modules the tools read (their ``seq_len``, ``batch_size`` and cache).
DATA_CLASSES = ("lightning_2d.TextDataModule", "lightning_2d.ChatDataModule", "lightning_2d.PreferenceDataModule")


def data_class(spec: Any, source: str = "the recipe") -> type:
    """The data module class a parsed recipe's ``data`` section names (``TextDataModule``, ``ChatDataModule`` or
    ``PreferenceDataModule``).

    Raises:
        RecipeError: Another class: the tools read those two.
    """
    class_path = str(spec.get("class_path") or "lightning_2d.TextDataModule")
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "lightning_2d"), name)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"{source}: data.class_path {class_path!r} does not import ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, (TextDataModule, ChatDataModule, PreferenceDataModule))):
        raise RecipeError(f"{source}: data.class_path is {class_path!r}; prepare-data builds the cache of a"
                          " TextDataModule or a ChatDataModule (or PreferenceDataModule), whose seq_len and batch_size"
                          f" plan and benchmark read (class_path: {' or '.join(DATA_CLASSES)})")
    return cls


def data_arguments(spec: Any) -> dict[str, Any]:
    """The ``init_args`` of a parsed recipe's ``data`` section, as a plain dict."""
    init_args = spec.get("init_args") if hasattr(spec, "get") else None
    return init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})


def normalized_args(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config`` checked to name a file (or to be inline YAML)."""
    out = []
    for option in argv:
        name, _, value = option.partition("=")
        if name in ("-c", "--config"):
            if not Path(value).is_file() and not value.lstrip().startswith("{") and "\n" not in value:
                raise RecipeError(f"--config {value}: no such file")
            option = f"--config={value}"
        out.append(option)
    return out


def fit_config(recipe_argv: list[str], prog: str) -> Any:
    """The recipe parsed by ``fit``'s parser (a jsonargparse ``Namespace``; nothing instantiated).

    Raises:
        RecipeError: a missing file, an unknown key, a value of the wrong type: jsonargparse's message.
    """
    class ParseOnly(Lightning2DCLI):
        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            super().add_arguments_to_parser(parser)
            # `fit`'s subcommand option, which the parser without subcommands lacks: accepted, ignored here.
            parser.add_argument("--ckpt_path", type=Optional[str], default=None)

        def instantiate_classes(self) -> None:
            pass

    args = [*normalized_args(recipe_argv), "--seed_everything=false"]  # last: nothing is seeded for a tool
    with warnings.catch_warnings():
        # LightningCLI warns when `args` is given while sys.argv has options (the tool's).
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        try:
            cli = ParseOnly(**MODEL_AND_DATA, args=args, run=False,
                            parser_kwargs={"prog": prog, "exit_on_error": False})
        except Exception as err:  # jsonargparse's ArgumentError: the recipe's problem, with its key
            if type(err).__name__ != "ArgumentError":
                raise
            raise RecipeError(f"the recipe does not parse as `lightning-2d fit` would take it: {err}") from None
    return cli.config


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _instantiate(spec: Any, what: str) -> Any:
    """A ``class_path``/``init_args`` spec of the parsed recipe, built (as jsonargparse builds it for ``fit``)."""
    init_args = spec.get("init_args")
    kwargs = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    try:
        return _import(spec["class_path"])(**kwargs)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise RecipeError(f"{what} ({spec['class_path']}): {err}") from None


def _devices(value: Any) -> Optional[int]:
    """``trainer.devices`` as a count, ``None`` for ``"auto"``/``-1`` (every device of the machine: unknown here)."""
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str):
        text = value.strip()
        if "," in text:
            return len([v for v in text.split(",") if v.strip()])
        if text.lstrip("-").isdigit():
            value = int(text)
        else:
            return None
    return None if value == -1 else int(value)


#: Lightning's short precision names, as the Trainer resolves them.
_PRECISION_NAMES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed", "None": "32-true",
                    "transformer-engine": "transformer-engine"}


def _precision(value: Any) -> str:
    text = str(value)
    return _PRECISION_NAMES.get(text, text)


@dataclass(frozen=True)
class RecipeRun:
    """What ``lightning-2d fit`` would launch, read from a recipe (``read_run``).

    Args:
        module_class: The LightningModule's ``class_path``.
        model: The model the module builds: ``ModelArgs`` (``LlamaLightningModule``) or a Hugging Face config's
            fields (``HFCausalLMModule``).
        model_name: A short name of it (the preset, or the config's ``model_type``).
        loss_chunk_size: Tokens per chunk of the fused loss (``None``: sized by memory); ``None`` too without it.
        fused_loss: Whether the module fuses the output projection with the loss.
        accelerator: ``trainer.accelerator``.
        devices: Devices per node; ``None`` where the recipe says ``"auto"``.
        num_nodes: ``trainer.num_nodes``.
        precision: ``trainer.precision`` in Lightning's long form (``bf16-mixed``).
        accumulate_grad_batches: ``trainer.accumulate_grad_batches``.
        strategy_options: The strategy's ``init_args`` as written.
        config: The strategy's ``ParallelConfig``.
        data: The ``data`` section's arguments (``TextDataModule``'s, ``ChatDataModule``'s, whose ``document_mask``
            is ``pack``, or ``PreferenceDataModule``'s, whose ``document_mask`` is always on).
        lora: The module's ``lora`` settings (a dict), ``None`` for full fine-tuning.
        preference: The module's ``preference`` loss (a dict of ``PreferenceLoss``'s fields), ``None`` for
            next-token training.
        teacher: The module's ``teacher`` as it read it (a dict of ``model``, ``init_from``, ``model_overrides``),
            ``None`` without distillation.
        distillation: The module's ``distillation`` settings (a dict of ``DistillationConfig``'s fields), or ``None``.
    """

    module_class: str
    model: Any
    model_name: str
    loss_chunk_size: Optional[int]
    fused_loss: bool
    accelerator: str
    devices: Optional[int]
    num_nodes: int
    precision: str
    accumulate_grad_batches: int
    strategy_options: dict[str, Any]
    config: Any
    data: dict[str, Any] = field(default_factory=dict)
    lora: Optional[dict[str, Any]] = None
    preference: Optional[dict[str, Any]] = None
    teacher: Optional[dict[str, Any]] = None
    distillation: Optional[dict[str, Any]] = None

    @property
    def seq_len(self) -> int:
        return int(self.data["seq_len"])

    @property
    def batch_size(self) -> int:
        """Sequences per data-parallel replica and micro-batch (``data.batch_size``)."""
        return int(self.data["batch_size"])

    @property
    def is_llama(self) -> bool:
        return isinstance(self.model, ModelArgs)


def _strategy(value: Any) -> tuple[Any, dict[str, Any]]:
    """The recipe's strategy, built (its ``ParallelConfig`` checked), and its ``init_args`` as written."""
    if isinstance(value, str) and value == ModelParallel2DStrategy.strategy_name:
        return ModelParallel2DStrategy(), {}
    spec = value.as_dict() if hasattr(value, "as_dict") else value
    if not (isinstance(spec, dict) and "class_path" in spec):
        raise RecipeError(f"trainer.strategy is {value!r}; the tools read runs of lightning_2d.ModelParallel2DStrategy:"
                          " write trainer.strategy.class_path: lightning_2d.ModelParallel2DStrategy (or"
                          " --trainer.strategy=model_parallel_2d)")
    try:
        cls = _import(spec["class_path"])
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"trainer.strategy.class_path {spec['class_path']!r} does not import ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, ModelParallel2DStrategy)):
        raise RecipeError(f"trainer.strategy is {spec['class_path']}; the tools read runs of"
                          " lightning_2d.ModelParallel2DStrategy")
    options = dict(spec.get("init_args") or {})
    try:
        return cls(**options), options
    except (ParallelConfigError, ValueError, TypeError) as err:
        raise RecipeError(f"trainer.strategy: {err}") from None


def run_of(config: Any) -> RecipeRun:
    """``RecipeRun`` of a parsed recipe (``fit_config``): the module and the strategy are built, nothing else."""
    model_spec = config["model"]
    spec = model_spec.as_dict() if hasattr(model_spec, "as_dict") else dict(model_spec)
    # A recipe for downloaded weights names their folder, which the machine that plans may not have: the shapes
    # then come from the recipe's preset (model) or config, the weights are not needed to plan.
    init_args = dict(spec.get("init_args") or {})
    init_from = init_args.get("init_from")
    missing = isinstance(init_from, str) and not Path(init_from).expanduser().exists()
    if missing and (init_args.get("model") is not None or init_args.get("config") is not None):
        spec = {**spec, "init_args": {**init_args, "init_from": None}}
    module = _instantiate(spec, "model")
    if isinstance(module, LlamaLightningModule):
        model, name = module.model_args, str(module.hparams.get("model") or "ModelArgs")
        if not isinstance(module.hparams.get("model"), str):
            name = "llama (recipe ModelArgs)" if module.hparams.get("model") is not None else "llama (init_from)"
        fused = bool(module.hparams.fused_loss)
        chunk = module.hparams.loss_chunk_size if fused else None  # None: sized by memory (fused) or no chunks
    elif isinstance(module, HFCausalLMModule):
        model, name = module.hf_config.to_dict(), f"{module.hf_config.model_type} (Hugging Face config)"
        fused, chunk = False, None
    else:
        raise RecipeError(f"model is {spec['class_path']}; the tools read LlamaLightningModule and HFCausalLMModule"
                          " recipes")
    if missing and spec["init_args"].get("init_from") is None:
        name += f"; init_from {init_from} not found here, the shapes planned from the recipe's"
        name += " model" if isinstance(module, LlamaLightningModule) else " config"
    trainer = config["trainer"]
    strategy, options = _strategy(trainer["strategy"])
    data = data_arguments(config["data"])
    kind = data_class(config["data"]).__name__
    if kind == "ChatDataModule":  # packed conversations are documents
        data["document_mask"] = bool(data.get("pack", True))
    elif kind == "PreferenceDataModule":  # chosen and rejected are documents of one window, packed or not
        data["document_mask"] = True
    return RecipeRun(
        module_class=spec["class_path"],
        model=model,
        model_name=name,
        loss_chunk_size=chunk,
        fused_loss=fused,
        accelerator=str(trainer["accelerator"]),
        devices=_devices(trainer["devices"]),
        num_nodes=int(trainer["num_nodes"]),
        precision=_precision(trainer["precision"]),
        accumulate_grad_batches=int(trainer["accumulate_grad_batches"] or 1),
        strategy_options=options,
        config=strategy.parallel_config,
        data=data,
        lora=module.hparams.get("lora"),
        preference=module.hparams.get("preference"),
        teacher=module.hparams.get("teacher"),
        distillation=module.hparams.get("distillation"),
    )


def read_run(recipe_argv: list[str], prog: str) -> RecipeRun:
    """``RecipeRun`` of ``--config`` files and dotted options (``split_argv``'s second list)."""
    return run_of(fit_config(recipe_argv, prog))


def given_options(parser: Any, argv: list[str]) -> tuple[Any, set[str]]:
    """``parser.parse_args(argv)`` and the destinations the command line set (not left at their defaults).

    argparse fills in a default only for a destination the namespace lacks: parsing into a namespace that
    already holds a marker for every destination leaves the marker exactly where nothing was given.
    """
    marker = object()
    defaults = vars(parser.parse_args([]))
    namespace = parser.parse_args(argv, namespace=argparse.Namespace(**{k: marker for k in defaults}))
    given = {k for k, v in vars(namespace).items() if v is not marker}
    for key in set(defaults) - given:
        setattr(namespace, key, defaults[key])
    return namespace, given


def add_recipe_options(parser: Any, keys: str) -> None:
    """The recipe's help group of a tool's argparse parser, with ``--config`` (which ``split_argv`` takes out, with
    the dotted options, before argparse sees the rest)."""
    group = parser.add_argument_group("recipe", RECIPE_HELP.format(keys=keys).replace("%", "%%"))
    group.add_argument("-c", "--config", metavar="RECIPE.yaml", action="append", help="a `lightning-2d fit` recipe")


__all__ = ["DATA_CLASSES", "RecipeError", "RecipeRun", "add_recipe_options", "data_arguments", "data_class", "fit_config",
           "given_options", "normalized_args",
           "read_run", "run_of", "split_argv"]

