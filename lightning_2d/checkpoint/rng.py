"""Random states in checkpoints: each rank's generators saved beside its shard (``rng/rank{r}.pt``, or inside a full
file), and restored after a load only at the layout they were saved at (``layout_of``: what a checkpoint records of
it), since at another one the ranks draw other numbers anyway.

As tensors and plain values only, so they load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_2d.checkpoint.digests import file_digest
from lightning_2d.checkpoint.names import RNG_FOLDER
from lightning_2d.checkpoint.safe_load import load_checkpoint_file


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
    (folder / RNG_FOLDER).mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    name = f"{RNG_FOLDER}/rank{rank}.pt"
    (folder / name).write_bytes(buffer.getvalue())
    return {name: file_digest(buffer.getvalue())}


def load_rng(folder: Path, rank: int) -> bool:
    """Restore this rank's generators from a sharded checkpoint; ``False`` if it has none for this rank."""
    file = folder / RNG_FOLDER / f"rank{rank}.pt"
    if not file.is_file():
        return False
    set_rng_state(load_checkpoint_file(file))
    return True


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
