"""Checkpoints of part of a model: LoRA's adapters (the frozen base comes from its own source, ``init_from`` or the
seeded init). What such a checkpoint keeps and records (``TrainedSubset``, from the run's model converters,
``parallel.converters``), applied by the checkpoint IO of both strategies (``integration.checkpoint_io``) and, under
Lightning's own strategies, by the module; the record checked before a resume reads anything
(``check_adapter_record``); the tensors the checkpoint holds loaded (``load_trained_subset``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_2d.checkpoint.dcp_metadata import stored_shapes
from lightning_2d.checkpoint.errors import CheckpointError
from lightning_2d.checkpoint.names import METADATA_FILE
from lightning_2d.checkpoint.safe_load import load_checkpoint_file

if TYPE_CHECKING:
    from lightning_2d.parallel.converters import ModelConverters


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


@dataclass(frozen=True)
class TrainedSubset:
    """What a checkpoint of part of a model holds: the model's tensors ``keeps`` names (with the optimizer state of
    what trains, the loop's position and the schedule, as always), and ``record`` under ``ADAPTERS_KEY``: the
    converters' record (LoRA's settings) and the base they were trained on, so that a resume rebuilds the same base.

    Attributes:
        keeps: Whether the checkpoint holds the model tensor of this (qualified) name.
        record: ``{"lora": settings, "base": {"init_from": folder or None, "init_seed": seed or None}}``.
    """

    keeps: Callable[[str], bool]
    record: dict[str, Any]

    @classmethod
    def of(cls, converters: "ModelConverters", base: dict[str, Any]) -> Optional["TrainedSubset"]:
        """The subset ``converters`` keep (``checkpoint_filter``) of a model on ``base``; ``None``: checkpoints hold the
        whole model."""
        keeps = converters.checkpoint_filter
        return None if keeps is None else cls(keeps, {**converters.checkpoint_record(), "base": base})

    def state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of the model state dict ``state`` the checkpoint keeps."""
        return {name: value for name, value in state.items() if self.keeps(name)}

    def apply(self, checkpoint: dict[str, Any], key: str) -> None:
        """Keep only this subset of the model state under ``checkpoint[key]`` and add the record, in place."""
        checkpoint[key] = self.state_dict(checkpoint[key])
        checkpoint[ADAPTERS_KEY] = self.record


def check_adapter_record(saved: dict[str, Any], current: Optional[TrainedSubset], path: Path) -> None:
    """Refuse (before anything is loaded) adapters trained with other settings or on another base than this run's.

    Args:
        saved: The checkpoint's record (``ADAPTERS_KEY``).
        current: What this run's checkpoints keep (``None``: the whole model: it trains no adapters).
        path: The checkpoint, for the message.

    Raises:
        CheckpointError: naming each difference and the way on.
    """
    problems = []
    saved_lora = saved.get("lora") or {}
    lora = current.record.get("lora") if current is not None else None
    if lora is None:
        problems.append(f"it holds LoRA adapters ({saved_lora}) and no base, but this module has no lora=; pass"
                        f" lora={saved_lora} and the base's init_from, or export it merged first")
    else:
        changed = {k: (saved_lora.get(k), v) for k, v in lora.items() if k != "dropout" and saved_lora.get(k) != v}
        problems += [f"lora.{k} was {old!r}, is {new!r}" for k, (old, new) in changed.items()]
        assert current is not None
        saved_base, base = saved.get("base") or {}, current.record["base"]
        if saved_base.get("init_from") != base["init_from"]:
            problems.append(f"its adapters were trained on init_from={saved_base.get('init_from')!r}; this run's"
                            f" base is init_from={base['init_from']!r}")
        elif base["init_from"] is None and saved_base.get("init_seed") != base["init_seed"]:
            problems.append(f"its adapters were trained on the base initialized from seed"
                            f" {saved_base.get('init_seed')}; this run's base is from seed {base['init_seed']}: set"
                            f" init_seed={saved_base.get('init_seed')}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path} holds LoRA adapters that do not belong to this run:\n  - " + "\n  - ".join(problems)
            + "\nResume with the settings and base it was saved with (nothing was loaded)."
        )


def adapter_record(path: Path) -> Optional[dict[str, Any]]:
    """The adapters record of a sharded checkpoint (``{"lora": settings, "base": {...}}``), ``None`` for a checkpoint
    of the whole model."""
    file = Path(path) / METADATA_FILE
    if not file.exists():
        return None
    record = load_checkpoint_file(file).get(ADAPTERS_KEY)
    return record if isinstance(record, dict) else None
