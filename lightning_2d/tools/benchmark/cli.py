"""``lightning-2d benchmark``'s command line: the parser (model, run, the lightning_2d variant's loss, one flag
per ``ParallelConfig`` field) and ``main``, which checks the settings, runs the variants (spawned or in
place), prints the report and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

from lightning_2d.models.llama.model import PRESETS
from lightning_2d.ops.distillation import DIVERGENCES
from lightning_2d.ops.preference import LOSSES
from lightning_2d.parallel.config import SUPPORTED_PRECISIONS, ParallelConfig
from lightning_2d.tools.benchmark import comparisons  # its table read at each call: a test may add a row
from lightning_2d.tools.benchmark.options import add_strategy_options, option_flag
from lightning_2d.tools.benchmark.processes import (
    BenchmarkJobError,
    run_in_place,
    run_spawned,
    started_by_launcher,
    worker_main,
)
from lightning_2d.tools.benchmark.report import format_report, summarize
from lightning_2d.tools.benchmark.settings import VARIANTS, BenchmarkConfigError, settings_from_args
from lightning_2d.tools.recipe import RecipeError, RecipeRun, add_recipe_options, given_options, read_run, split_argv

#: What ``benchmark`` reads from a recipe.
RECIPE_KEYS = ("trainer.accelerator, trainer.devices, trainer.num_nodes, trainer.precision, trainer.strategy (every"
               " option), model (LlamaLightningModule: its model, model_overrides, init_from, fused_loss,"
               " loss_chunk_size), data.seq_len and data.batch_size (per data-parallel replica)")

#: The parser's own flags that share a name with a recipe's top-level key.
OWN_FLAGS = ("--model",)


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-2d benchmark`` parser, strategy options included."""
    parser = argparse.ArgumentParser(
        prog="lightning-2d benchmark",
        description="Train a Llama model for --warmup + --steps steps and print the median step time, tokens/s"
        " (global and per device), TFLOP/s, MFU (GPU), peak memory per device and the settings. --compare runs,"
        " alternating, ModelParallel2DStrategy (lightning_2d), Lightning's ModelParallelStrategy with the plan"
        " hand-written (lightning) and a plain torch loop (plain), and prints the step-time ratios.",
    )
    parser.add_argument("--compare", action="store_true", help="run the three variants side by side")
    for row in comparisons.COMPARISONS:  # --compare-backends, --compare-lora RANK, --compare-expert-parallel EP
        row.add_flag(parser)
    add_recipe_options(parser, RECIPE_KEYS)
    model = parser.add_argument_group(
        "model", "default: PyTorch's 2D example (dim 256, 2 layers, 16 heads, vocab 32000)"
    )
    model.add_argument("--model", choices=list(PRESETS), default=None, help="a preset to start from")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"):
        model.add_argument(option_flag(name), type=int, default=None, help=f"ModelArgs.{name}")
    # The experts' shape, on a model with experts: what decides whether expert parallelism pays
    # (docs/scaling/experts.md: EP wins where the experts' weights outweigh the tokens routed to them).
    for name, field in (("n_experts", "num_experts"), ("top_k", "top_k"), ("expert_hidden_dim", "hidden_dim")):
        model.add_argument(option_flag(name), type=int, default=None, help=f"MoEArgs.{field} (a model with experts)")
    run = parser.add_argument_group("run")
    run.add_argument("--seq-len", type=int, default=256)
    run.add_argument("--global-batch-size", type=int, default=8, help="sequences per step over all replicas")
    run.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    run.add_argument("--devices", type=int, default=4, help="processes per node")
    run.add_argument("--num-nodes", type=int, default=1)
    run.add_argument("--precision", choices=SUPPORTED_PRECISIONS, default="32-true")
    run.add_argument("--steps", type=int, default=18, help="timed steps per run")
    run.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every run")
    run.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the tokens")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take before it is killed")
    run.add_argument("--collectives", dest="collectives_by_issuer", action="store_true",
                     help="also record which code issued each collective of the counted step (the last warm-up"
                     " step of rank 0), in every variant, and print per variant a table of issuer × kind → count,"
                     " elements (in --json too); costs that dropped step a slower, traced run")
    run.add_argument("--json", type=Path, default=None, help="write the settings, summaries and raw step times here")
    module = parser.add_argument_group("LlamaLightningModule (the lightning_2d variant)")
    module.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=True,
                        help="output projection fused with the cross-entropy, chunk by chunk (default); "
                        "--no-fused-loss: logits, then F.cross_entropy")
    module.add_argument("--loss-chunk-size", type=int, default=None,
                        help="tokens per chunk of the fused loss (default: sized by memory, LlamaLightningModule's)")
    module.add_argument("--preference", choices=LOSSES, default=None, metavar="LOSS_TYPE",
                        help="train this preference loss (preference={'loss_type': LOSS_TYPE}, beta 0.1) on synthetic"
                        " packed pairs (each window whole pairs of a random prompt and two random completions) instead"
                        " of next tokens, in every variant: lightning_2d trains the whole model against a frozen copy"
                        " (reference copy; none for simpo, orpo); under it --compare-lora's variant takes the base with"
                        f" its adapters off as the reference, and --compare-precomputed-reference adds precomputed"
                        f" values. One of {', '.join(LOSSES)}")
    module.add_argument("--teacher", default=None, metavar="MODEL",
                        help="distil from this teacher (a preset or a Llama folder)")
    module.add_argument("--distillation", choices=DIVERGENCES, default=None, metavar="LOSS",
                        help="--teacher's divergence (default forward_kl)")
    add_strategy_options(parser)
    # Internal: one rank of a job started by run_job.
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def apply_recipe(args: argparse.Namespace, given: set[str], run: RecipeRun) -> None:
    """The recipe's run as the defaults of ``args``: a flag given on the command line keeps its value."""
    if not run.is_llama:
        raise RecipeError(f"the recipe's model is {run.module_class}; the benchmark trains LlamaLightningModule"
                          " (its model: a preset or ModelArgs fields)")
    if "model" not in given:
        args.recipe_model = run.model
    devices = run.devices if "devices" not in given else args.devices
    if devices is None:
        raise RecipeError("trainer.devices is 'auto' (every device of the machine); add --trainer.devices=N")
    accelerator = {"cuda": "gpu"}.get(run.accelerator, run.accelerator)
    if accelerator not in ("auto", "cpu", "gpu"):
        raise RecipeError(f"trainer.accelerator is {run.accelerator!r}; the benchmark runs on cpu or gpu")
    recipe = {"seq_len": run.seq_len, "accelerator": accelerator, "devices": devices, "num_nodes": run.num_nodes,
              "precision": run.precision, "fused_loss": run.fused_loss}
    if run.loss_chunk_size is not None:
        recipe["loss_chunk_size"] = run.loss_chunk_size
    for name, value in recipe.items():
        if name not in given:
            setattr(args, name, value)
    if "global_batch_size" not in given:
        args.batch_size_per_replica = run.batch_size
    # The strategy's layout and training options (ParallelConfig's fields, as written); its checkpoint and
    # watchdog options do not apply to a benchmark.
    layout = {f.name for f in fields(ParallelConfig)}
    args.recipe_strategy_options = {k: v for k, v in run.strategy_options.items() if k in layout}


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-2d benchmark`` / ``python -m lightning_2d.tools.benchmark``: run the benchmark's processes (or,
    started by a launcher such as ``torchrun``, run in them), then print the report and with ``--json`` write it.

    Settings the benchmark refuses exit with status 2 (argparse's usage error, with the message); a run whose
    processes fail exits with status 1 and their output.

    Args:
        argv: The arguments after ``benchmark`` (``None``: ``sys.argv[1:]``): the flags of ``build_parser`` and, with
            ``--config RECIPE``, ``lightning-2d fit``'s dotted overrides.

    Example:
        ```python
        from lightning_2d.tools.benchmark import main

        main(["--compare", "--json", "out.json"])  # (dp, tp) = (2, 2) on 4 CPU processes, beside Lightning's and torch's
        ```
    """
    parser = build_parser()
    own, recipe = split_argv(sys.argv[1:] if argv is None else list(argv), own=OWN_FLAGS)
    args, given = given_options(parser, own)
    if recipe:
        try:
            apply_recipe(args, given, read_run(recipe, prog="lightning-2d benchmark"))
        except RecipeError as err:
            parser.error(str(err))
    if args.worker is not None:
        if args.settings is None or args.out is None:
            parser.error("--worker needs --settings and --out")
        worker_main(args.worker, args.settings, args.out)
        return
    in_place = started_by_launcher()
    try:
        settings = settings_from_args(args, world_size=int(os.environ["WORLD_SIZE"]) if in_place else None)
    except BenchmarkConfigError as err:
        parser.error(str(err))
    if in_place:
        runs = run_in_place(settings)
        if runs is None:
            return
    else:
        try:
            runs = run_spawned(settings, log=lambda line: print(line, flush=True))
        except BenchmarkJobError as err:
            print(err, file=sys.stderr)
            raise SystemExit(1) from None
    report = summarize(settings, runs, in_place=in_place)
    print(format_report(report), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
