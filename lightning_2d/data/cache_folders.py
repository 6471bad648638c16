"""Cache folders: what the token cache (``cache``) and the chat cache (``chat/cache``) share.

A cache folder lives under ``DEFAULT_CACHE_DIR`` unless told otherwise and is named by a digest of what decides its
contents and of its source files' paths, sizes and mtimes (``folder_key``: an edited file is another cache). It is
built once (``build_once``): processes of one machine building the same folder take turns on a file lock, and the
second finds the first one's result. A build writes each file as a partial file of its host and process, synced and
renamed into place only when the build succeeds (``partial_files``); ``meta.json``, written last the same way
(``write_meta``), marks the folder complete, so an interrupted build (error, Ctrl-C, kill) never leaves a folder that
looks complete, and the partial files a killed build left are removed by the next build on that machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Optional, TypeVar

import numpy as np

from lightning_2d.data.sources import stat_source

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, builds may overlap (see ``exclusive``)
    fcntl = None  # type: ignore[assignment]

DEFAULT_CACHE_DIR = Path(os.environ.get("LIGHTNING_2D_CACHE", Path.home() / ".cache" / "lightning_2d"))
#: Written last: a folder is complete once it exists.
META = "meta.json"

R = TypeVar("R")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every token id of a vocabulary: ``uint16`` up to 65,536 ids, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def folder_key(settings: str, sources: Sequence[Path]) -> str:
    """24 hex digits of the SHA-256 of ``settings`` (what else decides the contents) and of each source's path,
    size and mtime, in order.

    Raises:
        DataError: A source that cannot be read (``stat_source``).
    """
    h = hashlib.sha256(settings.encode())
    for path in sources:
        stat = stat_source(path)
        h.update(f"|{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def read_meta(folder: Path) -> Optional[dict[str, Any]]:
    """The folder's ``meta.json``, or ``None`` while it is not complete."""
    try:
        return json.loads((folder / META).read_text())
    except FileNotFoundError:
        return None


def _partial(path: Path) -> Path:
    """Where ``path`` is written until it is complete: a name of this host and process, so builds that overlap (no
    lock on the file system) or a killed one never write or leave the final name."""
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_meta(folder: Path, meta: Mapping[str, Any]) -> None:
    """Write ``meta.json`` through a synced partial file, renamed into place: the mark that the folder is complete.
    Call it once every other file is in place (``partial_files``)."""
    partial = _partial(folder / META)
    with partial.open("w") as f:
        f.write(json.dumps(meta, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, folder / META)


@contextmanager
def partial_files(folder: Path, names: Sequence[str]) -> Iterator[dict[str, BinaryIO]]:
    """Each of ``names`` opened for writing as a partial file in ``folder``, by name.

    When the ``with`` block ends normally the files are synced (the data is on disk before ``meta.json`` can say the
    folder is complete) and renamed to their names; when it raises, they are removed and no name is written.
    """
    partials = {name: _partial(folder / name) for name in names}
    try:
        with ExitStack() as stack:
            files = {name: stack.enter_context(open(path, "wb")) for name, path in partials.items()}
            yield files
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        for name, path in partials.items():
            os.replace(path, folder / name)
    finally:
        for path in partials.values():
            path.unlink(missing_ok=True)


def remove_dead_partials(folder: Path) -> None:
    """Delete the partial files left by killed builds of this machine (not those of live processes)."""
    host = socket.gethostname()
    for path in folder.glob(f"*.tmp-{host}-*"):
        try:
            os.kill(int(path.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


@contextmanager
def exclusive(lock_path: Path, on_wait: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``: processes of one machine build a cache one at a time.

    The others wait, then find the cache complete. Where ``flock`` is unavailable (Windows, some
    network file systems) builds may overlap; each writes its own partial files, so the result is
    still complete and correct, only computed twice.
    """
    if fcntl is None:  # pragma: no cover - Windows
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


def build_once(folder: Path, build: Callable[[], R], found: Callable[[dict[str, Any]], R],
               log: Optional[Callable[[str], None]] = None) -> R:
    """``found(meta)`` of a complete folder, else ``build()`` under the folder's lock.

    ``build`` writes its files with ``partial_files`` and ``meta.json`` last with ``write_meta``; it runs after the
    partial files of killed builds are removed. A process that waited for the lock and then finds the folder
    complete returns ``found`` of the other one's ``meta.json``.

    Args:
        folder: The cache folder (created if missing).
        build: Builds the folder; its result is returned.
        found: What a complete folder gives, from its ``meta.json``.
        log: Called with a line for events worth telling (waiting for another builder).
    """
    meta = read_meta(folder)
    if meta is None:
        folder.mkdir(parents=True, exist_ok=True)
        with exclusive(folder / ".lock", log or (lambda line: None)):
            meta = read_meta(folder)  # another process may have finished it while this one waited
            if meta is None:
                remove_dead_partials(folder)
                return build()
    return found(meta)
