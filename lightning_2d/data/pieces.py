"""Tokenizing a corpus in parallel: files cut into pieces, tokenized by a pool of processes, in corpus order.

``plan_pieces`` cuts text and JSONL files into byte ranges of about ``CHUNK_BYTES`` (each worker finds its
own boundary at a newline) and Parquet files into row groups; ``group_tasks`` groups them into tasks;
``PieceTokenizer`` reads and tokenizes a task in a worker (forked: it inherits the loaded tokenizer), and
``tokenized_in_order`` yields the results in task order with a bounded number of tasks in flight (the chat cache
runs its own worker through the same pool).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, TypeVar

import numpy as np

from lightning_2d.data.sources import DataError, stat_source
from lightning_2d.data.tokenizers import Tokenizer

#: Pieces of work and of text: a text/JSONL file larger than this is read and tokenized as byte
#: ranges of about this size ending at a newline, small files are grouped into tasks of about this
#: size. Part of the cache key: a subword tokenizer may merge differently across a piece boundary.
CHUNK_BYTES = 1 << 20
#: Parquet rows converted to Python strings and tokenized at a time.
PARQUET_BATCH_ROWS = 1024
_BLOCK = 1 << 16  # read size when looking for a piece boundary

T = TypeVar("T")


# ---- pieces: what one tokenizing task reads ----------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A part of one source file that is read and tokenized on its own.

    Text and JSONL files are cut at nominal byte offsets ``k · chunk_bytes``; a piece starts at the
    first line start at or after its nominal ``start`` (0 for the first) and ends where the next
    piece starts (the end of the file for the last), so the pieces cover the file exactly once and
    each worker finds its own boundaries. In text with no newline within ``chunk_bytes`` after a
    nominal offset, the boundary is the next UTF-8 character instead (memory stays bounded); a JSONL
    record is never cut. A Parquet piece is one row group (``start`` is its index).

    Args:
        file: Index of the file in the corpus (pieces of one file are consecutive).
        path: The file.
        kind: ``"text"`` (the whole file is one document), ``"jsonl"`` or ``"parquet"`` (one
            document per record).
        start: Nominal first byte (text/JSONL) or row group (Parquet).
        stop: Nominal end byte (text/JSONL) or row group + 1 (Parquet).
        file_size: Size of the file when the corpus was planned.
        last: Whether this is the file's last piece (a text document ends there).
        nbytes: About how many bytes of the file it covers (task sizes, progress); a Parquet file's
            size is shared evenly among its row groups.
    """

    file: int
    path: str
    kind: str
    start: int
    stop: int
    file_size: int
    last: bool
    nbytes: int


