"""The checkpoints a folder holds, complete or not, in the order they were saved; the newest intact one.

A sharded checkpoint is *complete* when both DCP's ``.metadata`` and ``meta.pt`` exist; ``meta.pt`` is written
last, so a save interrupted anywhere (a rank killed, a node lost) leaves a folder that is not complete. A full
checkpoint is one file, written under a temporary name and renamed, so it is complete whenever it exists.

What counts as a checkpoint is decided by content, not by a naming scheme (``is_checkpoint``), so the Trainer's
``epoch=0-step=4.ckpt`` and the Fabric recipe's ``step-000004/`` are found alike; they are ordered by the step in
their names, then by modification time.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from lightning_2d.checkpoint.integrity import Integrity
from lightning_2d.checkpoint.names import (
    CHECKPOINT_SUFFIXES,
    DCP_METADATA_FILE,
    DCP_SHARD_SUFFIX,
    FULL_FILE_MARK,
    METADATA_FILE,
    RNG_FOLDER,
    checkpoint_step,
)


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


def save_order(path: Path) -> tuple[int, float]:
    """Where checkpoint ``path`` stands among its folder's (later saves sort higher): the step in its name, then its
    modification time."""
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
    return sorted(found.values(), key=save_order)


def latest_checkpoint(
    folder: Path, warn: Optional[Callable[[str], None]] = None, integrity: Optional[Integrity] = None
) -> Optional[Path]:
    """The newest complete, intact checkpoint of ``folder`` (``--resume latest``), or ``None``.

    Newer saves that never finished (or were damaged since, changed bytes included: the one returned is read
    whole here and its digests checked) are skipped and, with ``warn``, named: the work after the returned
    checkpoint is lost, and the user should know why.

    Args:
        folder: Where a run saves its checkpoints.
        warn: Where to report skipped saves.
        integrity: The checks of the strategy that will load the answer (``strategy.checkpoint_integrity``): it then
            does not read again what was read whole here. ``None``: this call's own.
    """
    integrity = integrity if integrity is not None else Integrity()
    skipped = []
    for candidate in reversed(checkpoints_in(folder)):
        # Read whole here, by the one process that decides (the load then knows it was checked).
        problems = integrity.problems(candidate, warn) if is_complete(candidate) else ["incomplete"]
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
