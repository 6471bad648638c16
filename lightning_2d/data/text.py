"""Text data: sources → tokens cached on disk → packed windows → data-parallel, resumable batches.

The corpus is tokenized once into a flat token file (``uint16``/``uint32``) under ``cache_dir``,
keyed by the sources (path, size, mtime), the tokenizer, the text field and the piece size, and
memory-mapped afterwards: a multi-GB corpus costs neither RAM nor a second tokenization. The token
stream is cut into windows of ``seq_len + 1`` tokens that overlap by one (the last input token of a
window is the first label of the next), documents separated by the tokenizer's end-of-text token.

Tokenizing is streamed and parallel (``prepare_token_cache``; ``lightning-2d prepare-data`` and
``TextDataModule.prepare`` run it with every local core): files are cut into pieces of about
``CHUNK_BYTES`` (byte ranges ending at a newline for text and JSONL, row groups for Parquet), a
process pool tokenizes them and the parent writes their tokens in corpus order, so the cache is the
same token for token whatever the number of processes. When training starts, a corpus without a
cache is tokenized inline only when it is small (``max_unprepared_mb``); a larger one is refused
with the command that prepares it, instead of tokenizing on one process while every rank waits.

Batches: each data-parallel replica reads a different part of every epoch's permutation and the
ranks of a tensor-parallel group the same batch (the sampler is built from the strategy's
``distributed_sampler_kwargs``, which the 2D strategy derives from the data-parallel sub-mesh).
The training loader is stateful: checkpoints record how many samples of the current epoch were
consumed, and a resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import multiprocessing
import os
import shlex
import signal
import socket
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_2d.data.tokenizers import Tokenizer, load_tokenizer

#: Version of the cache layout and of the way text is cut into pieces (part of the cache key).
CACHE_FORMAT = 2
#: Pieces of work and of text: a text/JSONL file larger than this is read and tokenized as byte
#: ranges of about this size ending at a newline, small files are grouped into tasks of about this
#: size. Part of the cache key: a subword tokenizer may merge differently across a piece boundary.
CHUNK_BYTES = 1 << 20
#: Default of ``TextDataModule(max_unprepared_mb=...)``: larger corpora without a cache are refused
#: when training starts (tokenizing them inline would keep every other rank waiting).
DEFAULT_MAX_UNPREPARED_MB = 8.0
DEFAULT_CACHE_DIR = Path(os.environ.get("LIGHTNING_2D_CACHE", Path.home() / ".cache" / "lightning_2d"))
#: Parquet rows converted to Python strings and tokenized at a time.
PARQUET_BATCH_ROWS = 1024
_BLOCK = 1 << 16  # read size when looking for a piece boundary


class DataError(ValueError):
    """Bad data input: names the file or value and what to do."""


# ---- sources ----------------------------------------------------------------------------------
def stdlib_sources() -> list[Path]:
    """The Python standard library's own ``.py`` files (tens of MB of real text on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return [p for p in sorted(root.rglob("*.py")) if not skip.intersection(p.relative_to(root).parts)]


#: The files a *directory* contributes (a file or glob named explicitly is always taken): text, code,
#: JSONL and Parquet. Hidden files and folders (``.gitattributes``, ``.git/``), ``__pycache__`` and
#: anything else (a dataset card ``README.md``, ``LICENSE``, ``*.json`` metadata, ``*.pyc``) are skipped;
#: name such files or a glob (``"docs/**/*.md"``) to train on them.
FOLDER_SUFFIXES = (".txt", ".text", ".jsonl", ".ndjson", ".parquet", ".py")


def _folder_files(folder: Path) -> list[Path]:
    """The corpus files below ``folder`` (see ``FOLDER_SUFFIXES``), sorted; refuses a folder with none."""
    taken, skipped = [], []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        parts = path.relative_to(folder).parts
        if any(part.startswith(".") or part == "__pycache__" for part in parts) or path.suffix.lower() not in FOLDER_SUFFIXES:
            skipped.append(path)
        else:
            taken.append(path)
    if not taken:
        names = ", ".join(str(p.relative_to(folder)) for p in skipped[:5]) + (", …" if len(skipped) > 5 else "")
        raise DataError(
            f"{folder} holds no corpus files (suffixes {', '.join(FOLDER_SUFFIXES)}; hidden files and __pycache__"
            f" skipped){': it holds ' + names if skipped else ''}. Name the files or a glob (e.g. '{folder}/**/*.csv')"
            " to train on other files."
        )
    return taken


