"""The one place where a model is parallelized: (pipeline split) → (float8) → TP/SP → expert parallelism →
activation checkpointing → compile → FSDP2.

The Trainer strategy (``lightning_2d.integration.trainer_strategy``) and the Fabric strategy (``lightning_2d.integration.fabric_strategy``)
both call ``parallelize_model``; neither has a copy of these steps. Before them, ``parallelize_and_materialize``
applies the model converters the trained thing asks for (``parallel.converters``: LoRA's adapters, QLoRA's NF4 bases)
to the meta model, at the one point both strategies, the planner and the one-device path
(``convert_and_materialize``) share. It returns one result, ``Parallelized`` (the
model, its ``Pipeline`` when there is one, the meshes), which the strategy keeps and hands to whoever steps the
model: there is no registry to look a model's pipeline up in.

Each step can be replaced without subclassing a strategy: an object passed as ``hooks`` (the
LightningModule, or the module given to ``fabric.setup``) that defines a method of the step's
name is called instead of the library's function, with the same arguments (every hook a
LightningModule or model may define is listed in ``lightning_2d.parallel.hooks``):

====================================  ==============================================
``apply_tensor_parallel``             ``(model, tp_mesh, plan, config)``
``apply_expert_parallel``             ``(model, ep_mesh, plan, config)``
``apply_activation_checkpointing``    ``(model, plan, config)``
``apply_compile``                     ``(model, plan, config)``
``apply_fully_shard``                 ``(model, dp_mesh, plan, config)``
``apply_simple_fsdp``                 ``(model, dp_mesh, plan, config)`` (``fsdp_backend="simple_fsdp"``)
====================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_2d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_2d.parallel.async_tensor_parallel import enable_async_tensor_parallel
from lightning_2d.parallel.compile import apply_compile
from lightning_2d.parallel.ties import retie, shared_parameters, tied_pipeline_message
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.context import apply_context_parallel
from lightning_2d.parallel.converters import ModelConverters, fsdp_shards
from lightning_2d.parallel.expert import apply_expert_parallel, expert_modules
from lightning_2d.parallel.float8 import convert_to_float8, float8_tensor_parallel_plan
from lightning_2d.parallel.fsdp_backend import BACKENDS, fsdp_backend
from lightning_2d.parallel.grad_sync import DeferredTensorReduction, defer_tensor_reductions
from lightning_2d.parallel.hooks import STEP_HOOKS
from lightning_2d.parallel.materialize import has_meta_tensors, materialize_model
from lightning_2d.parallel.meshes import ParallelMeshes, as_meshes
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.parallel.names import CP_DIM, EP_DIM, PP_DIM, TP_DIM
from lightning_2d.parallel.pipeline import Pipeline, parallelize_pipeline
from lightning_2d.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The library's function of each step hook; the FSDP step is each backend's (``parallel.fsdp_backend``).
STEPS: dict[str, Callable[..., None]] = {
    **dict(zip(STEP_HOOKS, (apply_tensor_parallel, apply_expert_parallel, apply_activation_checkpointing,
                            apply_compile))),
    **{backend.hook: backend.step for backend in BACKENDS.values()},
}


@dataclass(frozen=True, eq=False)
class Parallelized:
    """What ``parallelize_model`` made of a model; the strategy owns it (``strategy.parallelized``) and passes it on.

    Attributes:
        model: The model, parallelized in place (under a pipeline: pruned to this rank's blocks; calling it raises).
        meshes: The meshes it was parallelized over (``ParallelMeshes``).
        pipeline: The ``Pipeline`` that steps it under pipeline parallelism (``train_step``/``eval_step``), else
            ``None``.
        init_seed: The seed its meta tensors were initialized from (``parallelize_and_materialize``), else ``None``.
        converters: The model converters ``parallelize_and_materialize`` applied (``parallel.converters``): what
            trains, what a checkpoint keeps.
        tensor_reductions: Its tensor-parallel gradient reductions deferred to one bucketed all-reduce per step
            (``parallel.grad_sync``), when ``parallelize_and_materialize`` parallelized it with FSDP2; else ``None``.
    """

    model: nn.Module
    meshes: ParallelMeshes
    pipeline: Optional["Pipeline"] = None
    init_seed: Optional[int] = None
    converters: ModelConverters = field(default_factory=ModelConverters)
    tensor_reductions: Optional[DeferredTensorReduction] = None

    def finish_gradients(self) -> None:
        """Complete the gradients after the step's last backward, before anything reads them (``grad_sync``)."""
        if self.tensor_reductions is not None:
            self.tensor_reductions.finish()


def _step(hooks: Any, name: str) -> Callable[..., None]:
    override = getattr(hooks, name, None) if hooks is not None else None
    return override if callable(override) else STEPS[name]


def is_parallelized(model: nn.Module) -> bool:
    """Whether ``model`` already holds DTensor parameters (e.g. parallelized by the user's ``configure_model``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def target_module(owner: nn.Module, plan: ParallelPlan) -> nn.Module:
    """The module the plan applies to: ``owner`` itself or its attribute ``plan.module``."""
    if not plan.module:
        return owner
    target = getattr(owner, plan.module, None)
    if not isinstance(target, nn.Module):
        raise AttributeError(
            f"The parallel plan applies to `{type(owner).__name__}.{plan.module}`, which is"
            f" {type(target).__name__}, not an nn.Module. Build the model (in `configure_model()` for a"
            f" LightningModule) and assign it to `self.{plan.module}`, or set ParallelPlan(module=...) to its"
            " attribute name."
        )
    return target


def parallelize_and_materialize(
    owner: nn.Module,
    mesh: "DeviceMesh",
    config: ParallelConfig,
    plan: ParallelPlan,
    precision: str,
    device: torch.device,
    seed: Callable[[], int],
    known_init_hooks: Callable[[nn.Module], Any] = lambda model: None,
    inputs: Mapping[str, Any] = {},
) -> Parallelized:
    """What both strategies do with a model: convert it (``parallel.converters``), parallelize it (unless already
    done) and materialize it.

    Args:
        owner: The LightningModule or the module given to ``fabric.setup``; its methods named like
            the steps override them, its ``parallel_plan(config)`` gives the plan unless ``plan``
            is given, its ``weights_source()`` (if any) gives the initial values.
        mesh: The meshes (``ParallelDims.build_mesh``) or their root ``DeviceMesh``.
        config: The strategy's options.
        plan: The plan to apply (``lightning_2d.models.registry.resolve_plan``: the strategy's, the
            owner's ``parallel_plan(config)`` or a known model's).
        precision: The Trainer/Fabric precision string.
        device: Where the shards live.
        seed: Called (on every rank) for the initialization seed when a seeded init is needed.
        known_init_hooks: The built-in init hooks of a model family the library knows, for a model that
            has none (``lightning_2d.models.registry.known_init_hooks``), else ``None``.
        inputs: What the owner says of itself (the checks' inputs, ``models.registry.validation_inputs_of``): the
            model converters it asks for (``lora`` …) are made from them and ``plan``.

    Returns:
        ``Parallelized``: the module the plan applied to, its pipeline (if any), the meshes, the converters. A model
        the owner parallelized itself (``configure_model``) is only materialized, and has no pipeline.
    """
    config = config.resolve_dtypes(precision)
    model = target_module(owner, plan)
    meshes = as_meshes(mesh, config)  # the public boundary: a root read as its meshes, a missing dimension refused
    assert meshes is not None
    converters = ModelConverters.of(plan, inputs)
    result = Parallelized(model, meshes, converters=converters)
    if not is_parallelized(model):
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # store the shards in bf16 ("true" half precision)
        convert_model(model, meshes, converters, device)
        result = replace(parallelize_model(model, meshes, plan, config, hooks=owner), converters=converters)
        result = replace(result, tensor_reductions=defer_tensor_reductions(result.model, config.fsdp_backend))
    if has_meta_tensors(owner):
        weights = _weights_source(owner)
        init_seed = seed()
        # The stored shards are what initialization fills (the backend's attribute read may gather otherwise).
        with fsdp_backend(config.fsdp_backend).state_access():
            _materialize(owner, model, device, init_seed, weights, known_init_hooks)
        result = replace(result, init_seed=init_seed)
    return result


def convert_and_materialize(
    owner: nn.Module,
    plan: ParallelPlan,
    device: torch.device,
    seed: int,
    inputs: Mapping[str, Any] = {},
    known_init_hooks: Callable[[nn.Module], Any] = lambda model: None,
) -> ModelConverters:
    """One device (the modules' parity reference, a single-device Fabric loop): what ``parallelize_and_materialize``
    does with the owner's meta model, without the parallelism: its converters applied (whole weights: one shard),
    then its tensors allocated on ``device`` and initialized from ``seed`` (or the owner's ``weights_source()``).

    Args:
        owner: The LightningModule, or the model itself (``plan.module`` names the model in it).
        plan: The model's plan (its family's facts the converters read: ``adapter_targets`` …).
        device: Where the model lives.
        seed: The initialization seed.
        inputs: What the owner says of itself (the checks' inputs): the converters it asks for.
        known_init_hooks: As ``parallelize_and_materialize``'s.

    Returns:
        The converters applied (what trains, what a checkpoint keeps).
    """
    model = target_module(owner, plan)
    converters = ModelConverters.of(plan, inputs)
    convert_model(model, None, converters, device)
    _materialize(owner, model, device, seed, _weights_source(owner), known_init_hooks)
    return converters


def convert_model(model: nn.Module, meshes: Optional[ParallelMeshes], converters: ModelConverters,
                  device: torch.device) -> None:
    """Apply ``converters`` (``ModelConverters.of(plan, inputs)``) to the meta model for the layout of ``meshes``
    (``None``: one device), in place: the one point where a model is converted (``parallelize_and_materialize``,
    ``convert_and_materialize``, the planner's simulated rank).

    On the meta model, before anything wraps its layers: QLoRA's NF4 bases must be the parameters FSDP shards
    (torchao's all-gather), each cut on whole scaler groups into FSDP's row shards (``fsdp_shards``; checked before
    any allocation, the layout already by the strategies' validation: ``parallel/lora.py``'s checks).
    """
    converters.convert(model, fsdp_shards(meshes) if meshes is not None else 1, device)


def _weights_source(owner: nn.Module) -> Any:
    """The owner's ``weights_source()`` (the model's initial values: ``init_from`` …), else ``None``: its init."""
    source_fn = getattr(owner, "weights_source", None)
    return source_fn() if callable(source_fn) else None


def _materialize(owner: nn.Module, model: nn.Module, device: torch.device, seed: int, weights: Any,
                 known_init_hooks: Callable[[nn.Module], Any]) -> None:
    """Materialize ``model`` (the plan's module of ``owner``) from ``weights``, else from ``seed``, then the owner's
    other meta tensors."""
    # Init hooks: the model's own, else the owner's (for a model class the user cannot change),
    # else those of an architecture this library knows (a Hugging Face decoder given to Fabric).
    hooks = [h for h in (owner, known_init_hooks(model)) if h is not None and h is not model]
    materialize_model(model, device, seed=seed, weights=weights, init_hooks=hooks)
    materialize_model(owner, device, seed=seed)  # meta tensors outside the plan's module, if any


def parallelize_model(
    model: nn.Module,
    mesh: "ParallelMeshes | DeviceMesh",
    plan: ParallelPlan,
    config: ParallelConfig,
    hooks: Any = None,
) -> Parallelized:
    """Apply (float8) → TP/SP → expert parallelism → activation checkpointing → compile → FSDP2 to ``model``, in
    place.

    Under context parallelism the plan's attention modules first get the context-parallel attention core
    (``lightning_2d.parallel.context``). Under pipeline parallelism the model is then split into this rank's stages
    (``lightning_2d.parallel.pipeline``) and the steps are applied to each stage.

    Args:
        model: The model, preferably on the meta device (then materialize it afterwards with
            ``lightning_2d.parallel.materialize_model``).
        mesh: The meshes of ``ParallelDims.build_mesh``, their root ``DeviceMesh`` (``strategy.device_mesh``, as
            Fabric's ``parallelize_fn`` receives it: read as the meshes it was built with, expert parallelism
            included), a root built by hand (with ``config``'s expert parallelism), or Lightning's 2D
            ``(data_parallel, tensor_parallel)`` mesh. A size above 1 that ``config`` asks for and the mesh does not
            have raises ``ValueError`` here, before anything is changed.
        plan: Module names to parallelize.
        config: The options, with ``param_dtype``/``reduce_dtype`` resolved
            (``ParallelConfig.resolve_dtypes``).
        hooks: An object whose methods named like the steps override them (see the module docstring).

    Returns:
        ``Parallelized``: ``model``, the meshes, and under pipeline parallelism the ``Pipeline`` that steps it.
    """
    meshes = as_meshes(mesh, config)  # the public boundary: a root read as its meshes, a missing dimension refused
    assert meshes is not None
    cp_mesh = meshes.optional(CP_DIM)
    if cp_mesh is not None:
        if plan.attention is None:
            raise ValueError("context parallelism needs the plan's attention modules (ParallelPlan.attention)")
        apply_context_parallel(model, cp_mesh, plan.attention)
    if meshes.optional(EP_DIM) is not None and not expert_modules(model, plan):
        raise ValueError(
            f"expert_parallel_size={meshes.size(EP_DIM)} but ParallelPlan.expert_parallel names no module of"
            f" {type(model).__name__} ({', '.join(plan.expert_parallel) or 'it is empty'}): its experts would train"
            " unsplit. Name each layer's stacked experts there (module name → ExpertParallel()), or use"
            " expert_parallel_size=1"
        )
    if meshes.optional(PP_DIM) is not None:
        if ties := shared_parameters(model):
            raise ValueError(tied_pipeline_message(ties))
        # Split into this rank's pipeline stages, then the steps below on each stage (its own FSDP root).
        pipeline = parallelize_pipeline(
            model, meshes, plan, config,
            lambda stage, stage_plan: _parallelize_one(stage, meshes, stage_plan, config, hooks),
        )
        return Parallelized(model, meshes, pipeline)
    _parallelize_one(model, meshes, plan, config, hooks)
    return Parallelized(model, meshes)


def _parallelize_one(model: nn.Module, meshes: ParallelMeshes, plan: ParallelPlan, config: ParallelConfig,
                     hooks: Any) -> None:
    tp_mesh, dp_mesh = meshes.get(TP_DIM), meshes.fsdp  # dp_mesh: (replicate, shard) under HSDP
    # One dict of styles from here on: the plan's sequence-parallel overlay merged in when the option is on.
    plan = replace(plan, tensor_parallel=plan.tensor_parallel_styles(config.sequence_parallel))
    ties = shared_parameters(model)  # before the styles give each name its own DTensor
    if config.float8:
        # A module swap on the meta model, before anything wraps the Linears (torchtitan's order);
        # the block projections then take torchao's float8 tensor-parallel styles.
        convert_to_float8(
            model,
            emulate=config.float8 == "emulate",
            recipe=config.float8_recipe,
            # Over a 1-rank data-parallel mesh there is no all-gather to shrink (as torchtitan).
            fsdp_float8_all_gather=config.fsdp_float8_all_gather and dp_mesh.size() > 1,
            tensor_parallel_size=tp_mesh.size(),
            # The head stays in high precision (as torchtitan): the plan's output unit names it
            # (Llama's `output`, a Hugging Face decoder's `lm_head`).
            skip=plan.output_unit or ("output",),
        )
        plan = replace(plan, tensor_parallel=float8_tensor_parallel_plan(plan.tensor_parallel, model))
    if tp_mesh.size() > 1 and plan.tensor_parallel:
        frozen = _frozen_parameters(model)
        _step(hooks, "apply_tensor_parallel")(model, tp_mesh, plan, config)
        retie(model, ties)
        _refreeze(model, frozen)
        if config.async_tensor_parallel:
            enable_async_tensor_parallel(tp_mesh)  # before the first compiled forward
    ep_mesh = meshes.optional(EP_DIM)
    # The plan's expert modules, found before any wrapper renames their path (activation checkpointing).
    experts = expert_modules(model, plan) if ep_mesh is not None else []
    if experts:  # after tensor parallelism, as torchtitan: the experts' own placement over their ranks
        _step(hooks, "apply_expert_parallel")(model, ep_mesh, plan, config)
    if config.activation_checkpointing != "none":
        _step(hooks, "apply_activation_checkpointing")(model, plan, config)
    if config.compile:
        _step(hooks, "apply_compile")(model, plan, config)
    # FSDP also at dp == 1: it carries the mixed-precision policy, and every parameter becomes a
    # DTensor, so checkpoints and gradient clipping handle one kind of parameter at every layout.
    backend = fsdp_backend(config.fsdp_backend)
    backend.apply(model, meshes, plan, config, _step(hooks, backend.hook), experts=experts)


def _frozen_parameters(model: nn.Module) -> set[str]:
    return {canonical_name(n) for n, p in model.named_parameters() if not p.requires_grad}


def _refreeze(model: nn.Module, frozen: set[str]) -> None:
    """Freeze again what was frozen before tensor parallelism: torch's ``SequenceParallel`` (2.13) re-registers a
    norm's weight as a new ``Parameter`` without its ``requires_grad``, so a frozen norm (a LoRA base) would train."""
    for name, param in model.named_parameters():
        if canonical_name(name) in frozen:
            param.requires_grad_(False)
