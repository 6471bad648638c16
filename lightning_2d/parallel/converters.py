"""Model converters: a change of the model that a training run asks for (low-rank adapters, their NF4 bases), applied
at one point to the meta model, before it is parallelized (torchtitan's ``ModelConverter``).

A converter is made from what the trained thing says of itself (the registered checks' inputs, ``parallel.checks
.INPUTS``: a module's ``lora=``, the adapters of a model given to Fabric) and its plan (the family's facts, such as
where adapters go by default): ``ModelConverters.of(plan, inputs)`` asks each row of ``CONVERTERS``. Then it

- converts the meta model in place, given the shards FSDP will cut each weight into (``convert``);
- says which parameters train (``trained``: the rest is frozen);
- says what a checkpoint of the run keeps (``checkpoint_filter``: the names it holds, ``None`` for the whole model)
  and what it records of the conversion (``checkpoint_record``), which the checkpoint IO applies.

``parallelize_and_materialize`` (both strategies) and ``convert_and_materialize`` (one device: the modules' parity
reference, a single-device Fabric loop) apply them; so does the planner's simulated rank. Nothing else knows what a
converter does: a new one is a class with these members, in the module of its feature, and a row of ``CONVERTERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import nn

from lightning_2d.parallel.config import ParallelPlan
from lightning_2d.parallel.lora import LoRAAdapters, NF4Bases

if TYPE_CHECKING:
    from lightning_2d.parallel.meshes import ParallelMeshes


class ModelConverter(Protocol):
    """One change of the model (see the module docstring)."""

    def convert(self, model: nn.Module, shards: Optional[int], device: Optional[torch.device]) -> None:
        """Change ``model`` (on the meta device, not yet parallelized) in place.

        Args:
            model: The model the plan applies to.
            shards: The row shards FSDP cuts each weight into (``ParallelMeshes.fsdp``'s shard dimension; 1 on one
                device); ``None``: the layout is not known yet (a module checking its settings against the model at
                construction): only what changes the parameters' names and shapes is done.
            device: Where the model will be materialized (a meta tensor's constants that ``to_empty`` does not
                allocate go there).
        """
        ...

    def trained(self, name: str) -> bool:
        """Whether the parameter called ``name`` (a qualified name) trains; ``convert`` froze the others."""
        ...

    @property
    def checkpoint_filter(self) -> Optional[Callable[[str], bool]]:
        """Whether a checkpoint keeps the model tensor called ``name`` (the rest is rebuilt from the run's base);
        ``None``: the converter keeps every tensor."""
        ...

    def checkpoint_record(self) -> dict[str, Any]:
        """What a checkpoint records of the conversion (plain data), for a resume to be checked against; ``{}``:
        nothing."""
        ...

    def freezes(self) -> bool:
        """Whether it freezes part of the model (the planner then counts no gradient, optimizer state or saved
        normalized value for what does not train)."""
        ...

    def plan_note(self, trained: int, numel: int) -> Optional[str]:
        """What the planner says of the conversion on a device holding ``numel`` parameter elements, ``trained`` of
        them training; ``None``: nothing."""
        ...


#: Each converter kind's maker, in the order they convert: ``maker(plan, inputs)`` is the converter ``inputs`` (the
#: checks' inputs) ask for, or ``None``. Adapters first, then the storage of their frozen bases.
CONVERTERS: tuple[Callable[[ParallelPlan, Mapping[str, Any]], Optional[ModelConverter]], ...] = (
    LoRAAdapters.of,
    NF4Bases.of,
)


@dataclass(frozen=True)
class ModelConverters:
    """The converters a run applies, in order (``of``); empty: the model trains as it is built."""

    converters: tuple[ModelConverter, ...] = ()

    @classmethod
    def of(cls, plan: ParallelPlan, inputs: Mapping[str, Any]) -> "ModelConverters":
        """The converters ``inputs`` (what the trained thing says of itself: ``lora`` …) ask for, made with ``plan``."""
        made = (maker(plan, inputs) for maker in CONVERTERS)
        return cls(tuple(converter for converter in made if converter is not None))

    def convert(self, model: nn.Module, shards: Optional[int], device: Optional[torch.device] = None) -> None:
        """Each converter's ``convert``, in order (see ``ModelConverter.convert``), then what one of them does not
        train frozen."""
        for converter in self.converters:
            converter.convert(model, shards, device)
        if self.converters:
            for name, param in model.named_parameters():
                if param.requires_grad and not self.trained(name):
                    param.requires_grad_(False)

    def trained(self, name: str) -> bool:
        """Whether the parameter called ``name`` trains: every converter trains it."""
        return all(converter.trained(name) for converter in self.converters)

    @property
    def checkpoint_filter(self) -> Optional[Callable[[str], bool]]:
        """Whether a checkpoint keeps the model tensor called ``name``: every converter keeps it; ``None``: the whole
        model (no converter filters)."""
        filters = [f for f in (converter.checkpoint_filter for converter in self.converters) if f is not None]
        if not filters:
            return None
        return lambda name: all(keeps(name) for keeps in filters)

    def checkpoint_record(self) -> dict[str, Any]:
        """What a checkpoint records of the conversion: every converter's record."""
        record: dict[str, Any] = {}
        for converter in self.converters:
            record.update(converter.checkpoint_record())
        return record

    def freezes(self) -> bool:
        """Whether a converter freezes part of the model."""
        return any(converter.freezes() for converter in self.converters)

    def plan_notes(self, trained: int, numel: int) -> list[str]:
        """What the planner says of the conversion (``ModelConverter.plan_note``), one note for all: each converter's
        part, in order, joined by "; "."""
        parts = [note for note in (c.plan_note(trained, numel) for c in self.converters) if note]
        return ["; ".join(parts)] if parts else []


def fsdp_shards(meshes: "ParallelMeshes") -> int:
    """The row shards FSDP cuts a weight into over ``meshes`` (its data-parallel shard dimension; under context
    parallelism data shard × context), what a converter is given as ``shards``."""
    return meshes.fsdp.shape[-1]


__all__ = ["CONVERTERS", "ModelConverter", "ModelConverters", "fsdp_shards"]