def resolve_sources(paths: Union[str, list[str], None]) -> list[Path]:
    """Expand files, directories (their corpus files, ``FOLDER_SUFFIXES``) and globs (``**`` allowed) into
    a sorted file list."""
    if paths is None:
        return stdlib_sources()
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise DataError("TextDataModule(paths=[]) names no files; give paths or globs, or None for the built-in corpus")
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob(expanded, recursive=True)) if any(c in expanded for c in "*?[") else [expanded]
        found = []
        for match in map(Path, matches):
            if match.is_dir():
                found.extend(_folder_files(match))
            elif match.is_file():
                found.append(match)
        if not found:
            raise DataError(f"No files matched {pattern!r} (relative to {Path.cwd()})")
        files.extend(found)
    return list(dict.fromkeys(p.resolve() for p in files))  # keep order, drop duplicates


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as err:
        raise DataError(f"Cannot read {path}: {err.strerror or err}") from err


def _file_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    return "parquet" if suffix == ".parquet" else "text"


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
        size, kind = _stat(path).st_size, _file_kind(path)
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


def _parquet_row_groups(path: Path, text_field: str) -> int:
    pq = _pyarrow_parquet(path)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise DataError(f"Cannot read {path} as Parquet: {err}") from err
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path} has no column {text_field!r} (columns: {columns}); set text_field")
    return parquet.num_row_groups


def _pyarrow_parquet(path: Path | str) -> Any:
    try:
        import pyarrow.parquet as pq
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


def _piece_boundary(f: BinaryIO, nominal: int, file_size: int, window: Optional[int]) -> int:
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
    """

    def __init__(self, tokenizer: Tokenizer, text_field: str, dtype: np.dtype, chunk_bytes: int) -> None:
        self.tokenizer, self.text_field, self.dtype, self.chunk_bytes = tokenizer, text_field, dtype, chunk_bytes
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        self.eos = np.asarray(eos, dtype=dtype)

    def __call__(self, task: list[Piece]) -> list[PieceTokens]:
        results: list[PieceTokens] = []
        texts: list[str] = []
        owners: list[tuple[int, bool]] = []  # per text: (index in results, whether a document ends with it)
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
            owners.extend((len(results), ends) for _ in docs)
            texts.extend(docs)
            results.append(PieceTokens(self.eos[:0], documents=len(docs) if ends else 0, bytes_read=bytes_read,
                                       blank=blank))
        # One encode_batch call for the whole task: a Hugging Face tokenizer amortizes its call overhead.
        parts: list[list[np.ndarray]] = [[] for _ in results]
        for (owner, ends), ids in zip(owners, self._encode(texts)):
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
                begin = _piece_boundary(f, piece.start, piece.file_size, window)
                end = piece.file_size if piece.last else _piece_boundary(f, piece.stop, piece.file_size, window)
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
        pq = _pyarrow_parquet(piece.path)
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
                arrays += [ids, self.eos]
            documents += len(texts)
        tokens = np.concatenate(arrays).astype(self.dtype, copy=False) if arrays else self.eos[:0]
        return PieceTokens(tokens, documents=documents, bytes_read=bytes_read)


_WORKER: Optional[PieceTokenizer] = None


def _init_worker(tokenize: PieceTokenizer) -> None:
    global _WORKER
    _WORKER = tokenize
    # Ctrl-C reaches the whole process group: the parent stops the pool and removes its partial
    # file; workers that died of KeyboardInterrupt would only add tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One process per core already: a Hugging Face tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run_task(task: list[Piece]) -> list[PieceTokens]:
    assert _WORKER is not None
    return _WORKER(task)


def default_num_workers() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; CPU count where that does not exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def _tokenized_in_order(
    tasks: list[list[Piece]], tokenize: PieceTokenizer, num_workers: int
) -> Iterator[list[PieceTokens]]:
    """Each task's results, in task order; at most ``2 · num_workers`` tasks in flight (bounded memory)."""
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


