"""What a load takes: the checkpoint asked for if it is complete and intact, else an error naming it, or — only for
"last" — the newest intact one, with a warning saying why.

Checked three times over, by whoever can do it soonest: the process that launches the ranks (``check_ckpt_path``:
a file or a small sharded checkpoint read whole, an error before any rank starts), rank 0 for the job
(``resolve_on_rank_zero``: one warning, one answer, broadcast), and the ranks together (``resolve_and_check``:
each re-reads its share of the digests). What one of them read whole, the next skips when handed its
``Integrity``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

from lightning_2d.checkpoint.discovery import checkpoints_in, incomplete_checkpoints, is_complete, save_order
from lightning_2d.checkpoint.errors import CheckpointError, UnreadableCheckpointError, UnsafeCheckpointError
from lightning_2d.checkpoint.integrity import Integrity, damage, describe_changed
from lightning_2d.checkpoint.names import METADATA_FILE
from lightning_2d.checkpoint.safe_load import load_checkpoint_file

#: A sharded checkpoint up to this size is checked whole by the process that launches the ranks
#: (``check_ckpt_path``: an error before any rank starts, in seconds); a larger one by the ranks, split.
LAUNCHER_CHECK_BYTES = 4 * 1024**3
#: ``ckpt_path`` values Lightning's Trainer turns into a path itself (``Trainer.fit(ckpt_path=...)``), as it does
#: any ``"registry:…"``: not paths to check.
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")


def resolve_checkpoint(
    path: Path,
    warn: Callable[[str], None],
    fall_back: bool = False,
    check_digests: Union[bool, int, None] = False,
    rejected: Optional[Mapping[Path, list[str]]] = None,
    integrity: Optional[Integrity] = None,
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
        check_digests: Also re-read the checkpoint and check its digests here (``Integrity.problems``): ``True``
            whole, a number: only a sharded checkpoint up to that many bytes (larger ones are left to the
            ranks, which split the work); ``False``: only full files, which rank 0 reads whole anyway; ``None``:
            none (a launched rank's early check: rank 0 checks, then the ranks together).
        rejected: Checkpoints already found damaged elsewhere (by the ranks' digest check), with the problems.
        integrity: The checks this process made before (what it read whole is not read again) and keeps making.
            ``None``: this call's own.

    Raises:
        CheckpointError: ``path`` cannot be loaded and no fall-back is allowed (or none exists).
    """
    integrity = integrity if integrity is not None else Integrity()
    rejected = {Path(p).resolve(): problems for p, problems in (rejected or {}).items()}

    def problems_of(candidate: Path) -> list[str]:
        if candidate.resolve() in rejected:
            return [describe_changed(candidate, rejected[candidate.resolve()])]
        return integrity.problems(candidate, warn, check_digests=check_digests)

    path = Path(path)
    problems = problems_of(path) if is_complete(path) else []
    if is_complete(path) and not problems:
        resolved = path.resolve()
        newer = [
            p for p in incomplete_checkpoints(path.parent)
            if p.resolve() != resolved and save_order(p) > save_order(resolved)
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


def may_fall_back(path: Any) -> bool:
    """Whether another checkpoint may stand in for ``path``: only a "last" one (``ckpt_path="last"`` resolves to
    ``last*.ckpt``), never one named explicitly."""
    return Path(str(path)).name.startswith("last")


def check_ckpt_path(ckpt_path: Any, integrity: Optional[Integrity] = None) -> Optional[Path]:
    """What loading will check, done before any process starts: a local ``ckpt_path`` must be a complete and
    intact checkpoint (``resolve_checkpoint``, with the same fall-back rule as the strategies' loading).

    Args:
        ckpt_path: A Trainer's ``ckpt_path``; ``None``, Lightning's names (``LIGHTNING_CKPT_NAMES``,
            ``registry:…``) and remote URLs are left to Lightning (returns ``None``).
        integrity: Where to remember what was read whole, for the strategy whose rank 0 runs in this process
            (``strategy.checkpoint_integrity``, as ``lightning-2d`` hands it over). ``None``: this call's own.

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
        check_digests=LAUNCHER_CHECK_BYTES if launcher else None, integrity=integrity,
    )
    if launcher:
        # Its non-tensor part read weights-only now (small; a full file's tensors are mapped, not read): a pickled
        # callable is refused in one line before any process starts, and before LightningCLI's own torch.load of a
        # full file for its hyper-parameters.
        load_checkpoint_file(resolved / METADATA_FILE if resolved.is_dir() else resolved, mmap=not resolved.is_dir())
    return resolved


def resolve_on_rank_zero(
    path: Any, global_rank: int, broadcast: Callable[[Any], Any], warn: Callable[[str], None], fall_back: bool = False,
    rejected: Optional[Mapping[Path, list[str]]] = None, integrity: Optional[Integrity] = None,
) -> Path:
    """``resolve_checkpoint`` decided once, by rank 0 (one warning, one answer), and shared: an error
    there is raised on every rank with the same message."""
    kinds = {cls.__name__: cls for cls in (CheckpointError, UnreadableCheckpointError, UnsafeCheckpointError)}
    answer: Any = None
    if global_rank == 0:
        try:
            answer = str(resolve_checkpoint(Path(path), warn=warn, fall_back=fall_back, rejected=rejected,
                                            integrity=integrity))
        except CheckpointError as err:  # sent as plain data: its class by name, its message
            answer = ("error", str(err), type(err).__name__ if type(err).__name__ in kinds else "CheckpointError")
    answer = broadcast(answer)
    if isinstance(answer, (tuple, list)) and len(answer) == 3 and answer[0] == "error":
        raise kinds[answer[2]](answer[1])
    return Path(answer)


def resolve_and_check(
    path: Any, global_rank: int, world_size: int, broadcast: Callable[[Any], Any],
    all_gather: Callable[[Any], list[Any]], warn: Callable[[str], None], fall_back: bool = False,
    prefixes: Optional[tuple[str, ...]] = None, integrity: Optional[Integrity] = None,
) -> Path:
    """What every rank loads: ``resolve_on_rank_zero``, then the digests of that checkpoint checked by all ranks
    together (each re-reads its share of the items, ``Integrity.digest_problems``) before any weight is read.
    Changed bytes are an error on every rank naming the file, the tensor and the step, or, with ``fall_back``, the
    next intact checkpoint is taken (and checked), with rank 0's warning.

    Args:
        path, global_rank, broadcast, warn, fall_back: As for ``resolve_on_rank_zero``.
        world_size: How many ranks share the check.
        all_gather: Every rank's object, in rank order (``torch.distributed.all_gather_object``).
        prefixes: Only the items whose names start with these (what the load reads), e.g. ``("state_dict.",)``.
        integrity: This rank's checks (the checkpoint IO's): rank 0 skips the ranks' check of a checkpoint it read
            whole before. ``None``: this call's own.
    """
    integrity = integrity if integrity is not None else Integrity()
    rejected: dict[Path, list[str]] = {}
    while True:
        chosen = resolve_on_rank_zero(path, global_rank, broadcast, warn, fall_back=fall_back, rejected=rejected,
                                      integrity=integrity)
        # Rank 0 may have read it whole already (check_ckpt_path, latest_checkpoint, a full file).
        done = broadcast(integrity.checked_whole(chosen) or not chosen.is_dir() if global_rank == 0 else None)
        if done:
            return chosen
        mine = integrity.digest_problems(chosen, prefixes, global_rank, world_size)
        parts = all_gather(mine)
        if global_rank == 0 and all(part is None for part in parts):
            integrity.warn_undigested(chosen, warn)
        problems = [problem for part in parts if part for problem in part]
        if not problems:
            return chosen
        rejected[chosen] = problems
        if not fall_back:
            # The same error on every rank, as resolve_checkpoint words it for an explicit checkpoint.
            path = chosen
