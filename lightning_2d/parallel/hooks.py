"""What a LightningModule (or the module given to ``fabric.setup``) and its model may define.

The strategies look these names up with ``getattr``; every one is optional. They are listed here,
in one place, as two Protocols: ``ParallelHooks`` for the *owner* (the LightningModule, or the
module passed to ``fabric.setup``) and ``ModelInitHooks`` for the *model* the plan applies to
(``owner.<plan.module>``, e.g. ``LlamaLightningModule.model``; the owner itself when
``plan.module == ""``, as for Fabric). ``lightning_2d.LlamaLightningModule`` and
``lightning_2d.Transformer`` implement them; see ``recipes/custom_model_plan.py`` for another model.

Order in which the strategies use them (both the Trainer's and Fabric's):

1. ``configure_model()`` (Trainer; Fabric: the module is built in ``fabric.init_module(empty_init=True)``)
   builds the model, on the meta device when ``strategy.materializes_meta_modules``.
2. ``parallel_plan(config)`` gives the ``ParallelPlan`` (unless one was passed to the strategy).
3. ``apply_tensor_parallel`` → ``apply_expert_parallel`` → ``apply_activation_checkpointing`` →
   ``apply_compile`` → ``apply_fully_shard`` (or ``apply_simple_fsdp`` under ``fsdp_backend="simple_fsdp"``): each,
   when defined, replaces the library's step of the same name
   (``lightning_2d.parallel.parallelize``) and is called with the same arguments.
4. Materialization of meta tensors: values from ``weights_source()`` if it returns a source,
   else the model's ``param_init_specs()`` with the seed (the strategy's ``init_seed``, else the
   owner's ``init_seed``, else the run's seed), else each module's ``reset_parameters()`` (values
   then depend on the layout; a warning says so); then the model's ``init_buffers(device)``.
   ``ModelInitHooks`` may also be defined on the owner (for a model class you cannot change; names
   relative to the model); a Hugging Face Llama-family decoder gets them from the library
   (``lightning_2d.models.hf_decoders.HFDecoderInit``). Any tensor none of these fills stops the run
   (``MaterializationError``).

A plan may carry its sequence-parallel form (``ParallelPlan.sequence_parallel``), applied only
under the strategy's ``sequence_parallel=True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_2d.ops.init import InitSpec
    from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
    from lightning_2d.parallel.materialize import WeightSource


@runtime_checkable
class ParallelHooks(Protocol):
    """Optional methods of the owner (LightningModule, or the module given to ``fabric.setup``).

    Attributes:
        init_seed: Seed of the layout-independent initialization (``None``: the run's seed).
    """

    init_seed: Optional[int]

    def parallel_plan(self, config: "ParallelConfig") -> "ParallelPlan":
        """Which modules to parallelize and how, for the strategy's ``config`` (e.g. the sequence-parallel
        styles only when ``config.sequence_parallel``)."""
        ...

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: "DeviceMesh", plan: "ParallelPlan", config: "ParallelConfig") -> None:
        """Replaces ``lightning_2d.parallel.apply_tensor_parallel`` (called only when ``tp > 1``)."""
        ...

    def apply_expert_parallel(self, model: nn.Module, ep_mesh: "DeviceMesh", plan: "ParallelPlan", config: "ParallelConfig") -> None:
        """Replaces ``lightning_2d.parallel.expert.apply_expert_parallel`` (called only when ``expert_parallel_size >
        1``); the modules ``plan.expert_parallel`` names are then FSDP-sharded over the experts' own mesh."""
        ...

    def apply_activation_checkpointing(self, model: nn.Module, plan: "ParallelPlan", config: "ParallelConfig") -> None:
        """Replaces ``lightning_2d.parallel.apply_activation_checkpointing`` (when not ``"none"``)."""
        ...

    def apply_compile(self, model: nn.Module, plan: "ParallelPlan", config: "ParallelConfig") -> None:
        """Replaces ``lightning_2d.parallel.apply_compile`` (when ``compile=True``)."""
        ...

    def apply_fully_shard(self, model: nn.Module, dp_mesh: "DeviceMesh", plan: "ParallelPlan", config: "ParallelConfig") -> None:
        """Replaces ``lightning_2d.parallel.apply_fully_shard``. ``dp_mesh`` is 1-D (FSDP) or 2-D
        ``(data_parallel_replicate, data_parallel_shard)`` (HSDP)."""
        ...

    def apply_simple_fsdp(self, model: nn.Module, dp_mesh: "DeviceMesh", plan: "ParallelPlan", config: "ParallelConfig") -> None:
        """Replaces ``lightning_2d.parallel.simple_fsdp.apply_simple_fsdp`` (``fsdp_backend="simple_fsdp"``, in
        place of ``apply_fully_shard``). ``dp_mesh`` as for ``apply_fully_shard``."""
        ...

    def weights_source(self) -> Optional["WeightSource"]:
        """Initial values read block by block (e.g. ``lightning_2d.checkpoint.hf.HFWeights``), or ``None`` to initialize."""
        ...


@runtime_checkable
class ModelInitHooks(Protocol):
    """Optional methods of the model the plan applies to (or of the owner), for layout-independent
    materialization. ``from lightning_2d import InitSpec, ModelInitHooks``::

        class MyModel(nn.Module):
            def param_init_specs(self) -> dict[str, InitSpec]:
                return {"proj.weight": InitSpec("trunc_normal", std=0.02), "proj.bias": InitSpec("constant")}
    """

    def param_init_specs(self) -> dict[str, "InitSpec"]:
        """Parameter name (as ``named_parameters()`` of the model, on one device) → how to draw it
        (``lightning_2d.InitSpec``: ``"normal"``, ``"trunc_normal"`` or ``"constant"``); every parameter needs one."""
        ...

    def init_buffers(self, device: torch.device) -> None:
        """Fill the buffers (e.g. rotary tables) after the parameters are allocated on ``device``."""
        ...


#: The step-replacing method names of ``ParallelHooks``, in the order they run.
STEP_HOOKS = ("apply_tensor_parallel", "apply_expert_parallel", "apply_activation_checkpointing", "apply_compile",
              "apply_fully_shard", "apply_simple_fsdp")


#: Every method name of ``ParallelHooks``.
OWNER_HOOKS = ("parallel_plan", *STEP_HOOKS, "weights_source")


def defined_hooks(owner: Any) -> list[str]:
    """The ``ParallelHooks`` methods ``owner`` defines, in the order they are used."""
    return [name for name in OWNER_HOOKS if callable(getattr(owner, name, None))]
