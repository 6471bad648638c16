"""The corpus's source files: files, folders and globs resolved to a sorted file list (``resolve_sources``),
the built-in corpus (the standard library's ``.py`` files) and ``DataError``, the error every bad data input
raises, naming the file or value and what to do.
"""

from __future__ import annotations

import os
import sysconfig
from glob import glob
from pathlib import Path
from collections.abc import Callable
from typing import Union

from lightning_2d.errors import Lightning2DError

class DataError(Lightning2DError, ValueError):
    """Bad data input: names the file or value and what to do."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data input file (a tokenizer) that does not exist."""


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
        hidden = any(part.startswith(".") or part == "__pycache__" for part in parts)
        if hidden or path.suffix.lower() not in FOLDER_SUFFIXES:
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


def expand_patterns(patterns: list[str], folder_files: Callable[[Path], list[Path]],
                    no_match: Callable[[str], str]) -> list[Path]:
    """Files, folders (``folder_files(folder)``) and globs (``**`` allowed), in order, each file once (resolved).

    Raises:
        DataError: A pattern that matches no file (``no_match(pattern)`` is the message).
    """
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob(expanded, recursive=True)) if any(c in expanded for c in "*?[") else [expanded]
        found: list[Path] = []
        for match in map(Path, matches):
            if match.is_dir():
                found.extend(folder_files(match))
            elif match.is_file():
                found.append(match)
        if not found:
            raise DataError(no_match(pattern))
        files.extend(found)
    return list(dict.fromkeys(p.resolve() for p in files))  # keep order, drop duplicates


def resolve_sources(paths: Union[str, list[str], None]) -> list[Path]:
    """Expand files, directories (their corpus files, ``FOLDER_SUFFIXES``) and globs (``**`` allowed) into
    a sorted file list."""
    if paths is None:
        return stdlib_sources()
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise DataError("TextDataModule(paths=[]) names no files; give paths or globs, or None for the built-in corpus")
    return expand_patterns(patterns, _folder_files,
                           lambda pattern: f"No files matched {pattern!r} (relative to {Path.cwd()})")


def stat_source(path: Path) -> os.stat_result:
    """``path.stat()``; a file that cannot be read raises ``DataError`` naming it."""
    try:
        return path.stat()
    except OSError as err:
        raise DataError(f"Cannot read {path}: {err.strerror or err}") from err


def corpus_bytes(sources: list[Path]) -> int:
    """Total size of the source files."""
    return sum(stat_source(p).st_size for p in sources)
