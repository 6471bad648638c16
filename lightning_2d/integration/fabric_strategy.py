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
ignored, resumable at another layout, optionally written in the background; under LoRA they hold the adapters only
(with their settings and base), as the Trainer's do.

A model beside the trained one that is not trained (a DPO reference, a distillation teacher) is given to
``fabric.setup`` with every parameter frozen::

    reference.requires_grad_(False)
    reference = fabric.setup(reference)    # same steps, same meshes; no gradients, no optimizer, no checkpoint

It is parallelized by ``lightning_2d.parallel.frozen.parallelize_frozen``, as the Trainer strategy parallelizes a
module's ``frozen_models()``; an optimizer over its parameters and a ``fabric.save`` of it are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d._compat import backward_sync_control_class, is_stateful
from lightning_2d.checkpoint.safe_load import check_weights_only, trusted_globals
from lightning_2d.checkpoint.subset import ADAPTERS_KEY
from lightning_2d.integration.strategy_options import takes_options
from lightning_2d.integration.precision import FabricFSDP2Precision
from lightning_2d.integration.strategy_base import STRATEGY_NAME, ModelParallel2DBase
from lightning_2d.models import registry
from lightning_2d.models.registry import validation_inputs_of, resolve_plan
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.converters import ModelConverters
from lightning_2d.parallel.frozen import held_frozen
from lightning_2d.parallel.fsdp_backend import FSDPBackend
from lightning_2d.parallel.grad_norm import clip_grad_norm_
from lightning_2d.parallel.guard import check_finite_weights
from lightning_2d.parallel.materialize import materialize_model
from lightning_2d.parallel.options import Option
from lightning_2d.parallel.parallelize import parallelize_and_materialize

__all__ = ["FabricFSDP2Precision", "ModelParallel2DStrategy"]

if TYPE_CHECKING:
    from datetime import timedelta
    from typing import Literal  # the generated __init__ declaration's annotations

    from lightning_2d.parallel.config import ParallelPlan, Size
    from lightning_2d.parallel.schedules import ScheduleName


