"""Digests of every item a checkpoint stores, computed while it is written and checked before it is loaded.

Truncation and missing files show in sizes (``integrity.damage``); a changed byte does not: a flipped exponent bit
in a weight loads, trains and may never go non-finite. So each item a save writes gets an ``xxh3_64`` digest
(``HASH``; measured against ``hashlib.blake2b`` and ``zlib.crc32`` in CONTRIBUTING: several times faster, and it
releases the GIL, so a background save does not stall the training thread):

* sharded (DCP) checkpoints: ``DigestingWriter``, a ``FileSystemWriter`` whose file system hands out streams
  that hash what DCP writes into each ``.distcp`` file, item by item (each tensor chunk's ``torch.save`` bytes,
  each bytes-io item), in the thread that writes (also under ``dcp.async_save``). The coordinator's ``finish``
  writes the digests of every rank as one manifest, ``digests.json``, before DCP's ``.metadata`` (and so
  before ``meta.pt``, the completeness mark): a complete checkpoint of this version always has its manifest.
  Each rank's whole files (``meta.pt`` on the coordinator, ``rng/rank{r}.pt``) are hashed from their bytes before
  they are written and ride to the coordinator in DCP's local plans; DCP's ``.metadata`` is hashed as DCP writes it.
  The manifest lists them under ``whole`` (a whole file's size must match too) and carries a digest of itself, so a
  damaged manifest is told from a damaged checkpoint. It is written after ``.metadata`` and before ``meta.pt``.
* full files: ``tensor_digests`` of every tensor of the checkpoint dict, stored in it (``lightning_2d.digests``)
  by the writer before ``torch.save``; the pickle itself is covered by the zip's CRC-32, which torch writes.

Checking re-reads the stored bytes of the items asked for (``check_items``), never deserializing them; a
mismatch is an ``Item`` with what was found (``Item.problem``: the one line every check reports). Policy (who
checks what, what a process remembers, the error) lives in ``integrity``; the fall-back in ``resolution``.
"""

from __future__ import annotations

import functools
import io
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

#: The hash of every digest we write; a manifest names its own, so another can be added later.
HASH = "xxh3_64"
#: The manifest of a sharded checkpoint, beside DCP's ``.metadata``.
MANIFEST_FILE = "digests.json"
MANIFEST_FORMAT = "lightning_2d.digests/2"  # /1 (before whole files and the manifest's own digest) is still read
#: Where a full file keeps its digests (inside its ``lightning_2d`` entry).
FULL_FILE_KEY = "digests"
_READ_BLOCK = 16 * 1024 * 1024  # re-reading: one block in memory at a time


def _hasher(name: str) -> Callable[[], Any]:
    if name == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64
    raise ValueError(f"unknown digest {name!r} (this version knows {HASH!r}); load it with a newer lightning_2d")


def digest_of(data: Any, name: str = HASH) -> str:
    """The hex digest of a bytes-like object."""
    return _hasher(name)(data).hexdigest()


# ---- sharded checkpoints: hashing in DCP's writer ----------------------------------------------------------------
class _HashingStream(io.RawIOBase):
    """A ``.distcp`` file as DCP writes it, hashing each item's bytes on the way.

    DCP's writer asks ``tell()`` before and after each item (its offset and length in the file): each ``tell``
    closes the running segment. ``DigestingWriter`` matches segments to DCP's ``(offset, length)`` afterwards and
    re-reads any item that matches none, so a DCP that writes otherwise costs time, never a wrong digest.
    """

    def __init__(self, raw: Any, hasher: Callable[[], Any]) -> None:
        super().__init__()
        self.raw, self._new = raw, hasher
        self.position = raw.tell()
        self._start, self._hash = self.position, hasher()
        self.segments: dict[tuple[int, int], str] = {}

    def _cut(self) -> None:
        if self.position > self._start:
            self.segments[(self._start, self.position - self._start)] = self._hash.hexdigest()
        self._start, self._hash = self.position, self._new()

    @property
    def name(self) -> Any:
        """The file's name, as DCP's own stream has it (code that looks at ``stream.name`` keeps working)."""
        return self.raw.name

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        written = self.raw.write(view)
        if written is not None and written != len(view):  # a raw file may write less; write the rest
            self.raw.write(view[written:])
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        self._cut()
        return self.position

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()  # DCP fsyncs it

    def close(self) -> None:
        if not self.closed:
            self._cut()
        super().close()


