"""Reading ``torch.save`` checkpoint files without running their code: ``torch.load(weights_only=True)``
with the few types our checkpoints may hold, and a refusal that names any other type."""

from __future__ import annotations

import importlib
import pathlib
import pickle
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_2d.errors import Lightning2DError
from lightning_2d.models.llama.model import ModelArgs


class ExportError(Lightning2DError, ValueError):
    """A checkpoint that cannot be exported as asked; the message names the problem and the fix."""


#: Types besides tensors and plain containers that a weights-only load of a checkpoint may build:
#: ``ModelArgs`` (the hyper-parameters of older checkpoints) and paths (LightningCLI/jsonargparse
#: hyper-parameters, callback states). Building them runs none of the file's code.
SAFE_GLOBALS: tuple[type, ...] = (ModelArgs, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)


def _import_global(qualified_name: str) -> Any:
    module, _, name = qualified_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ExportError(
            f"--allow-global {qualified_name!r}: cannot import it ({err}); give MODULE.NAME as the refusal names it"
        ) from err


def load_checkpoint_file(path: Path, mmap: bool = False, allow_globals: Sequence[str] = ()) -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint file, tensors on the CPU.

    Only tensors, plain containers, ``SAFE_GLOBALS`` and the types named in ``allow_globals`` are
    built. Anything else pickled in the file (whose ``__reduce__`` could run any code) is refused,
    before it is built, with an ``ExportError`` naming it.

    Args:
        path: A ``torch.save`` file: a full checkpoint, or a sharded checkpoint's ``meta.pt``.
        mmap: Map the tensors' bytes instead of reading them (``torch.save``'s zip format): only the
            pages of the tensors used are ever read.
        allow_globals: ``module.Name`` of further types the user trusts this file to hold.
    """
    if mmap and not zipfile.is_zipfile(path):
        raise ExportError(
            f"{path} is not a torch.save zip archive (the format of torch >= 1.6, which Lightning writes), so"
            " it cannot be memory-mapped. If it is an old-format checkpoint, re-save it:"
            " torch.save(torch.load(path, weights_only=True), new_path)."
        )
    trusted = [*SAFE_GLOBALS, *(_import_global(name) for name in allow_globals)]
    try:
        with torch.serialization.safe_globals(trusted):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except RuntimeError as err:  # torch's reader: a truncated or corrupt archive
        raise ExportError(f"{path} could not be read: {err}") from err
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found is None:  # not a refused type: a corrupt or foreign file
            reason = str(err).partition("WeightsUnpickler error:")[2].strip().splitlines() or [str(err)]
            raise ExportError(f"{path} is not a readable torch.save checkpoint: {reason[0]}") from err
        name = found.group(1)
        allowed = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in SAFE_GLOBALS)
        raise ExportError(
            f"{path} holds a pickled {name}, which a weights-only load refuses to build (unpickling it could run"
            f" arbitrary code): the file was not loaded. Checkpoints of LlamaLightningModule hold only tensors,"
            f" plain containers and {allowed}; {name} comes from other code (a callback's state, a subclass's"
            f" hyper-parameters) or from a tampered file. If you trust the file and {name} is a data class (not"
            f" a function such as exec or os.system), pass --allow-global {name}"
            f" (export_hf(..., allow_globals=[{name!r}])) to build it."
        ) from err
