"""``lightning-2d prepare-data``: tokenize a recipe's corpus with every local core, before training.

    lightning-2d prepare-data --config recipes/debug_cpu.yaml
    lightning-2d prepare-data --config recipes/llama3_8b_1node.yaml \\
        --data.paths='["/data/corpus/*.jsonl"]' --data.tokenizer=/models/Meta-Llama-3-8B/tokenizer.json
    lightning-2d prepare-data --data.paths=/data/books --num-workers 32

The recipe is parsed by the same LightningCLI parser as ``lightning-2d fit`` (the same files,
defaults and ``--data.*`` overrides; other sections are parsed and ignored, nothing but the data
module is instantiated, so a GPU recipe prepares on a CPU machine), and the cache written is the
one ``TextDataModule.setup`` then finds. A recipe's ``data`` section may also be written as
``class_path``/``init_args``. Prints progress, then files, bytes, tokens, seconds and tokens/s.
The Python equivalent is ``TextDataModule(...).prepare(num_workers=...)``.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_2d.data import CacheReport, DataError, TextDataModule, corpus_bytes, default_num_workers

DESCRIPTION = (
    "Tokenize the corpus of a recipe's `data` section (TextDataModule) into the token cache that training"
    " then memory-maps, with a pool of processes (--num-workers, default every core this process may use)."
    " Takes the same --config files and --data.* options as `lightning-2d fit`; the other sections are"
    " read and ignored. Streams every file in pieces: memory stays about workers x 1 MB."
)


def _flatten_class_path(config: Any, source: str) -> Any:
    """``data: {class_path: ..., init_args: {...}}`` → ``data: {...}`` (the form ``fit`` takes)."""
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict) or "class_path" not in config["data"]:
        return config
    import importlib

    data = config["data"]
    module, _, name = str(data["class_path"]).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "lightning_2d"), name)
    except (ImportError, AttributeError) as err:
        raise DataError(f"{source}: data.class_path {data['class_path']!r} does not import ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, TextDataModule)):
        raise DataError(
            f"{source}: data.class_path is {data['class_path']!r}; prepare-data builds the cache of a TextDataModule"
        )
    return {**config, "data": dict(data.get("init_args") or {})}


def _normalized_args(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config`` file whose data section uses ``class_path`` given as its flattened text."""
    out, i = [], 0
    while i < len(argv):
        option = argv[i]
        name, has_value, value = option.partition("=")
        if name in ("-c", "--config"):
            if not has_value and i + 1 < len(argv):
                i, value = i + 1, argv[i + 1]
            path = Path(value)
            if path.is_file():
                loaded = yaml.safe_load(path.read_text())
                flattened = _flatten_class_path(loaded, str(path))
                if flattened is not loaded:
                    value = yaml.safe_dump(flattened, sort_keys=False)
            out.append(f"{name}={value}")
        else:
            out.append(option)
        i += 1
    return out


def parse_args(argv: list[str]) -> tuple[TextDataModule, int]:
    """The data module of ``argv`` (as ``lightning-2d fit`` would build it) and the number of tokenizing processes.

    Args:
        argv: The options after ``lightning-2d prepare-data``.
    """
    from lightning.pytorch.cli import LightningArgumentParser

    from lightning_2d.tools.cli import MODEL_AND_DATA, Lightning2DCLI

    class DataOnlyCLI(Lightning2DCLI):
        """``lightning-2d fit``'s parser (no subcommand); instantiates the data module only."""

        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument(
                "--num-workers", type=Optional[int], default=None,
                help="tokenizing processes (default: every core this process may use); not data.num_workers,"
                " the DataLoader's",
            )
            # A `fit` recipe may name a checkpoint to resume from; accepted here and ignored.
            parser.add_argument("--ckpt_path", type=Optional[str], default=None, help="ignored")

        def instantiate_classes(self) -> None:
            self.datamodule = TextDataModule(**self.config["data"].as_dict())

    with warnings.catch_warnings():
        # LightningCLI warns when `args` is given while sys.argv has options (ours: prepare-data ...).
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        cli = DataOnlyCLI(
            # Last: a recipe's seed_everything would seed (and log) for nothing here.
            **MODEL_AND_DATA, args=[*_normalized_args(argv), "--seed_everything=false"], run=False,
            parser_kwargs={"prog": "lightning-2d prepare-data", "description": DESCRIPTION},
        )
    workers = cli.config["num_workers"]
    if workers is not None and workers < 1:
        raise DataError(f"--num-workers must be at least 1, got {workers}")
    return cli.datamodule, workers or default_num_workers()


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


class _Progress:
    """Prints a progress line at most every ``every`` seconds, and the last one."""

    def __init__(self, every: float = 2.0) -> None:
        self.every, self.start, self.last = every, time.perf_counter(), 0.0

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and done < total:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        eta = elapsed * (total - done) / done if done else float("nan")
        print(
            f"  {_mb(done)} / {_mb(total)} ({100 * done / max(total, 1):.0f}%)  {_count(tokens)} tokens"
            f"  {_count(tokens / elapsed)} tokens/s  eta {eta:.0f} s",
            flush=True,
        )


def summary(report: CacheReport) -> str:
    """The closing lines: files, bytes, documents, tokens, seconds and tokens/s."""
    lines = [
        f"{'Built' if report.built else 'Already complete'}: {report.folder}",
        f"  files      {report.files:,}",
        f"  bytes      {report.bytes:,} ({_mb(report.bytes)})",
        f"  documents  {report.documents:,}",
        f"  tokens     {report.tokens:,}",
    ]
    if report.built:
        lines += [
            f"  seconds    {report.seconds:.2f} ({report.num_workers} tokenizing process(es), {report.tasks:,} tasks)",
            f"  tokens/s   {report.tokens_per_second:,.0f}",
        ]
    else:
        lines.append("  seconds    0 (nothing to tokenize)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> CacheReport:
    """``lightning-2d prepare-data [--config RECIPE.yaml ...] [--data.* ...] [--num-workers N]``.

    Args:
        argv: Options (default ``sys.argv[1:]``).

    Returns:
        The ``CacheReport`` (also printed).
    """
    data, workers = parse_args(sys.argv[1:] if argv is None else argv)
    sources = data.sources
    print(
        f"Corpus: {len(sources):,} file(s), {_mb(corpus_bytes(sources))}; tokenizer {data.tokenizer.fingerprint};"
        f" cache {data.cache_folder}; up to {workers} tokenizing process(es)",
        flush=True,
    )
    report = data.prepare(num_workers=workers, progress=_Progress(), log=lambda line: print(line, flush=True))
    print(summary(report), flush=True)
    return report


if __name__ == "__main__":
    main()
