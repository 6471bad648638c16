"""``lightning_2d.integration.fabric_strategy.ModelParallel2DStrategy``: the same 2D parallelism for Fabric scripts.

    fabric = L.Fabric(devices=8, strategy=ModelParallel2DStrategy(tensor_parallel_size=8))
    with fabric.init_module(empty_init=True):
        model = Transformer(ModelArgs.from_name("llama3-8b"))
    model = fabric.setup(model)            # TP/SP → AC → compile → FSDP2, then sharded init

Fabric's own ``ModelParallelStrategy`` needs a hand-written ``parallelize_fn``; this one applies
the plan itself (the Llama plan for a ``Transformer``, the module's ``parallel_plan(config)`` or
a ``plan=``), through ``lightning_2d.parallel.parallelize_and_materialize`` — the function the
Trainer strategy calls. A custom ``parallelize_fn(module, device_mesh)`` is still accepted.
Checkpoints (``fabric.save``/``fabric.load``) go through ``DistributedCheckpointIO``: complete or
ignored, resumable at another layout, optionally written in the background.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d._compat import backward_sync_control_class, is_stateful, saves_distributed_checkpoint
from lightning_2d.integration.options import takes_options
from lightning_2d.integration.precision import FabricFSDP2Precision
from lightning_2d.integration.strategy_base import STRATEGY_NAME, ModelParallel2DBase
from lightning_2d.models import registry
from lightning_2d.models.registry import resolve_plan
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.fsdp import gradient_sync
from lightning_2d.parallel.grad_norm import clip_grad_norm_
from lightning_2d.parallel.guard import check_finite_weights
from lightning_2d.parallel.materialize import materialize_model
from lightning_2d.parallel.options import Option
from lightning_2d.parallel.parallelize import parallelize_and_materialize

__all__ = ["FabricFSDP2Precision", "ModelParallel2DStrategy"]


class _GradientSyncControl(backward_sync_control_class()):  # type: ignore[misc]
    """``fabric.no_backward_sync``: the FSDP2 switch the Trainer strategy uses too."""

    def __init__(self, config: ParallelConfig) -> None:
        self.config = config

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return gradient_sync(module, enabled=not enabled or self.config.reduce_every_micro_batch)


#: Fabric's own constructor argument, after the options.
PARALLELIZE_FN = Option(
    name="parallelize_fn",
    annotation=Optional[Callable[[nn.Module, Any], nn.Module]],
    default=None,
    doc="Fabric's hook ``(module, device_mesh) -> module``; when given, it replaces the plan and the steps (the"
    " model is still materialized afterwards).",
)


class ModelParallel2DStrategy(ModelParallel2DBase, ModelParallelStrategy):
    """2D parallelism (FSDP2 or HSDP × tensor/sequence parallel) for Fabric, applied by the strategy.

    Takes the options of the Trainer strategy (``lightning_2d.integration.options``), plus
    ``parallelize_fn``: see ``__init__``.
    """

    # The Trainer strategy's parameters (generated from the options' fields), then Fabric's own, keyword-only.
    @takes_options("The options of the Trainer strategy, plus Fabric's ``parallelize_fn``.", extra=(PARALLELIZE_FN,))
    def __init__(
        self, options: dict[str, Any], *, parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]]
    ) -> None:
        self._user_parallelize_fn = parallelize_fn
        self._setup_modules: list[nn.Module] = []  # whose float8 all-gather scales follow each step
        super().__init__(**options)
        self._backward_sync_control = _GradientSyncControl(self.parallel_config)

    # ---- what differs from the Trainer --------------------------------------------------------
    def _lightning_strategy_kwargs(self) -> dict[str, Any]:
        return {"parallelize_fn": self._user_parallelize_fn or (lambda module, mesh: module)}

    fsdp2_precision_class = FabricFSDP2Precision

    def _precision_plugin_2d(self) -> Any:
        return self.precision

    def _set_precision_plugin_2d(self, plugin: Any) -> None:
        self.precision = plugin

    def _float8_modules(self) -> list[nn.Module]:
        return self._setup_modules if self.parallel_config.fsdp_float8_all_gather else []

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        precision = self.precision.precision
        if self._user_parallelize_fn is not None:
            module = self._user_parallelize_fn(module, self.device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
            materialize_model(module, self.root_device, seed=self._init_seed(module))
            return module
        plan = resolve_plan(module, self.parallel_config, self.strategy_options.plan)
        self.validate(plan=plan)  # the model's constraints, before any collective touches it
        self.parallelized = parallelize_and_materialize(
            module, self.device_mesh, self.parallel_config, plan, precision, self.root_device,
            seed=lambda: self._init_seed(module), known_init_hooks=registry.known_init_hooks,
        )
        self._setup_modules.append(module)
        return module

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self._guarded_backward(tensor, partial(super().backward, tensor, module, *args, **kwargs))

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip to the global norm over DTensor gradients on any mix of meshes (the single-device norm)."""
        self.precision.unscale_gradients(optimizer)
        # Under non_finite="skip" a NaN/inf norm is the step guard's to handle (it drops the step).
        strict = error_if_nonfinite and self.parallel_config.non_finite != "skip"
        return clip_grad_norm_(
            self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite=strict,
            pipeline_group=self.pipeline.pp_group if self.pipeline is not None else None,
        )

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``fabric.save``: a sharded folder (default) or a full file; complete or recognisably incomplete."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support filtered checkpoints")
        io = self.distributed_checkpoint_io
        path = io.path_to_save(path, storage_options)
        modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
        if len(modules) != 1:
            raise ValueError(
                f"fabric.save needs exactly one model in the state (got {len(modules)}): state={{'model': model, ...}}"
            )
        check_finite_weights(modules[0], path)  # never a checkpoint of NaN weights
        sharded = saves_distributed_checkpoint(self)
        options = StateDictOptions(full_state_dict=not sharded, cpu_offload=True)
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                tensors[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, Optimizer):
                tensors[key] = get_optimizer_state_dict(modules[0], obj, options=options)
            else:
                metadata[key] = obj.state_dict() if is_stateful(obj) else obj
        io.save(tensors, metadata, path)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``fabric.load``: falls back from an incomplete checkpoint; reshards to the current layout."""
        # Digests checked for what the load reads: the modules' and optimizers' entries (a full file: all of it).
        parts = state if isinstance(state, dict) else {}
        loaded = [key for key, obj in parts.items() if isinstance(obj, (nn.Module, Optimizer))]
        resolved = self._checkpoint_to_load(path, prefixes=tuple(f"{key}." for key in loaded) or None)
        # Fabric's loader puts the saved state dict in place of a stateful object (an LR scheduler, a
        # data loader); give the object its state instead.
        stateful = {}
        if isinstance(state, dict):
            stateful = {
                k: v for k, v in state.items() if is_stateful(v) and not isinstance(v, (nn.Module, Optimizer))
            }
        if isinstance(state, dict):
            for key, obj in state.items():
                if isinstance(obj, nn.Module):
                    self._check_checkpoint_fits(resolved, key, obj, strict=strict)
        remainder = super().load_checkpoint(resolved, state, strict=strict, weights_only=weights_only)
        for key, obj in stateful.items():
            if isinstance(state, dict) and state.get(key) is not obj:
                obj.load_state_dict(state[key])
                state[key] = obj
        saved = remainder.pop("lightning_2d", None) if isinstance(remainder, dict) else None
        self.distributed_checkpoint_io.restore_random_state(resolved, saved)
        return remainder


if STRATEGY_NAME not in STRATEGY_REGISTRY:
    # The name for `Fabric(strategy="model_parallel_2d")` (default options, the plan resolved from the model);
    # one registered by someone else is left alone.
    STRATEGY_REGISTRY.register(
        STRATEGY_NAME,
        ModelParallel2DStrategy,
        description="FSDP2/HSDP × tensor/sequence × pipeline × context parallelism, applied by lightning_2d",
    )
