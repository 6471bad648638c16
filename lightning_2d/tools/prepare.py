"""``lightning-2d prepare-data``: tokenize a recipe's corpus with every local core, before training.

    lightning-2d prepare-data --config recipes/debug_cpu.yaml
    lightning-2d prepare-data --config recipes/llama3_8b_1node.yaml \\
        --data.paths='["/data/corpus/*.jsonl"]' --data.tokenizer=/models/Meta-Llama-3-8B/tokenizer.json
    lightning-2d prepare-data --data.paths=/data/books --processes 32

The recipe is parsed by the same LightningCLI parser as ``lightning-2d fit`` (the same files,
defaults and ``--data.*`` overrides; other sections are parsed and ignored, nothing but the data
module is instantiated, so a GPU recipe prepares on a CPU machine), and the cache written is the
one ``TextDataModule.setup`` then finds. A recipe's ``data`` section may also be written as
``class_path``/``init_args``. Prints progress, then files, bytes, tokens, seconds and tokens/s.
The Python equivalent is ``TextDataModule(...).prepare(num_workers=...)``; a ``ChatDataModule`` or
``PreferenceDataModule`` recipe builds its chat cache the same way (``--preview N``: N rows as the model sees them).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, Optional, Union

import numpy as np
from docstring_parser import parse

from lightning_2d.data import (
    CacheReport,
    ChatDataModule,
    DataError,
    PreferenceDataModule,
    TextDataModule,
    corpus_bytes,
    default_num_workers,
)
from lightning_2d.data.chat import ChatCacheReport, pack_windows, to_conversation
from lightning_2d.data.chat.cache import plan_chat_pieces, read_rows, row_location
from lightning_2d.data.preference import EncodedExample, EncodedPair, UnpairedExample, to_example
from lightning_2d.tools.recipe import RecipeError, add_recipe_options, data_arguments, data_class, fit_config, split_argv

DESCRIPTION = (
    "Tokenize the corpus of a recipe's `data` section (TextDataModule) into the token cache that training"
    " then memory-maps, with a pool of processes (--processes, default every core this process may use)."
    " Takes the same --config files and --data.* options as `lightning-2d fit`; the other sections are"
    " read and ignored. Streams every file in pieces: memory stays about workers x 1 MB."
)


#: The ``data`` options that decide the token cache (the others, seq_len, batch_size …, are training's).
CACHE_OPTIONS = ("paths", "tokenizer", "eos_token", "text_field", "cache_dir")


def _data_options(group: argparse._ArgumentGroup) -> None:
    """One help line per ``TextDataModule`` argument (``--data.NAME``), from its signature and docstring."""
    docs = {p.arg_name: " ".join(p.description.split()) for p in parse(TextDataModule.__doc__ or "").params}
    for name, parameter in inspect.signature(TextDataModule).parameters.items():
        if name not in CACHE_OPTIONS:
            continue
        text = re.sub(r"``(.*?)``", r"\1", docs.get(name, ""))
        group.add_argument(f"--data.{name}", metavar="VALUE", dest=f"data_{name}",
                           help=f"{text} (default: {parameter.default})".replace("%", "%%"))


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``prepare-data``'s own option and, for ``--help``, the recipe's options it reads (parsed by
    ``fit``'s parser, ``lightning_2d.tools.recipe``)."""
    parser = argparse.ArgumentParser(prog="lightning-2d prepare-data", description=DESCRIPTION)
    parser.add_argument(
        "--processes", "--num-workers", dest="processes", type=int, default=None, metavar="N",
        help="tokenizing processes (default: every core this process may use); not --data.num_workers, the"
        " DataLoader's workers during training",
    )
    parser.add_argument(
        "--preview", type=int, default=None, metavar="N",
        help="ChatDataModule, PreferenceDataModule: print N rendered samples (a pair: its prompt, chosen and rejected"
        " completion; an unpaired example: its label, prompt and completion) with the trained spans marked [[like this]], their token counts and the packing efficiency,"
        " without writing the cache",
    )
    add_recipe_options(parser, "the data section")
    _data_options(parser.add_argument_group(
        "data", "The options of the recipe's data section (TextDataModule) that decide the cache; the others are"
        " parsed as fit parses them and ignored."))
    return parser


