"""How a stored weight is filled, kept, counted and checked, whatever its storage format: a plain tensor, float8
training's weight wrapper, or QLoRA's 4-bit NF4 bases (``lightning_2d.ops.nf4``).

Materialization (``parallel.materialize``), FSDP2 (``parallel.fsdp``), the save-time finite check
(``parallel.guard``) and the planner ask a weight's ``WeightFormat`` (``weight_format(tensor)``) instead of testing
its type: a new format is a class with these members and a row of ``FORMATS``.

Pure ``torch``; torchao's tensor types are recognised by name, never imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from lightning_2d.ops.nf4 import NF4Format

#: ``fill_block(out, offset)``: writes the values of the block of a weight that starts at ``offset`` (``None``: the
#: whole weight) into ``out`` (a weight source's ``fill_block_`` with the weight's name and shape bound).
FillBlock = Callable[[torch.Tensor, Optional[tuple[int, ...]]], None]


class WeightFormat(Protocol):
    """What the library does with a weight (a rank's local tensor) of one storage format."""

    #: Whether freshly allocated memory can hold a value no initializer produces (materialization checks that every
    #: tensor lost it); ``False``: the format has no such value, and materialization tracks its fill instead.
    has_sentinel: bool
    #: Whether the save-time check of NaN/inf values reads it (frozen 4-bit codes: no value training can change).
    checks_finite: bool
    #: Whether FSDP2 all-gathers it as one tensor (torch's one-rank shortcut copies one all-gather input per parameter).
    gathers_as_one: bool

    def matches(self, local: torch.Tensor) -> bool:
        """Whether ``local`` (a plain tensor, or a DTensor's local shard) is stored in this format."""
        ...

    def fill_(self, local: torch.Tensor, fill_block: FillBlock, global_shape: tuple[int, ...],
              offset: Optional[tuple[int, ...]], device: torch.device) -> None:
        """Give ``local`` (this rank's block of the weight, at ``offset``; ``None``: the whole) its values."""
        ...

    def snapshot(self, local: torch.Tensor) -> Any:
        """A copy of ``local``'s stored values, to ``restore_`` after ``to_empty`` reallocated it."""
        ...

    def restore_(self, local: torch.Tensor, snapshot: Any) -> None:
        """Put ``snapshot`` (``snapshot(local)`` of this weight) back into ``local``, in place."""
        ...

    def nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes stored for ``numel`` elements of a weight of ``dtype``."""
        ...

    def gathered_bytes(self, numel: int, dtype: torch.dtype, gather_dtype: torch.dtype) -> int:
        """Bytes of ``numel`` elements of a weight of ``dtype`` that FSDP gathers in ``gather_dtype`` (its
        ``param_dtype``)."""
        ...


class PlainFormat:
    """A tensor in its dtype: NaN (floating point) or the dtype's minimum (integers) as the sentinel; copied whole."""

    has_sentinel = True
    checks_finite = True
    gathers_as_one = True

    def matches(self, local: torch.Tensor) -> bool:
        return True

    def fill_(self, local: torch.Tensor, fill_block: FillBlock, global_shape: tuple[int, ...],
              offset: Optional[tuple[int, ...]], device: torch.device) -> None:
        fill_block(local, offset)

    def snapshot(self, local: torch.Tensor) -> Any:
        return local.detach().clone()

    @torch.no_grad()
    def restore_(self, local: torch.Tensor, snapshot: Any) -> None:
        local.copy_(snapshot)

    def nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def gathered_bytes(self, numel: int, dtype: torch.dtype, gather_dtype: torch.dtype) -> int:
        return numel * gather_dtype.itemsize


class Float8TrainingFormat(PlainFormat):
    """torchao's float8 training weight (``WeightWithDynamicFloat8CastTensor`` …): stored in its high-precision dtype,
    all-gathered in float8 (one byte) under ``fsdp_float8_all_gather``."""

    def matches(self, local: torch.Tensor) -> bool:
        return "Float8" in type(local).__name__

    def gathered_bytes(self, numel: int, dtype: torch.dtype, gather_dtype: torch.dtype) -> int:
        return numel


PLAIN = PlainFormat()
#: The formats other than plain, asked in this order (the first that matches; plain otherwise).
FORMATS: tuple[WeightFormat, ...] = (NF4Format(), Float8TrainingFormat())


def weight_format(tensor: Any) -> WeightFormat:
    """The ``WeightFormat`` of ``tensor`` (a parameter, a DTensor or a local shard)."""
    if hasattr(tensor, "to_local"):  # a DTensor: its local shard's format
        with torch.no_grad():
            tensor = tensor.to_local()
    return next((f for f in FORMATS if f.matches(tensor)), PLAIN)


__all__ = ["FORMATS", "FillBlock", "Float8TrainingFormat", "PLAIN", "PlainFormat", "WeightFormat", "weight_format"]