def plan_pieces(sources: list[Path], text_field: str, chunk_bytes: int = CHUNK_BYTES) -> list[Piece]:
    """Cut the corpus into pieces (see ``Piece``), in corpus order; only file sizes and Parquet metadata are read.

    Args:
        sources: The files, in corpus order.
        text_field: JSONL field / Parquet column holding the text (Parquet files are checked here).
        chunk_bytes: Nominal piece size of text and JSONL files.
    """
    pieces: list[Piece] = []
    for index, path in enumerate(sources):
        size, kind = stat_source(path).st_size, _file_kind(path)
        if kind == "parquet":
            groups = _parquet_row_groups(path, text_field)
            shares = [size * (g + 1) // groups - size * g // groups for g in range(groups)]
            pieces.extend(Piece(index, str(path), kind, g, g + 1, size, g == groups - 1, share)
                          for g, share in enumerate(shares))
            continue
        for start in range(0, max(size, 1), chunk_bytes):  # an empty file is one (empty) piece
            stop = min(start + chunk_bytes, size)
            pieces.append(Piece(index, str(path), kind, start, stop, size, stop >= size, stop - start))
    return pieces


def _file_kind(path: Path) -> str:
    """How a corpus file is read, by its suffix: ``"jsonl"``, ``"parquet"`` or ``"text"`` (one document)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    return "parquet" if suffix == ".parquet" else "text"


def _parquet_row_groups(path: Path, text_field: str) -> int:
    pq = pyarrow_parquet(path)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise DataError(f"Cannot read {path} as Parquet: {err}") from err
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path} has no column {text_field!r} (columns: {columns}); set text_field")
    return parquet.num_row_groups


def pyarrow_parquet(path: Path | str) -> Any:
    """``pyarrow.parquet``, imported when a Parquet file is read (pyarrow is optional); without it, an
    ``ImportError`` naming the file and the install."""
    try:
        import pyarrow.parquet as pq  # the `parquet` extra: optional, imported for Parquet files only
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"Reading {path} needs pyarrow: pip install pyarrow") from err
    return pq


def group_tasks(pieces: list[Piece], chunk_bytes: int = CHUNK_BYTES) -> list[list[Piece]]:
    """Consecutive pieces grouped into tasks of about ``chunk_bytes`` (many small files make one task)."""
    tasks: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        # A Parquet row group is a task of its own (it may be large); other pieces fill tasks up to chunk_bytes.
        if current and (size + piece.nbytes > chunk_bytes or "parquet" in (piece.kind, current[-1].kind)):
            tasks.append(current)
            current, size = [], 0
        current.append(piece)
        size += piece.nbytes
    if current:
        tasks.append(current)
    return tasks


def _find_newline(f: BinaryIO, begin: int, limit: int) -> int:
    """Offset of the first ``\\n`` in ``[begin, limit)`` of ``f``, or -1; reads in small blocks."""
    f.seek(begin)
    offset = begin
    while offset < limit:
        block = f.read(min(_BLOCK, limit - offset))
        if not block:
            break
        found = block.find(b"\n")
        if found >= 0:
            return offset + found
        offset += len(block)
    return -1


def piece_boundary(f: BinaryIO, nominal: int, file_size: int, window: Optional[int]) -> int:
    """Where the piece whose nominal start is ``nominal`` really starts.

    Just after the first newline at or after ``nominal - 1`` (so a line that starts exactly at
    ``nominal`` starts the piece). ``window``: look that far only (text), then cut at the first UTF-8
    character start at or after ``nominal``; ``None``: look to the end of the file (JSONL records are
    never cut). A pure function of ``nominal``, so neighbouring pieces agree on their boundary.
    """
    if nominal <= 0:
        return 0
    if nominal >= file_size:
        return file_size
    limit = file_size if window is None else min(file_size, nominal + window)
    newline = _find_newline(f, nominal - 1, limit)
    if newline >= 0:
        return newline + 1
    if limit >= file_size:
        return file_size
    f.seek(nominal)
    head = f.read(4)
    # UTF-8 continuation bytes are 0b10xxxxxx; a character starts at the first other byte.
    return nominal + next((i for i, b in enumerate(head) if b & 0xC0 != 0x80), 0)


# ---- tokenizing pieces (in the worker processes) ---------------------------------------------
@dataclass
class PieceTokens:
    """What tokenizing one piece gave.

    Args:
        tokens: The piece's token ids (a document's end-of-text token included where it ends).
        documents: Documents that end in this piece.
        bytes_read: Bytes of the file read for it.
        blank: A text piece of whitespace only (a text file all of whose pieces are blank is empty).
        error: Why the piece could not be tokenized (the message of the ``DataError`` to raise).
        skippable: The error skips the file in a non-strict build (empty / non-UTF-8 text file).
    """

    tokens: np.ndarray
    documents: int = 0
    bytes_read: int = 0
    blank: bool = False
    error: Optional[str] = None
    skippable: bool = False


class _PieceError(Exception):
    def __init__(self, message: str, skippable: bool = False) -> None:
        super().__init__(message)
        self.skippable = skippable


class PieceTokenizer:
    """Tokenizes tasks (lists of pieces); one lives in each worker process (or in the parent for one worker).

    Args:
        tokenizer: The tokenizer.
        text_field: JSONL field / Parquet column holding the text.
        dtype: Token dtype of the cache.
        chunk_bytes: Nominal piece size (a long text line is cut at a character after this many bytes).
        add_bos: Start each document with the tokenizer's beginning-of-text token (a text file's first
            piece, every JSONL/Parquet record).
    """

    def __init__(
        self, tokenizer: Tokenizer, text_field: str, dtype: np.dtype, chunk_bytes: int, add_bos: bool = False
    ) -> None:
        self.tokenizer, self.text_field, self.dtype, self.chunk_bytes = tokenizer, text_field, dtype, chunk_bytes
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        self.eos = np.asarray(eos, dtype=dtype)
        bos_id = getattr(tokenizer, "bos_id", None)
        if add_bos and bos_id is None:
            raise DataError(f"add_bos=True, but the tokenizer ({tokenizer.fingerprint}) has no beginning-of-text token")
        self.bos = np.asarray([bos_id] if add_bos else [], dtype=dtype)

    def __call__(self, task: list[Piece]) -> list[PieceTokens]:
        results: list[PieceTokens] = []
        texts: list[str] = []
        # per text: (index in results, whether a document begins with it, whether one ends with it)
        owners: list[tuple[int, bool, bool]] = []
        for piece in task:
            try:
                if piece.kind == "parquet":  # tokenized batch by batch: a row group can be large
                    results.append(self._parquet(piece))
                    continue
                read = self._text if piece.kind == "text" else self._jsonl
                docs, ends, bytes_read, blank = read(piece)
            except _PieceError as err:
                results.append(PieceTokens(self.eos[:0], error=str(err), skippable=err.skippable))
                continue
            begins = piece.kind != "text" or piece.start == 0  # a text file is one document, from its first piece
            owners.extend((len(results), begins, ends) for _ in docs)
            texts.extend(docs)
            results.append(PieceTokens(self.eos[:0], documents=len(docs) if ends else 0, bytes_read=bytes_read,
                                       blank=blank))
        # One encode_batch call for the whole task: a Hugging Face tokenizer amortizes its call overhead.
        parts: list[list[np.ndarray]] = [[] for _ in results]
        for (owner, begins, ends), ids in zip(owners, self._encode(texts)):
            if begins and self.bos.size:
                parts[owner].append(self.bos)
            parts[owner].append(ids)
            if ends:
                parts[owner].append(self.eos)
        for result, arrays in zip(results, parts):
            if arrays:
                result.tokens = np.concatenate(arrays).astype(self.dtype, copy=False)
        return results

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        fast = getattr(self.tokenizer, "encode_arrays", None)  # e.g. ByteTokenizer: no Python int lists
        if fast is not None:
            return fast(texts)
        return [np.asarray(ids, dtype=self.dtype) for ids in self.tokenizer.encode_batch(texts)]

    def _read(self, piece: Piece, window: Optional[int]) -> tuple[bytes, int]:
        try:
            with open(piece.path, "rb") as f:
                begin = piece_boundary(f, piece.start, piece.file_size, window)
                end = piece.file_size if piece.last else piece_boundary(f, piece.stop, piece.file_size, window)
                f.seek(begin)
                return f.read(max(0, end - begin)), begin
        except OSError as err:
            raise _PieceError(f"Cannot read {piece.path}: {err.strerror or err}") from None

    def _text(self, piece: Piece) -> tuple[list[str], bool, int, bool]:
        data, begin = self._read(piece, window=self.chunk_bytes)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _PieceError(
                f"{piece.path} is not UTF-8 text (byte {begin + err.start}: {err.reason}); convert or remove it",
                skippable=True,
            ) from None
        return [text], piece.last, len(data), not data.strip()

    def _jsonl(self, piece: Piece) -> tuple[list[str], bool, int, bool]:
        data, begin = self._read(piece, window=None)
        docs = []
        for i, line in enumerate(data.split(b"\n")):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                what = f"not valid JSON ({err.msg})" if isinstance(err, json.JSONDecodeError) else "not UTF-8"
                raise _PieceError(f"{piece.path}:{self._line_number(piece, begin, i)} is {what}") from None
            if not isinstance(record, dict) or self.text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise _PieceError(
                    f"{piece.path}:{self._line_number(piece, begin, i)} has no field {self.text_field!r}"
                    f" (found {keys}); set text_field"
                )
            value = record[self.text_field]
            if not isinstance(value, str):  # null, a number, a list or an object would be tokenized as its repr
                raise _PieceError(
                    f"{piece.path}:{self._line_number(piece, begin, i)}: field {self.text_field!r} holds"
                    f" {'null' if value is None else type(value).__name__} ({json.dumps(value)[:40]}), not a string;"
                    " fix or drop the record"
                )
            docs.append(value)
        return docs, True, len(data), False

    @staticmethod
    def _line_number(piece: Piece, begin: int, index: int) -> int:
        # Only for error messages: count the newlines before the piece (streamed, not kept).
        lines = 0
        with open(piece.path, "rb") as f:
            for done in range(0, begin, 1 << 20):
                lines += f.read(min(1 << 20, begin - done)).count(b"\n")
        return lines + index + 1

    def _parquet(self, piece: Piece) -> PieceTokens:
        pq = pyarrow_parquet(piece.path)
        arrays, documents = [], 0
        try:
            parquet = pq.ParquetFile(piece.path)
            bytes_read = parquet.metadata.row_group(piece.start).total_byte_size
            batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[piece.start],
                                           columns=[self.text_field])
        except Exception as err:
            raise _PieceError(f"Cannot read {piece.path} as Parquet: {err}") from None
        while True:
            try:  # only reading errors are the file's; a tokenizer's errors are raised as they are
                batch = next(batches, None)
            except Exception as err:
                raise _PieceError(f"Cannot read {piece.path} as Parquet: {err}") from None
            if batch is None:
                break
            texts = [str(t) for t in batch.column(0).to_pylist() if t is not None]
            for ids in self._encode(texts):
                arrays += [self.bos, ids, self.eos]
            documents += len(texts)
        tokens = np.concatenate(arrays).astype(self.dtype, copy=False) if arrays else self.eos[:0]
        return PieceTokens(tokens, documents=documents, bytes_read=bytes_read)


_WORKER: Optional[Callable[[list[Piece]], Any]] = None


def _init_worker(tokenize: Callable[[list[Piece]], Any]) -> None:
    global _WORKER
    _WORKER = tokenize
    # Ctrl-C reaches the whole process group: the parent stops the pool and removes its partial
    # file; workers that died of KeyboardInterrupt would only add tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One process per core already: a Hugging Face tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run_task(task: list[Piece]) -> Any:
    assert _WORKER is not None
    return _WORKER(task)


def default_num_workers() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; CPU count where that does not exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def tokenized_in_order(
    tasks: list[list[Piece]], tokenize: Callable[[list[Piece]], T], num_workers: int
) -> Iterator[T]:
    """``tokenize(task)`` of each task, in task order, by ``num_workers`` forked processes (1: in this one); at
    most ``2 · num_workers`` tasks in flight (bounded memory).

    Args:
        tasks: Lists of pieces (``group_tasks``).
        tokenize: What a worker runs on a task (``PieceTokenizer``; the chat cache's encoder); forked workers
            inherit it, so it need not be picklable where ``fork`` exists.
        num_workers: Processes.
    """
    if num_workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield tokenize(task)
        return
    # fork: the workers inherit the loaded tokenizer; spawned ones would each import lightning_2d
    # (torch + Lightning, seconds per process) and need a picklable tokenizer.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    executor = ProcessPoolExecutor(
        min(num_workers, len(tasks)), mp_context=multiprocessing.get_context(method),
        initializer=_init_worker, initargs=(tokenize,),
    )
    try:
        pending: deque[Future] = deque()
        queue = iter(tasks)
        for task in queue:
            pending.append(executor.submit(_run_task, task))
            if len(pending) >= 2 * num_workers:
                break
        while pending:
            results = pending.popleft().result()
            task = next(queue, None)
            if task is not None:
                pending.append(executor.submit(_run_task, task))
            yield results
    finally:
        # On an error or Ctrl-C: drop the queued tasks; the running ones are one piece each.
        executor.shutdown(wait=True, cancel_futures=True)