def _file_system_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class DigestingFileSystem(FileSystem):  # type: ignore[misc, valid-type]  # torch's public class, lazily
        """DCP's local file system, whose ``.distcp`` streams hash what is written (``segments`` by file)."""

        def __init__(self) -> None:
            super().__init__()
            self.segments: dict[str, dict[tuple[int, int], str]] = {}
            self._lock = threading.Lock()  # DCP may write files from several threads (thread_count)

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if mode != "wb" or not str(path).endswith((".distcp", ".metadata.tmp")):
                    yield stream
                    return
                hashing = _HashingStream(stream, _hasher(HASH))
                try:
                    yield hashing
                finally:
                    hashing.close()
                    with self._lock:
                        self.segments[Path(path).name] = hashing.segments

    return DigestingFileSystem


@dataclass(frozen=True)
class Item:
    """One stored item: a tensor chunk (``fqn`` and its ``chunk`` offsets in the full tensor) or a bytes-io item
    (``chunk`` empty), at ``offset``/``length`` in ``file``; ``found`` is what a check read there instead."""

    file: str
    fqn: str
    chunk: tuple[int, ...]
    offset: int
    length: int
    digest: str
    found: Optional[str] = None
    #: A whole file (``meta.pt``, ``rng/rank0.pt``, DCP's ``.metadata``): its size must be ``length`` too.
    whole: bool = False

    def change(self) -> str:
        """How the item found differs from the one saved (after ``check_items``)."""
        if self.found is not None and self.found.endswith(" bytes"):
            return f"is {self.found} long, saved {self.length:,} bytes long"
        return f"reads as {self.found}, saved as {self.digest}"

    def describe(self) -> str:
        if self.whole:
            return "the whole file"
        where = f" (chunk at {list(self.chunk)})" if any(self.chunk) else ""
        return f"{self.fqn}{where}"

    def problem(self) -> str:
        """The line a check reports for this changed item (after ``check_items``): ``FILE: WHAT reads as FOUND, saved
        as DIGEST`` (a whole file's ``FILE: the whole file is N bytes long, …``)."""
        return f"{self.file}: {self.describe()} {self.change()}"


def _writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    file_system = _file_system_class()

    class DigestingWriter(FileSystemWriter):  # type: ignore[misc, valid-type]  # torch's public class, lazily
        """DCP's ``FileSystemWriter`` that records a digest of each item it writes and, on the coordinator,
        writes them all as ``digests.json`` before DCP's ``.metadata``.

        The digests travel to the coordinator inside the write results (DCP gathers them for ``finish``) and are
        taken out again there, so DCP's ``.metadata`` is the one a plain writer writes.
        """

        rereads = 0  # items whose digest came from re-reading the file (DCP wrote them without a tell())

        def __init__(self, path: Any, whole_files: Optional[Mapping[str, tuple[int, str]]] = None, **kwargs: Any) -> None:
            super().__init__(path, **kwargs)
            self.fs = file_system()
            self.whole_files = dict(whole_files or {})  # this rank's: name → (length, digest)
            self.all_whole_files: dict[str, tuple[int, str]] = {}  # every rank's, on the coordinator

        def prepare_local_plan(self, plan: Any) -> Any:
            # This rank's whole files travel to the coordinator inside its local plan (DCP gathers the plans).
            plan = super().prepare_local_plan(plan)
            return replace(plan, storage_data=_WithWholeFiles(plan.storage_data, self.whole_files))

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            unwrapped = []
            for plan in plans:
                carried = plan.storage_data
                if isinstance(carried, _WithWholeFiles):
                    self.all_whole_files.update(carried.files)
                    plan = replace(plan, storage_data=carried.inner)
                unwrapped.append(plan)
            return super().prepare_global_plan(unwrapped)

        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)  # a torch Future; FileSystemWriter wrote before returning
            written.wait()
            results = written.value()
            digested = []
            for result in results:
                info = result.storage_data
                segments = self.fs.segments.get(info.relative_path, {})
                digest = segments.get((int(info.offset), int(info.length)))
                if digest is None:
                    type(self).rereads += 1
                    digest = _digest_range(Path(self.path) / info.relative_path, int(info.offset), int(info.length))
                digested.append(replace(result, storage_data=(info, digest)))
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(digested)
            return future

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            items = []
            plain = []
            for rank_results in results:
                plain.append([])
                for result in rank_results:
                    info, digest = result.storage_data
                    index = result.index
                    chunk = tuple(int(o) for o in index.offset) if index.offset is not None else ()
                    items.append(Item(info.relative_path, index.fqn, chunk, int(info.offset), int(info.length), digest))
                    plain[-1].append(replace(result, storage_data=info))
            super().finish(metadata, plain)  # DCP's .metadata, hashed as it is written
            whole = dict(self.all_whole_files)
            for name, segments in self.fs.segments.items():
                if name.endswith(".metadata.tmp") and segments:
                    (_, length), digest = next(iter(segments.items()))
                    whole[".metadata"] = (length, digest)
            write_manifest(Path(self.path), items, whole)

    return DigestingWriter


