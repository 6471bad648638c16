"""The one place where a model is parallelized: TP/SP → activation checkpointing → compile → FSDP2.

The Trainer strategy (``lightning_2d.strategy``) and the Fabric strategy (``lightning_2d.fabric``)
both call ``parallelize_model``; neither has a copy of these steps.

Each step can be replaced without subclassing a strategy: an object passed as ``hooks`` (the
LightningModule, or the module given to ``fabric.setup``) that defines a method of the step's
name is called instead of the library's function, with the same arguments:

====================================  ==============================================
``apply_tensor_parallel``             ``(model, tp_mesh, plan, config)``
``apply_activation_checkpointing``    ``(model, plan, config)``
``apply_compile``                     ``(model, plan, config)``
``apply_fully_shard``                 ``(model, dp_mesh, plan, config)``
====================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_2d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_2d.parallel.compile import apply_compile
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.dims import DP_DIM, TP_DIM
from lightning_2d.parallel.fsdp import apply_fully_shard
from lightning_2d.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

STEPS: dict[str, Callable[..., None]] = {
    "apply_tensor_parallel": apply_tensor_parallel,
    "apply_activation_checkpointing": apply_activation_checkpointing,
    "apply_compile": apply_compile,
    "apply_fully_shard": apply_fully_shard,
}


def _step(hooks: Any, name: str) -> Callable[..., None]:
    override = getattr(hooks, name, None) if hooks is not None else None
    return override if callable(override) else STEPS[name]


def is_parallelized(model: nn.Module) -> bool:
    """Whether ``model`` already holds DTensor parameters (e.g. parallelized by the user's ``configure_model``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def resolve_plan(owner: Any, config: ParallelConfig, plan: ParallelPlan | None) -> ParallelPlan:
    """The plan to apply: the one given to the strategy, else ``owner.parallel_plan(config)``, else the default names."""
    if plan is not None:
        return plan
    plan_fn = getattr(owner, "parallel_plan", None)
    if callable(plan_fn):
        return plan_fn(config)
    return ParallelPlan()


def parallelize_model(
    model: nn.Module,
    mesh: "DeviceMesh",
    plan: ParallelPlan,
    config: ParallelConfig,
    hooks: Any = None,
) -> None:
    """Apply TP/SP, activation checkpointing, compile and FSDP2 to ``model`` in place, in that order.

    Args:
        model: The model, preferably on the meta device (then materialize it afterwards with
            ``lightning_2d.parallel.materialize_model``).
        mesh: The 2D ``(data_parallel, tensor_parallel)`` device mesh.
        plan: Module names to parallelize.
        config: The options, with ``param_dtype``/``reduce_dtype`` resolved
            (``ParallelConfig.resolve_dtypes``).
        hooks: An object whose methods named like the steps override them (see the module docstring).
    """
    tp_mesh, dp_mesh = mesh[TP_DIM], mesh[DP_DIM]
    if tp_mesh.size() > 1 and plan.tensor_parallel:
        _step(hooks, "apply_tensor_parallel")(model, tp_mesh, plan, config)
    if config.activation_checkpointing != "none":
        _step(hooks, "apply_activation_checkpointing")(model, plan, config)
    if config.compile:
        _step(hooks, "apply_compile")(model, plan, config)
    # FSDP2 also at dp == 1: it carries the mixed-precision policy, and every parameter becomes a
    # DTensor, so checkpoints and gradient clipping handle one kind of parameter at every layout.
    _step(hooks, "apply_fully_shard")(model, dp_mesh, plan, config)
