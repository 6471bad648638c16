"""Checkpoints that never lose work: complete-or-ignored saves, fall-back on resume, async writes, RNG.

A sharded checkpoint is a folder written by PyTorch Distributed Checkpoint (one ``.distcp`` file per
rank, ``.metadata`` written by rank 0 once every rank's shard is on disk) plus Lightning's
``meta.pt``. It is *complete* when both ``.metadata`` and ``meta.pt`` exist; ``meta.pt`` is
written last, so a save interrupted anywhere (a rank killed, a node lost) leaves a folder that is
not complete. A full checkpoint is one file, written under a temporary name and renamed, so it
is complete whenever it exists.

Resuming from an incomplete checkpoint (``ckpt_path="last"`` can point at one) falls back to the
newest complete checkpoint in the same folder and says so. What counts as a checkpoint there is
decided by content, not by a naming scheme (``is_checkpoint``), so the Trainer's
``epoch=0-step=4.ckpt`` and the Fabric recipe's ``step-000004/`` get the same fall-back; they are
ordered by the step in their names, then by modification time.

Both the Trainer and the Fabric strategies use this module.
"""

from __future__ import annotations

import functools
import os
import pickle
import random
import re
import shutil
import threading
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from lightning_2d.checkpoint.errors import CheckpointError, UnreadableCheckpointError, UnsafeCheckpointError

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"
DCP_SHARD_SUFFIX = ".distcp"
RNG_FOLDER = "rng"
# Lightning's checkpoint suffix, then torch's usual ones (``fabric.save("step-3.pt")``).
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")
# A step number in the common naming schemes: Lightning's ``epoch=E-step=N`` and ``step=N``, the
# Fabric recipe's ``step-000003``, ``step_N``, ``stepN``. Not preceded by a letter, so ``timestep5``
# or ``mystep5`` carry no step.
STEP_PATTERN = re.compile(r"(?<![a-z])step[=_-]?(\d+)", re.IGNORECASE)
# The key our strategies put in every checkpoint: what tells our full ``.pt`` files from tensor dumps.
FULL_FILE_MARK = b"lightning_2d"


# ---- integrity: DCP's metadata read safely, files checked against it ---------------------------
# DCP writes its `.metadata` with pickle and its own reader loads it with a plain `pickle.load`:
# a tampered file would run code. Only DCP's metadata types (and what they hold) are built here.
_DCP_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)


class DCPMetadataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict unpickling: every global goes through ``find_class``."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not part of DCP's metadata")


