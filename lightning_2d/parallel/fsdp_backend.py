"""The FSDP backend as an object: what ``fsdp_backend`` names, and the one table of them.

How parameters are sharded over the data-parallel ranks is a backend: FSDP2's ``fully_shard``
(``lightning_2d.parallel.fsdp.FullyShard``) or SimpleFSDP (``lightning_2d.parallel.simple_fsdp.SimpleFSDP``). Each
is one object that applies itself (``parallelize_model``'s last step), says how the model's state is read outside a
forward (``state_access``: the checkpoint IO enters it around every state-dict path, materialization around
initialization), how gradient reduction is deferred during accumulation, its compile options, and what the planner
counts of it. Nobody else branches on the option's value: the strategies resolve the object once
(``strategy.fsdp_backend``), the rest asks it.

A third backend is one module with a class like these two and a row in ``BACKENDS``, plus its name where the option
lists the names (``ParallelConfig.fsdp_backend``'s ``Literal`` and ``FSDP_BACKENDS`` in ``parallel/config.py``, which
cannot import the backends: they import it); ``tests/unit/test_simple_fsdp.py`` checks the three agree.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

from torch import nn

from lightning_2d.parallel.fsdp import FullyShard
from lightning_2d.parallel.simple_fsdp import SimpleFSDP

if TYPE_CHECKING:
    from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
    from lightning_2d.parallel.fsdp import FSDPUnit
    from lightning_2d.parallel.meshes import ParallelMeshes


@runtime_checkable
class FSDPBackend(Protocol):
    """What a backend is (``FullyShard``, ``SimpleFSDP``).

    Attributes:
        name: The ``fsdp_backend`` value naming it.
        hook: The owner's method that replaces ``step`` (``lightning_2d.parallel.hooks.ParallelHooks``).
        step: The library's sharding step, ``(model, dp_mesh, plan, config)``.
    """

    name: str
    hook: str
    step: Callable[..., None]

    def apply(self, model: nn.Module, meshes: "ParallelMeshes", plan: "ParallelPlan", config: "ParallelConfig",
              step: Optional[Callable[..., None]] = None, experts: Sequence[nn.Module] = ()) -> None:
        """Shard ``model`` (tensor-parallel, checkpointed and compiled as configured) over the data-parallel ranks
        with ``step`` (the owner's replacement of ``self.step``, if any); ``experts``: the plan's expert-parallel
        modules (found before activation checkpointing renamed their paths), sharded over ``meshes.expert_fsdp``."""
        ...

    def state_access(self) -> AbstractContextManager[Any]:
        """A context in which a parameter read as a module attribute is the stored shard (what torch's state-dict
        APIs, initialization and re-tying read), not a collective."""
        ...

    def gradient_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """A context in which ``module``'s backward reduces gradients only if ``enabled`` (gradient accumulation's
        non-final micro-batches pass ``False``), where the backend can defer the reduction."""
        ...

    def inductor_options(self) -> Optional[dict[str, Any]]:
        """The inductor options of the compiled blocks (``None``: inductor's defaults)."""
        ...

    def unit_problem(self, name: str, modules: list[nn.Module]) -> Optional[str]:
        """The planner: why module group ``name`` is not what this backend made of it, else ``None``."""
        ...

    def buffer_bytes(self, units: list["FSDPUnit"], config: "ParallelConfig", accumulate_grad_batches: int,
                     pipeline_in_flight: Optional[int] = None) -> tuple[int, int]:
        """The planner: the peak bytes of gathered parameters and of accumulated unsharded gradients on one rank
        (``pipeline_in_flight``: the micro-batches in flight under a pipeline, ``None`` without one)."""
        ...

    def pipeline_notes(self, config: "ParallelConfig", accumulate_grad_batches: int) -> list[str]:
        """The planner: what its report says of these buffers under a pipeline."""
        ...

    def all_gather_row(self, param_dtype: str, activation_checkpointing: str, pipeline_keeps: bool) -> str:
        """The planner: the label of the gathered parameters' row in its report."""
        ...


#: Every backend, by the ``fsdp_backend`` value naming it.
BACKENDS: dict[str, FSDPBackend] = {backend.name: backend for backend in (FullyShard(), SimpleFSDP())}


def fsdp_backend(name: str) -> FSDPBackend:
    """The backend ``fsdp_backend=name`` names (``ParallelConfig`` refused any other name already)."""
    return BACKENDS[name]