@dataclass(frozen=True)
class _WithWholeFiles:
    """A local plan's ``storage_data`` (the writer's own, usually ``None``) with this rank's whole files' digests."""

    inner: Any
    files: Mapping[str, tuple[int, str]]


_WRITER: Optional[type] = None


def digesting_writer(path: Path, whole_files: Optional[Mapping[str, tuple[int, str]]] = None) -> Any:
    """A DCP storage writer for folder ``path`` that writes ``digests.json`` (``dcp.save(storage_writer=...)``).

    Args:
        path: The checkpoint folder.
        whole_files: This rank's files written beside DCP's (``meta.pt``, ``rng/rank0.pt``): relative name →
            ``(length, digest)`` (``file_digest`` of the bytes written), listed in the manifest as whole files.
    """
    global _WRITER
    if _WRITER is None:
        _WRITER = _writer_class()
    return _WRITER(str(path), whole_files)


def file_digest(data: bytes) -> tuple[int, str]:
    """``(length, digest)`` of a whole file's bytes, as the manifest lists it."""
    return len(data), digest_of(data)


def _manifest_body_digest(body: Mapping[str, Any]) -> str:
    return digest_of(json.dumps(body, separators=(",", ":")).encode())


def write_manifest(folder: Path, items: Sequence[Item], whole: Optional[Mapping[str, tuple[int, str]]] = None) -> None:
    """``digests.json``: per file, per item ``[fqn, chunk offsets, offset, length, digest]``; the whole files
    (``name: [length, digest]``); and ``self``, the digest of all that. Under a temporary name, then renamed (a
    manifest exists only whole)."""
    files: dict[str, list[list[Any]]] = {}
    for item in sorted(items, key=lambda i: (i.file, i.offset)):
        files.setdefault(item.file, []).append([item.fqn, list(item.chunk), item.offset, item.length, item.digest])
    body = {"format": MANIFEST_FORMAT, "hash": HASH, "files": files,
            "whole": {name: [int(length), digest] for name, (length, digest) in sorted((whole or {}).items())}}
    tmp = folder / f".{MANIFEST_FILE}.incomplete"
    # No fsync (as for meta.pt): one more flush doubled a small save's time; after a power loss a lost manifest
    # reads as "no digests" (a note), a cut one as damaged (refused, "last" falls back).
    with open(tmp, "w") as f:
        json.dump({**body, "self": _manifest_body_digest(body)}, f, separators=(",", ":"))
    os.replace(tmp, folder / MANIFEST_FILE)


class ManifestError(ValueError):
    """``digests.json`` itself is damaged (cut short, or not the bytes written): the checkpoint cannot be checked."""