def read_dcp_metadata(folder: Path) -> Any:
    """DCP's ``Metadata`` of a sharded checkpoint folder, unpickled with only DCP's own types.

    Cached by the file's path, size and modification time: a resume checks the shards' sizes and the
    tensors' shapes from it (at 405B the metadata alone is tens of MB).
    """
    file = Path(folder) / DCP_METADATA_FILE
    stat = file.stat()
    return _read_dcp_metadata(str(file.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_dcp_metadata(file: str, size: int, mtime_ns: int) -> Any:
    with open(file, "rb") as f:
        return DCPMetadataUnpickler(f).load()


def shard_size_problems(folder: Path, metadata: Any) -> list[str]:
    """``.distcp`` files that are missing or shorter than DCP's metadata says (a copy cut short, a
    shard lost or truncated after saving); one line per file."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            needed[relative] = max(needed.get(relative, 0), int(info.offset) + int(info.length))
    problems = []
    for relative, size in sorted(needed.items()):
        file = Path(folder) / relative
        if not file.is_file():
            problems.append(f"{relative}: missing")
        elif file.stat().st_size < size:
            problems.append(f"{relative}: {file.stat().st_size:,} bytes, but the metadata places data up to byte {size:,}")
    return problems


def damage(path: Path) -> list[str]:
    """What is wrong with a checkpoint that looks complete (empty: nothing found). Reads metadata and
    file sizes only, never the tensors: its ``digests.json`` must be intact and vouch for DCP's ``.metadata`` and
    ``meta.pt`` (both checked before either is read), DCP's ``.metadata`` must unpickle, every shard must hold the
    bytes it lists, ``meta.pt`` must be an intact archive (CRC-checked; it is small); a full file's
    archive directory (at its end) must be readable."""
    path = Path(path)
    if path.is_dir():
        from lightning_2d.checkpoint import digests

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


def stored_shapes(path: Path, key: str) -> dict[str, tuple[int, ...]]:
    """Name → full shape of the tensors a checkpoint stores under ``key`` (``"state_dict"``, or the
    model's key in a ``fabric.save`` state), read from metadata only (sharded: DCP's ``.metadata``;
    full file: the memory-mapped archive)."""
    path = Path(path)
    if path.is_dir():
        metadata = read_dcp_metadata(path)
        prefix = key + "."
        return {
            name[len(prefix):]: tuple(meta.size)
            for name, meta in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and hasattr(meta, "size")
        }
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file  # the weights-only loader with our safe types

    stored = load_checkpoint_file(path, mmap=True).get(key) or {}
    return {name: tuple(t.shape) for name, t in stored.items() if isinstance(t, torch.Tensor)}


def shape_mismatches(
    stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], strict: bool = True
) -> list[str]:
    """Where a checkpoint's tensors and a model's differ: missing in the checkpoint, shapes (checkpoint
    vs model), and — when ``strict`` — tensors the model does not have (they would be dropped)."""
    problems = [f"{name}: checkpoint {stored[name]}, model {shape}" for name, shape in expected.items()
                if name in stored and tuple(stored[name]) != tuple(shape)]
    missing = [name for name in expected if name not in stored]
    unexpected = [name for name in stored if name not in expected] if strict else []
    for label, names in (("missing from the checkpoint", missing), ("in the checkpoint but not in the model", unexpected)):
        if names:
            problems.append(f"{len(names)} tensor(s) {label}: {', '.join(names[:6])}{', …' if len(names) > 6 else ''}")
    return problems


# ---- digests: changed bytes ---------------------------------------------------------------------
#: A sharded checkpoint up to this size is checked whole by the process that launches the ranks
#: (``check_ckpt_path``: an error before any rank starts, in seconds); a larger one by the ranks, split.
LAUNCHER_CHECK_BYTES = 4 * 1024**3
_verified: dict[str, tuple[int, int]] = {}  # checkpoints this process checked whole, by path → fingerprint
_warned_undigested: set[str] = set()


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Size and modification time of every file of a checkpoint: a write to any of them after the check (a shard
    copied again, a byte patched in place) changes it. What it cannot see, a byte flipped by the disk itself in the
    seconds between the launcher's check and the ranks' load, is left unchecked there (CONTRIBUTING)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(p.relative_to(path)) if path.is_dir() else p.name, p.stat().st_size, p.stat().st_mtime_ns)
                 for p in files)


def checked_whole(path: Path) -> bool:
    """Whether this process already found every digest of ``path`` intact (and the checkpoint has not been
    rewritten since): a load need not read it again."""
    try:
        return _verified.get(str(Path(path).resolve())) == _fingerprint(Path(path))
    except OSError:
        return False


def saved_step(path: Path, read: bool = True) -> Optional[int]:
    """The step a checkpoint was saved at: from its name, else (``read``) its ``global_step``/``step`` entry (a
    sharded checkpoint's ``meta.pt``, read weights-only; it is small)."""
    step = checkpoint_step(path)
    if step is not None or not read:
        return step
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file  # weights-only, with our few safe types

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


def digest_problems(
    path: Path, prefixes: Optional[tuple[str, ...]] = None, rank: int = 0, world_size: int = 1,
    size_limit: Optional[int] = None, allow_globals: Sequence[str] = (),
) -> Optional[list[str]]:
    """Check this process's share of the digests of checkpoint ``path``: what changed, one short line each
    (empty: intact). ``None`` when there is nothing to check: a checkpoint saved before digests (warned once by
    the caller, ``warn_undigested``), or one over ``size_limit`` bytes (left to the ranks).

    Sharded: the items named in ``digests.json`` (those under ``prefixes``, e.g. ``("state_dict.",)``, if given),
    split among ``world_size`` processes (``share_of``); full file: rank 0 checks it whole (the pickle's CRC-32,
    then each tensor).

    Args:
        path: A complete checkpoint (folder or file).
        prefixes: Only the items whose name starts with one of these (what the load reads).
        rank, world_size: This process's share.
        size_limit: Check nothing (``None``) when the checkpoint's items are larger than this.
        allow_globals: Further types a full file may hold (``safe_load.load_checkpoint_file``).

    Raises:
        UnsafeCheckpointError: a full file holds a type a weights-only load refuses (nothing in it was built).
    """
    from lightning_2d.checkpoint import digests

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
        problems = [f"{i.file}: {i.describe()} {i.change()}" for i in wrong]
    else:
        if rank != 0:
            return []
        problems = _full_file_digest_problems(path, prefixes, allow_globals)
        if problems is None:
            return None
    if not problems and whole:
        _verified[str(path.resolve())] = _fingerprint(path)
    return problems


def _full_file_digest_problems(
    path: Path, prefixes: Optional[tuple[str, ...]], allow_globals: Sequence[str] = ()
) -> Optional[list[str]]:
    from lightning_2d.checkpoint import digests
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file

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
        wrong = digests.check_tensors(loaded, recorded)
    except ValueError as err:
        return [str(err)]
    return [f"{path.name}: {name} reads as {found}, saved as {saved}" for name, saved, found in wrong]


def describe_changed(path: Path, problems: list[str]) -> str:
    """The reason a checkpoint with changed bytes is refused, one line: the first item (file, tensor), how
    many more, the step."""
    from lightning_2d.checkpoint.digests import MANIFEST_FILE

    if problems[0].startswith(MANIFEST_FILE):  # the manifest itself: nothing can be checked against it
        return f"is damaged: {problems[0]} (a disk, copy or transfer error)"
    # meta.pt is read for the step only when it is not among what changed.
    step = saved_step(path, read=not any(p.startswith(METADATA_FILE) for p in problems))
    more = f" (and {len(problems) - 1} more item(s))" if len(problems) > 1 else ""
    return (
        f"is damaged: its bytes changed after it was saved{f' at step {step}' if step is not None else ''}"
        f" ({problems[0]}{more}; a disk, copy or transfer error)"
    )


def warn_undigested(path: Path, warn: Callable[[str], None]) -> None:
    """Once per checkpoint: it was saved before digests, so changed bytes in it cannot be noticed."""
    key = str(Path(path).resolve())
    if key not in _warned_undigested:
        _warned_undigested.add(key)
        warn(
            f"Checkpoint {path} carries no digests (saved before lightning_2d wrote them): it loads, but bytes"
            " changed since it was saved would go unnoticed. Save it again to add them."
        )


# ---- completeness ------------------------------------------------------------------------------
def is_complete(path: Path) -> bool:
    """Whether ``path`` is a checkpoint that finished writing."""
    path = Path(path)
    if path.is_dir():
        return (path / DCP_METADATA_FILE).is_file() and (path / METADATA_FILE).is_file()
    return path.is_file()


def _save_started(folder: Path) -> bool:
    """Whether ``folder`` holds traces of a sharded save: a DCP shard, DCP's ``.metadata``, or the
    per-rank RNG files our writer puts there before the shards."""
    if (folder / DCP_METADATA_FILE).is_file():
        return True
    if any(p.suffix == DCP_SHARD_SUFFIX for p in folder.iterdir()):
        return True
    rng = folder / RNG_FOLDER
    return rng.is_dir() and any(p.name.startswith("rank") and p.suffix == ".pt" for p in rng.iterdir())


def _is_our_full_file(path: Path) -> bool:
    """Whether ``path`` is a ``torch.save`` archive of one of our checkpoints (it has the
    ``lightning_2d`` entry); reads only the archive's pickle, never the tensors."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            return bool(pickles) and FULL_FILE_MARK in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile):
        return False


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint, complete or from a save that started, whatever its name.

    * a folder: complete (``.metadata`` and ``meta.pt``), or with traces of a sharded save (shards,
      ``.metadata``, ``rng/rank*.pt``), or named like a checkpoint file (``last.ckpt/``: Lightning's
      names, even before anything is written in it);
    * a file: ``*.ckpt`` (Lightning's checkpoint suffix), or ``*.pt``/``*.pth``/no suffix holding one
      of our checkpoints (other ``.pt`` files are tensor dumps, exported weights...).

    Hidden entries never are (``.name.incomplete``: a full file still being written; DCP's own
    ``.metadata``).

    Args:
        path: An entry of a checkpoint folder.
    """
    path = Path(path)
    if path.name.startswith("."):
        return False
    if path.is_dir():
        return path.suffix in CHECKPOINT_SUFFIXES or is_complete(path) or _save_started(path)
    if path.is_file():
        # No suffix: the Fabric recipe's ``step-000003`` saved as one full file.
        return path.suffix == ".ckpt" or (path.suffix in (*CHECKPOINT_SUFFIXES, "") and _is_our_full_file(path))
    return False  # a dangling link, a socket...


def checkpoint_step(path: Path) -> Optional[int]:
    """The step number in ``path``'s name (that of its target, for a link), or ``None``.

    Args:
        path: A checkpoint file or folder, named ``epoch=0-step=12.ckpt``, ``step-000012``, ``step_12.pt``...
    """
    matches = STEP_PATTERN.findall(Path(path).resolve().name)
    return int(matches[-1]) if matches else None


def _order_key(path: Path) -> tuple[int, float]:
    # A step in the name wins over the clock (copies and rsync reset mtimes); names without one
    # (``last.ckpt``'s target outside the folder, ``final.pt``) rank below any numbered checkpoint,
    # as Lightning's ``step=N`` names always did.
    step = checkpoint_step(path)
    return (step if step is not None else -1, path.stat().st_mtime)


def checkpoints_in(folder: Path) -> list[Path]:
    """Every checkpoint of ``folder`` (complete or not, see ``is_checkpoint``), oldest first.

    Ordered by the step in the name, then by modification time. A link and its target in the same
    folder (``last.ckpt``) count once, under the target's name.

    Args:
        folder: Where a run saves its checkpoints.
    """
    folder = Path(folder)
    if not folder.is_dir() or is_complete(folder) or _save_started(folder):
        # The parts of a sharded checkpoint (``meta.pt``, ``rng/``) are never checkpoints themselves.
        return []
    found: dict[Path, Path] = {}
    for entry in folder.iterdir():
        if not is_checkpoint(entry):
            continue
        target = entry.resolve()
        if target not in found or found[target].is_symlink():
            found[target] = entry
    return sorted(found.values(), key=_order_key)


def latest_checkpoint(folder: Path, warn: Optional[Callable[[str], None]] = None) -> Optional[Path]:
    """The newest complete, intact checkpoint of ``folder`` (``--resume latest``), or ``None``.

    Newer saves that never finished (or were damaged since, changed bytes included: the one returned is read
    whole here and its digests checked) are skipped and, with ``warn``, named: the work after the returned
    checkpoint is lost, and the user should know why.

    Args:
        folder: Where a run saves its checkpoints.
        warn: Where to report skipped saves.
    """
    skipped = []
    for candidate in reversed(checkpoints_in(folder)):
        problems = damage(candidate) if is_complete(candidate) else ["incomplete"]
        if not problems and not checked_whole(candidate):
            # Read whole here, by the one process that decides (the load then knows it was checked).
            changed = digest_problems(candidate)
            if changed is None and warn is not None:
                warn_undigested(candidate, warn)
            problems = [describe_changed(candidate, changed)] if changed else []
        if not problems:
            if skipped and warn is not None:
                def described(problems: list[str]) -> str:
                    if problems == ["incomplete"]:
                        return "is incomplete"
                    changed = problems[0].startswith("is damaged: ")  # describe_changed's whole reason
                    return problems[0] if changed else "is damaged: " + "; ".join(problems)

                names = ", ".join(f"{p.name} {described(r)}" for p, r in skipped)
                warn(f"Skipping interrupted save(s) in {folder} ({names}); resuming from {candidate}")
            return candidate
        skipped.append((candidate, problems))
    return None


def newest_complete_checkpoint(folder: Path, exclude: Optional[Path] = None) -> Optional[Path]:
    """The complete checkpoint of ``folder`` with the highest step (then the newest), if any.

    Args:
        folder: Where a run saves its checkpoints.
        exclude: A checkpoint not to return (the one being replaced).
    """
    excluded = Path(exclude).resolve() if exclude is not None else None
    complete = [p for p in checkpoints_in(folder) if is_complete(p) and p.resolve() != excluded]
    return complete[-1] if complete else None


def incomplete_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints of ``folder`` whose save started but did not finish, oldest first."""
    return [p for p in checkpoints_in(folder) if not is_complete(p)]


def resolve_checkpoint(
    path: Path,
    warn: Callable[[str], None],
    fall_back: bool = False,
    check_digests: Union[bool, int, None] = False,
    rejected: Optional[Mapping[Path, list[str]]] = None,
) -> Path:
    """``path`` if it is complete and intact; otherwise an error naming it, or, with ``fall_back``
    (``ckpt_path="last"``), the newest complete sibling with a warning.

    Also warns when the folder holds checkpoints newer than the one resumed from that never
    finished writing (a save interrupted by a crash): the work since is lost, and the user should
    know why the run restarts from an older step.

    Args:
        path: The checkpoint asked for (a file, a sharded folder, or a link to one).
        warn: Where to report a fall-back or lost saves (rank 0's warning).
        fall_back: Whether another checkpoint may stand in for ``path``: only when the user asked
            for "the last one", never for a checkpoint named explicitly.
        check_digests: Also re-read the checkpoint and check its digests here (``digest_problems``): ``True``
            whole, a number: only a sharded checkpoint up to that many bytes (larger ones are left to the
            ranks, which split the work); ``False``: only full files, which rank 0 reads whole anyway; ``None``:
            none (a launched rank's early check: rank 0 checks, then the ranks together).
        rejected: Checkpoints already found damaged elsewhere (by the ranks' digest check), with the problems.

    Raises:
        CheckpointError: ``path`` cannot be loaded and no fall-back is allowed (or none exists).
    """
    rejected = {Path(p).resolve(): problems for p, problems in (rejected or {}).items()}

    def problems_of(candidate: Path) -> list[str]:
        if candidate.resolve() in rejected:
            return [describe_changed(candidate, rejected[candidate.resolve()])]
        found = damage(candidate)
        skip = check_digests is None or (candidate.is_dir() and check_digests is False)
        if found or skip or checked_whole(candidate):
            return found
        limit = None if isinstance(check_digests, bool) else int(check_digests)
        changed = digest_problems(candidate, size_limit=limit if candidate.is_dir() else None)
        if changed is None and candidate.is_dir() and limit is not None:
            return []  # too large to check here: the ranks check it (and warn if it has no digests)
        if changed is None:
            warn_undigested(candidate, warn)
        return [describe_changed(candidate, changed)] if changed else []

    path = Path(path)
    problems = problems_of(path) if is_complete(path) else []
    if is_complete(path) and not problems:
        resolved = path.resolve()
        newer = [
            p for p in incomplete_checkpoints(path.parent)
            if p.resolve() != resolved and _order_key(p) > _order_key(resolved)
        ]
        if newer:
            names = ", ".join(f"{p.name} is incomplete" for p in newer)
            warn(f"Skipping interrupted save(s) in {path.parent} ({names}); resuming from {path} ({resolved.name})")
        return path
    folder = path.parent
    if len(problems) == 1 and problems[0].startswith("is damaged: "):  # describe_changed's whole reason
        reason = problems[0]
    elif problems:
        reason = "is damaged (" + "; ".join(problems) + ")"
    elif not path.exists() and not path.is_symlink():
        reason = "does not exist"
    else:
        reason = "is incomplete (an interrupted save)"
    asked = path.resolve()
    candidates = [p for p in reversed(checkpoints_in(folder)) if is_complete(p) and p.resolve() != asked] if folder.is_dir() else []
    # A damaged one is no fall-back either; digests are checked only for the one taken (newest first).
    fallback = next((p for p in candidates if not problems_of(p)), None) if fall_back else (
        next((p for p in candidates if not damage(p) and p.resolve() not in rejected), None))
    if not fall_back:
        alternatives = f"; the newest complete one there is {fallback}" if fallback is not None else ""
        raise CheckpointError(
            f"Checkpoint {path} {reason}. Not resuming from another checkpoint, since this one was asked for"
            f"{alternatives}. Pass that path, or ckpt_path=\"last\" to take the newest complete checkpoint."
        )
    if fallback is None:
        raise CheckpointError(
            f"Checkpoint {path} {reason}, and {folder} holds no complete checkpoint to resume from instead."
        )
    warn(f"Checkpoint {path} {reason}; resuming from the newest complete checkpoint instead: {fallback}")
    return fallback


#: ``ckpt_path`` values Lightning's Trainer turns into a path itself (``Trainer.fit(ckpt_path=...)``), as it does
#: any ``"registry:…"``: not paths to check.
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")


def may_fall_back(path: Any) -> bool:
    """Whether another checkpoint may stand in for ``path``: only a "last" one (``ckpt_path="last"`` resolves to
    ``last*.ckpt``), never one named explicitly."""
    return Path(str(path)).name.startswith("last")


def check_ckpt_path(ckpt_path: Any) -> Optional[Path]:
    """What loading will check, done before any process starts: a local ``ckpt_path`` must be a complete and
    intact checkpoint (``resolve_checkpoint``, with the same fall-back rule as the strategies' loading).

    Args:
        ckpt_path: A Trainer's ``ckpt_path``; ``None``, Lightning's names (``LIGHTNING_CKPT_NAMES``,
            ``registry:…``) and remote URLs are left to Lightning (returns ``None``).

    Returns:
        The checkpoint that will be loaded.

    Raises:
        CheckpointError: missing, interrupted or damaged, naming the file and the way on.
        UnsafeCheckpointError: it holds a pickled object a weights-only load refuses (it could run code).
    """
    if ckpt_path is None:
        return None
    text = str(ckpt_path)
    if text in LIGHTNING_CKPT_NAMES or text.startswith("registry") or "://" in text:
        return None
    # The process that launches the ranks (or rank 0 under torchrun) reads a file or a small sharded checkpoint
    # whole: changed bytes are an error before any rank starts. The ranks check again what it did not.
    launcher = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
    resolved = resolve_checkpoint(
        Path(text), warn=lambda _: None, fall_back=may_fall_back(text),  # the ranks warn
        check_digests=LAUNCHER_CHECK_BYTES if launcher else None,
    )
    if launcher:
        # Its non-tensor part read weights-only now (small; a full file's tensors are mapped, not read): a pickled
        # callable is refused in one line before any process starts, and before LightningCLI's own torch.load of a
        # full file for its hyper-parameters.
        from lightning_2d.checkpoint.safe_load import load_checkpoint_file

        load_checkpoint_file(resolved / METADATA_FILE if resolved.is_dir() else resolved, mmap=not resolved.is_dir())
    return resolved


def remove_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


# ---- RNG ---------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's random generators (torch CPU and CUDA, NumPy, Python), as tensors and plain
    values only, so checkpoints load with ``torch.load(weights_only=True)``."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "cached": cached},
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(folder: Path, rank: int) -> dict[str, tuple[int, str]]:
    """This rank's generators into ``rng/rank{rank}.pt``; returns the file's ``{name: (length, digest)}`` for the
    manifest (hashed from the bytes written, never read back)."""
    import io

    from lightning_2d.checkpoint.digests import file_digest

    (folder / RNG_FOLDER).mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    name = f"{RNG_FOLDER}/rank{rank}.pt"
    (folder / name).write_bytes(buffer.getvalue())
    return {name: file_digest(buffer.getvalue())}


def load_rng(folder: Path, rank: int) -> bool:
    """Restore this rank's generators from a sharded checkpoint; ``False`` if it has none for this rank."""
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file

    file = folder / RNG_FOLDER / f"rank{rank}.pt"
    if not file.is_file():
        return False
    set_rng_state(load_checkpoint_file(file))
    return True


# ---- writing -----------------------------------------------------------------------------------
def save_full_file(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: the file exists only once complete. The digest of every
    tensor goes in with them (``lightning_2d.digests``), checked before the file is loaded."""
    from lightning_2d.checkpoint.digests import FULL_FILE_KEY, tensor_digests

    tmp = path.with_name(f".{path.name}.incomplete")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    ours = {**checkpoint.get("lightning_2d", {}), FULL_FILE_KEY: tensor_digests(checkpoint)}
    torch.save({**checkpoint, "lightning_2d": ours}, tmp)
    os.replace(tmp, path)


class ShardedCheckpointWriter:
    """Writes sharded checkpoints with DCP, synchronously or in a background thread.

    Async: ``dcp.async_save`` first copies the state to its own CPU buffers (so the next optimizer
    step cannot change what is written), then writes in a thread; its collectives run on a
    dedicated gloo group so they never interleave with training collectives. ``meta.pt`` (the
    completeness mark) is written by rank 0 only when every rank's shard is on disk. At most one
    save is in flight: the next save, a checkpoint removal, or the end of training waits for it.

    Args:
        global_rank: This process's rank.
        barrier: The strategy's barrier.
        async_save: Write in the background.
        process_group: Group for the background collectives (a gloo group) when ``async_save``.
    """

    def __init__(
        self,
        global_rank: int,
        barrier: Callable[[], None],
        async_save: bool = False,
        process_group: Any = None,
    ) -> None:
        self.global_rank = global_rank
        self.barrier = barrier
        self.async_save = async_save
        self.process_group = process_group
        self._pending: Optional[Future] = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on disk; re-raise its error here."""
        with self._lock:
            future, self._pending = self._pending, None
        if future is not None:
            future.result()

    def save(self, state: dict[str, Any], metadata: dict[str, Any], path: Path) -> None:
        """Write ``state`` (tensors, sharded) and ``metadata`` (rank 0's ``meta.pt``) into folder ``path``."""
        import io

        import torch.distributed.checkpoint as dcp

        self.wait()
        if self.global_rank == 0:
            # Never leave an old .metadata/meta.pt beside new shards: the folder would look complete.
            remove_path(path)
            path.mkdir(parents=True)
        self.barrier()
        whole_files = save_rng(path, self.global_rank)
        # Serialize now: the objects behind the metadata may change while a background save runs.
        buffer = io.BytesIO()
        if self.global_rank == 0:
            from lightning_2d.checkpoint.digests import file_digest

            torch.save(metadata, buffer)
            whole_files[METADATA_FILE] = file_digest(buffer.getvalue())  # listed before it is written, last

        def finish() -> None:
            if self.global_rank == 0:
                tmp = path / f".{METADATA_FILE}.incomplete"
                tmp.write_bytes(buffer.getvalue())
                os.replace(tmp, path / METADATA_FILE)  # the completeness mark, last

        from lightning_2d.checkpoint.digests import digesting_writer

        # The writer hashes each item as it writes it and writes digests.json (with every rank's whole files and
        # DCP's .metadata) after .metadata, before meta.pt.
        writer = digesting_writer(path, whole_files)
        if not self.async_save:
            dcp.save(state, checkpoint_id=path, storage_writer=writer)
            finish()
            self.barrier()
            return
        upload = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=self.process_group)
        if not isinstance(upload, Future):  # an AsyncSaveResponse (non-blocking staging)
            upload = upload.upload_completion
        done: Future = Future()

        def on_upload(f: Future) -> None:
            # Runs in the writer thread: rank 0's upload completes only after every rank's shard and
            # DCP's .metadata are written, so the mark can follow at once.
            try:
                f.result()
                finish()
                done.set_result(path)
            except BaseException as err:  # noqa: BLE001 - handed to wait() on the training thread
                done.set_exception(err)

        upload.add_done_callback(on_upload)
        with self._lock:
            self._pending = done


# ---- shared by the strategies ------------------------------------------------------------------
def layout_of(world_size: int, dims: Any = None) -> dict[str, Any]:
    """What a checkpoint records of the layout it was saved at (``dims``: a ``ParallelDims``)."""
    layout: dict[str, Any] = {"world_size": world_size, "data_parallel": None, "tensor_parallel": None}
    if dims is not None:
        layout.update(data_parallel=dims.dp, tensor_parallel=dims.tp, data_parallel_replicate=dims.dp_replicate)
    return layout


def _describe_layout(layout: dict[str, Any]) -> str:
    replicas = layout.get("data_parallel_replicate") or 1
    dp, tp = layout.get("data_parallel"), layout.get("tensor_parallel")
    mesh = f"(data_parallel_replicate, data_parallel_shard, tensor_parallel) = ({replicas}, {dp // replicas}, {tp})" if isinstance(dp, int) else f"(data_parallel, tensor_parallel) = ({dp}, {tp})"
    return f"{mesh} on {layout.get('world_size')} processes"


def restore_random_state(
    path: Path, saved: dict[str, Any], now: dict[str, Any], rank: int, info: Callable[[str], None]
) -> None:
    """After loading ``path``: restore this rank's RNG if the layout is the one saved, else say why not.

    Args:
        path: The loaded checkpoint.
        saved: The checkpoint's ``lightning_2d`` entry (``layout``, and ``rng`` for full files).
        now: The current layout (``layout_of``).
        rank: This process's global rank.
        info: Where to report a layout change (rank 0's logger).
    """
    layout = saved.get("layout") or {}
    if layout.get("world_size") == now["world_size"]:
        if path.is_dir():
            load_rng(path, rank)
        elif saved.get("rng"):
            set_rng_state(saved["rng"][rank])
    elif layout:
        info(
            f"Resuming a checkpoint saved at {_describe_layout(layout)} at {_describe_layout(now)}: weights and"
            " optimizer states are resharded; per-process random states are not restored."
        )


def make_writer(global_rank: int, barrier: Callable[[], None], sharded: bool, async_save: bool) -> ShardedCheckpointWriter:
    """The strategies' checkpoint writer; call on every rank after the process group exists.

    Background writes get their own gloo group: their collectives must never interleave with the
    training collectives on the default group.
    """
    import torch.distributed as dist

    group = dist.new_group(backend="gloo") if async_save and sharded else None
    return ShardedCheckpointWriter(global_rank, barrier, async_save=group is not None, process_group=group)


def save_full_checkpoint(checkpoint: dict[str, Any], path: Path, global_rank: int, world_size: int,
                         barrier: Callable[[], None]) -> None:
    """A full single-file checkpoint (tensors already gathered): every rank's RNG in it, written by rank 0."""
    import torch.distributed as dist

    rng: list[Any] = [None] * world_size
    dist.all_gather_object(rng, rng_state())
    checkpoint.setdefault("lightning_2d", {})["rng"] = rng
    if global_rank == 0:
        save_full_file(checkpoint, path)
    barrier()


def resolve_on_rank_zero(
    path: Any, global_rank: int, broadcast: Callable[[Any], Any], warn: Callable[[str], None], fall_back: bool = False,
    rejected: Optional[Mapping[Path, list[str]]] = None,
) -> Path:
    """``resolve_checkpoint`` decided once, by rank 0 (one warning, one answer), and shared: an error
    there is raised on every rank with the same message."""
    kinds = {cls.__name__: cls for cls in (CheckpointError, UnreadableCheckpointError, UnsafeCheckpointError)}
    answer: Any = None
    if global_rank == 0:
        try:
            answer = str(resolve_checkpoint(Path(path), warn=warn, fall_back=fall_back, rejected=rejected))
        except CheckpointError as err:  # sent as plain data: its class by name, its message
            answer = ("error", str(err), type(err).__name__ if type(err).__name__ in kinds else "CheckpointError")
    answer = broadcast(answer)
    if isinstance(answer, (tuple, list)) and len(answer) == 3 and answer[0] == "error":
        raise kinds[answer[2]](answer[1])
    return Path(answer)


def resolve_and_check(
    path: Any, global_rank: int, world_size: int, broadcast: Callable[[Any], Any],
    all_gather: Callable[[Any], list[Any]], warn: Callable[[str], None], fall_back: bool = False,
    prefixes: Optional[tuple[str, ...]] = None,
) -> Path:
    """What every rank loads: ``resolve_on_rank_zero``, then the digests of that checkpoint checked by all ranks
    together (each re-reads its share of the items, ``digest_problems``) before any weight is read. Changed
    bytes are an error on every rank naming the file, the tensor and the step, or, with ``fall_back``, the next
    intact checkpoint is taken (and checked), with rank 0's warning.

    Args:
        path, global_rank, broadcast, warn, fall_back: As for ``resolve_on_rank_zero``.
        world_size: How many ranks share the check.
        all_gather: Every rank's object, in rank order (``torch.distributed.all_gather_object``).
        prefixes: Only the items whose names start with these (what the load reads), e.g. ``("state_dict.",)``.
    """
    rejected: dict[Path, list[str]] = {}
    while True:
        chosen = resolve_on_rank_zero(path, global_rank, broadcast, warn, fall_back=fall_back, rejected=rejected)
        # Rank 0 may have read it whole already (check_ckpt_path, latest_checkpoint, a full file).
        done = broadcast(checked_whole(chosen) or not chosen.is_dir() if global_rank == 0 else None)
        if done:
            return chosen
        mine = digest_problems(chosen, prefixes, global_rank, world_size)
        parts = all_gather(mine)
        if global_rank == 0 and all(part is None for part in parts):
            warn_undigested(chosen, warn)
        problems = [problem for part in parts if part for problem in part]
        if not problems:
            return chosen
        rejected[chosen] = problems
        if not fall_back:
            # The same error on every rank, as resolve_checkpoint words it for an explicit checkpoint.
            path = chosen


def load_trained_subset(path: Path, key: str, module: torch.nn.Module, optimizers: Mapping[str, Any]) -> dict[str, Any]:
    """Load a sharded checkpoint that holds only some of ``module``'s tensors (LoRA's adapters; the frozen base comes
    from its own source, ``init_from`` or the seeded init): those tensors under ``key``, each optimizer's state
    under its own key, resharded to the current layout; return the metadata (``meta.pt``).

    Lightning's loader asks DCP for every tensor of the module, and DCP refuses a checkpoint without them; this reads
    what the checkpoint holds, the rest of the module kept as it is.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = stored_shapes(path, key)
    state = {name: tensor for name, tensor in get_model_state_dict(module).items() if name in saved}
    dcp.load({key: state}, checkpoint_id=path)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    for optim_key, optimizer in optimizers.items():
        optim_state = {optim_key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[optim_key],
                                 options=StateDictOptions(cpu_offload=True))
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file

    return load_checkpoint_file(path / METADATA_FILE)


#: The key of a checkpoint's adapters record (``meta.pt``): their settings and the base they were trained on.
ADAPTERS_KEY = "adapters"


def adapter_record(path: Path) -> Optional[dict[str, Any]]:
    """The adapters record of a sharded checkpoint (``{"lora": settings, "base": {...}}``), ``None`` for a checkpoint
    of the whole model."""
    file = Path(path) / METADATA_FILE
    if not file.exists():
        return None
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file

    record = load_checkpoint_file(file).get(ADAPTERS_KEY)
    return record if isinstance(record, dict) else None