class _GradientSyncControl(backward_sync_control_class()):  # type: ignore[misc]
    """``fabric.no_backward_sync``: the FSDP backend's switch (``gradient_sync``), which the Trainer strategy uses
    too."""

    def __init__(self, backend: FSDPBackend, config: ParallelConfig) -> None:
        self.backend, self.config = backend, config

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.backend.gradient_sync(module, enabled=not enabled or self.config.reduce_every_micro_batch)


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

    Takes the options of the Trainer strategy (``lightning_2d.integration.strategy_options``), plus
    ``parallelize_fn``: see ``__init__``.

    Raises:
        ParallelConfigError: At construction, options out of their range or contradicting each other; at
            ``fabric.setup``, a layout the world or the model's plan cannot take. Every problem is listed in one
            message, with the values and the way out.
        TypeError: An argument the strategy does not take, as a Python call would.

    Example:
        ```python
        import lightning as L
        import torch
        from lightning_2d import ModelArgs, Transformer
        from lightning_2d.fabric import ModelParallel2DStrategy

        fabric = L.Fabric(devices=8, precision="bf16-mixed", strategy=ModelParallel2DStrategy(tensor_parallel_size=8))
        fabric.launch()
        with fabric.init_module(empty_init=True), torch.device("meta"):
            model = Transformer(ModelArgs.from_name("llama3-8b"))  # nothing allocated yet
        model = fabric.setup(model)  # TP/SP → AC → compile → FSDP2, then each rank's shards
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
        ```

        The whole loop (resuming, accumulation, checkpoints): ``recipes/fabric_pretrain.py``.
    """

    def _init_fabric(
        self, options: dict[str, Any], *, parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]]
    ) -> None:
        """The constructor's body (``__init__`` is generated around it below): the options by name, and Fabric's
        ``parallelize_fn``."""
        self._user_parallelize_fn = parallelize_fn
        self._setup_modules: list[nn.Module] = []  # whose float8 all-gather scales follow each step
        super().__init__(**options)
        self._backward_sync_control = _GradientSyncControl(self.fsdp_backend, self.parallel_config)

    # The Trainer strategy's parameters, then Fabric's own, keyword-only: type checkers and IDEs read the generated
    # declaration, ``takes_options`` makes the one that runs (see ``ModelParallel2DBase``).
    if TYPE_CHECKING:
        # BEGIN generated by python -m lightning_2d.tools.options_table --write-signatures
        def __init__(
            self,
            data_parallel_size: Size = "auto",
            tensor_parallel_size: Size = "auto",
            data_parallel_replicate_size: int = 1,
            pipeline_parallel_size: int = 1,
            pipeline_schedule: ScheduleName = "1F1B",
            pipeline_microbatches: Optional[int] = None,
            pipeline_stages_per_rank: Optional[int] = None,
            pipeline_layers_per_stage: Optional[list[int]] = None,
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
            init_seed: Optional[int] = None,
            save_distributed_checkpoint: bool = True,
            async_checkpoint: bool = False,
            non_finite: Literal["raise", "skip", "off"] = "raise",
            process_group_backend: Optional[str] = None,
            timeout: Optional[timedelta] = ...,
            watchdog_timeout: Optional[timedelta] = ...,
            context_parallel_size: int = 1,
            fsdp_backend: Literal["fully_shard", "simple_fsdp"] = "fully_shard",
            expert_parallel_size: int = 1,
            experts_over_tensor_parallel: bool = False,
            *,
            parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]] = None,
        ) -> None: ...
        # END generated
    else:
        __init__ = takes_options(
            "The options of the Trainer strategy, plus Fabric's ``parallelize_fn``.", extra=(PARALLELIZE_FN,)
        )(_init_fabric)

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
        """``fabric.setup(model)``: the trained model (converted, parallelized, materialized), or a frozen one held
        beside it (``held_frozen``: no parameter requires a gradient, no adapters declared; a DPO reference, a
        distillation teacher): the same steps on the same meshes with its own plan, every unit resharded after its
        forward, no gradients, and nothing of the trained model's state (its pipeline, its checkpoints) touched."""
        precision = self.precision.precision
        if self._user_parallelize_fn is not None:
            frozen = held_frozen(module, ModelConverters())  # the hook converts nothing
            module = self._user_parallelize_fn(module, self.device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
            materialize_model(module, self.root_device, seed=self._init_seed(module))
            if frozen:
                self.frozen_modules.add(module)  # kept out of optimizers and checkpoints all the same
            else:
                self.distributed_checkpoint_io.trained_subset = None  # converted by nobody: checkpoints hold all of it
            return module
        plan = resolve_plan(module, self.parallel_config, self.strategy_options.plan)
        # The model's constraints (its plan, its adapters, its experts), before any collective touches it.
        inputs = validation_inputs_of(module)
        frozen = held_frozen(module, ModelConverters.of(plan, inputs))
        self.validate(plan=plan, frozen=frozen, **inputs)
        if frozen:
            module.eval()  # never trained: no dropout (the trained model's train()/eval() do not reach it)
            self._parallelize_frozen_model(module, plan, precision, seed_owner=module)
            return module
        self._keep_parallelized(module, parallelize_and_materialize(
            module, self._built_meshes(), self.parallel_config, plan, precision, self.root_device,
            seed=lambda: self._init_seed(module), known_init_hooks=registry.known_init_hooks,
            inputs=inputs,  # the converters it asks for (its declared lora, or the adapters it was given with)
        ))
        self._setup_modules.append(module)
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
                                    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: refused for a frozen model before anything is parallelized."""
        if optimizers and not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"fabric.setup({type(module).__name__}, optimizer): no parameter of {type(module).__name__} requires a"
                " gradient, so it is a frozen model held beside the trained one (a reference, a teacher) and has no"
                " optimizer. Set it up alone: `reference = fabric.setup(reference)`; give the optimizer the trained"
                " model's parameters"
            )
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers``: an optimizer over a frozen model's parameters is refused (torch would skip them,
        gradient-less, without a word)."""
        frozen = self._frozen_parameters()
        held = [frozen[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in frozen]
        if held:
            module, name = held[0]
            raise ValueError(
                f"The optimizer given to fabric.setup_optimizers holds {len(held)} parameter(s) of the frozen model"
                f" {type(module).__name__} set up by fabric.setup (e.g. {name!r}): a frozen model (every parameter"
                " requires_grad=False: a reference, a teacher) is never trained. Build the optimizer over the trained"
                " model's parameters: `[p for p in model.parameters() if p.requires_grad]`"
            )
        return super().setup_optimizer(optimizer)

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
        """Clip to the global norm over DTensor gradients on any mix of meshes (the single-device norm), once the
        deferred reductions completed them (``finish_gradients``)."""
        self.finish_gradients()
        self.precision.unscale_gradients(optimizer)
        # Under non_finite="skip" a NaN/inf norm is the step guard's to handle (it drops the step).
        strict = error_if_nonfinite and self.parallel_config.non_finite != "skip"
        return clip_grad_norm_(
            self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite=strict,
            pipeline_group=self.pipeline.pp_group if self.pipeline is not None else None,
        )

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        """Lightning's value clipping, once the deferred reductions completed the gradients (``finish_gradients``)."""
        self.finish_gradients()
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``fabric.save``: a sharded folder (default) or a full file; complete or recognisably incomplete. Under LoRA
        the model's state is its adapters (``DistributedCheckpointIO.trained_subset``)."""
        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support filtered checkpoints")
        if frozen := [key for key, obj in state.items() if isinstance(obj, nn.Module) and obj in self.frozen_modules]:
            raise ValueError(
                f"fabric.save: state[{frozen[0]!r}] is a frozen model held beside the trained one, which no checkpoint"
                " keeps (it is rebuilt as it was set up: its init or its weights). Leave it out of the state"
            )
        io = self.distributed_checkpoint_io
        path = io.path_to_save(path, storage_options)
        modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
        if len(modules) != 1:
            raise ValueError(
                f"fabric.save needs exactly one model in the state (got {len(modules)}): state={{'model': model, ...}}"
            )
        check_finite_weights(modules[0], path)  # never a checkpoint of NaN weights
        tensors, metadata = io.state_dicts(state, modules[0])
        io.save(tensors, metadata, path)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``fabric.load``: falls back from an incomplete checkpoint; reshards to the current layout; weights-only. An
        adapters-only checkpoint (LoRA) is checked against this run's adapters and base, then only its tensors are
        read."""
        check_weights_only(weights_only, path)  # every load is weights-only: False is refused, not ignored
        # Digests checked for what the load reads: the modules' and optimizers' entries (a full file: all of it).
        parts = state if isinstance(state, dict) else {}
        loaded = [key for key, obj in parts.items() if isinstance(obj, (nn.Module, Optimizer))]
        resolved = self._checkpoint_to_load(path, prefixes=tuple(f"{key}." for key in loaded) or None)
        io = self.distributed_checkpoint_io
        # An adapters-only checkpoint (LoRA): its base is this run's own (the seeded init), which must be the one it
        # was trained on; refused before anything is read otherwise. (A full file's record is read when this run
        # trains adapters: a run without them is refused its missing tensors by Lightning's loader.)
        full = io.read_metadata(resolved) if not resolved.is_dir() and io.trained_subset is not None else None
        adapters = io.adapters_to_load(resolved, full.get(ADAPTERS_KEY) if full is not None else None)
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
                    self._check_checkpoint_fits(resolved, key, obj, strict=strict, trained_only=adapters is not None)
        if adapters is not None and isinstance(state, dict) and resolved.is_dir():
            remainder = self._load_trained(resolved, state, strict)
        else:
            if full is not None and adapters is not None and strict and isinstance(state, dict):
                _require_keys(state, full)  # a full file of the adapters: the model's other tensors are not in it
            with trusted_globals():  # Lightning's own torch.load of meta.pt (or the full file), weights-only
                remainder = io.state_dict_call(super().load_checkpoint, resolved, state,
                                               strict=strict and adapters is None, weights_only=True)
        for key, obj in stateful.items():
            if isinstance(state, dict) and state.get(key) is not obj:
                obj.load_state_dict(state[key])
                state[key] = obj
        saved = remainder.pop("lightning_2d", None) if isinstance(remainder, dict) else None
        io.restore_random_state(resolved, saved)
        return remainder

    def _load_trained(self, path: Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        """An adapters-only sharded checkpoint into ``state``, as Lightning's loader fills it: the model's tensors the
        checkpoint holds and each optimizer's state (``DistributedCheckpointIO.load_trained``), the other requested
        objects from its metadata; returns the metadata not requested."""
        modules = {key: obj for key, obj in state.items() if isinstance(obj, nn.Module)}
        if len(modules) != 1:
            raise ValueError(f"fabric.load needs exactly one model in the state (got {len(modules)}):"
                             " state={'model': model, ...}")
        (key, module), = modules.items()
        optimizers = {k: obj for k, obj in state.items() if isinstance(obj, Optimizer)}
        metadata = self.distributed_checkpoint_io.load_trained(path, key, module, optimizers)
        requested = [k for k in state if k not in modules and k not in optimizers]
        if strict:
            _require_keys({k: state[k] for k in requested}, metadata)
        for name in requested:
            if name in metadata:
                state[name] = metadata.pop(name)
        return metadata


def _require_keys(state: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    """Lightning's strict load: every object of ``state`` but the model and its optimizers is in the checkpoint."""
    missing = [k for k, obj in state.items() if not isinstance(obj, (nn.Module, Optimizer)) and k not in checkpoint]
    if missing:
        raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in the loaded checkpoint."
                       " To disable strict loading, set `strict=False`.")


if STRATEGY_NAME not in STRATEGY_REGISTRY:
    # The name for `Fabric(strategy="model_parallel_2d")` (default options, the plan resolved from the model);
    # one registered by someone else is left alone.
    STRATEGY_REGISTRY.register(
        STRATEGY_NAME,
        ModelParallel2DStrategy,
        description="FSDP2/HSDP × tensor/sequence × pipeline × context parallelism, applied by lightning_2d",
    )
