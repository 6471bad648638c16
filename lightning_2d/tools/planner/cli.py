"""``lightning-2d plan``'s command line: the parser (model, world, training step, one flag per
``ParallelConfig`` field, and a ``fit`` recipe with its dotted overrides) and ``main``, which prints the table or
the JSON report, or every problem of the layout without a traceback.

    lightning-2d plan --config recipes/llama3_8b_1node.yaml                 # the run `fit` would launch
    lightning-2d plan --config recipes/llama3_8b_1node.yaml --trainer.num_nodes=2 --device-memory-gib 131
    lightning-2d plan --model llama3-70b --num-nodes 4 --devices 8 --tensor-parallel-size 8   # no recipe

With a recipe, the model, world, precision, gradient accumulation, sequence length, micro-batch and strategy
come from it (``lightning_2d.tools.recipe``); a kebab-case flag given as well replaces the recipe's value.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any, Optional

from lightning_2d.models.hf_decoders import HF_DECODER_TYPES
from lightning_2d.models.llama.model import PRESETS
from lightning_2d.ops.distillation import DIVERGENCES
from lightning_2d.ops.preference import LOSSES, REFERENCES
from lightning_2d.parallel.config import SUPPORTED_PRECISIONS, ParallelConfig, ParallelConfigError
from lightning_2d.tools.benchmark.options import add_strategy_options
from lightning_2d.tools.planner.activations import DEFAULT_LOSS_CHUNK_SIZE
from lightning_2d.tools.planner.estimate import DEFAULT_DEVICE_MEMORY_GIB, DEFAULT_RESERVE_GIB, plan_run
from lightning_2d.tools.planner.report import format_report
from lightning_2d.tools.recipe import RecipeError, RecipeRun, add_recipe_options, given_options, read_run, split_argv

#: What ``plan`` reads from a recipe.
RECIPE_KEYS = ("trainer.devices, trainer.num_nodes, trainer.precision, trainer.accumulate_grad_batches,"
               " trainer.strategy (every option), model (its model, model_overrides, init_from, config,"
               " fused_loss, loss_chunk_size, lora, preference), data.seq_len and data.batch_size (the micro-batch)")

#: The parser's own flags that share a name with a recipe's top-level key.
OWN_FLAGS = ("--model",)


def add_parallel_config_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ParallelConfig`` field, as ``lightning-2d benchmark`` generates them (help from the
    field docs; unset flags keep ``ParallelConfig``'s defaults)."""
    add_strategy_options(parser, defaults={}, description="ModelParallel2DStrategy / ParallelConfig options")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}; write e.g. '{{\"n_layers\": 2}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of ModelArgs (or config) fields, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-2d plan`` parser."""
    parser = argparse.ArgumentParser(
        prog="lightning-2d plan",
        description="Check the layout of a training run with the real validation and parallelization on a simulated"
        " world (one process, no GPU) and estimate the memory of one training step per device: parameters,"
        " gradients, AdamW state, FSDP buffers and activations, with a verdict against the device memory. The run"
        " is a `lightning-2d fit` recipe (--config, plus fit's dotted overrides), or the flags below, which also"
        " replace a recipe's values.",
    )
    add_recipe_options(parser, RECIPE_KEYS)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="llama3-8b", metavar="PRESET_OR_CONFIG",
                       help=f"a ModelArgs preset ({', '.join(PRESETS)}; default: llama3-8b), or a Hugging Face"
                       f" config.json of a Llama-family decoder (model_type {', '.join(HF_DECODER_TYPES)}) or a"
                       " directory holding one: planned as HFCausalLMModule trains it")
    model.add_argument("--model-overrides", type=_json_object, default=None, metavar="JSON",
                       help="ModelArgs fields to change, as JSON: '{\"n_layers\": 2}' (a config's:"
                       " '{\"num_hidden_layers\": 2}')")
    world = parser.add_argument_group("world")
    world.add_argument("--num-nodes", type=int, default=1)
    world.add_argument("--devices", type=int, default=8, help="devices (processes) per node (default: 8)")
    world.add_argument("--device-memory-gib", type=float, default=DEFAULT_DEVICE_MEMORY_GIB,
                       help="memory of one device in GiB (default: 80, an H100/A100 80GB; an H200's 141 GB are"
                       " 131 GiB)")
    world.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                       help="GiB kept for the CUDA context, NCCL and allocator fragmentation (default: 2)")
    run = parser.add_argument_group("training step")
    run.add_argument("--precision", choices=SUPPORTED_PRECISIONS, default="bf16-mixed", help="(default: bf16-mixed)")
    run.add_argument("--seq-len", type=int, default=None,
                     help="tokens per sequence (default: the model's max_seq_len, a config's max_position_embeddings)")
    run.add_argument("--micro-batch-size", type=int, default=1,
                     help="sequences per device and micro-batch (default: 1)")
    run.add_argument("--accumulate-grad-batches", type=int, default=1,
                     help="micro-batches per optimizer step (default: 1); above 1 FSDP keeps unsharded gradients"
                     " between them unless --reduce-every-micro-batch")
    run.add_argument("--lora-rank", type=int, default=None, metavar="R",
                     help="plan LoRA fine-tuning: rank-R adapters on the attention and MLP projections, the base frozen"
                     " (a recipe's model.init_args.lora is read as it is)")
    run.add_argument("--qlora", action="store_true",
                     help="with --lora-rank: QLoRA, the adapted projections' frozen weights stored in NF4")
    run.add_argument("--preference", choices=LOSSES, default=None, metavar="LOSS",
                     help="plan preference tuning with this loss (" + ", ".join(LOSSES) + "): against a reference"
                     " model (the DPO family) its forward without a graph each micro-batch, and without --lora-rank a"
                     " frozen copy of the model's parameters beside it; replaces a recipe's model.init_args.preference"
                     " (read as it is otherwise)")
    run.add_argument("--preference-reference", choices=REFERENCES, default=None,
                     help="the preference loss's reference model: auto (the default: adapters_off under LoRA, else"
                     " copy), copy (a frozen copy) or adapters_off (the model with its adapters off)")
    run.add_argument("--teacher", default=None, metavar="MODEL",
                     help="plan distillation from this teacher (a preset or a Hugging Face folder/config.json): its"
                     " shards under its own plan, its gathers, its forward without a graph and the fused divergence's"
                     " chunks in the student's head; replaces a recipe's model.init_args.teacher")
    run.add_argument("--distillation", choices=DIVERGENCES, default=None, metavar="LOSS",
                     help="the divergence distilled with (" + ", ".join(DIVERGENCES) + "; default: a recipe's, else"
                     " forward_kl); needs --teacher or a recipe with teacher")
    run.add_argument("--loss-chunk-size", type=int, default=DEFAULT_LOSS_CHUNK_SIZE,
                     help="tokens per chunk of the fused loss (default: sized by memory, LlamaLightningModule's)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--plot", metavar="PNG", help="also draw the per-device memory, a stacked bar per pipeline"
                        " rank (needs the plot extra: pip install 'lightning-2d[plot]')")
    parser.add_argument("--plot-mesh", metavar="PNG", help="also draw which global rank holds which mesh coordinates,"
                        " ranks grouped by node (needs the plot extra)")
    add_parallel_config_options(parser)
    return parser


