"""Async tensor parallelism (``_micro_pipeline_tp``): inductor splits each sequence-parallel all-gather → matmul and
matmul → reduce-scatter pair into chunks that overlap communication with compute through symmetric memory. It only
changes compiled graphs, so it needs ``compile=True``, CUDA and NCCL (the registered checks in ``parallel/dims.py``
refuse the rest before any process group). Applied by ``parallelize_model`` right after tensor parallelism."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from lightning_2d._compat import enable_micro_pipeline_tp, has_symmetric_memory, symmetric_memory

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def symmetric_memory_available() -> bool:
    """Whether this torch has ``torch.distributed._symmetric_memory`` (what async TP registers its group with)."""
    return has_symmetric_memory()


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap the tensor-parallel collectives with the matmuls (micro-pipelined TP).

    Sets ``torch._inductor.config._micro_pipeline_tp`` (process-wide) and enables symmetric
    memory for the tensor-parallel group. Call it on every rank after the process group exists and
    before the first compiled forward (compilation is lazy, so right after tensor parallelism is
    applied). Only graphs compiled afterwards are rewritten, which is why it needs ``compile=True``;
    the registered checks (``parallel/dims.py``: ``async_tensor_parallel_options`` …) refuse the combination
    beforehand.

    Args:
        tp_mesh: The tensor-parallel (1D) sub-mesh.

    Raises:
        ValueError: If the mesh is not a CUDA mesh of at least two ranks.
    """
    if tp_mesh.device_type != "cuda":
        raise ValueError(
            f"Async tensor parallelism needs CUDA and NCCL; the tensor-parallel mesh is on {tp_mesh.device_type!r}."
            " Set async_tensor_parallel=False."
        )
    if tp_mesh.size() < 2:
        raise ValueError(
            f"Async tensor parallelism overlaps tensor-parallel communication, but the tensor-parallel mesh has"
            f" {tp_mesh.size()} rank. Use tensor_parallel_size > 1 or async_tensor_parallel=False."
        )
    symm_mem = symmetric_memory()
    enable_micro_pipeline_tp()
    group_name = tp_mesh.get_group().group_name
    # torch 2.13 marks enable_symm_mem_for_group deprecated ("no need to call"), yet its
    # micro-pipeline pass still skips any group for which is_symm_mem_enabled_for_group() is False,
    # which only that call makes True: without it async TP silently does nothing.
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and (is_enabled is None or not is_enabled(group_name)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