def read_manifest(folder: Path) -> Optional[tuple[str, list[Item]]]:
    """``(hash name, items)`` of a sharded checkpoint's manifest, whole files included (``Item.whole``); ``None``
    when it has none (saved before digests). Cached by the file's path, size and modification time.

    Raises:
        ManifestError: the manifest is damaged itself (unreadable, or its own digest does not match).
    """
    file = Path(folder) / MANIFEST_FILE
    if not file.is_file():
        return None
    stat = file.stat()
    name, items = _read_manifest(str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    return name, list(items)


@functools.lru_cache(maxsize=4)
def _read_manifest(file: str, size: int, mtime_ns: int) -> tuple[str, tuple[Item, ...]]:
    try:
        manifest = json.loads(Path(file).read_text())
        recorded = manifest.pop("self", None)
        if manifest.get("format") != "lightning_2d.digests/1":
            if recorded is None or _manifest_body_digest(manifest) != recorded:
                raise ManifestError(
                    f"{MANIFEST_FILE} is damaged: its content does not match its own digest"
                    f" ({'none recorded' if recorded is None else f'saved as {recorded}'}), so it cannot vouch for"
                    " the checkpoint's files"
                )
        items = [
            Item(name, fqn, tuple(chunk), int(offset), int(length), str(digest))
            for name, entries in manifest["files"].items()
            for fqn, chunk, offset, length, digest in entries
        ]
        items += [Item(name, name, (), 0, int(length), str(digest), whole=True)
                  for name, (length, digest) in manifest.get("whole", {}).items()]
        return str(manifest["hash"]), tuple(items)
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ManifestError(
            f"{MANIFEST_FILE} is unreadable ({type(err).__name__}: {err}): cut short or overwritten, so it cannot"
            " vouch for the checkpoint's files"
        ) from err


def _digest_range(file: Path, offset: int, length: int, name: str = HASH) -> str:
    hasher = _hasher(name)()
    with open(file, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                break  # cut short: the digest of what is there differs
            hasher.update(block)
            left -= len(block)
    return hasher.hexdigest()


def check_items(folder: Path, items: Iterable[Item], name: str = HASH) -> list[Item]:
    """The items of ``folder`` whose stored bytes no longer have their digest (``found``: what they have now,
    ``"missing"`` for a file that is gone), in file order. A whole file is read whole: a byte appended changes it."""
    wrong = []
    for item in sorted(items, key=lambda i: (i.file, i.offset)):
        file = Path(folder) / item.file
        if not file.is_file():
            found = "missing"
        elif item.whole and file.stat().st_size != item.length:
            found = f"{file.stat().st_size:,} bytes"
        else:
            found = _digest_range(file, item.offset, item.length, name)
        if found != item.digest:
            wrong.append(replace(item, found=found))
    return wrong


def share_of(items: Sequence[Item], rank: int, world_size: int) -> list[Item]:
    """``rank``'s part of ``items`` when ``world_size`` processes check them together: contiguous runs of the
    files (sequential reads), about the same number of bytes each; every item in exactly one part."""
    ordered = sorted(items, key=lambda i: (i.file, i.offset))
    total = sum(i.length for i in ordered) or 1
    mine, before = [], 0
    for item in ordered:
        # The item goes to the rank whose byte range holds its first byte.
        if min(before * world_size // total, world_size - 1) == rank:
            mine.append(item)
        before += item.length
    return mine


# ---- full files ------------------------------------------------------------------------------------------------------
def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for idx, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{idx}" if prefix else str(idx))


def _tensor_digest(tensor: torch.Tensor, name: str = HASH) -> str:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return digest_of(b"", name)
    return digest_of(flat.view(torch.uint8).numpy(), name)


def tensor_digests(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What a full file records of its tensors: ``{"hash": HASH, "tensors": {dotted name: digest}}``."""
    return {"hash": HASH, "tensors": {name: _tensor_digest(t) for name, t in _tensors(checkpoint)}}


def check_tensors(checkpoint: Mapping[str, Any], recorded: Mapping[str, Any], file: str) -> list[Item]:
    """The tensors of a loaded full checkpoint (the file named ``file``) whose digest changed, or that are gone
    (``found``: ``"missing"``); ``recorded`` is its ``lightning_2d.digests`` entry. A full file's tensor is found by
    its name: its ``Item`` has no offset or length."""
    name = str(recorded.get("hash", HASH))
    expected: Mapping[str, str] = recorded.get("tensors", {})
    present = dict(_tensors(checkpoint))
    wrong = []
    for key, digest in expected.items():
        found = _tensor_digest(present[key], name) if key in present else "missing"
        if found != digest:
            wrong.append(Item(file, key, (), 0, 0, digest, found=found))
    return wrong
