"""``lightning-2d plan``'s command line: the parser (model, world, training step, one flag per
``ParallelConfig`` field) and ``main``, which prints the table or the JSON report, or every problem of the
layout without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any, Optional

from lightning_2d.models.hf_decoders import HF_DECODER_TYPES
from lightning_2d.models.llama.model import PRESETS
from lightning_2d.parallel.config import SUPPORTED_PRECISIONS, ParallelConfig, ParallelConfigError
from lightning_2d.tools.planner.activations import DEFAULT_LOSS_CHUNK_SIZE
from lightning_2d.tools.planner.estimate import DEFAULT_DEVICE_MEMORY_GIB, DEFAULT_RESERVE_GIB, plan_run
from lightning_2d.tools.planner.report import format_report


def add_parallel_config_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ParallelConfig`` field, as ``lightning-2d benchmark`` generates them (help from the
    field docs; unset flags keep ``ParallelConfig``'s defaults)."""
    from lightning_2d.tools.benchmark.options import add_strategy_options

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
        description="Check a 2D layout with the real validation and parallelization on a simulated world (one"
        " process, no GPU) and estimate the memory of one training step per device: parameters, gradients,"
        " AdamW state, FSDP buffers and activations, with a verdict against the device memory.",
    )
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
    run.add_argument("--loss-chunk-size", type=int, default=DEFAULT_LOSS_CHUNK_SIZE,
                     help="tokens per chunk of the fused loss (default: 1024, LlamaLightningModule's)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--plot", metavar="PNG", help="also draw the per-device memory, a stacked bar per pipeline"
                        " rank (needs the plot extra: pip install 'lightning-2d[plot]')")
    parser.add_argument("--plot-mesh", metavar="PNG", help="also draw which global rank holds which mesh coordinates,"
                        " ranks grouped by node (needs the plot extra)")
    add_parallel_config_options(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-2d plan`` / ``python -m lightning_2d.tools.planner``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(ParallelConfig) if getattr(args, f.name) is not None}
    try:
        report = plan_run(
            args.model,
            num_nodes=args.num_nodes,
            devices=args.devices,
            config=ParallelConfig(**given),  # its own checks raise ParallelConfigError too
            precision=args.precision,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            accumulate_grad_batches=args.accumulate_grad_batches,
            model_overrides=args.model_overrides,
            loss_chunk_size=args.loss_chunk_size,
            device_memory_gib=args.device_memory_gib,
            reserve_gib=args.reserve_gib,
        )
    except ParallelConfigError as err:
        # The message lists every problem with its fix; a traceback would only bury it.
        print(f"lightning-2d plan: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report), flush=True)
    if args.plot or args.plot_mesh:
        from lightning_2d.tools.plots import PlotsUnavailable, plot_memory, plot_mesh

        try:
            for path, plot in ((args.plot, plot_memory), (args.plot_mesh, plot_mesh)):
                if path:
                    print(f"wrote {plot(report, path)}", file=sys.stderr)
        except PlotsUnavailable as err:
            print(f"lightning-2d plan: {err}", file=sys.stderr)
            raise SystemExit(2) from None