def parse_args(argv: list[str]) -> tuple[Union[TextDataModule, ChatDataModule, PreferenceDataModule], int]:
    """The data module of ``argv`` (as ``lightning-2d fit`` would build it) and the number of tokenizing processes.

    Args:
        argv: The options after ``lightning-2d prepare-data``.
    """
    own, recipe = split_argv(argv)
    args = build_parser().parse_args(own)
    if args.processes is not None and args.processes < 1:
        raise DataError(f"--processes/--num-workers must be at least 1, got {args.processes}")
    try:
        config = fit_config(recipe, prog="lightning-2d prepare-data")
    except RecipeError as err:
        raise DataError(str(err)) from None
    try:
        configs = [option.partition("=")[2] for option in recipe if option.partition("=")[0] in ("-c", "--config")]
        cls = data_class(config["data"], ", ".join(configs) or "the command line")
    except RecipeError as err:
        raise DataError(str(err)) from None
    data = cls(**data_arguments(config["data"]))
    return data, args.processes or default_num_workers()


def _preview_count(argv: list[str]) -> Optional[int]:
    own, _ = split_argv(argv)
    count = build_parser().parse_args(own).preview
    if count is not None and count < 1:
        raise DataError(f"--preview must be at least 1, got {count}")
    return count


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


class _Progress:
    """Prints a progress line at most every ``every`` seconds, and the last one."""

    def __init__(self, every: float = 2.0, unit: str = "tokens") -> None:
        self.every, self.start, self.last, self.unit = every, time.perf_counter(), 0.0, unit

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and done < total:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        eta = elapsed * (total - done) / done if done else float("nan")
        print(
            f"  {_mb(done)} / {_mb(total)} ({100 * done / max(total, 1):.0f}%)  {_count(tokens)} {self.unit}"
            f"  {_count(tokens / elapsed)} {self.unit}/s  eta {eta:.0f} s",
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


def _prepare_chat(data: Union[ChatDataModule, PreferenceDataModule], workers: int) -> ChatCacheReport:
    sources = data.sources
    kind = "Preference data" if isinstance(data, PreferenceDataModule) else "Chat data"
    print(f"{kind}: {len(sources):,} file(s), {_mb(corpus_bytes(sources))}; template"
          f" {data.template.origin}; cache {data.cache_folder}; up to {workers} encoding process(es)", flush=True)
    report = data.prepare(num_workers=workers, progress=_Progress(unit="conversations"),
                          log=lambda line: print(line, flush=True))
    data.setup("fit")
    assert data.packing is not None
    lines = [
        f"{'Built' if report.built else 'Already complete'}: {report.folder}",
        f"  files          {report.files:,}",
        f"  rows           {report.rows:,} ({report.no_target:,} dropped: no token to train on)",
        *(_preference_counts(report) if isinstance(data, PreferenceDataModule) else []),
        f"  conversations  {report.conversations:,}, {report.tokens:,} tokens, {report.targets:,} trained",
        f"  end of turn    {', '.join(map(str, report.end_of_turn)) or 'none found'}",
        f"Packing (training split, seq_len {data.seq_len}, {'packed' if data.pack else 'one per sequence'}):",
        *data.packing.lines(),
    ]
    if report.built:
        lines.insert(lines.index(f"  end of turn    {', '.join(map(str, report.end_of_turn)) or 'none found'}"),
                     f"  seconds        {report.seconds:.2f}")
    print("\n".join(lines), flush=True)
    return report


def _preference_counts(report: ChatCacheReport) -> list[str]:
    """A preference cache's pairs, or its unpaired examples and how many are desirable."""
    counts = report.counts
    if counts.get("examples"):
        return [f"  examples       {counts['examples']:,} ({counts.get('desirable', 0):,} desirable)"]
    return [f"  pairs          {counts.get('pairs', 0):,}"]


def _rows(data: Any) -> Iterator[tuple[str, Any]]:
    """Every row of ``data``'s files with its place (``file:line``), in order; a row that is not JSON raises."""
    for piece in plan_chat_pieces(data.sources, 1 << 62):
        for row, record, error in read_rows(piece):
            where = row_location(piece, row)
            if error is not None:
                raise DataError(f"{where} {error}")
            yield where, record


def chat_preview(data: ChatDataModule, count: int) -> str:
    """``count`` rows rendered as the model will see them, the trained text inside ``[[ ]]``, with token counts;
    then the packing efficiency of the whole data set (encoded in memory, nothing written)."""
    out, lengths, trained = [], [], 0
    shown = 0
    for where, record in _rows(data):
        encoded = data.encoder.encode(to_conversation(record, data.format, data.fields, where), where)
        if encoded.num_targets == 0:
            continue
        lengths.append(min(len(encoded.ids) - 1, data.seq_len))
        trained += encoded.num_targets
        if shown < count:
            shown += 1
            out.append(f"---- {where}: {len(encoded.ids)} tokens, {encoded.num_targets} trained"
                       f" (end of turn: {sorted(encoded.end_of_turn) or 'none'})")
            out.append(_marked(data, encoded.ids, encoded.trained))
    windows = pack_windows(np.asarray(lengths, dtype=np.int64), data.seq_len, data.pack)
    total = len(windows) * data.seq_len
    out.append(f"---- {len(lengths):,} conversations, {trained:,} trained tokens: {len(windows):,} sequences of"
               f" {data.seq_len}, {100 * int(np.sum(lengths)) / max(total, 1):.1f}% of positions filled"
               f" ({100 * trained / max(total, 1):.1f}% trained), nothing written")
    return "\n".join(out)


def preference_preview(data: PreferenceDataModule, count: int) -> str:
    """``count`` pairs as the model will see them: the prompt's tokens, then the chosen and the rejected completion
    with their trained text inside ``[[ ]]``, with token counts (an unpaired example: its prompt and its completion,
    with its label); then the packing efficiency of the whole data set (encoded in memory, nothing written; an
    example takes twice its positions: itself and its KL sequence)."""
    out, positions, trained, dropped, desirable = [], [], 0, 0, 0
    units = Counter()
    shown = 0
    for where, record in _rows(data):
        unit = to_example(record, data.format, data.fields, where)
        if isinstance(unit, UnpairedExample):
            example = data.pair_encoder.encode_example(unit, where)
            sequences, length = (example.sequence,), 2 * (len(example.sequence.ids) - 1)
        else:
            pair = data.pair_encoder.encode(unit, where)
            sequences, length = (pair.chosen, pair.rejected), len(pair.chosen.ids) + len(pair.rejected.ids) - 2
        if not all(s.num_targets for s in sequences) or length > data.seq_len:
            dropped += 1
            continue
        positions.append(length)
        trained += sum(s.num_targets for s in sequences)
        units["examples" if isinstance(unit, UnpairedExample) else "pairs"] += 1
        desirable += isinstance(unit, UnpairedExample) and unit.desirable
        if shown < count:
            shown += 1
            out += _preview_example(data, where, example) if isinstance(unit, UnpairedExample) else \
                _preview_pair(data, where, pair)
    windows = pack_windows(np.asarray(positions, dtype=np.int64), data.seq_len, data.pack)
    total = len(windows) * data.seq_len
    what = " and ".join(f"{n:,} {kind}" + (f" ({desirable:,} desirable)" if kind == "examples" else "")
                        for kind, n in sorted(units.items())) or "0 pairs"
    out.append(f"---- {what}, {trained:,} trained tokens: {len(windows):,} windows of {data.seq_len},"
               f" {100 * int(np.sum(positions)) / max(total, 1):.1f}% of positions filled"
               f" ({100 * trained / max(total, 1):.1f}% trained); {dropped:,} dropped (no trained token, or"
               f" longer than seq_len: overflow={data.overflow!r}); nothing written")
    return "\n".join(out)


def _preview_pair(data: PreferenceDataModule, where: str, pair: EncodedPair) -> list[str]:
    """A pair's lines: its token counts, its prompt, chosen and rejected completions (trained text marked)."""
    cut = ["prompt truncated" if pair.prompt_truncated else "",
           f"{pair.completions_truncated} completion(s) truncated" if pair.completions_truncated else ""]
    p = pair.prompt_tokens
    return [f"---- {where}: prompt {p} tokens; chosen {len(pair.chosen.ids) - p} tokens,"
            f" {pair.chosen.num_targets} trained; rejected {len(pair.rejected.ids) - p} tokens,"
            f" {pair.rejected.num_targets} trained" + "".join(f"; {c}" for c in cut if c),
            "prompt:   " + _marked(data, pair.chosen.ids[:p], pair.chosen.trained[:p]),
            "chosen:   " + _marked(data, pair.chosen.ids[p:], pair.chosen.trained[p:]),
            "rejected: " + _marked(data, pair.rejected.ids[p:], pair.rejected.trained[p:])]


def _preview_example(data: PreferenceDataModule, where: str, example: EncodedExample) -> list[str]:
    """An unpaired example's lines: its label and token counts, its prompt and completion (trained text marked)."""
    cut = ["prompt truncated" if example.prompt_truncated else "",
           "completion truncated" if example.completion_truncated else ""]
    p, sequence = example.prompt_tokens, example.sequence
    return [f"---- {where}: {'desirable' if example.desirable else 'undesirable'}; prompt {p} tokens; completion"
            f" {len(sequence.ids) - p} tokens, {sequence.num_targets} trained" + "".join(f"; {c}" for c in cut if c),
            "prompt:     " + _marked(data, sequence.ids[:p], sequence.trained[:p]),
            "completion: " + _marked(data, sequence.ids[p:], sequence.trained[p:])]


def _marked(data: Union[ChatDataModule, PreferenceDataModule], ids: np.ndarray, trained: np.ndarray) -> str:
    """Tokens decoded, trained runs inside ``[[ ]]`` (special tokens written out)."""
    pieces, run, state = [], [], None
    for token, is_trained in zip(ids.tolist(), trained.tolist()):
        if state is not None and is_trained != state:
            text = data.tokenizer.decode_keep_special(run)
            pieces.append(f"[[{text}]]" if state else text)
            run = []
        run.append(token)
        state = is_trained
    if run:
        text = data.tokenizer.decode_keep_special(run)
        pieces.append(f"[[{text}]]" if state else text)
    return "".join(pieces)


def main(argv: Optional[list[str]] = None) -> Union[CacheReport, ChatCacheReport, None]:
    """``lightning-2d prepare-data [--config RECIPE.yaml ...] [--data.* ...] [--processes N]``.

    Args:
        argv: Options (default ``sys.argv[1:]``).

    Returns:
        The ``CacheReport`` (also printed); ``None`` with ``--preview``.

    Raises:
        DataError: Files that cannot be read or rows of no known format (naming ``file:line``), or ``--preview`` of
            a ``TextDataModule`` recipe.

    Example:
        ```python
        from lightning_2d.tools.prepare import main

        main(["--config", "recipes/sft_cpu.yaml", "--processes", "8"])  # `lightning-2d prepare-data ...`
        main(["--config", "recipes/sft_cpu.yaml", "--preview", "3"])    # 3 rows as the model sees them
        ```
    """
    argv = sys.argv[1:] if argv is None else argv
    data, workers = parse_args(argv)
    preview = _preview_count(argv)
    if preview is not None:
        if isinstance(data, PreferenceDataModule):
            print(preference_preview(data, preview), flush=True)
            return None
        if not isinstance(data, ChatDataModule):
            raise DataError("--preview shows rendered conversations: the recipe's data is a TextDataModule; use it with"
                            " data.class_path: lightning_2d.ChatDataModule (or lightning_2d.PreferenceDataModule)")
        print(chat_preview(data, preview), flush=True)
        return None
    if isinstance(data, (ChatDataModule, PreferenceDataModule)):
        return _prepare_chat(data, workers)
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
