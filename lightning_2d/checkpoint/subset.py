"""Checkpoints of part of a model: LoRA's adapters (the frozen base comes from its own source, ``init_from`` or the
seeded init), loaded as the tensors the checkpoint holds, and the record of what they were trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.checkpoint.dcp_metadata import stored_shapes
from lightning_2d.checkpoint.names import METADATA_FILE
from lightning_2d.checkpoint.safe_load import load_checkpoint_file


def load_trained_subset(path: Path, key: str, module: torch.nn.Module, optimizers: Mapping[str, Any]) -> dict[str, Any]:
    """Load a sharded checkpoint that holds only some of ``module``'s tensors (LoRA's adapters; the frozen base comes
    from its own source, ``init_from`` or the seeded init): those tensors under ``key``, each optimizer's state
    under its own key, resharded to the current layout; return the metadata (``meta.pt``).

    Lightning's loader asks DCP for every tensor of the module, and DCP refuses a checkpoint without them; this reads
    what the checkpoint holds, the rest of the module kept as it is.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = stored_shapes(path, key)
    state = {name: tensor for name, tensor in get_model_state_dict(module).items() if name in saved}
    dcp.load({key: state}, checkpoint_id=path)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    for optim_key, optimizer in optimizers.items():
        optim_state = {optim_key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[optim_key],
                                 options=StateDictOptions(cpu_offload=True))
    return load_checkpoint_file(path / METADATA_FILE)


#: The key of a checkpoint's adapters record (``meta.pt``): their settings and the base they were trained on.
ADAPTERS_KEY = "adapters"


def adapter_record(path: Path) -> Optional[dict[str, Any]]:
    """The adapters record of a sharded checkpoint (``{"lora": settings, "base": {...}}``), ``None`` for a checkpoint
    of the whole model."""
    file = Path(path) / METADATA_FILE
    if not file.exists():
        return None
    record = load_checkpoint_file(file).get(ADAPTERS_KEY)
    return record if isinstance(record, dict) else None