def _inputs(args: argparse.Namespace, given: set[str], run: Optional[RecipeRun]) -> dict[str, Any]:
    """``plan_run``'s arguments: the recipe's run (if any), with the flags given on the command line on top."""
    flags = {f.name: getattr(args, f.name) for f in fields(ParallelConfig) if getattr(args, f.name) is not None}
    own = {name: getattr(args, name) for name in ("model", "model_overrides", "num_nodes", "devices", "precision",
                                                 "seq_len", "micro_batch_size", "accumulate_grad_batches",
                                                 "loss_chunk_size")}
    if args.qlora and args.lora_rank is None:
        raise RecipeError("--qlora plans QLoRA adapters: give their rank with --lora-rank R (e.g. --lora-rank 16 --qlora)")
    lora = ({"rank": args.lora_rank, **({"quantize_base": "nf4"} if args.qlora else {})}
            if args.lora_rank is not None else None)
    preference = _preference(args, run)
    teacher = _teacher(args, run)
    if run is None:
        return {**own, "config": ParallelConfig(**flags), "model_name": None, "lora": lora, "preference": preference,
                **teacher}
    from dataclasses import replace

    devices = args.devices if "devices" in given else run.devices
    if devices is None:
        raise RecipeError("trainer.devices is 'auto' (every device of the machine), which the planner cannot know;"
                          " add --trainer.devices=N (or --devices N)")
    from_recipe = {
        "model": run.model, "model_name": run.model_name, "num_nodes": run.num_nodes, "devices": devices,
        "precision": run.precision, "seq_len": run.seq_len, "micro_batch_size": run.batch_size,
        "accumulate_grad_batches": run.accumulate_grad_batches, "loss_chunk_size": run.loss_chunk_size,
        "model_overrides": None, "document_mask": bool(run.data.get("document_mask", False)),
        "lora": lora if lora is not None else run.lora, "preference": preference, **teacher,
    }
    config = replace(run.config, **flags) if flags else run.config
    if config.pipeline_parallel_size > 1 and "micro_batch_size" not in given:
        # The pipeline splits each data.batch_size batch into pipeline_microbatches (default: one sequence each).
        count = config.pipeline_microbatches or run.batch_size
        if problems := config.microbatch_problems(count, run.batch_size, schedule_checks=False):
            raise ParallelConfigError(problems)
        from_recipe["micro_batch_size"] = run.batch_size // count
        config = replace(config, pipeline_microbatches=count)
    chosen = {**from_recipe, **{name: value for name, value in own.items() if name in given}}
    if "model" in given:
        chosen["model_name"] = None
    return {**chosen, "config": config}


