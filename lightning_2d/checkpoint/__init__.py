"""Checkpoints: complete-or-ignored sharded (DCP) and full saves, integrity checks and fall-back on resume,
background writes, RNG states (``files``); weights-only reading (``safe_load``); our Llama's weights to and
from Hugging Face directories (``hf``). Above the model families and the parallel mechanics."""

from lightning_2d.checkpoint.files import (
    CheckpointError,
    check_ckpt_path,
    checkpoints_in,
    incomplete_checkpoints,
    is_checkpoint,
    is_complete,
    latest_checkpoint,
    resolve_checkpoint,
)

__all__ = [
    "CheckpointError",
    "check_ckpt_path",
    "checkpoints_in",
    "incomplete_checkpoints",
    "is_checkpoint",
    "is_complete",
    "latest_checkpoint",
    "resolve_checkpoint",
]
