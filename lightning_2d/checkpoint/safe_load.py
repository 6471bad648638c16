"""Reading ``torch.save`` checkpoint files without running their code: ``torch.load(weights_only=True)``
with the few types our checkpoints may hold, and a refusal that names any other type.

Every load of a checkpoint file in the package goes through ``load_checkpoint_file`` (a sharded checkpoint's
``meta.pt`` and RNG files, a full file, export), and Lightning's own loads run inside ``trusted_globals`` with
``weights_only=True``: a file carrying a pickled callable (``os.system``, ``exec``) is refused before anything in it
is built, with one line naming the file and what it holds (``UnsafeCheckpointError``). DCP's ``.metadata`` is read
by ``dcp_metadata.DCPMetadataUnpickler``, which builds DCP's own types only. The errors
raised here are defined in ``checkpoint.errors``.
"""

from __future__ import annotations

import importlib
import pathlib
import pickle
import re
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.checkpoint.errors import (
    CheckpointError,
    ExportError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
)
from lightning_2d.models.llama.model import ModelArgs

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


def trusted(allow_globals: Sequence[str] = ()) -> list[Any]:
    """``SAFE_GLOBALS`` and the types named in ``allow_globals`` (imported by name)."""
    return [*SAFE_GLOBALS, *(_import_global(name) for name in allow_globals)]


@contextmanager
def trusted_globals(allow_globals: Sequence[str] = ()) -> Iterator[None]:
    """Within: a ``torch.load(weights_only=True)`` (Lightning's own, of ``meta.pt`` or a full file) builds
    ``SAFE_GLOBALS`` too. Types registered with ``torch.serialization.add_safe_globals`` stay allowed."""
    with torch.serialization.safe_globals(trusted(allow_globals)):
        yield


def check_weights_only(weights_only: Optional[bool], path: Any) -> None:
    """Refuse ``weights_only=False`` (``Trainer.fit(..., weights_only=False)``, ``fabric.load``): the strategies'
    loads are weights-only whatever is asked, and saying so beats ignoring the argument."""
    if weights_only is False:
        raise CheckpointError(
            f"weights_only=False was passed to load {path}: the 2D strategies load checkpoints weights-only always"
            " (unpickling other objects could run code stored in the file). Leave weights_only unset; if the"
            " checkpoint holds a type of your own (a data class in your hyper-parameters or a callback's state),"
            " register it with torch.serialization.add_safe_globals([YourType]) before the load."
        )


def load_checkpoint_file(path: Path, mmap: bool = False, allow_globals: Sequence[str] = ()) -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint file, tensors on the CPU.

    Only tensors, plain containers, ``SAFE_GLOBALS``, the types registered with
    ``torch.serialization.add_safe_globals`` and those named in ``allow_globals`` are built. Anything else pickled
    in the file (whose ``__reduce__`` could run any code) is refused, before it is built, with an
    ``UnsafeCheckpointError`` naming it.

    Args:
        path: A ``torch.save`` file: a full checkpoint, a sharded checkpoint's ``meta.pt`` or RNG file.
        mmap: Map the tensors' bytes instead of reading them (``torch.save``'s zip format): only the
            pages of the tensors used are ever read.
        allow_globals: ``module.Name`` of further types the user trusts this file to hold.

    Raises:
        UnsafeCheckpointError: the file holds a type a weights-only load refuses.
        UnreadableCheckpointError: the file is not a readable ``torch.save`` archive.
    """
    if mmap and not zipfile.is_zipfile(path):
        raise UnreadableCheckpointError(
            f"{path} is not a torch.save zip archive (the format of torch >= 1.6, which Lightning writes), so"
            " it cannot be memory-mapped. If it is an old-format checkpoint, re-save it:"
            " torch.save(torch.load(path, weights_only=True), new_path)."
        )
    try:
        with trusted_globals(allow_globals):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except RuntimeError as err:  # torch's reader: a truncated or corrupt archive
        raise UnreadableCheckpointError(f"{path} could not be read: {_first_line(err)}") from err
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found is None:  # not a refused type: a corrupt or foreign file
            reason = str(err).partition("WeightsUnpickler error:")[2].strip().splitlines() or [str(err)]
            raise UnreadableCheckpointError(f"{path} is not a readable torch.save checkpoint: {reason[0]}") from err
        name = found.group(1)
        allowed = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in SAFE_GLOBALS)
        # Never imported to look at it (an import runs the module's code): a class is capitalized by convention.
        if name.rpartition(".")[2][:1].isupper():
            way = (f"{name} comes from other code (a callback's state, a subclass's hyper-parameters) or from a"
                   f" tampered file. If you trust the file and {name} is a data class, register it before loading"
                   f" (torch.serialization.add_safe_globals([{name}])), or pass --allow-global {name} to lightning-2d"
                   f" export (export_hf(..., allow_globals=[{name!r}])).")
        else:
            way = (f"{name} looks like a function, which no checkpoint needs to hold: the file was written by code"
                   " you should not trust or tampered with since. Do not allow it; load a checkpoint you saved.")
        raise UnsafeCheckpointError(
            f"{path} holds a pickled {name}, which a weights-only load refuses to build (unpickling it could run"
            f" arbitrary code): the file was not loaded. Checkpoints of LlamaLightningModule hold only tensors,"
            f" plain containers and {allowed}; {way}"
        ) from err


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
