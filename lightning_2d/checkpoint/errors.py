"""The checkpoint package's errors, in one place.

``CheckpointError`` (a checkpoint a load refuses) is defined in ``lightning_2d/errors.py`` and imported here;
``ExportError`` (a checkpoint an export refuses) and the two a load and an export share, ``UnreadableCheckpointError``
and its ``UnsafeCheckpointError``, are defined here. Every module of the package imports them from this one.
"""

from __future__ import annotations

from lightning_2d.errors import CheckpointError, Lightning2DError

__all__ = ["CheckpointError", "ExportError", "UnreadableCheckpointError", "UnsafeCheckpointError"]


class ExportError(Lightning2DError, ValueError):
    """A checkpoint that cannot be exported as asked; the message names the problem and the fix."""


class UnreadableCheckpointError(CheckpointError, ExportError):
    """A checkpoint file that cannot be read (cut short, not a ``torch.save`` archive): refused by a load and by an
    export alike."""


class UnsafeCheckpointError(UnreadableCheckpointError):
    """A checkpoint file holding a pickled object a weights-only load refuses to build (its unpickling could run
    code): the file was not loaded. Raised by every load path (Trainer, Fabric, export, the CLI's check)."""
