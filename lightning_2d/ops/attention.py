"""Causal attention within packed documents: the masks and the attention core, pure torch.

One mask per batch serves every layer. A model builds it once per forward from the tokens' positions
(``attention_mask``: ``None`` for plain causal attention, a dense ``(B, 1, T, T)`` boolean mask, or a FlexAttention
``BlockMask``) and hands it to each layer's core (``attend``), which picks the kernel from the mask's kind:
``scaled_dot_product_attention`` (causal, or with the dense mask) or FlexAttention (the block mask: the blocks no query
may see are skipped, not computed). The block mask is the default on CUDA; ``flex=True`` forces it anywhere, so the
CPU tests run the CUDA code path's forward (torch 2.13 has no FlexAttention backward on CPU).

FlexAttention is compiled once for the process (``compiled_flex_attention``, as torchtitan's ``FlexAttentionWrapper``
keeps one ``torch.compile(flex_attention)``): uncompiled, on CUDA it is an unfused reference implementation that
materializes the whole ``(T, T)`` score matrix (torch warns so) -- what long sequences cannot afford. So is
``create_block_mask`` (``compiled_create_block_mask``, as torchtitan): eager, it evaluates the mask function on the
whole ``(B, T_q, T_kv)`` grid at once (a boolean tensor: 1 GiB per sequence of 32k tokens) before reducing it to
blocks. Every caller (``attention_mask``, ``attend``, ``lightning_2d.parallel.context``) goes through
``flex_attention_for`` / ``create_block_mask_for``, so no path of ours runs either uncompiled on CUDA. On other devices
they run eagerly: compiling FlexAttention on CPU costs about 80 s (measured, 2 cores) for a forward that only the tests
run.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

#: What ``attention_mask`` builds and ``attend`` takes: nothing (causal), a dense boolean mask, or a block mask.
AttentionMask = Optional[Union[torch.Tensor, "BlockMask"]]

#: The device types on which FlexAttention runs compiled (``flex_attention_for``).
COMPILED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)

#: The process's compiled callables by name (``flex_attention``, ``create_block_mask``), created on first use.
_compiled: dict[str, Callable[..., Any]] = {}
_compiled_lock = threading.Lock()  # ranks simulated as threads (the unit tests) may race to create them


def _eager(name: str) -> Callable[..., Any]:
    from torch.nn.attention import flex_attention as module

    return getattr(module, name)


def _compiled_once(name: str) -> Callable[..., Any]:
    with _compiled_lock:
        if name not in _compiled:
            _compiled[name] = torch.compile(_eager(name))
        return _compiled[name]


def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, created on first use and then the same object for the process: one
    compiled callable whose graphs (one per input shape and mask kind) every layer and every path share."""
    return _compiled_once("flex_attention")


def compiled_create_block_mask() -> Callable[..., "BlockMask"]:
    """``torch.compile(create_block_mask)``, once for the process: the block tables computed block by block,
    without the whole boolean mask the eager function materializes first."""
    return _compiled_once("create_block_mask")


def flex_attention_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The FlexAttention callable to run on ``device``: the process's compiled one on CUDA
    (``COMPILED_DEVICE_TYPES``), the eager one elsewhere (forward only on CPU, for the tests)."""
    return compiled_flex_attention() if device.type in COMPILED_DEVICE_TYPES else _eager("flex_attention")


def create_block_mask_for(device: torch.device) -> Callable[..., "BlockMask"]:
    """``create_block_mask`` to build a block mask on ``device`` with: compiled once on CUDA, eager elsewhere."""
    return compiled_create_block_mask() if device.type in COMPILED_DEVICE_TYPES else _eager("create_block_mask")


def is_block_mask(mask: Any) -> bool:
    """Whether ``mask`` is a FlexAttention ``BlockMask`` (checked without importing FlexAttention for other masks)."""
    if mask is None or isinstance(mask, torch.Tensor):
        return False
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)``: which packed document each token is in; a document starts wherever ``position_ids`` is 0
    (``lightning_2d.data.document_positions``)."""
    return (position_ids == 0).cumsum(-1)


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool: query ``i`` sees key ``j`` iff ``j <= i`` and both are in the same document.

    The dense form, for ``scaled_dot_product_attention`` on any device; ``document_block_mask`` is the same mask as
    FlexAttention blocks.
    """
    document = document_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def document_block_mask(position_ids: torch.Tensor) -> "BlockMask":
    """``document_causal_mask`` as a FlexAttention ``BlockMask`` (one head dimension shared by all heads): per
    128 × 128 block, whether it is empty, full or partial, so FlexAttention skips the blocks across documents."""
    document = document_ids(position_ids)

    def same_document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (document[b, q_idx] == document[b, kv_idx])

    batch, length = position_ids.shape
    create = create_block_mask_for(position_ids.device)
    return create(same_document_causal, batch, None, length, length, device=position_ids.device)


def attention_mask(
    position_ids: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None, flex: Optional[bool] = None
) -> AttentionMask:
    """The mask of one batch, for every layer: ``None`` without ``position_ids`` (causal attention over the whole
    window), else the documents' causal mask as a block mask (``flex``; default: on CUDA) or dense.

    Args:
        position_ids: ``(B, T)`` each token's position in its document, or ``None``.
        dtype: The activations' dtype (unused here; a context-parallel builder makes an additive mask of it).
        flex: Build FlexAttention's block mask (``True``) or the dense mask (``False``); ``None``: by device.
    """
    if position_ids is None:
        return None
    if position_ids.is_cuda if flex is None else flex:
        return document_block_mask(position_ids)
    return document_causal_mask(position_ids)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
    """Causal attention of ``(B, H, T, Dh)`` query heads to ``(B, H_kv, T, Dh)`` key/value heads (each serving
    ``H / H_kv`` consecutive query heads) under ``mask`` (``attention_mask``'s): ``None`` causal, a dense boolean
    mask, or a ``BlockMask`` (FlexAttention, compiled on CUDA; the key/value heads are not repeated)."""
    if is_block_mask(mask):
        return flex_attention_for(q.device)(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
