"""Chat data tokenized once: rows read from JSONL, JSON, Parquet or a ``datasets`` folder, encoded by a process
pool, cached on disk.

The cache of a data set is a folder keyed by its files (path, size, mtime), the tokenizer, the template (its
text and special tokens), the template arguments, the format and the masking rule; it is built as the token cache
is (``cache_folders``: one process of a machine at a time, partial files synced and renamed, and ``meta.json``,
written last, marks it complete). It holds every kept conversation's tokens (``tokens.bin``), which of them are trained
(``trained.bin``, one byte each), where each conversation starts (``offsets.bin``, int64), the row it came
from (``rows.bin``: file index and row number, for messages), its trained tokens (``targets.bin``) and its label
(``labels.bin``, a byte: an unpaired preference example's, 1 when desirable; 0 for every other conversation). It does
not depend on ``seq_len``: packing happens when training starts, in a fraction of a second.

Rows are read in pieces (JSONL by byte ranges ending at a newline, Parquet by row groups, a JSON list or a
``datasets`` Arrow file whole) by the same pool as ``TextDataModule``'s corpus (``pieces.tokenized_in_order``):
the cache is the same for any number of processes. Every bad row is reported at once (``file:line`` and the fix,
the first 20), and nothing is cached then.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np

from lightning_2d.data.cache_folders import (
    DEFAULT_CACHE_DIR,
    build_once,
    folder_key,
    partial_files,
    token_dtype,
    write_meta,
)
from lightning_2d.data.chat.encode import ChatEncoder, EncodedChat
from lightning_2d.data.chat.formats import to_conversation
from lightning_2d.data.pieces import CHUNK_BYTES, Piece, piece_boundary, pyarrow_parquet, tokenized_in_order
from lightning_2d.data.sources import DataError, expand_patterns, stat_source

#: Version of the chat cache's layout (part of its key).
CHAT_CACHE_FORMAT = 1
#: The files a folder contributes (a ``datasets`` folder: its Arrow files).
CHAT_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
MAX_PROBLEMS = 20
#: The files of a chat cache besides ``meta.json``.
CHAT_FILES = ("tokens.bin", "trained.bin", "offsets.bin", "rows.bin", "targets.bin", "labels.bin")

__all__ = ["CHAT_FILES", "ChatCacheReport", "ChatPieceEncoder", "PieceResult", "chat_cache_folder",
           "plan_chat_pieces", "prepare_chat_cache", "read_rows", "resolve_chat_sources", "row_location"]


# ---- sources ------------------------------------------------------------------------------------
def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".json", ".parquet", ".arrow"):
        return suffix[1:]
    raise DataError(f"{path}: a chat data file is JSONL, JSON, Parquet or a datasets folder's .arrow, not"
                    f" {suffix or 'a file without suffix'!r}")


def _datasets_folder(folder: Path) -> Optional[list[Path]]:
    """The Arrow files of a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict``'s
    ``train`` split), or ``None`` for another folder."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{folder} is a datasets DatasetDict with splits {splits} and no 'train'; name the split's"
                            f" folder (e.g. {folder / splits[0]}) in paths" if splits else f"{folder} has no splits")
        folder = folder / "train"
    state = folder / "state.json"
    if not state.is_file():
        return None
    files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    return [folder / name for name in files]


def _chat_folder_files(folder: Path) -> list[Path]:
    """A ``datasets`` folder's Arrow files, else the folder's JSONL/JSON/Parquet files (not hidden ones)."""
    arrow = _datasets_folder(folder)
    if arrow is not None:
        return arrow
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix.lower() in CHAT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def resolve_chat_sources(paths: Union[str, list[str]]) -> list[Path]:
    """Files, folders (their JSONL/JSON/Parquet files, or a ``datasets`` folder's Arrow files) and globs, in order."""
    patterns = [paths] if isinstance(paths, str) else list(paths or [])
    if not patterns:
        raise DataError("ChatDataModule(paths=...) names no files; give JSONL/JSON/Parquet files, folders or globs")
    files = expand_patterns(
        patterns, _chat_folder_files,
        lambda pattern: f"No chat data files matched {pattern!r} (relative to {Path.cwd()}); give JSONL, JSON or"
                        " Parquet files, a folder of them, or a datasets save_to_disk folder")
    for path in files:
        _kind(path)
    return files


