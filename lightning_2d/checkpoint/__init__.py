"""Checkpoints: complete-or-ignored sharded (DCP) and full saves and what a load takes from a folder of them
(``discovery``, ``resolution``), whether one is intact (``integrity``, over ``digests``), writing them
(``writer``), random states (``rng``), part of a model (``subset``), what a checkpoint's metadata says
(``dcp_metadata``), weights-only reading (``safe_load``), the package's errors (``errors``); our Llama's weights to
and from Hugging Face directories (``hf``). Above the model families and the parallel mechanics."""

from lightning_2d.checkpoint.discovery import (
    checkpoints_in,
    incomplete_checkpoints,
    is_checkpoint,
    is_complete,
    latest_checkpoint,
)
from lightning_2d.checkpoint.errors import CheckpointError
from lightning_2d.checkpoint.integrity import Integrity
from lightning_2d.checkpoint.resolution import check_ckpt_path, resolve_checkpoint

__all__ = [
    "CheckpointError",
    "Integrity",
    "check_ckpt_path",
    "checkpoints_in",
    "incomplete_checkpoints",
    "is_checkpoint",
    "is_complete",
    "latest_checkpoint",
    "resolve_checkpoint",
]