# ---- the token cache --------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def cache_key(sources: list[Path], tokenizer: Tokenizer, text_field: str, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The cache folder's name: the sources (path, size, mtime), the tokenizer, the text field and the piece size."""
    h = hashlib.sha256(f"v{CACHE_FORMAT}|{tokenizer.fingerprint}|{text_field}|chunk{chunk_bytes}".encode())
    for path in sources:
        stat = _stat(path)
        h.update(f"|{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def cache_folder(
    sources: list[Path], tokenizer: Tokenizer, cache_dir: Union[str, Path], text_field: str = "text",
    chunk_bytes: int = CHUNK_BYTES,
) -> Path:
    """Where the cache of this corpus lives (complete once its ``meta.json`` exists)."""
    return Path(cache_dir).expanduser() / cache_key(sources, tokenizer, text_field, chunk_bytes)


def corpus_bytes(sources: list[Path]) -> int:
    """Total size of the source files."""
    return sum(_stat(p).st_size for p in sources)


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


def _read_meta(folder: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        return None


@contextmanager
def _exclusive(lock_path: Path, on_wait: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``: processes of one machine build a cache one at a time.

    The others wait, then find the cache complete. Where ``flock`` is unavailable (Windows, some
    network file systems) builds may overlap; each writes its own temporary file, so the result is
    still complete and correct, only computed twice.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(f"Waiting for another process that is building {lock_path.parent}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # pragma: no cover - no locks on this file system
            pass
        yield  # closing the file releases the lock, also when this process dies


def _partial_name() -> str:
    return f"tokens.bin.tmp-{socket.gethostname()}-{os.getpid()}"


def _remove_dead_partials(folder: Path) -> None:
    """Delete temporary token files left by killed builds of this machine (not those of live processes)."""
    host = socket.gethostname()
    for path in folder.glob(f"tokens.bin.tmp-{host}-*"):
        try:
            os.kill(int(path.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


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

    Returns:
        A ``CacheReport`` (``built=False`` when the cache already existed).
    """
    if chunk_bytes < 16:
        raise DataError(f"chunk_bytes must be at least 16, got {chunk_bytes}")
    if num_workers < 1:
        raise DataError(f"num_workers must be at least 1, got {num_workers}")
    folder = cache_folder(sources, tokenizer, cache_dir, text_field, chunk_bytes)
    meta = _read_meta(folder)
    if meta is None:
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / ".lock", log or (lambda message: None)):
            meta = _read_meta(folder)  # another process may have finished it while this one waited
            if meta is None:
                return _build(folder, sources, tokenizer, text_field, strict, num_workers, chunk_bytes, progress)
    return CacheReport(folder, False, meta["num_sources"], meta.get("num_bytes", 0), meta["num_tokens"],
                       meta["num_documents"])


def _build(
    folder: Path, sources: list[Path], tokenizer: Tokenizer, text_field: str, strict: bool, num_workers: int,
    chunk_bytes: int, progress: Optional[Callable[[int, int, int], None]],
) -> CacheReport:
    started = time.perf_counter()
    _remove_dead_partials(folder)
    tasks = group_tasks(plan_pieces(sources, text_field, chunk_bytes), chunk_bytes)
    total = corpus_bytes(sources)
    dtype = token_dtype(tokenizer.vocab_size)
    tokenize = PieceTokenizer(tokenizer, text_field, dtype, chunk_bytes)
    partial = folder / _partial_name()
    done = 0
    try:
        with partial.open("wb") as out, closing(_tokenized_in_order(tasks, tokenize, num_workers)) as tokenized:
            writer = _Writer(out, strict, dtype.itemsize)
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
                    f"{len(problems)} problem(s) in the corpus (nothing was cached):\n  - " + "\n  - ".join(problems[:20])
                    + (f"\n  - … and {len(problems) - 20} more" if len(problems) > 20 else "")
                )
            n_tokens = writer.tokens
            out.flush()
            os.fsync(out.fileno())  # the data is on disk before meta.json can say it is complete
        os.replace(partial, folder / "tokens.bin")
    finally:
        partial.unlink(missing_ok=True)
    meta = {
        "format": CACHE_FORMAT,
        "num_tokens": n_tokens,
        "num_documents": writer.documents,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.fingerprint,
        "text_field": text_field,
        "chunk_bytes": chunk_bytes,
        "num_bytes": total,
        "sources": [str(p) for p in sources[:1000]],
        "num_sources": len(sources),
    }
    partial_meta = folder / f"meta.json.tmp-{socket.gethostname()}-{os.getpid()}"
    with partial_meta.open("w") as f:
        f.write(json.dumps(meta, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial_meta, folder / "meta.json")
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
) -> Path:
    """``prepare_token_cache`` returning only the cache folder (see there for the arguments)."""
    return prepare_token_cache(sources, tokenizer, cache_dir, text_field, strict, num_workers, chunk_bytes).folder


class TokenWindows(Dataset):
    """Windows ``[i·seq_len, i·seq_len + seq_len + 1)`` of a token file, as ``{"input_ids", "labels"}``.

    The memory map is opened lazily in each process (DataLoader workers included).
    """

    def __init__(self, folder: Path, seq_len: int, first: int, count: int) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.path, self.dtype = folder / "tokens.bin", np.dtype(meta["dtype"])
        self.seq_len, self.first, self.count = seq_len, first, count
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = (self.first + index) * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


# ---- sampling ---------------------------------------------------------------------------------
class DataParallelSampler(DistributedSampler):
    """Every epoch one seeded permutation of all samples; replica ``r`` takes positions ``r, r+R, …``.

    Step ``i``'s batches of all replicas together are positions ``[i·B·R, (i+1)·B·R)`` of the
    permutation, whatever ``R``: the global batch sequence is the same for every data-parallel
    size with the same global batch. A ``DistributedSampler``, so Lightning keeps it (and calls
    ``set_epoch``). ``resume(epoch, consumed)`` skips the first ``consumed`` positions once, when
    that epoch is iterated.
    """

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.num_positions = num_samples - num_samples % num_replicas
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, consumed: int) -> None:
        self._resume = (epoch, consumed)

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self.epoch:
            return min(self._resume[1], self.num_positions)
        return 0

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        self._resume = None
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(n)
        return iter(order[start + self.rank : self.num_positions : self.num_replicas].tolist())

    def __len__(self) -> int:
        # The whole epoch, also when resuming inside it: Lightning sizes the epoch once from this
        # and counts the batches already done (restored from the checkpoint) against it.
        return self.num_positions // self.num_replicas


class ResumableDataLoader(DataLoader):
    """A DataLoader whose ``state_dict`` records the samples of the current epoch consumed so far.

    Lightning saves it in checkpoints and restores it before iterating (its stateful data-loader
    support).

    Args:
        consumed_batches: How many batches of this epoch were trained on. Lightning fetches a batch
            ahead, so counting yielded batches would skip one on resume.
        epoch: The epoch being iterated, read when an iteration starts. Lightning's own
            ``set_epoch`` value runs one ahead after resuming from a checkpoint saved at an epoch's
            end (it passes the number of *processed* epochs), which would skip a permutation; the
            number of *completed* epochs (``trainer.current_epoch``) is right in every case.
    """

    def __init__(
        self,
        *args: Any,
        consumed_batches: Optional[Callable[[], int]] = None,
        epoch: Optional[Callable[[], int]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, DataParallelSampler):
            raise TypeError("ResumableDataLoader needs a DataParallelSampler")
        self._consumed_batches = consumed_batches
        self._epoch = epoch
        self._yielded = 0
        self._offset = 0  # positions skipped by a resume in the epoch being iterated

    def __iter__(self) -> Iterator[Any]:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        if self._epoch is not None:
            sampler.set_epoch(self._epoch())
        self._offset, self._yielded = sampler._start(), 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        global_batch = self.batch_size * sampler.num_replicas
        if self._consumed_batches is not None:
            consumed = self._consumed_batches() * global_batch
        else:
            consumed = self._offset + self._yielded * global_batch
        return {"epoch": sampler.epoch, "consumed_samples": consumed, "seed": sampler.seed, "shuffle": sampler.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        sampler.set_epoch(int(state["epoch"]))  # a Fabric loop continues from the sampler's epoch
        sampler.resume(int(state["epoch"]), int(state["consumed_samples"]))


# ---- the data module --------------------------------------------------------------------------
class TextDataModule(L.LightningDataModule):
    """Real text for ``LlamaLightningModule``: tokenized once, cached, packed, data-parallel and resumable.

    Args:
        paths: Text files, directories and globs; ``.jsonl``/``.ndjson`` and ``.parquet`` files are
            read record by record from ``text_field``. A directory contributes its ``.txt``, ``.text``,
            ``.jsonl``, ``.ndjson``, ``.parquet`` and ``.py`` files, not hidden ones, ``__pycache__`` or
            metadata such as a dataset card ``README.md`` (``FOLDER_SUFFIXES``); name other files or a glob. ``None``: the Python standard library's
            source files (no download).
        tokenizer: ``"byte"`` (UTF-8 bytes, vocabulary 256), a Hugging Face ``tokenizer.json``, or a
            SentencePiece ``.model``.
        eos_token: End-of-text token of a Hugging Face tokenizer, when it is not a common one.
        text_field: Field/column holding the text in JSONL/Parquet files.
        seq_len: Tokens per training sequence.
        batch_size: Sequences per batch on each data-parallel replica.
        val_fraction: Fraction of the windows held out (from the end of the corpus) for validation
            (also used by ``test`` and ``predict``); ``0`` for none.
        shuffle: Shuffle training windows (a new seeded permutation every epoch).
        seed: Seed of the permutations.
        num_workers: DataLoader worker processes.
        cache_dir: Where the token cache lives (default ``$LIGHTNING_2D_CACHE`` or
            ``~/.cache/lightning_2d``).
        max_unprepared_mb: Largest corpus (in MB, 10^6 bytes of source files) tokenized when
            training starts if it has no cache: on one process per node while the other ranks wait.
            A larger corpus without a cache raises ``DataError`` before anything is tokenized, with
            the command that prepares it with every local core (``lightning-2d prepare-data``, or
            ``prepare()``). ``None``: no limit.
    """

    def __init__(
        self,
        paths: Union[str, list[str], None] = None,
        tokenizer: str = "byte",
        eos_token: Optional[str] = None,
        text_field: str = "text",
        seq_len: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.005,
        shuffle: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
        max_unprepared_mb: Optional[float] = DEFAULT_MAX_UNPREPARED_MB,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        problems = []
        if seq_len < 1:
            problems.append(f"seq_len must be a positive integer, got {seq_len}")
        if batch_size < 1:
            problems.append(f"batch_size must be a positive integer, got {batch_size}")
        if not 0 <= val_fraction < 1:
            problems.append(f"val_fraction must be in [0, 1), got {val_fraction}")
        if max_unprepared_mb is not None and not max_unprepared_mb >= 0:
            problems.append(f"max_unprepared_mb must be >= 0 or None (no limit), got {max_unprepared_mb}")
        if problems:
            raise DataError("Invalid TextDataModule arguments:\n  - " + "\n  - ".join(problems))
        self.paths, self.text_field = paths, text_field
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
        self.max_unprepared_mb = max_unprepared_mb
        self.tokenizer = load_tokenizer(tokenizer, eos_token)  # fails here, before any process starts
        self._sources: list[Path] | None = None
        self._folder: Path | None = None
        self._data_parallel: tuple[int, int] | None = None
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: TokenWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def sources(self) -> list[Path]:
        if self._sources is None:
            self._sources = resolve_sources(self.paths)
        return self._sources

    def check_model(self, model_vocab_size: int) -> None:
        """Refuse a model whose embedding cannot hold every token id."""
        if model_vocab_size < self.vocab_size:
            raise DataError(
                f"The model's vocab_size ({model_vocab_size}) is smaller than the tokenizer's ({self.vocab_size});"
                f" set the model's vocab_size to at least {self.vocab_size} (e.g. model_overrides:"
                f" {{vocab_size: {self.vocab_size}}}) or use the tokenizer the model was made for"
            )

    # ---- the token cache ----
    def prepare(
        self,
        num_workers: Optional[int] = None,
        progress: Optional[Callable[[int, int, int], None]] = None,
        log: Optional[Callable[[str], None]] = None,
    ) -> CacheReport:
        """Build the token cache with a pool of processes, whatever the corpus size (a no-op once it exists).

        What ``lightning-2d prepare-data`` runs. Call it before training; processes of one machine
        that call it together take turns on a file lock (no collective, so no timeout): the first
        tokenizes, the others then find its cache.

        Args:
            num_workers: Tokenizing processes (default: every core this process may use).
            progress: Called after each task with (bytes done, bytes in all, tokens so far).
            log: Called with a line of text for events worth telling (waiting for another builder).

        Returns:
            The ``CacheReport`` (files, bytes, tokens, seconds; ``built=False`` if it already existed).
        """
        workers = default_num_workers() if num_workers is None else num_workers
        return prepare_token_cache(self.sources, self.tokenizer, self.cache_dir, self.text_field,
                                   strict=self.paths is not None, num_workers=workers, progress=progress, log=log)

    @property
    def cache_folder(self) -> Path:
        """This corpus's cache folder (complete once ``meta.json`` exists in it)."""
        return cache_folder(self.sources, self.tokenizer, self.cache_dir, self.text_field)

    def check_prepared(self) -> bool:
        """Whether the cache is complete; raise ``DataError`` when it is not and training may not build it.

        Training builds a missing cache itself (one process per node, the other ranks waiting)
        only for a corpus of at most ``max_unprepared_mb``. Every rank can call this before a
        barrier: all of them fail with the same message instead of some waiting for the others.
        """
        if (self.cache_folder / "meta.json").is_file():
            return True
        if self.max_unprepared_mb is not None:
            size = corpus_bytes(self.sources)
            if size > self.max_unprepared_mb * 1e6:
                raise DataError(self._unprepared_message(size))
        return False

    def _unprepared_message(self, size: int) -> str:
        mb = size / 1e6
        return (
            f"The corpus ({len(self.sources):,} files, {mb:,.1f} MB) has no token cache in {self.cache_dir} and is"
            f" larger than max_unprepared_mb ({self.max_unprepared_mb:g} MB): it is not tokenized here, on one process while"
            f" every other rank waits. Tokenize it first with every local core, then start training again:\n"
            f"    {prepare_command(self)}\n"
            f"or in Python:\n"
            f"    {prepare_python(self)}\n"
            f"(To tokenize at start-up anyway, raise max_unprepared_mb above {mb:,.1f} or set it to null.)"
        )

    def _ensure_cache(self) -> Path:
        if not self.check_prepared():
            # A small corpus: tokenized here, in this process, as before prepare-data existed.
            return prepare_token_cache(self.sources, self.tokenizer, self.cache_dir, self.text_field,
                                       strict=self.paths is not None).folder
        return self.cache_folder

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node, then makes the others wait (in a barrier
        # without timeout): only a small corpus may be tokenized here (``check_prepared``).
        self._ensure_cache()

    def setup(self, stage: str | None = None) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        vocab_size = getattr(module, "vocab_size", None)  # the LM modules of lightning_2d (CausalLMModule)
        if isinstance(vocab_size, int):
            self.check_model(vocab_size)
        if self.train_dataset is not None:
            return
        self._folder = self._ensure_cache()
        meta = json.loads((self._folder / "meta.json").read_text())
        expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        if (self._folder / "tokens.bin").stat().st_size != expected:
            raise DataError(
                f"The token cache {self._folder} is damaged (tokens.bin is not {expected} bytes); delete that folder"
                f" and prepare the corpus again"
            )
        windows = (meta["num_tokens"] - 1) // self.seq_len
        if windows < 1:
            raise DataError(
                f"The corpus has {meta['num_tokens']} tokens, fewer than one sequence needs ({self.seq_len + 1});"
                f" add text or lower seq_len"
            )
        n_val = max(1, round(windows * self.val_fraction)) if self.val_fraction > 0 else 0
        if windows - n_val < 1:
            raise DataError(
                f"The corpus gives {windows} sequence(s) of {self.seq_len} tokens, too few for a training split and a"
                f" validation split; add text, lower seq_len or set val_fraction=0"
            )
        self.train_dataset = TokenWindows(self._folder, self.seq_len, 0, windows - n_val)
        self.val_dataset = TokenWindows(self._folder, self.seq_len, windows - n_val, n_val) if n_val else None

    def set_data_parallel(self, num_replicas: int, rank: int) -> None:
        """Outside a Trainer (Fabric): this process's data-parallel replica, e.g.
        ``data.set_data_parallel(**fabric.strategy.distributed_sampler_kwargs)``."""
        self._data_parallel = (int(num_replicas), int(rank))

    def _replicas(self) -> tuple[int, int]:
        if self._data_parallel is not None:
            return self._data_parallel
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _loader(self, dataset: TokenWindows, shuffle: bool) -> DataLoader:
        replicas, rank = self._replicas()
        if len(dataset) < replicas * self.batch_size:
            split = "training" if dataset is self.train_dataset else "validation"
            raise DataError(
                f"The {split} split has {len(dataset)} sequence(s), fewer than one global batch"
                f" ({replicas} data-parallel replica(s) × batch_size {self.batch_size}); add text, lower seq_len or"
                f" batch_size{', or raise val_fraction' if split == 'validation' else ''}"
            )
        sampler = DataParallelSampler(len(dataset), replicas, rank, shuffle=shuffle, seed=self.seed)
        kwargs = dict(
            batch_size=self.batch_size,
            sampler=sampler,
            # Its own generator: creating an iterator would otherwise draw from the global RNG and
            # shift the model's random stream (dropout) between a run and its resumption.
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        if dataset is not self.train_dataset:  # only training needs to resume mid-epoch
            return DataLoader(dataset, **kwargs)
        consumed = epoch = None
        if self.trainer is not None:
            trainer = self.trainer
            # Batches of this epoch whose training step ran, and completed epochs: both restored from
            # the checkpoint on resume.
            consumed = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed  # noqa: E731
            epoch = lambda: trainer.current_epoch  # noqa: E731
        return ResumableDataLoader(dataset, consumed_batches=consumed, epoch=epoch, **kwargs)

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "setup() first"
        return self._loader(self.train_dataset, self.shuffle)

    def _eval_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            raise DataError("val_fraction=0 leaves no held-out split; set val_fraction > 0 to validate or test")
        return self._loader(self.val_dataset, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader() if self.val_dataset is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_dataloader()


# ---- the commands that prepare a data module's cache (for messages) ---------------------------
#: The data module's arguments that decide its cache (the others do not change the tokens).
_CACHE_ARGS = ("paths", "tokenizer", "eos_token", "text_field", "cache_dir")
_TRAINER_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _non_default_cache_args(data: TextDataModule) -> dict[str, Any]:
    defaults = inspect.signature(TextDataModule.__init__).parameters
    hparams = dict(data.hparams)
    return {k: hparams[k] for k in _CACHE_ARGS if k in hparams and hparams[k] != defaults[k].default}


def prepare_command(data: TextDataModule, argv: Optional[list[str]] = None) -> str:
    """The shell command that builds ``data``'s cache.

    Started from ``lightning-2d fit|validate|test|predict ...`` (``argv``, default ``sys.argv``):
    the same ``--config`` files and ``--data*`` options after ``lightning-2d prepare-data``.
    Otherwise the data module's own arguments as ``--data.*`` options.
    """
    argv = sys.argv if argv is None else argv
    if len(argv) > 1 and argv[1] in _TRAINER_SUBCOMMANDS:
        program = "python -m lightning_2d" if argv[0].endswith("__main__.py") else "lightning-2d"
        kept, rest, i = [], argv[2:], 0
        while i < len(rest):
            option = rest[i]
            takes_value = "=" not in option and i + 1 < len(rest) and not rest[i + 1].startswith("--")
            name = option.split("=", 1)[0]
            if name in ("-c", "--config", "--data") or name.startswith("--data."):
                kept += rest[i : i + 1 + takes_value]
            i += 1 + takes_value
        return " ".join([program, "prepare-data", *map(shlex.quote, kept)])
    options = []
    for key, value in _non_default_cache_args(data).items():
        text = value if isinstance(value, str) else json.dumps(value)
        options.append(shlex.quote(f"--data.{key}={text}"))
    return " ".join(["lightning-2d", "prepare-data", *options])


def prepare_python(data: TextDataModule) -> str:
    """The Python statement that builds ``data``'s cache."""
    args = ", ".join(f"{k}={v!r}" for k, v in _non_default_cache_args(data).items())
    return f"TextDataModule({args}).prepare()  # from lightning_2d import TextDataModule"
