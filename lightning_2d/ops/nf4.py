"""NF4 base weights for QLoRA (Dettmers et al. 2023): torchao's ``NF4Tensor``, made and filled so that every layout holds
the same bits.

A frozen weight is stored as 4-bit NormalFloat codes in blocks of ``NF4_BLOCK_SIZE`` elements, each block with its
absmax scaler; the scalers are themselves quantized to int8 in groups of ``NF4_SCALER_BLOCK_SIZE`` blocks around their
mean ("double quantization"). ``F.linear`` with an ``NF4Tensor`` weight dequantizes it to the input's dtype (torchao's
``linear_nf4``); gradients flow to the input, never to the weight.

Two rules make a sharded NF4 weight equal to the one-device weight, bit for bit:

- **Quantize the whole weight, then cut it.** The scalers' mean is one number for the whole tensor, so quantizing
  each rank's rows alone gives other bits. ``fill_nf4_`` quantizes the full weight (every rank computes it from the
  same layout-independent values) and copies this rank's rows of the result in place.
- **Cut on whole scaler groups.** torchao splits an ``NF4Tensor`` along its rows only when every inner tensor splits
  evenly: each shard must hold whole groups of ``NF4_GROUP`` (64 × 256) elements and the rows must divide.
  ``nf4_shard_problem`` says when a weight cannot be cut that way.

A meta ``NF4Tensor`` (``to_nf4_weight`` of a meta weight) keeps its two small constants (the code table and the
scalers' mean) on the device the weights will live on: ``to_empty`` allocates only the quantized data, scalers and
factors, and shares the constants with every view FSDP2 makes of the shard, so filling them in place reaches all.

Pure ``torch`` + torchao (optional: ``pip install "lightning-2d[qlora]"``); no ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_2d.ops.torchao import quiet_torchao_import, torchao_problem, torchao_version

#: Elements per quantization block (one absmax scaler each); torchao's and bitsandbytes' default.
NF4_BLOCK_SIZE = 64
#: Blocks per group of double-quantized scalers (one int8 scale factor each).
NF4_SCALER_BLOCK_SIZE = 256
#: Elements of one scaler group: a shard of an NF4 weight must hold whole groups.
NF4_GROUP = NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE
#: The ``LoRA.quantize_base`` values.
QUANTIZATIONS = ("nf4",)


def nf4_problem() -> Optional[str]:
    """Why NF4 base weights cannot be used here (torchao missing or too old), else ``None``. Imports nothing."""
    return torchao_problem("lora.quantize_base='nf4' (QLoRA)", "qlora", torchao_version())


def _to_nf4() -> Any:
    problem = nf4_problem()
    if problem is not None:
        raise ImportError(problem)
    with quiet_torchao_import():
        from torchao.quantization import to_nf4
    return to_nf4


def is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) is torchao's ``NF4Tensor``, without importing torchao."""
    if hasattr(tensor, "to_local"):  # a DTensor
        with torch.no_grad():
            tensor = tensor.to_local()
    return type(tensor).__name__ == "NF4Tensor"


