"""``lightning-2d export CHECKPOINT OUT_DIR``: a Lightning checkpoint as a Hugging Face directory (weights, config,
tokenizer, generation config) that ``from_pretrained``, ``AutoTokenizer`` and ``pipeline()`` load as it is.

The conversion itself is ``lightning_2d.checkpoint.hf.export_hf``; this is its command line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from lightning_2d.checkpoint.hf import ExportError, export_hf
from lightning_2d.models.llama.model import PRESETS
from lightning_2d.parallel.config import DTYPE_NAMES


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-2d export`` parser (``main`` parses with it; the docs' commands are checked against it)."""
    parser = argparse.ArgumentParser(
        prog="lightning-2d export",
        description="Write model.safetensors + config.json (Hugging Face Llama layout) from a sharded or"
        " full LlamaLightningModule or HFCausalLMModule checkpoint, one output file in memory at a time, with the"
        " tokenizer's files and generation_config.json. Needs no GPU and no process group.",
    )
    parser.add_argument("checkpoint", help="checkpoint folder (sharded) or file (full)")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="default: as stored")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="split the weights into files of this size (also about the peak memory)")
    parser.add_argument("--model", default=None, metavar="PRESET",
                        help=f"the model's preset ({', '.join(PRESETS)}), for a checkpoint that does not record"
                        " its model args; one that does must agree")
    parser.add_argument("--model-overrides", default=None, metavar="JSON",
                        help="fields of ModelArgs to change, e.g. '{\"n_layers\": 2}'")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer to write with the weights: a tokenizer.json, a tokenizer.model"
                        " (SentencePiece or Meta's tiktoken), a model folder, or 'byte'; default: the one the"
                        " checkpoint records (the data module's --data.tokenizer, else the init_from folder's)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="for a LoRA checkpoint: the base (init_from, or the recorded seed's init) with the adapters"
                        " merged in, as a plain Hugging Face folder; default for a LoRA checkpoint: a peft adapter"
                        " folder (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("--allow-global", action="append", default=[], metavar="MODULE.NAME",
                        help="a type the checkpoint may hold besides tensors and plain data (only for a file you"
                        " trust: building it runs its code); repeatable")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-2d export CHECKPOINT OUT_DIR``: a checkpoint → Hugging Face Llama directory.

    A checkpoint that cannot be exported as asked exits with status 1 and a one-line reason (no
    traceback): the user's fix is in the message, not in the stack.

    Args:
        argv: The arguments after ``export`` (``None``: ``sys.argv[1:]``).

    Raises:
        SystemExit: Status 1 for a checkpoint that cannot be exported as asked (``ExportError``, or no complete
            checkpoint there), with its reason; 2 for options that do not parse.

    Example:
        ```python
        from lightning_2d.tools.export import main

        main(["checkpoints/last.ckpt", "export/", "--dtype", "bfloat16"])  # `lightning-2d export ...`
        ```
    """
    import sys

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_shard_gb <= 0:
        parser.error(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    overrides = None
    if args.model_overrides is not None:
        try:
            overrides = json.loads(args.model_overrides)
        except json.JSONDecodeError as err:
            parser.error(f"--model-overrides is not JSON ({err}): {args.model_overrides!r}")
        if not isinstance(overrides, dict):
            parser.error(f"--model-overrides must be a JSON object of ModelArgs fields, got {args.model_overrides!r}")
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else None
    notes: list[str] = []
    try:
        out = export_hf(
            Path(args.checkpoint), Path(args.out_dir), dtype=dtype, max_shard_bytes=int(args.max_shard_gb * 2**30),
            model=args.model, model_overrides=overrides, allow_globals=args.allow_global, tokenizer=args.tokenizer,
            log=lambda line: notes.append(line), merge_lora=args.merge_lora,
        )
    except (ExportError, FileNotFoundError) as err:
        print(f"lightning-2d export: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    if (out / "adapter_config.json").exists():
        print(f"Wrote {out}: LoRA adapters (load with peft.PeftModel.from_pretrained(base, {str(out)!r}); --merge-lora"
              " writes the merged model)")
    else:
        print(f"Wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained)")
    for note in notes:
        print(f"  {note}")