def _preference(args: argparse.Namespace, run: Optional[RecipeRun]) -> Optional[dict[str, Any]]:
    """The preference loss planned: ``--preference`` (replacing the recipe's), else the recipe's, with
    ``--preference-reference`` on top."""
    preference = run.preference if run is not None else None
    if args.preference is not None:
        preference = {"loss_type": args.preference}
    if args.preference_reference is not None:
        if preference is None:
            raise RecipeError(f"--preference-reference {args.preference_reference} plans a preference loss's reference"
                              " model: give the loss with --preference LOSS (e.g. --preference sigmoid), or a recipe"
                              " whose model has preference")
        preference = {**preference, "reference": args.preference_reference}
    return preference


def _teacher(args: argparse.Namespace, run: Optional[RecipeRun]) -> dict[str, Any]:
    """The teacher and distillation planned: ``--teacher`` (replacing the recipe's), else the recipe's, with
    ``--distillation`` on top."""
    teacher = args.teacher if args.teacher is not None else run.teacher if run is not None else None
    distillation = run.distillation if run is not None else None
    if args.distillation is not None:
        if teacher is None:
            raise RecipeError(f"--distillation {args.distillation} plans distillation from a teacher: give it with"
                              " --teacher MODEL (a preset or a model folder), or a recipe whose model has teacher")
        distillation = {**(distillation or {}), "loss": args.distillation}
    return {"teacher": teacher, "distillation": distillation} if teacher is not None else {}


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-2d plan`` / ``python -m lightning_2d.tools.planner``: print the plan's report (``format_report``;
    ``--json``: ``PlanReport.as_dict()``), and with ``--plot``/``--plot-mesh`` write its pictures.

    A layout or recipe the library refuses exits with status 2 and its message (every problem and its fix), without
    a traceback.

    Args:
        argv: The arguments after ``plan`` (``None``: ``sys.argv[1:]``): the flags of ``build_parser`` and, with
            ``--config RECIPE``, ``lightning-2d fit``'s dotted overrides.

    Example:
        ```python
        from lightning_2d.tools.planner import main

        main(["--model", "llama3-8b", "--devices", "8", "--tensor-parallel-size", "8", "--seq-len", "8192"])
        ```
    """
    parser = build_parser()
    own, recipe = split_argv(sys.argv[1:] if argv is None else list(argv), own=OWN_FLAGS)
    args, given = given_options(parser, own)
    try:
        run = read_run(recipe, prog="lightning-2d plan") if recipe else None
        inputs = _inputs(args, given, run)  # ParallelConfig's own checks raise ParallelConfigError too
        report = plan_run(
            **inputs,
            device_memory_gib=args.device_memory_gib,
            reserve_gib=args.reserve_gib,
        )
    except (ParallelConfigError, RecipeError, ValueError) as err:
        if not isinstance(err, (ParallelConfigError, RecipeError)) and not hasattr(err, "problems"):
            raise  # not a refusal: a bug to show whole
        # The message lists every problem with its fix (a check's own error, LoRA's or a preference loss's, carries
        # them too); a traceback would only bury it.
        print(f"lightning-2d plan: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report), flush=True)
    if args.plot or args.plot_mesh:
        # cycle: lightning_2d.tools.plots imports the planner (report, world), whose __init__ imports this module
        from lightning_2d.tools.plots import PlotsUnavailable, plot_memory, plot_mesh

        try:
            for path, plot in ((args.plot, plot_memory), (args.plot_mesh, plot_mesh)):
                if path:
                    print(f"wrote {plot(report, path)}", file=sys.stderr)
        except PlotsUnavailable as err:
            print(f"lightning-2d plan: {err}", file=sys.stderr)
            raise SystemExit(2) from None
