"""One recipe drives every tool: ``plan``, ``benchmark`` and ``prepare-data`` read ``--config RECIPE.yaml`` and
``fit``'s dotted overrides, and what they read is what ``fit`` builds.

The reference is the real ``fit`` path: ``Lightning2DCLI`` parses the recipe and instantiates the Trainer (on CPU,
without launching), the LightningModule and the data module. Every shipped recipe is planned and compared.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest

from lightning_2d.integration.hf_module import HFCausalLMModule
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.dims import validate_parallel_dims
from lightning_2d.tools import prepare
from lightning_2d.tools.benchmark import cli as bench_cli
from lightning_2d.tools.benchmark.settings import settings_from_args
from lightning_2d.tools.cli import MODEL_AND_DATA, Lightning2DCLI
from lightning_2d.tools.planner import cli as plan_cli
from lightning_2d.tools.recipe import RecipeError, given_options, read_run, split_argv

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
#: Given to both sides: the Trainer is built on this CPU machine (the planner ignores the accelerator), the data
#: module without the recipe's tokenizer file (which the tools do not read either).
ON_THIS_MACHINE = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--data.tokenizer=byte"]
LAYOUT = ("data_parallel_size", "tensor_parallel_size", "pipeline_microbatches", "param_dtype", "reduce_dtype")


def fit_objects(argv: list[str]) -> Lightning2DCLI:
    """What ``lightning-2d fit`` builds from ``argv`` (the Trainer not launched)."""
    return Lightning2DCLI(**MODEL_AND_DATA, args=[*argv, *ON_THIS_MACHINE], run=False)


def plan_json(argv: list[str], capsys) -> dict:
    plan_cli.main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def assert_plan_is_the_fit_run(report: dict, cli: Lightning2DCLI) -> None:
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    config = trainer.strategy.parallel_config
    assert (report["num_nodes"], report["devices_per_node"]) == (trainer.num_nodes, trainer.num_devices)
    assert report["world_size"] == trainer.world_size
    assert report["precision"] == trainer.precision
    assert report["accumulate_grad_batches"] == trainer.accumulate_grad_batches
    assert report["seq_len"] == data.seq_len
    dims = validate_parallel_dims(config, world_size=trainer.world_size, devices_per_node=trainer.num_devices,
                                  num_nodes=trainer.num_nodes)
    assert report["dims"] == {**dims.as_dict(), "data_parallel": dims.dp}
    if dims.pp > 1:  # the pipeline cuts data.batch_size into pipeline_microbatches (default: one sequence each)
        count = config.pipeline_microbatches or data.batch_size
        assert report["parallel_config"]["pipeline_microbatches"] == count
        assert report["micro_batch_size"] == data.batch_size // count
    else:
        assert report["micro_batch_size"] == data.batch_size
    for f in fields(ParallelConfig):
        if f.name not in LAYOUT:
            assert report["parallel_config"][f.name] == getattr(config, f.name), f.name
    if isinstance(module, HFCausalLMModule):
        assert report["model_args"] == json.loads(json.dumps(module.hf_config.to_dict()))  # as JSON: keys are text
    else:
        assert report["model_args"] == asdict(module.model_args)
        assert report["model"] == module.hparams.model


def planned_inputs(argv: list[str], monkeypatch) -> dict:
    """The arguments ``lightning-2d plan`` gives ``plan_run`` for ``argv`` (planning the big presets on a simulated
    world takes seconds each; ``plan_run`` itself is tested in test_planner.py and, from a recipe, below)."""
    seen: dict = {}

    class Planned(Exception):
        pass

    def capture(**kwargs):
        seen.update(kwargs)
        raise Planned

    monkeypatch.setattr(plan_cli, "plan_run", capture)
    with pytest.raises(Planned):
        plan_cli.main(argv)
    return seen


def without_absent_weights(recipe: Path) -> list[str]:
    """``--model.init_args.init_from=null`` for a recipe whose ``init_from`` folder is not on this machine (the
    planner then plans the recipe's preset or config, as fit builds it without the weights)."""
    import yaml

    model = yaml.safe_load(recipe.read_text())["model"]
    init_from = model.get("init_args", model).get("init_from")
    return ["--model.init_args.init_from=null"] if init_from and not Path(init_from).exists() else []


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_plan_of_every_recipe_is_the_run_fit_builds(recipe, monkeypatch):
    inputs = planned_inputs(["--config", str(recipe)], monkeypatch)
    cli = fit_objects(["--config", str(recipe), *without_absent_weights(recipe)])
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    config = trainer.strategy.parallel_config
    assert (inputs["num_nodes"], inputs["devices"]) == (trainer.num_nodes, trainer.num_devices)
    assert (inputs["precision"], inputs["accumulate_grad_batches"]) == (trainer.precision, trainer.accumulate_grad_batches)
    assert inputs["seq_len"] == data.seq_len and inputs["model_overrides"] is None
    assert (inputs.get("teacher"), inputs.get("distillation")) == (module.hparams.get("teacher"),
                                                                 module.hparams.get("distillation"))
    if config.pipeline_parallel_size > 1:  # data.batch_size cut into pipeline_microbatches (default: 1 sequence each)
        count = config.pipeline_microbatches or data.batch_size
        assert inputs["config"] == replace(config, pipeline_microbatches=count)
        assert inputs["micro_batch_size"] == data.batch_size // count
    else:
        assert inputs["config"] == config and inputs["micro_batch_size"] == data.batch_size
    if isinstance(module, HFCausalLMModule):
        assert inputs["model"] == module.hf_config.to_dict() and inputs["loss_chunk_size"] is None
    else:
        assert inputs["model"] == module.model_args
        assert inputs["loss_chunk_size"] == (module.hparams.loss_chunk_size if module.hparams.fused_loss else None)


@pytest.mark.parametrize("recipe", ["debug_cpu.yaml", "hf_llama_cpu.yaml"])
def test_the_plan_report_of_a_recipe_is_the_run_fit_builds(recipe, capsys):
    path = str(RECIPES[[p.name for p in RECIPES].index(recipe)])
    assert_plan_is_the_fit_run(plan_json(["--config", path], capsys), fit_objects(["--config", path]))


#: A recipe's header quoting its plan: "# Memory per GPU (`lightning-2d plan`): 22.8 GiB estimated peak of 80 GiB,
#: 55.2 GiB headroom: ...".
QUOTED_PLAN = re.compile(r"^# Memory per GPU \(`lightning-2d plan`\): ([\d.]+) GiB estimated peak of (\d+) GiB,"
                         r" ([\d.]+) GiB headroom", re.M)
QUOTING = [p for p in RECIPES if QUOTED_PLAN.search(p.read_text())]


def test_the_gpu_preference_recipes_quote_their_plan():
    assert {"llama31_8b_dpo_lora.yaml", "llama31_8b_dpo_full.yaml", "qwen3_8b_dpo_lora.yaml"} <= {
        p.name for p in QUOTING}
    assert "llama31_8b_to_llama32_1b_distill.yaml" in {p.name for p in QUOTING}  # and the distillation recipe


@pytest.mark.parametrize("recipe", QUOTING, ids=lambda p: p.name)
def test_a_recipe_quoting_its_plan_quotes_what_the_planner_says_now(recipe, capsys):
    """The header's figures are the planner's for the recipe as it is: a change of the recipe or of the planner's
    estimate that moves them fails here until the header says the new ones (`lightning-2d plan --config RECIPE`)."""
    peak, memory, headroom = QUOTED_PLAN.search(recipe.read_text()).groups()
    report = plan_json(["--config", str(recipe)], capsys)
    assert report["fits"]
    planned = (f"{report['total_gib']:.1f}", f"{report['device_memory_gib']:.0f}", f"{report['headroom_gib']:.1f}")
    assert planned == (peak, memory, headroom)


def test_dotted_overrides_and_flags_reach_the_plan_as_fit_takes_them(capsys):
    recipe = str(RECIPES[[p.name for p in RECIPES].index("llama3_8b_1node.yaml")])
    overrides = ["--trainer.devices=4", "--trainer.num_nodes", "2", "--trainer.strategy.init_args.tensor_parallel_size=2",
                 "--trainer.accumulate_grad_batches=2", "--data.seq_len=2048", "--model.model=llama3.2-1b"]
    report = plan_json(["--config", recipe, *overrides], capsys)
    assert_plan_is_the_fit_run(report, fit_objects(["--config", recipe, *overrides]))
    assert (report["world_size"], report["dims"]["tensor_parallel"], report["seq_len"]) == (8, 2, 2048)
    assert report["model"] == "llama3.2-1b" and report["accumulate_grad_batches"] == 2
    # A kebab-case flag replaces the recipe's value; the rest stays the recipe's.
    report = plan_json(["--config", recipe, "--tensor-parallel-size", "4", "--data-parallel-size", "2", "--seq-len",
                        "1024"], capsys)
    assert (report["dims"]["tensor_parallel"], report["seq_len"], report["parallel_config"]["compile"]) == (4, 1024, True)


def test_a_recipe_the_tools_cannot_read_is_one_message(tmp_path, capsys):
    debug = str(RECIPES[[p.name for p in RECIPES].index("debug_cpu.yaml")])
    cases = {
        "--trainer.devicez=3": r"unrecognized arguments: --trainer\.devicez=3",
        "--trainer.strategy=ddp": r"trainer\.strategy is 'ddp'; the tools read runs of lightning_2d\.ModelParallel2DStrategy",
        "--trainer.devices=auto": r"trainer\.devices is 'auto'.*--trainer\.devices=N",
        "--trainer.strategy.init_args.tensor_parallel_size=3": r"tensor_parallel_size",
    }
    for override, message in cases.items():
        with pytest.raises(SystemExit) as exit:
            plan_cli.main(["--config", debug, override])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and re.search(message, err), (override, err)
        assert "Traceback" not in err
    with pytest.raises(RecipeError, match=r"--config nowhere\.yaml: no such file"):
        read_run(["--config=nowhere.yaml"], "lightning-2d plan")


def test_benchmark_reads_the_recipe_as_fit_builds_it():
    recipe = str(RECIPES[[p.name for p in RECIPES].index("debug_cpu.yaml")])
    cli = fit_objects(["--config", recipe])
    own, recipe_argv = split_argv(["--config", recipe, "--steps", "3"], own=bench_cli.OWN_FLAGS)
    args, given = given_options(bench_cli.build_parser(), own)
    bench_cli.apply_recipe(args, given, read_run(recipe_argv, "lightning-2d benchmark"))
    settings = settings_from_args(args)
    strategy = cli.trainer.strategy
    assert settings.model_args == cli.model.model_args and settings.seq_len == cli.datamodule.seq_len
    assert (settings.devices, settings.num_nodes, settings.precision) == (cli.trainer.num_devices, 1, cli.trainer.precision)
    assert settings.global_batch_size == cli.datamodule.batch_size * strategy.parallel_config.data_parallel_size
    assert ParallelConfig(**settings.strategy_options) == strategy.parallel_config
    assert settings.module_options == {"fused_loss": cli.model.hparams.fused_loss,
                                       "loss_chunk_size": cli.model.hparams.loss_chunk_size}
    assert settings.steps == 3
    # The hand-written default layout (tensor_parallel_size 2) does not leak into a recipe's.
    own, recipe_argv = split_argv(["--config", recipe, "--trainer.strategy.init_args.tensor_parallel_size=1",
                                   "--trainer.strategy.init_args.data_parallel_size=4"], own=bench_cli.OWN_FLAGS)
    args, given = given_options(bench_cli.build_parser(), own)
    bench_cli.apply_recipe(args, given, read_run(recipe_argv, "lightning-2d benchmark"))
    assert (settings_from_args(args).dp, settings_from_args(args).tp) == (4, 1)
    hf = str(RECIPES[[p.name for p in RECIPES].index("hf_llama_cpu.yaml")])
    args, given = given_options(bench_cli.build_parser(), [])
    with pytest.raises(RecipeError, match=r"HFCausalLMModule; the benchmark trains LlamaLightningModule"):
        bench_cli.apply_recipe(args, given, read_run([f"--config={hf}"], "lightning-2d benchmark"))


@pytest.mark.parametrize("tool, reads", [
    (plan_cli.build_parser, ["--config", "trainer.devices", "trainer.strategy", "data.seq_len", "--device-memory-gib"]),
    (bench_cli.build_parser, ["--config", "trainer.devices", "data.batch_size", "--steps"]),
    (prepare.build_parser, ["--config", "--data.paths", "--data.tokenizer", "--processes"]),
])
def test_each_tools_help_shows_what_it_uses_only(tool, reads):
    text = tool().format_help()
    for option in reads:
        assert option in text, option
    # Not the Trainer's 200 options, as LightningCLI's parser would print them.
    for other in ("--trainer.max_steps", "--trainer.callbacks", "--optimizer", "--data.batch_size VALUE"):
        assert other not in text, other
    assert len(text.splitlines()) < 420  # fit's parser prints 586 lines (ours: the strategy options, one each)


def test_prepare_data_reads_the_recipe_through_fits_parser(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    recipe = str(RECIPES[[p.name for p in RECIPES].index("llama3_8b_1node.yaml")])
    data, workers = prepare.parse_args(["--config", recipe, "--data.tokenizer=byte", "--processes", "3",
                                        "--data.seq_len=128", "--model.model=debug"])
    cli = fit_objects(["--config", recipe, "--data.seq_len=128", "--model.model=debug"])
    assert (data.paths, data.seq_len, data.text_field) == (cli.datamodule.paths, cli.datamodule.seq_len, "text")
    assert workers == 3
