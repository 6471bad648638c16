"""The token cache: a corpus tokenized once into a flat token file on disk, built by one process at a time.

``prepare_token_cache`` finds the cache of a corpus (keyed by the sources' paths, sizes and mtimes, the
tokenizer, the text field, the piece size and whether documents start with the BOS token) or builds it: the
tokens of the pieces (``pieces``) are
appended in corpus order to a temporary file, which is synced and renamed, and ``meta.json``, written last,
marks the cache complete. Processes of one machine building the same cache take turns on a file lock. That
protocol, and where caches live, is the chat cache's too (``cache_folders``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional, Union

from lightning_2d.data.cache_folders import build_once, folder_key, partial_files, token_dtype, write_meta
from lightning_2d.data.pieces import (
    CHUNK_BYTES,
    Piece,
    PieceTokenizer,
    PieceTokens,
    group_tasks,
    plan_pieces,
    tokenized_in_order,
)
from lightning_2d.data.sources import DataError, corpus_bytes
from lightning_2d.data.tokenizers import Tokenizer

#: Version of the cache layout and of the way text is cut into pieces (part of the cache key).
CACHE_FORMAT = 2


def cache_key(
    sources: list[Path], tokenizer: Tokenizer, text_field: str, chunk_bytes: int = CHUNK_BYTES, add_bos: bool = False
) -> str:
    """The cache folder's name: the sources (path, size, mtime), the tokenizer, the text field, the piece size
    and, with ``add_bos``, the beginning-of-text token (a cache without it keeps its earlier key)."""
    bos = f"|bos{getattr(tokenizer, 'bos_id', None)}" if add_bos else ""
    return folder_key(f"v{CACHE_FORMAT}|{tokenizer.fingerprint}|{text_field}|chunk{chunk_bytes}{bos}", sources)


def cache_folder(
    sources: list[Path], tokenizer: Tokenizer, cache_dir: Union[str, Path], text_field: str = "text",
    chunk_bytes: int = CHUNK_BYTES, add_bos: bool = False,
) -> Path:
    """Where the cache of this corpus lives (complete once its ``meta.json`` exists)."""
    return Path(cache_dir).expanduser() / cache_key(sources, tokenizer, text_field, chunk_bytes, add_bos)


@dataclass
class CacheReport:
    """What ``prepare_token_cache`` found or built.

    Args:
        folder: The cache folder (``tokens.bin`` + ``meta.json``).
        built: ``False`` when the cache was already complete (nothing was tokenized).
        files: Source files.
        bytes: Their total size.
        tokens: Tokens in the cache.
        documents: Documents (each followed by the end-of-text token, when the tokenizer has one).
        seconds: Time spent building (0 when ``built`` is ``False``).
        num_workers: Tokenizing processes used.
        tasks: Tasks the corpus was cut into.
        largest_read: Largest number of bytes read for one piece (bounded by about 2 · ``chunk_bytes``
            for text, one record more for JSONL, a row group for Parquet).
    """

    folder: Path
    built: bool
    files: int
    bytes: int
    tokens: int
    documents: int
    seconds: float = 0.0
    num_workers: int = 0
    tasks: int = 0
    largest_read: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Writer:
    """Appends the tokens of each piece to ``out`` in corpus order and applies the per-file rules.

    A text file all of whose pieces are whitespace is empty; an empty or non-UTF-8 file raises
    ``DataError`` (``strict``) or is skipped: its tokens already written are truncated away.
    """

    def __init__(self, out: BinaryIO, strict: bool, itemsize: int) -> None:
        self.out, self.strict, self.itemsize = out, strict, itemsize
        self.file = -1
        self.file_start = 0
        self.file_documents = 0
        self.file_blank = True
        self.skipping = False
        self.documents = 0
        self.largest_read = 0

    def add(self, piece: Piece, result: PieceTokens) -> None:
        if piece.file != self.file:
            self.file, self.file_start = piece.file, self.out.tell()
            self.file_documents, self.file_blank, self.skipping = 0, True, False
        if self.skipping:
            return
        if result.error is not None:
            if self.strict or not result.skippable:
                raise DataError(result.error)
            self._drop_file()
            return
        self.largest_read = max(self.largest_read, result.bytes_read)
        result.tokens.tofile(self.out)
        self.file_documents += result.documents
        self.file_blank = self.file_blank and result.blank
        if piece.last:
            if piece.kind == "text" and self.file_blank:
                if self.strict:
                    raise DataError(f"{piece.path} is empty; remove it from paths")
                self._drop_file()
                return
            self.documents += self.file_documents

    def skip_file(self) -> None:
        """Ignore the rest of the current file (after an error was reported for it)."""
        self.skipping = True

    def _drop_file(self) -> None:
        self.out.truncate(self.file_start)
        self.out.seek(self.file_start)
        self.skipping = True

    @property
    def tokens(self) -> int:
        return self.out.tell() // self.itemsize


def prepare_token_cache(
    sources: list[Path],
    tokenizer: Tokenizer,
    cache_dir: Union[str, Path],
    text_field: str = "text",
    strict: bool = True,
    num_workers: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Optional[Callable[[int, int, int], None]] = None,
    log: Optional[Callable[[str], None]] = None,
    add_bos: bool = False,
) -> CacheReport:
    """Tokenize ``sources`` into ``cache_dir/<key>/tokens.bin`` unless that cache is complete.

    Streaming and parallel: the corpus is cut into pieces (``plan_pieces``), ``num_workers``
    processes tokenize them (at most two tasks per worker in flight, so memory stays about
    ``num_workers × chunk_bytes`` whatever the corpus size) and this process appends their tokens in
    corpus order: the cache is the same, token for token, for any ``num_workers``. The tokens go to
    a temporary file, which is synced and renamed to ``tokens.bin``; ``meta.json``, written last
    (also via a temporary file), marks the cache complete, so an interrupted build (error, Ctrl-C,
    kill) never leaves a cache that looks complete. Processes of one machine building the same
    cache take turns (a file lock): the second finds the first one's cache.

    Args:
        sources: Files in corpus order (``resolve_sources``).
        tokenizer: The tokenizer (``load_tokenizer``).
        cache_dir: Folder of the caches.
        text_field: JSONL field / Parquet column holding the text.
        strict: Raise on an empty or non-UTF-8 text file (``False``: skip it, for the built-in corpus).
        num_workers: Tokenizing processes (1: in this process).
        chunk_bytes: Piece size (part of the cache key).
        progress: Called after each task with (bytes done, bytes in all, tokens so far).
        log: Called with a line of text for events worth telling (waiting for another builder).
        add_bos: Start each document with the tokenizer's beginning-of-text token (part of the cache key).

    Returns:
        A ``CacheReport`` (``built=False`` when the cache already existed).
    """
    if chunk_bytes < 16:
        raise DataError(f"chunk_bytes must be at least 16, got {chunk_bytes}")
    if num_workers < 1:
        raise DataError(f"num_workers must be at least 1, got {num_workers}")
    if add_bos and getattr(tokenizer, "bos_id", None) is None:
        raise DataError(f"add_bos=True, but the tokenizer ({tokenizer.fingerprint}) has no beginning-of-text token")
    folder = cache_folder(sources, tokenizer, cache_dir, text_field, chunk_bytes, add_bos)
    return build_once(
        folder,
        lambda: _build(folder, sources, tokenizer, text_field, strict, num_workers, chunk_bytes, progress, add_bos),
        lambda meta: CacheReport(folder, False, meta["num_sources"], meta.get("num_bytes", 0), meta["num_tokens"],
                                 meta["num_documents"]),
        log,
    )


def _build(
    folder: Path, sources: list[Path], tokenizer: Tokenizer, text_field: str, strict: bool, num_workers: int,
    chunk_bytes: int, progress: Optional[Callable[[int, int, int], None]], add_bos: bool = False,
) -> CacheReport:
    started = time.perf_counter()
    tasks = group_tasks(plan_pieces(sources, text_field, chunk_bytes), chunk_bytes)
    total = corpus_bytes(sources)
    dtype = token_dtype(tokenizer.vocab_size)
    tokenize = PieceTokenizer(tokenizer, text_field, dtype, chunk_bytes, add_bos)
    done = 0
    with partial_files(folder, ["tokens.bin"]) as files, \
            closing(tokenized_in_order(tasks, tokenize, num_workers)) as tokenized:
        writer = _Writer(files["tokens.bin"], strict, dtype.itemsize)
        problems: list[str] = []
        for task, results in zip(tasks, tokenized):
            for piece, result in zip(task, results):
                try:
                    writer.add(piece, result)
                except DataError as err:  # go on: every bad file is reported at once, not one per run
                    problems.append(str(err))
                    writer.skip_file()
            done += sum(p.nbytes for p in task)
            if progress is not None:
                progress(min(done, total), total, writer.tokens)
        if problems:
            raise DataError(
                f"{len(problems)} problem(s) in the corpus (nothing was cached):\n  - "
                + "\n  - ".join(problems[:20])
                + (f"\n  - … and {len(problems) - 20} more" if len(problems) > 20 else "")
            )
        n_tokens = writer.tokens
    meta = {
        "format": CACHE_FORMAT,
        "num_tokens": n_tokens,
        "num_documents": writer.documents,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.fingerprint,
        "bos_id": getattr(tokenizer, "bos_id", None) if add_bos else None,
        "text_field": text_field,
        "chunk_bytes": chunk_bytes,
        "num_bytes": total,
        "sources": [str(p) for p in sources[:1000]],
        "num_sources": len(sources),
    }
    write_meta(folder, meta)
    return CacheReport(folder, True, len(sources), total, n_tokens, writer.documents, time.perf_counter() - started,
                       min(num_workers, max(1, len(tasks))), len(tasks), writer.largest_read)


def build_token_cache(
    sources: list[Path],
    tokenizer: Tokenizer,
    cache_dir: Union[str, Path],
    text_field: str = "text",
    strict: bool = True,
    num_workers: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    add_bos: bool = False,
) -> Path:
    """``prepare_token_cache`` returning only the cache folder (see there for the arguments)."""
    return prepare_token_cache(sources, tokenizer, cache_dir, text_field, strict, num_workers, chunk_bytes,
                               add_bos=add_bos).folder
