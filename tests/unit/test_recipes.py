"""Every shipped recipe parses with the CLI, and its layout is valid for the world it declares."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import yaml

from lightning_2d import LlamaLightningModule, ParallelConfig
from lightning_2d.integration.strategy_options import OPTIONS, PARAMETER_ORDER
from lightning_2d.parallel import validate_parallel_dims
from lightning_2d.tools.cli import cli_main

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
STRATEGY_KEYS = set(ParallelConfig.__dataclass_fields__)


def build_module(model: dict):
    """The recipe's LightningModule: ``class_path`` + ``init_args``, or LlamaLightningModule's arguments."""
    if "class_path" not in model:
        return LlamaLightningModule(**model)
    module_name, _, name = model["class_path"].rpartition(".")
    init_args = dict(model.get("init_args", {}))
    if init_args.get("init_from") and not Path(init_args["init_from"]).exists():  # a placeholder: the shapes suffice
        init_args["init_from"] = None
    return getattr(importlib.import_module(module_name), name)(**init_args)


def max_seq_len(module) -> int:
    args = getattr(module, "model_args", None)
    return args.max_seq_len if args is not None else module.hf_config.max_position_embeddings


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"debug_cpu.yaml", "llama3_8b_1node.yaml", "llama3_70b_multinode.yaml", "fsdp_only.yaml", "tp_only.yaml",
            "llama3_405b_pipeline.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses(recipe, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-2d"])
    with pytest.raises(SystemExit) as exit_:
        cli_main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_2d.ModelParallel2DStrategy"
    # Every option, in the constructor's order; those the recipe leaves out at their default.
    shown = printed["trainer"]["strategy"]["init_args"]
    assert list(shown) == list(PARAMETER_ORDER)
    given = yaml.safe_load(recipe.read_text())["trainer"]["strategy"].get("init_args", {})
    for opt in OPTIONS:
        if opt.name not in given and (opt.default is None or isinstance(opt.default, (bool, int, str))):
            assert shown[opt.name] == opt.default, opt.name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_layout_is_valid_for_its_world(recipe):
    config = yaml.safe_load(recipe.read_text())
    text = recipe.read_text()
    assert text.startswith("#") and ("lightning-2d fit --config" in text)  # says what it is and how to launch
    trainer, model, data = config["trainer"], config["model"], config["data"]
    data = data.get("init_args", data)  # ChatDataModule's recipes name it with class_path
    options = {k: v for k, v in trainer["strategy"]["init_args"].items() if k in STRATEGY_KEYS}
    parallel = ParallelConfig(**options)
    module = build_module(model)
    dims = validate_parallel_dims(
        parallel,
        world_size=trainer["devices"] * trainer.get("num_nodes", 1),
        devices_per_node=trainer["devices"],
        plan=module.parallel_plan(parallel),
        precision=trainer.get("precision", "32-true"),
        seq_len=data["seq_len"],
        batch_size=data.get("batch_size"),
        num_nodes=trainer.get("num_nodes", 1),
    )
    assert dims.pp * dims.dp * dims.tp == trainer["devices"] * trainer.get("num_nodes", 1)
    assert data["seq_len"] <= max_seq_len(module)
    if trainer.get("num_nodes", 1) > 1:
        assert dims.tp <= trainer["devices"]  # tensor parallel stays inside a node


def test_the_405b_recipe_is_pipeline_8_by_data_8_by_tensor_8():
    config = yaml.safe_load((RECIPES[0].parent / "llama3_405b_pipeline.yaml").read_text())
    trainer = config["trainer"]
    options = {k: v for k, v in trainer["strategy"]["init_args"].items() if k in STRATEGY_KEYS}
    module = LlamaLightningModule(**config["model"])
    parallel = ParallelConfig(**options)
    dims = validate_parallel_dims(parallel, world_size=512, devices_per_node=8, plan=module.parallel_plan(parallel),
                                  seq_len=8192, batch_size=config["data"]["batch_size"], num_nodes=64)
    assert (dims.pp, dims.dp, dims.tp) == (8, 8, 8) and parallel.num_pipeline_stages == 16
