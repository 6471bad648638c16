"""``lightning_2d.fabric.ModelParallel2DStrategy``: the same 2D parallelism for Fabric scripts.

    fabric = L.Fabric(devices=8, strategy=ModelParallel2DStrategy(tensor_parallel_size=8))
    with fabric.init_module(empty_init=True):
        model = Transformer(ModelArgs.from_name("llama3-8b"))
    model = fabric.setup(model)            # TP/SP → AC → compile → FSDP2, then sharded init

Fabric's own ``ModelParallelStrategy`` needs a hand-written ``parallelize_fn``; this one applies
the plan itself (the Llama plan for a ``Transformer``, the module's ``parallel_plan(config)`` or
a ``plan=``), through ``lightning_2d.parallel.parallelize_and_materialize`` — the function the
Trainer strategy calls. A custom ``parallelize_fn(module, device_mesh)`` is still accepted.
Checkpoints (``fabric.save``/``fabric.load``) use ``lightning_2d.checkpoint``: complete or
ignored, resumable at another layout, optionally written in the background.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d.checkpoint import (
    ShardedCheckpointWriter,
    layout_of,
    make_writer,
    resolve_on_rank_zero,
    restore_random_state,
    save_full_checkpoint,
)
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.dims import ParallelDims, cuda_index, destroy_process_group_at_exit, validate_parallel_dims
from lightning_2d.parallel.float8 import precompute_float8_scales
from lightning_2d.parallel.fsdp import gradient_sync
from lightning_2d.parallel.grad_norm import clip_grad_norm_
from lightning_2d.parallel.loss import backward_context
from lightning_2d.parallel.materialize import materialize_model
from lightning_2d.parallel.parallelize import parallelize_and_materialize, resolve_plan


class FSDP2Precision(Precision):
    """Fabric precision under the 2D strategy: FSDP2's ``MixedPrecisionPolicy`` casts (no autocast)."""

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the FSDP2 switch the Trainer strategy uses too."""

    def __init__(self, config: ParallelConfig) -> None:
        self.config = config

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return gradient_sync(module, enabled=not enabled or self.config.reduce_every_micro_batch)


class ModelParallel2DStrategy(ModelParallelStrategy):
    """2D parallelism (FSDP2 × tensor/sequence parallel) for Fabric, applied by the strategy.

    Takes the options of the Trainer strategy (``lightning_2d.ModelParallel2DStrategy``; see there),
    plus:

    Args:
        parallelize_fn: Fabric's hook ``(module, device_mesh) -> module``; when given, it replaces the
            plan and the steps (the model is still materialized afterwards).
        init_seed: Seed of the layout-independent initialization of a meta-device model; ``None``:
            the run's seed (``fabric.seed_everything``) broadcast from rank 0.
    """

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        sequence_parallel: bool = True,
        loss_parallel: bool = False,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        selective_ac_option: Union[str, int] = "op",
        compile: bool = False,
        param_dtype: Optional[Union[str, torch.dtype]] = None,
        reduce_dtype: Optional[Union[str, torch.dtype]] = None,
        reshard_after_forward: Literal["default", "always", "never"] = "default",
        reduce_every_micro_batch: bool = False,
        float8: Union[bool, Literal["emulate"]] = False,
        float8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise",
        fsdp_float8_all_gather: bool = False,
        async_tensor_parallel: bool = False,
        plan: Optional[ParallelPlan] = None,
        parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]] = None,
        init_seed: Optional[int] = None,
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        self.parallel_config = ParallelConfig.from_options(locals())
        super().__init__(
            parallelize_fn=parallelize_fn or (lambda module, mesh: module),
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _GradientSyncControl(self.parallel_config)
        self._float8_modules: list[nn.Module] = []  # whose float8 all-gather scales follow each step
        self._user_parallelize_fn = parallelize_fn
        self._plan = plan
        self._init_seed_value = init_seed
        self._async_checkpoint = async_checkpoint
        self._checkpoint_writer: Optional[ShardedCheckpointWriter] = None
        self.parallel_dims: Optional[ParallelDims] = None

    # ---- validation, precision, mesh ---------------------------------------------------------
    def validate(self, plan: Optional[ParallelPlan] = None, device_index: Optional[int] = None) -> ParallelDims:
        """Check the layout (and ``plan``'s divisibility constraints, and with ``device_index`` this
        process's GPU); raises listing every problem."""
        return validate_parallel_dims(
            self.parallel_config,
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            plan=plan if plan is not None else self._plan,
            precision=getattr(self.precision, "precision", None),
            num_nodes=self.num_nodes,
            device_type=self.parallel_devices[0].type if self.parallel_devices else None,
            device_index=device_index,
        )

    @override
    def _configure_launcher(self) -> None:
        # Called by Fabric's constructor, before any process is launched: fail there.
        self.validate()
        if type(self.precision) in (Precision, MixedPrecision, HalfPrecision):
            self.precision = FSDP2Precision(self.precision.precision)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self.parallel_dims = self.validate(device_index=cuda_index(self.root_device))
        self._data_parallel_size, self._tensor_parallel_size = self.parallel_dims.dp, self.parallel_dims.tp
        super().setup_environment()
        destroy_process_group_at_exit()
        self._checkpoint_writer = make_writer(
            self.global_rank, self.barrier, self._save_distributed_checkpoint, self._async_checkpoint
        )

    # ---- the model -----------------------------------------------------------------------------
    def _init_seed(self) -> int:
        seed = self._init_seed_value
        return int(seed if seed is not None else self.broadcast(torch.initial_seed()))

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        precision = self.precision.precision
        if self._user_parallelize_fn is not None:
            module = self._user_parallelize_fn(module, self.device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
            materialize_model(module, self.root_device, seed=self._init_seed())
            return module
        plan = resolve_plan(module, self.parallel_config, self._plan)
        self.validate(plan)  # the model's constraints, before any collective touches it
        parallelize_and_materialize(
            module, self.device_mesh, self.parallel_config, plan, precision, self.root_device, seed=self._init_seed
        )
        if self.parallel_config.fsdp_float8_all_gather:
            self._float8_modules.append(module)
        return module

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
        return clip_grad_norm_(
            self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ---- checkpoints ---------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        dims = self.parallel_dims
        return layout_of(self.world_size, dims.dp if dims else None, dims.tp if dims else None)

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

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support filtered checkpoints")
        assert self._checkpoint_writer is not None
        path = Path(self.broadcast(str(path)))
        modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
        if len(modules) != 1:
            raise ValueError(
                f"fabric.save needs exactly one model in the state (got {len(modules)}): state={{'model': model, ...}}"
            )
        options = StateDictOptions(full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True)
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {"lightning_2d": {"layout": self._layout()}}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                tensors[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, Optimizer):
                tensors[key] = get_optimizer_state_dict(modules[0], obj, options=options)
            else:
                metadata[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        if self._save_distributed_checkpoint:
            self._checkpoint_writer.save(tensors, metadata, path)
            return
        self._checkpoint_writer.wait()
        save_full_checkpoint({**tensors, **metadata}, path, self.global_rank, self.world_size, self.barrier)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``fabric.load``: falls back from an incomplete checkpoint; reshards to the current layout."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()
        resolved = resolve_on_rank_zero(path, self.global_rank, self.broadcast, rank_zero_warn)
        # Fabric's loader puts the saved state dict in place of a stateful object (an LR scheduler, a
        # data loader); give the object its state instead.
        stateful = {}
        if isinstance(state, dict):
            stateful = {
                k: v for k, v in state.items() if isinstance(v, _Stateful) and not isinstance(v, (nn.Module, Optimizer))
            }
        remainder = super().load_checkpoint(resolved, state, strict=strict, weights_only=weights_only)
        for key, obj in stateful.items():
            if isinstance(state, dict) and state.get(key) is not obj:
                obj.load_state_dict(state[key])
                state[key] = obj
        saved = remainder.pop("lightning_2d", None) if isinstance(remainder, dict) else None
        restore_random_state(resolved, saved or {}, self._layout(), self.global_rank, rank_zero_info)
        return remainder

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        # Float8 all-gather weights: their scales for the next step, in one all-reduce (a no-op otherwise).
        for module in self._float8_modules:
            precompute_float8_scales(module)
        return output

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        with backward_context(tensor, self.parallel_config.loss_parallel):
            return super().backward(tensor, module, *args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()
        super().teardown()
