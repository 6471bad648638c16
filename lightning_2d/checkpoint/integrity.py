"""Whether a complete checkpoint is intact, and what a process remembers of the checks it made.

Two kinds of harm, found two ways:

* damage (``damage``): what metadata and file sizes show, never reading a tensor: a shard cut short or missing, a
  ``.metadata`` that does not unpickle, a ``meta.pt`` failing its CRC, a manifest that does not vouch for them;
* changed bytes (``Integrity.digest_problems``): the stored bytes re-read and compared with the digests written
  with them (``digests``), a share of them per rank or the whole checkpoint by one process.

``Integrity`` holds what its owner learnt: the checkpoints it read whole and found intact (by a fingerprint of every
file, so a rewrite is seen) and those saved before digests it already warned about. Each owner has its own, never a
process-wide one: a strategy (handed to each of its checkpoint IOs), the CLI's check of ``--ckpt_path`` (handed to
the strategy it instantiates, whose rank 0 then runs in the same process), an export. ``describe_changed`` words
changed bytes as every refusal and warning shows them.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional, Union

from lightning_2d.checkpoint import digests
from lightning_2d.checkpoint.dcp_metadata import read_dcp_metadata, shard_size_problems
from lightning_2d.checkpoint.names import DCP_METADATA_FILE, METADATA_FILE, checkpoint_step
from lightning_2d.checkpoint.safe_load import load_checkpoint_file

#: A checkpoint's fingerprint: ``(name, size, mtime_ns)`` of every one of its files.
Fingerprint = tuple[tuple[str, int, int], ...]


def damage(path: Path) -> list[str]:
    """What is wrong with a checkpoint that looks complete (empty: nothing found). Reads metadata and
    file sizes only, never the tensors: its ``digests.json`` must be intact and vouch for DCP's ``.metadata`` and
    ``meta.pt`` (both checked before either is read), DCP's ``.metadata`` must unpickle, every shard must hold the
    bytes it lists, ``meta.pt`` must be an intact archive (CRC-checked; it is small); a full file's
    archive directory (at its end) must be readable."""
    path = Path(path)
    if path.is_dir():
        try:  # the manifest first: it vouches for .metadata and meta.pt before either is read
            manifest = digests.read_manifest(path)
        except digests.ManifestError as err:
            return [str(err)]
        small = [i for i in (manifest[1] if manifest else ()) if i.whole and i.file in (DCP_METADATA_FILE, METADATA_FILE)]
        if manifest is not None and (changed := digests.check_items(path, small, manifest[0])):
            return [f"{i.file} changed after it was saved: it {i.change()}" for i in changed]
        try:
            metadata = read_dcp_metadata(path)
        except Exception as err:  # a truncated or garbage pickle raises anything from EOFError on
            return [f"{DCP_METADATA_FILE}: unreadable ({type(err).__name__}: {err})"]
        problems = shard_size_problems(path, metadata)
        try:
            with zipfile.ZipFile(path / METADATA_FILE) as archive:
                bad = archive.testzip()
            if bad is not None:
                problems.append(f"{METADATA_FILE}: entry {bad} fails its CRC check")
        except (zipfile.BadZipFile, OSError) as err:
            problems.append(f"{METADATA_FILE}: not a readable torch archive ({err})")
        return problems
    try:
        with zipfile.ZipFile(path):
            return []
    except (zipfile.BadZipFile, OSError) as err:
        return [f"not a readable torch archive ({err}); a file cut short or overwritten"]


def saved_step(path: Path, read: bool = True) -> Optional[int]:
    """The step a checkpoint was saved at: from its name, else (``read``) its ``global_step``/``step`` entry (a
    sharded checkpoint's ``meta.pt``, read weights-only; it is small)."""
    step = checkpoint_step(path)
    if step is not None or not read:
        return step
    path = Path(path)
    try:
        saved = load_checkpoint_file(path / METADATA_FILE if path.is_dir() else path, mmap=True)
    except Exception:  # noqa: BLE001 - the step only names the checkpoint in a message
        return None
    for key in ("global_step", "step"):
        value = saved.get(key) if isinstance(saved, dict) else None
        if isinstance(value, int):
            return value
    return None


def describe_changed(path: Path, problems: list[str]) -> str:
    """The reason a checkpoint with changed bytes is refused, one line: the first item (file, tensor), how
    many more, the step."""
    if problems[0].startswith(digests.MANIFEST_FILE):  # the manifest itself: nothing can be checked against it
        return f"is damaged: {problems[0]} (a disk, copy or transfer error)"
    # meta.pt is read for the step only when it is not among what changed.
    step = saved_step(path, read=not any(p.startswith(METADATA_FILE) for p in problems))
    more = f" (and {len(problems) - 1} more item(s))" if len(problems) > 1 else ""
    return (
        f"is damaged: its bytes changed after it was saved{f' at step {step}' if step is not None else ''}"
        f" ({problems[0]}{more}; a disk, copy or transfer error)"
    )


def fingerprint(path: Path) -> Fingerprint:
    """Size and modification time of every file of a checkpoint: a write to any of them after the check (a shard
    copied again, a byte patched in place) changes it. What it cannot see, a byte flipped by the disk itself in the
    seconds between the launcher's check and the ranks' load, is left unchecked there (CONTRIBUTING)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(p.relative_to(path)) if path.is_dir() else p.name, p.stat().st_size, p.stat().st_mtime_ns)
                 for p in files)


class Integrity:
    """The digest checks of one owner (a checkpoint IO and its strategy, the CLI's check, an export), with what it
    remembers of them: the checkpoints it read whole and found intact (``checked_whole``), and those without digests
    it already warned about (``warn_undigested``: once each).

    The memory is the owner's, not the process's: whoever should skip what another check read whole is handed that
    check's ``Integrity`` (the CLI hands its own to the strategy it instantiates).
    """

    def __init__(self) -> None:
        self._intact: dict[str, Fingerprint] = {}  # read whole and intact: resolved path → fingerprint then
        self._warned: set[str] = set()  # saved before digests, already warned about: resolved paths

    def checked_whole(self, path: Path) -> bool:
        """Whether this owner already found every digest of ``path`` intact (and the checkpoint has not been
        rewritten since): a load need not read it again."""
        try:
            return self._intact.get(str(Path(path).resolve())) == fingerprint(Path(path))
        except OSError:
            return False

    def digest_problems(
        self, path: Path, prefixes: Optional[tuple[str, ...]] = None, rank: int = 0, world_size: int = 1,
        size_limit: Optional[int] = None, allow_globals: Sequence[str] = (),
    ) -> Optional[list[str]]:
        """Check this process's share of the digests of checkpoint ``path``: what changed, one short line each
        (empty: intact; remembered when the whole checkpoint was checked). ``None`` when there is nothing to check:
        a checkpoint saved before digests (warned once by the caller, ``warn_undigested``), or one over
        ``size_limit`` bytes (left to the ranks).

        Sharded: the items named in ``digests.json`` (those under ``prefixes``, e.g. ``("state_dict.",)``, if
        given), split among ``world_size`` processes (``share_of``); full file: rank 0 checks it whole (the pickle's
        CRC-32, then each tensor).

        Args:
            path: A complete checkpoint (folder or file).
            prefixes: Only the items whose name starts with one of these (what the load reads).
            rank, world_size: This process's share.
            size_limit: Check nothing (``None``) when the checkpoint's items are larger than this.
            allow_globals: Further types a full file may hold (``safe_load.load_checkpoint_file``).

        Raises:
            UnsafeCheckpointError: a full file holds a type a weights-only load refuses (nothing in it was built).
        """
        path = Path(path)
        whole = world_size == 1 and prefixes is None
        if path.is_dir():
            try:
                manifest = digests.read_manifest(path)
            except digests.ManifestError as err:
                return [str(err)]
            if manifest is None:
                return None
            name, items = manifest
            if prefixes is not None:  # whole files (meta.pt, RNG, .metadata) are read by every load
                items = [i for i in items if i.whole or i.fqn.startswith(prefixes)]
            if size_limit is not None and sum(i.length for i in items) > size_limit:
                return None
            try:
                wrong = digests.check_items(path, digests.share_of(items, rank, world_size), name)
            except ValueError as err:  # a hash this version does not know
                return [str(err)]
            problems = [i.problem() for i in wrong]
        else:
            if rank != 0:
                return []
            problems = _full_file_digest_problems(path, prefixes, allow_globals)
            if problems is None:
                return None
        if not problems and whole:
            self._intact[str(path.resolve())] = fingerprint(path)
        return problems

    def warn_undigested(self, path: Path, warn: Callable[[str], None]) -> None:
        """Once per checkpoint: it was saved before digests, so changed bytes in it cannot be noticed."""
        key = str(Path(path).resolve())
        if key not in self._warned:
            self._warned.add(key)
            warn(
                f"Checkpoint {path} carries no digests (saved before lightning_2d wrote them): it loads, but bytes"
                " changed since it was saved would go unnoticed. Save it again to add them."
            )

    def problems(
        self, path: Path, warn: Optional[Callable[[str], None]] = None, check_digests: Union[bool, int, None] = True
    ) -> list[str]:
        """What is wrong with complete checkpoint ``path`` (empty: nothing found): its ``damage``, else, as
        ``check_digests`` asks, its bytes changed since it was saved (one line, ``describe_changed``). A checkpoint
        without digests is warned about (with ``warn``, once).

        Args:
            path: A complete checkpoint.
            warn: Where to say that it carries no digests (``None``: say nothing).
            check_digests: Re-read it here and check its digests: ``True`` whole; a number: a sharded checkpoint
                only up to that many bytes (a larger one is left to the ranks, which split the work); ``False``:
                only a full file, which rank 0 reads whole anyway; ``None``: none.
        """
        path = Path(path)
        found = damage(path)
        skip = check_digests is None or (path.is_dir() and check_digests is False)
        if found or skip or self.checked_whole(path):
            return found
        limit = None if isinstance(check_digests, bool) else int(check_digests)
        changed = self.digest_problems(path, size_limit=limit if path.is_dir() else None)
        if changed is None and path.is_dir() and limit is not None:
            return []  # too large to check here: the ranks check it (and warn if it has no digests)
        if changed is None and warn is not None:
            self.warn_undigested(path, warn)
        return [describe_changed(path, changed)] if changed else []


def _full_file_digest_problems(
    path: Path, prefixes: Optional[tuple[str, ...]], allow_globals: Sequence[str] = ()
) -> Optional[list[str]]:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return None  # not a torch.save archive at all: the reader's own error says so
    with archive:
        try:  # the pickle (every non-tensor entry): zipfile checks the CRC-32 torch wrote for it
            for entry in archive.namelist():
                if entry == "data.pkl" or entry.endswith("/data.pkl"):
                    archive.read(entry)
        except (zipfile.BadZipFile, OSError) as err:
            return [f"{path.name}: the pickled non-tensor part fails its check ({err})"]
    # A file holding a type a weights-only load refuses raises its one-line UnsafeCheckpointError here.
    loaded = load_checkpoint_file(path, mmap=True, allow_globals=allow_globals)
    recorded = (loaded.get("lightning_2d") or {}).get(digests.FULL_FILE_KEY) if isinstance(loaded, dict) else None
    if not recorded:
        return None
    if prefixes is not None:
        recorded = {**recorded, "tensors": {k: v for k, v in recorded["tensors"].items() if k.startswith(prefixes)}}
    try:
        wrong = digests.check_tensors(loaded, recorded, path.name)
    except ValueError as err:
        return [str(err)]
    return [i.problem() for i in wrong]
