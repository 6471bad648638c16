"""Models held beside the trained one, frozen: a preference loss's reference, a distillation teacher.

A ``FrozenModel`` wraps such a model (built on the meta device by its owner, like the trained one) with where its
values come from (``weights_source``: the trained model's ``init_from``, else the same seeded init: its initial
weights). The strategies parallelize and materialize it as they do the trained model, with the same plan and
meshes (``parallelize_frozen``: TP/SP, FSDP-sharded, its parameters never requiring gradients); on one device
``materialize_frozen`` does the rest without the parallelism. The owner keeps it outside its registered modules, so
it has no optimizer state, is in no checkpoint and adds nothing to the gradient norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.parallelize import Parallelized, convert_and_materialize, parallelize_and_materialize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_2d.parallel.meshes import ParallelMeshes


class FrozenModel(nn.Module):
    """``model`` (under the attribute the trained model's plan names, ``plan.module``), frozen, with the values
    ``weights_source()`` gives it (``None``: the seeded init).

    Args:
        name: What it is, for messages (``"reference"``).
        module_name: The attribute holding the model (the trained model's ``plan.module``: ``"model"``), so the
            trained model's plan applies to it as it is.
        model: The model, on the meta device.
        weights_source: Its initial values' source (the trained model's ``init_from``), or ``None``.
    """

    def __init__(self, name: str, module_name: str, model: nn.Module,
                 weights_source: Optional[Callable[[], Any]] = None) -> None:
        super().__init__()
        self.name = name
        self.module_name = module_name
        setattr(self, module_name, model)
        model.requires_grad_(False)
        self.eval()  # no dropout; the Trainer's train()/eval() never reach it (the owner does not register it)
        self._weights_source = weights_source

    def frozen(self) -> nn.Module:
        """The model held (``getattr(self, module_name)``; parallelized in place by the strategy)."""
        return getattr(self, self.module_name)

    def weights_source(self) -> Any:
        return self._weights_source() if self._weights_source is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.frozen()(*args, **kwargs)


def parallelize_frozen(frozen: FrozenModel, mesh: "ParallelMeshes | DeviceMesh", config: ParallelConfig,
                       plan: ParallelPlan, precision: str, device: torch.device, seed: Callable[[], int],
                       known_init_hooks: Callable[[nn.Module], Any] = lambda model: None) -> Parallelized:
    """``parallelize_and_materialize`` of a frozen model: the trained model's plan (no converters: the frozen model
    is the initial one), the same meshes; its seeded init gives the trained model's initial values (``seed`` must
    return the trained model's)."""
    return parallelize_and_materialize(frozen, mesh, config, plan, precision, device, seed, known_init_hooks)


def materialize_frozen(frozen: FrozenModel, plan: ParallelPlan, device: torch.device, seed: int,
                       known_init_hooks: Callable[[nn.Module], Any] = lambda model: None) -> None:
    """One device: ``convert_and_materialize`` of a frozen model (no converters), from ``seed`` or its weights."""
    convert_and_materialize(frozen, plan, device, seed, {}, known_init_hooks)


__all__ = ["FrozenModel", "materialize_frozen", "parallelize_frozen"]