def plan_chat_pieces(sources: list[Path], chunk_bytes: int) -> list[Piece]:
    """The files cut into pieces read on their own: JSONL by byte ranges of ``chunk_bytes`` (each ending at a
    newline), Parquet by row groups, a JSON list or a ``datasets`` Arrow file whole."""
    pieces = []
    for index, path in enumerate(sources):
        size, kind = stat_source(path).st_size, _kind(path)
        if kind == "jsonl":
            for start in range(0, max(size, 1), chunk_bytes):
                stop = min(start + chunk_bytes, size)
                pieces.append(Piece(index, str(path), kind, start, stop, size, stop >= size, stop - start))
        elif kind == "parquet":
            pq = pyarrow_parquet(path)
            try:
                groups = pq.ParquetFile(path).num_row_groups
            except Exception as err:
                raise DataError(f"Cannot read {path} as Parquet: {err}") from None
            pieces += [Piece(index, str(path), kind, g, g + 1, size, g == groups - 1, size // max(groups, 1))
                       for g in range(groups)]
        else:
            pieces.append(Piece(index, str(path), kind, 0, size, size, True, size))
    return pieces


def _tasks(pieces: list[Piece], chunk_bytes: int) -> list[list[Piece]]:
    tasks: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        if not tasks or size + piece.nbytes > chunk_bytes:
            tasks.append([])
            size = 0
        tasks[-1].append(piece)
        size += piece.nbytes
    return tasks


# ---- reading and encoding rows (in the worker processes) -----------------------------------------
def read_rows(piece: Piece) -> Iterator[tuple[int, Any, Optional[str]]]:
    """``(row number, record, error)`` of a piece: a JSONL line number (from 1), else the row index (from 0)."""
    if piece.kind == "jsonl":
        with open(piece.path, "rb") as f:
            begin = piece_boundary(f, piece.start, piece.file_size, None)
            end = piece.file_size if piece.last else piece_boundary(f, piece.stop, piece.file_size, None)
            f.seek(0)
            before = f.read(begin).count(b"\n") if begin else 0
            f.seek(begin)
            data = f.read(max(0, end - begin))
        for i, line in enumerate(data.split(b"\n")):
            if line.strip():
                try:
                    yield before + i + 1, json.loads(line), None
                except (ValueError, UnicodeDecodeError) as err:
                    yield before + i + 1, None, f"is not valid JSON ({getattr(err, 'msg', err)})"
    elif piece.kind == "json":
        try:
            records = json.loads(Path(piece.path).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            yield 0, None, f"is not valid JSON ({getattr(err, 'msg', err)})"
            return
        if not isinstance(records, list):
            yield 0, None, "is a JSON object, not a list of rows (write JSONL, one row per line, or a list)"
            return
        yield from ((i, r, None) for i, r in enumerate(records))
    elif piece.kind == "parquet":
        pq = pyarrow_parquet(piece.path)
        table = pq.ParquetFile(piece.path).read_row_group(piece.start)
        offset = sum(pq.ParquetFile(piece.path).metadata.row_group(g).num_rows for g in range(piece.start))
        yield from ((offset + i, r, None) for i, r in enumerate(table.to_pylist()))
    else:  # a datasets Arrow file: an IPC stream
        import pyarrow as pa  # the `parquet` extra: optional, imported for Arrow files only

        with pa.memory_map(piece.path) as source:
            table = pa.ipc.open_stream(source).read_all()
        yield from ((i, r, None) for i, r in enumerate(table.to_pylist()))


def row_location(piece: Piece, row: int) -> str:
    """How messages name a row: ``file:line`` in JSONL, else ``file row N``."""
    return f"{piece.path}:{row}" if piece.kind == "jsonl" else f"{piece.path} row {row}"


@dataclass
class PieceResult:
    """What a piece's rows gave: the kept conversations (tokens, trained mask, row and label each), the rows read, the
    rows dropped without a trained token, the end-of-turn ids, the bad rows' messages, and ``counts`` of whatever else
    a piece encoder counts (summed into the cache's ``meta.json``)."""

    ids: list[np.ndarray] = field(default_factory=list)
    trained: list[np.ndarray] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    rows_read: int = 0
    no_target: int = 0
    end_of_turn: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def add(self, encoded: EncodedChat, row: int, label: int = 0) -> None:
        """Keep one conversation (the cache's next), with its ``label`` (``labels.bin``)."""
        self.ids.append(encoded.ids)
        self.trained.append(encoded.trained)
        self.rows.append(row)
        self.labels.append(label)
        self.end_of_turn |= encoded.end_of_turn


class ChatPieceEncoder:
    """Reads and encodes a task (a list of pieces); one lives in each worker process.

    A data set of other rows subclasses it and overrides ``add_row`` (one row into the piece's result) and
    ``nothing_kept`` (the message when no row gave anything to train on), as ``PreferencePieceEncoder`` does.
    """

    #: How messages name the data.
    data_name = "chat data"

    def __init__(self, encoder: ChatEncoder, format: str, fields: Optional[Mapping[str, str]]) -> None:
        self.encoder, self.format, self.fields = encoder, format, dict(fields or {})

    def __call__(self, task: list[Piece]) -> list[PieceResult]:
        return [self._piece(piece) for piece in task]

    def add_row(self, record: Any, where: str, row: int, out: PieceResult) -> None:
        """Encode one row into ``out``: a conversation with a trained token, or ``no_target`` counted.

        Raises:
            DataError: A bad row (the message names ``where`` and the fix).
        """
        encoded = self.encoder.encode(to_conversation(record, self.format, self.fields, where), where)
        if encoded.num_targets == 0:
            out.no_target += 1
            return
        out.add(encoded, row)

    def nothing_kept(self, rows: int, no_target: int) -> str:
        """The message of a data set none of whose rows gave a conversation to train on."""
        return (f"No conversation of the chat data ({rows} row(s)) has a token to train on ({no_target} without"
                f" one): check train_on ({self.encoder.train_on!r}) and the roles")

    def _piece(self, piece: Piece) -> PieceResult:
        out = PieceResult()
        try:
            rows = list(read_rows(piece))
        except (OSError, Exception) as err:  # noqa: BLE001 - a file that cannot be read is the row's problem
            out.problems.append(f"Cannot read {piece.path}: {err}")
            return out
        for row, record, error in rows:
            where = row_location(piece, row)
            out.rows_read += 1
            if error is not None:
                out.problems.append(f"{where} {error}")
                continue
            try:
                self.add_row(record, where, row, out)
            except DataError as err:
                out.problems.append(str(err))
                if len(out.problems) >= MAX_PROBLEMS:
                    break
        return out


# ---- the cache ----------------------------------------------------------------------------------
@dataclass
class ChatCacheReport:
    """What ``prepare_chat_cache`` found or built.

    Args:
        folder: The cache folder.
        built: ``False`` when it was already complete.
        files: Source files.
        rows: Rows read.
        conversations: Conversations kept.
        no_target: Rows dropped because no token of theirs is trained.
        tokens: Tokens of the kept conversations.
        targets: Trained tokens among them.
        end_of_turn: The end-of-turn token ids found.
        seconds: Time spent building.
        counts: What else the piece encoder counted (a preference cache's pairs and truncations).
    """

    folder: Path
    built: bool
    files: int
    rows: int
    conversations: int
    no_target: int
    tokens: int
    targets: int
    end_of_turn: list[int]
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


def chat_cache_key(sources: list[Path], tokenizer: Any, settings: Mapping[str, Any]) -> str:
    """The cache folder's name: the files (path, size, mtime), the tokenizer and the settings (template digest,
    template arguments, format, masking rule)."""
    payload = json.dumps({"v": CHAT_CACHE_FORMAT, "tokenizer": tokenizer.fingerprint, **settings},
                         sort_keys=True, default=str)
    return "chat-" + folder_key(payload, sources)


def chat_cache_folder(sources: list[Path], tokenizer: Any, settings: Mapping[str, Any],
                      cache_dir: Union[str, Path, None] = None) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / chat_cache_key(sources, tokenizer, settings)


def _report(folder: Path, meta: Mapping[str, Any], built: bool, seconds: float = 0.0) -> ChatCacheReport:
    return ChatCacheReport(folder, built, meta["num_sources"], meta["rows"], meta["conversations"], meta["no_target"],
                           meta["tokens"], meta["targets"], list(meta["end_of_turn"]), seconds,
                           dict(meta.get("counts", {})))


def prepare_chat_cache(
    sources: list[Path],
    encoder: ChatEncoder,
    settings: Mapping[str, Any],
    cache_dir: Union[str, Path, None] = None,
    format: str = "auto",
    fields: Optional[Mapping[str, str]] = None,
    num_workers: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Optional[Callable[[int, int, int], None]] = None,
    log: Optional[Callable[[str], None]] = None,
    piece_encoder: Optional[ChatPieceEncoder] = None,
) -> ChatCacheReport:
    """Encode ``sources`` into their chat cache unless it is complete (see the module docstring).

    Args:
        sources: The files (``resolve_chat_sources``).
        encoder: The tokenizer, template and masking rule.
        settings: What else decides the tokens (part of the key, recorded in ``meta.json``).
        cache_dir: Folder of the caches.
        format: Row format (``formats.FORMATS``).
        fields: Renamed fields.
        num_workers: Encoding processes (1: this one).
        chunk_bytes: Size of a JSONL piece / a task.
        progress: Called after each task with (bytes done, bytes in all, conversations so far).
        log: Called with a line for events worth telling (waiting for another builder).
        piece_encoder: What turns each piece's rows into conversations (default ``ChatPieceEncoder(encoder, format,
            fields)``: one conversation a row); a ``PreferencePieceEncoder`` writes two a row.

    Raises:
        DataError: Bad rows (each one named, the first 20); nothing is cached.
    """
    folder = chat_cache_folder(sources, encoder.tokenizer, settings, cache_dir)
    rows_encoder = piece_encoder if piece_encoder is not None else ChatPieceEncoder(encoder, format, fields)
    return build_once(
        folder,
        lambda: _build(folder, sources, encoder, settings, rows_encoder, num_workers, chunk_bytes, progress),
        lambda meta: _report(folder, meta, built=False),
        log,
    )


def _build(folder: Path, sources: list[Path], encoder: ChatEncoder, settings: Mapping[str, Any],
           piece_encoder: ChatPieceEncoder, num_workers: int, chunk_bytes: int,
           progress: Optional[Callable[[int, int, int], None]]) -> ChatCacheReport:
    started = time.perf_counter()
    pieces = plan_chat_pieces(sources, chunk_bytes)
    tasks = _tasks(pieces, chunk_bytes)
    total = sum(p.nbytes for p in pieces)
    dtype = token_dtype(encoder.tokenizer.vocab_size)
    problems: list[str] = []
    rows = no_target = conversations = tokens = targets = done = 0
    end_of_turn: set[int] = set()
    counts: Counter = Counter()
    with partial_files(folder, CHAT_FILES) as files, \
            closing(tokenized_in_order(tasks, piece_encoder, num_workers)) as results:
        f_ids, f_trained, f_offsets, f_rows, f_targets, f_labels = (files[name] for name in CHAT_FILES)
        np.zeros(1, dtype=np.int64).tofile(f_offsets)
        for task, task_results in zip(tasks, results):
            for piece, result in zip(task, task_results):
                problems += result.problems
                rows += result.rows_read
                no_target += result.no_target
                end_of_turn |= result.end_of_turn
                counts.update(result.counts)
                if problems:
                    continue  # keep reading: every bad row is reported at once
                for ids, trained, row, label in zip(result.ids, result.trained, result.rows, result.labels,
                                                    strict=True):
                    ids.astype(dtype).tofile(f_ids)
                    trained.astype(np.uint8).tofile(f_trained)
                    tokens += len(ids)
                    count = int(trained[1:].sum())
                    targets += count
                    np.asarray([count], dtype=np.int64).tofile(f_targets)
                    np.asarray([tokens], dtype=np.int64).tofile(f_offsets)
                    np.asarray([piece.file, row], dtype=np.int64).tofile(f_rows)
                    np.asarray([label], dtype=np.uint8).tofile(f_labels)
                    conversations += 1
            done += sum(p.nbytes for p in task)
            if progress is not None:
                progress(min(done, total), total, conversations)
        if problems:
            shown = problems[:MAX_PROBLEMS]
            raise DataError(f"{len(problems)} bad row(s) in the {piece_encoder.data_name} (nothing was cached):\n  - "
                            + "\n  - ".join(shown) + ("\n  - …" if len(problems) > len(shown) else ""))
        if conversations == 0:
            raise DataError(piece_encoder.nothing_kept(rows, no_target))
    meta = {
        "format": CHAT_CACHE_FORMAT, "dtype": dtype.name, "vocab_size": encoder.tokenizer.vocab_size,
        "tokenizer": encoder.tokenizer.fingerprint, "settings": dict(settings), "rows": rows,
        "conversations": conversations, "no_target": no_target, "tokens": tokens, "targets": targets,
        "end_of_turn": sorted(end_of_turn), "sources": [str(p) for p in sources[:1000]],
        "num_sources": len(sources), "counts": dict(sorted(counts.items())),
    }
    write_meta(folder, meta)
    return _report(folder, meta, built=True, seconds=time.perf_counter() - started)