def nf4_shard_problem(name: str, shape: tuple[int, ...], shards: int) -> Optional[str]:
    """Why the weight ``name`` of ``shape`` cannot be held as NF4 in ``shards`` row shards, else ``None``."""
    numel = 1
    for size in shape:
        numel *= size
    if len(shape) != 2:
        return f"{name} has shape {tuple(shape)}; NF4 base weights are 2-D linear weights"
    if numel % NF4_GROUP:
        return (f"{name} ({shape[0]} × {shape[1]} = {numel:,} elements) is not a whole number of NF4 scaler groups of"
                f" {NF4_GROUP:,} ({NF4_BLOCK_SIZE} × {NF4_SCALER_BLOCK_SIZE}) elements")
    if shards > 1 and (shape[0] % shards or (numel // shards) % NF4_GROUP):
        return (f"{name} ({shape[0]} × {shape[1]}) does not split into {shards} row shards of whole NF4 scaler groups"
                f" ({NF4_GROUP:,} elements): each shard would hold {numel / shards:,.0f}")
    return None


def nf4_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of an NF4 weight of ``numel`` elements quantized from ``dtype``: two 4-bit codes per byte, an int8 scaler
    per block, a ``dtype`` factor per scaler group (the code table and the scalers' mean aside): about 0.52 per element."""
    return numel // 2 + numel // NF4_BLOCK_SIZE + numel // NF4_GROUP * dtype.itemsize


_CODE_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def to_nf4_weight(weight: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """``weight`` as an ``NF4Tensor`` of its dtype. A meta ``weight`` gives a meta ``NF4Tensor`` whose constants are on
    ``device`` (where ``to_empty`` will allocate the rest), ready for ``fill_nf4_``."""
    to_nf4 = _to_nf4()
    quantized = to_nf4(weight.detach(), NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)
    if weight.is_meta:
        device = torch.device(device) if device is not None else torch.device("cpu")
        # Each weight its own constants (filled in place later): the code table, from one real quantization per
        # device and dtype (a planner quantizes hundreds of meta weights).
        key = (device, weight.dtype)
        if key not in _CODE_TABLES:
            _CODE_TABLES[key] = to_nf4(torch.zeros(NF4_GROUP, dtype=weight.dtype, device=device), NF4_BLOCK_SIZE,
                                       NF4_SCALER_BLOCK_SIZE).nf4
        quantized.nf4 = _CODE_TABLES[key].clone()
        quantized.scaler_mean = torch.zeros((), dtype=quantized.scaler_mean.dtype, device=device)
    return quantized


def _inner_names(tensor: torch.Tensor) -> list[str]:
    return list(tensor.__tensor_flatten__()[0])


@torch.no_grad()
def fill_nf4_(local: torch.Tensor, full: torch.Tensor, row_offset: Optional[int]) -> None:
    """Set ``local`` (an ``NF4Tensor`` holding rows ``row_offset …`` of a weight) to its rows of the NF4 quantization of
    the whole weight ``full``, in place: the same bits as quantizing ``full`` on one device."""
    quantized = _to_nf4()(full.to(local.dtype).contiguous(), NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)
    rows = local.shape[0]
    if rows != full.shape[0]:
        quantized = torch.chunk(quantized, full.shape[0] // rows, dim=0)[(row_offset or 0) // rows]
    for name in _inner_names(local):
        getattr(local, name).copy_(getattr(quantized, name))


def nf4_state(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies of an ``NF4Tensor``'s inner tensors (to restore with ``restore_nf4_`` or compare with ``nf4_equal``)."""
    return {name: getattr(tensor, name).detach().clone() for name in _inner_names(tensor)}


@torch.no_grad()
def restore_nf4_(tensor: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    for name, value in state.items():
        getattr(tensor, name).copy_(value)


def nf4_equal(tensor: torch.Tensor, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``tensor`` holds exactly the bits of ``state`` (``nf4_state``)."""
    return all(torch.equal(getattr(tensor, name), value) for name, value in state.items())


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """An ``NF4Tensor``'s values in its dtype (a plain tensor)."""
    return tensor.get_original_weight()


class NF4Format:
    """An ``NF4Tensor`` weight as ``lightning_2d.ops.weights.WeightFormat``: no sentinel value (4-bit codes), filled by
    quantizing the whole weight and keeping this rank's rows (``fill_nf4_``), kept as its inner tensors (``clone()``
    would quantize its dequantized values again), about 0.52 bytes an element (gathered as such: torchao's all-gather
    moves the codes, scalers and factors, three all-gather inputs), and left out of the finite check (frozen codes;
    torchao has no norm of them)."""

    has_sentinel = False
    checks_finite = False
    gathers_as_one = False

    def matches(self, local: torch.Tensor) -> bool:
        return is_nf4(local)

    def fill_(self, local: torch.Tensor, fill_block: Any, global_shape: tuple[int, ...],
              offset: Optional[tuple[int, ...]], device: torch.device) -> None:
        # One full weight in its dtype is allocated at a time.
        full = torch.empty(global_shape, dtype=local.dtype, device=device)
        fill_block(full, None)  # the whole weight
        fill_nf4_(local, full, offset[0] if offset is not None else None)

    def snapshot(self, local: torch.Tensor) -> dict[str, torch.Tensor]:
        return nf4_state(local)

    def restore_(self, local: torch.Tensor, snapshot: dict[str, torch.Tensor]) -> None:
        restore_nf4_(local, snapshot)

    def nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return nf4_bytes(numel, dtype)

    def gathered_bytes(self, numel: int, dtype: torch.dtype, gather_dtype: torch.dtype) -> int:
        return nf4_bytes(numel, dtype)  # FSDP's param_dtype aside: the codes are gathered as stored


__all__ = ["NF4Format", "NF4_BLOCK_SIZE", "NF4_GROUP", "NF4_SCALER_BLOCK_SIZE", "QUANTIZATIONS", "dequantize", "fill_nf4_",
           "is_nf4", "nf4_bytes", "nf4_equal", "nf4_problem", "nf4_shard_problem", "nf4_state", "restore_nf4_", "to_nf4_weight"]
