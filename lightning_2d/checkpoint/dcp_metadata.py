"""What a checkpoint says about itself without a tensor read: DCP's ``.metadata`` unpickled with DCP's own types
only, the shard sizes it promises, and the names and shapes of the tensors stored (compared with a model's).

DCP writes its ``.metadata`` with pickle and its own reader loads it with a plain ``pickle.load``: a tampered file
would run code. ``DCPMetadataUnpickler`` builds only DCP's metadata types (and what they hold).
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any

import torch

from lightning_2d.checkpoint.names import DCP_METADATA_FILE
from lightning_2d.checkpoint.safe_load import load_checkpoint_file

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
