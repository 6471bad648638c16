"""What the Trainer and the Fabric strategies share: a strategy composed of parts with one job each.

``lightning_2d.ModelParallel2DStrategy`` (Trainer) and ``lightning_2d.integration.fabric_strategy.ModelParallel2DStrategy``
are each Lightning's ``ModelParallelStrategy`` of their world with ``ModelParallel2DBase`` in front of it
in the MRO. The base holds the options and wires the parts into Lightning's strategy hooks; each part
is a module of its own, usable and tested without a strategy:

=====================  =============================================  ===========================================
part                   module                                         where the strategy calls it
=====================  =============================================  ===========================================
layout and validation  ``parallel.dims`` (``validate_parallel_dims``,  ``validate``: construction, the launcher,
                       ``ParallelDims.build_mesh``),                  ``setup_environment`` (then the mesh)
                       ``parallel.checks`` (the checks' registry),
                       ``integration.validation``
precision              ``integration.precision`` (a Lightning         swapped in at construction
                       precision plugin)
step guard             ``integration.step_guard``                     ``backward``, ``optimizer_step``
FSDP backend           ``parallel.fsdp_backend`` (an object: what     resolved once at construction
                       the ``fsdp_backend`` option names)             (``fsdp_backend``): applied by
                                                                      ``parallelize_model``, its state access
                                                                      handed to the checkpoint IO, its gradient
                                                                      sync entered during accumulation
checkpoint IO          ``integration.checkpoint_io`` (a Lightning     ``setup_environment`` creates it; the
                       ``CheckpointIO``)                              strategies' save/load/remove delegate,
                                                                      every state-dict path through it; what a
                                                                      checkpoint keeps of a converted model
                                                                      (LoRA's adapters) handed to it once the
                                                                      model is parallelized
pipeline               ``parallel.pipeline`` (stepped by the          kept after parallelizing (``parallelized``):
                       LightningModule or the Fabric loop)            read by the module, the loop, the precision
                                                                      plugin (clipping spans the stages)
watchdog               ``parallel.watchdog``                          ``setup_environment`` … ``teardown``,
                                                                      ``optimizer_step``, ``on_exception``
=====================  =============================================  ===========================================

Each strategy keeps only what its world defines differently: the Trainer's ``setup`` and checkpoint dict,
Fabric's ``setup_module`` and ``fabric.save`` state.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_2d._compat import (
    saves_distributed_checkpoint,
    set_strategy_mesh,
    setup_distributed,
    strategy_timeout,
    trainer_of,
)
from lightning_2d.checkpoint.integrity import Integrity
from lightning_2d.checkpoint.rng import layout_of
from lightning_2d.checkpoint.subset import TrainedSubset
from lightning_2d.errors import Lightning2DWarning
from lightning_2d.integration.checkpoint_io import DistributedCheckpointIO
from lightning_2d.integration.strategy_options import split_options, takes_options
from lightning_2d.integration.precision import FabricFSDP2Precision, FSDP2Precision, fsdp2_precision
from lightning_2d.integration.step_guard import NonFiniteLossError, StepGuard, check_first_loss
from lightning_2d.models import registry
from lightning_2d.parallel.config import ParallelPlan
from lightning_2d.parallel.dims import ParallelDims, cuda_index, destroy_process_group_at_exit, validate_parallel_dims
from lightning_2d.parallel.float8 import precompute_float8_scales
from lightning_2d.parallel.frozen import parallelize_frozen
from lightning_2d.parallel.fsdp_backend import FSDPBackend, fsdp_backend
from lightning_2d.parallel.known_warnings import KnownWarnings
from lightning_2d.parallel.loss import backward_context
from lightning_2d.parallel.meshes import ParallelMeshes
from lightning_2d.parallel.parallelize import Parallelized
from lightning_2d.parallel.pipeline import Pipeline
from lightning_2d.parallel.watchdog import Watchdog, nccl_failure_env, start_watchdog

__all__ = [
    "FSDP2Precision", "FabricFSDP2Precision", "ModelParallel2DBase", "NonFiniteLossError", "check_first_loss",
]

if TYPE_CHECKING:
    from datetime import timedelta
    from typing import Literal, Union  # the generated __init__ declaration's annotations

    from lightning_2d.parallel.config import Size
    from lightning_2d.parallel.schedules import ScheduleName

    class LightningStrategyMembers:
        """What the base uses of Lightning's ``ModelParallelStrategy`` (the Trainer's and Fabric's both have it),
        for type checkers: the base is mixed into either, so at run time it has no Lightning base class."""

        num_nodes: int
        parallel_devices: Optional[list[torch.device]]
        accelerator: Any
        cluster_environment: Any

        def __init__(self, **kwargs: Any) -> None: ...
        @property
        def num_processes(self) -> int: ...
        @property
        def root_device(self) -> torch.device: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        def barrier(self, *args: Any, **kwargs: Any) -> None: ...
        def broadcast(self, obj: Any, src: int = 0) -> Any: ...
        def _configure_launcher(self) -> None: ...
        def setup_environment(self) -> None: ...
        def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any: ...
        def teardown(self) -> None: ...

else:
    LightningStrategyMembers = object


#: The name both strategies are registered under: ``Trainer(strategy=...)``, ``Fabric(strategy=...)``.
STRATEGY_NAME = "model_parallel_2d"


class ModelParallel2DBase(LightningStrategyMembers):
    """Mixin in front of Lightning's ``ModelParallelStrategy`` (Trainer or Fabric); see the module docstring.

    Its constructor takes the options of ``ParallelConfig`` and ``StrategyOptions``
    (``lightning_2d.integration.strategy_options``) as parameters generated from the fields (names, annotations, defaults,
    positional order and docstring).
    """

    #: Tells a LightningModule to build its model on the meta device in ``configure_model``.
    materializes_meta_modules = True
    #: The precision plugin that replaces Lightning's stock ones (the Trainer's or Fabric's kind).
    fsdp2_precision_class: type = FSDP2Precision

    def _init_options(self, options: dict[str, Any]) -> None:
        """The constructor's body (``__init__`` is generated around it below): ``options`` holds every option's
        value by name. A plain method, so that type checkers read it (and the attributes it sets)."""
        # Validate the options first: a typo fails here, at construction, with every problem listed.
        parallel, strategy = split_options(options)
        self.parallel_config, self.strategy_options = parallel, strategy
        #: The FSDP backend ``fsdp_backend`` names (``parallel.fsdp_backend``): how the model is sharded over the
        #: data-parallel ranks, how its state is read outside a forward, how gradient reduction is deferred.
        self.fsdp_backend: FSDPBackend = fsdp_backend(parallel.fsdp_backend)
        # Lightning's own size fields are left "auto": the mesh is ours (``setup_environment``).
        super().__init__(
            **self._lightning_strategy_kwargs(),
            save_distributed_checkpoint=strategy.save_distributed_checkpoint,
            process_group_backend=strategy.process_group_backend,
            timeout=strategy.timeout,
        )
        self.parallel_dims: Optional[ParallelDims] = None
        #: The parts (see the module docstring); the checkpoint IO is created with the process group.
        self.step_guard = StepGuard(parallel.non_finite)
        self._checkpoint_part: Optional[DistributedCheckpointIO] = None
        #: The digest checks of checkpoints this strategy's loads made, handed to each checkpoint IO it creates:
        #: what one check read whole (``lightning-2d``'s check of ``--ckpt_path`` hands its own over, the Fabric
        #: recipe's ``latest_checkpoint`` fills it) is not read again.
        self.checkpoint_integrity = Integrity()
        self._watchdog: Optional[Watchdog] = None
        self._optimizer_steps = 0
        self._meshes: Optional[ParallelMeshes] = None
        #: What ``parallelize_model`` made of the model (the Trainer's LightningModule's, or the last module
        #: given to ``fabric.setup``): the model, its pipeline, the meshes. The strategy hands it on; nothing
        #: looks it up.
        self.parallelized: Optional[Parallelized] = None
        #: The frozen models parallelized beside the trained one (``_parallelize_frozen_model``): in no optimizer,
        #: no checkpoint. Weak: a model the user drops is not kept alive (nor its parameters' ids reused).
        self.frozen_modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._known_warnings = KnownWarnings()

    # ``__init__`` is generated from the options' fields, twice: type checkers and IDEs read the declaration (they do
    # not run ``takes_options``); at run time ``takes_options`` makes the real one, every option a parameter in their
    # positional order with the field's annotation and default, which hands their values to ``_init_options``.
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
        ) -> None: ...
        # END generated
    else:
        __init__ = takes_options("The strategy's options (the fields of ``ParallelConfig`` and ``StrategyOptions``).")(
            _init_options
        )

    def _lightning_strategy_kwargs(self) -> dict[str, Any]:
        """Extra arguments of the Lightning strategy's constructor (Fabric: ``parallelize_fn``)."""
        return {}

    # ---- what differs between the worlds -----------------------------------------------------
    def _precision_plugin_2d(self) -> Any:
        raise NotImplementedError

    def _set_precision_plugin_2d(self, plugin: Any) -> None:
        raise NotImplementedError

    def _validation_context(self) -> dict[str, Any]:
        """``plan``, ``seq_len`` and ``batch_size`` known at this point (the Trainer knows its LightningModule)."""
        return {"plan": self.strategy_options.plan, "seq_len": None}

    def _float8_modules(self) -> list[nn.Module]:
        """Modules whose float8 all-gather scales are recomputed after each optimizer step."""
        return []

    def _use_checkpoint_io(self, io: DistributedCheckpointIO) -> None:
        """Hand the checkpoint part to Lightning where its strategy takes a ``CheckpointIO`` (the Trainer's)."""

    # ---- layout and validation ----------------------------------------------------------------
    def validate(
        self,
        device_index: Optional[int] = None,
        plan: Optional[ParallelPlan] = None,
        seq_len: Optional[int] = None,
        batch_size: Optional[int] = None,
        **inputs: Any,
    ) -> ParallelDims:
        """Check the layout against the world, the model, the precision and the hardware; raises
        ``ParallelConfigError`` listing every problem.

        The one entry to validation (``lightning_2d.integration.validation`` lists where it runs): before any
        process group, in the launching process once the Trainer/Fabric is constructed (world size,
        precision, float8/async-TP requirements) and once the launcher knows the LightningModule and the
        datamodule, and in each process once the model's plan, the sequence length and the process's GPU
        (``device_index``: float8 tensor cores) are known, and once the model is built, before parallelizing it.
        ``inputs``: other check inputs known here (``parallel.checks.INPUTS``: what the model says of itself).
        """
        context = self._validation_context()
        for name, value in dict(inputs, plan=plan, seq_len=seq_len, batch_size=batch_size).items():
            if value is not None:
                context[name] = value
        plugin = self._precision_plugin_2d()
        devices = self.parallel_devices
        return validate_parallel_dims(
            self.parallel_config,
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            precision=getattr(plugin, "precision", None),
            num_nodes=self.num_nodes,
            device_type=devices[0].type if devices else None,
            device_index=device_index,
            **context,
        )

    def _configure_launcher(self) -> None:
        # Called by the Trainer's/Fabric's constructor, before any process is launched: fail there.
        self.validate()
        plugin = fsdp2_precision(
            self._precision_plugin_2d(), self.fsdp2_precision_class, pipeline=self._current_pipeline,
            gradients_ready=self.finish_gradients,
        )
        self._set_precision_plugin_2d(plugin)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        """Validate in this process, start the process group, build the mesh (not Lightning's 2D one)."""
        self.parallel_dims = self.validate(device_index=cuda_index(self.root_device))
        if self.parallel_config.loss_parallel and self.parallel_dims.tp == 1:
            rank_zero_warn(
                "loss_parallel=True has no effect with tensor_parallel_size=1: the logits are not sharded over a"
                " vocabulary dimension. Set loss_parallel=False (or tensor_parallel_size > 1)."
            )
        # What Lightning's ModelParallelStrategy.setup_environment does before building its 2D mesh:
        # the accelerator's device, then the seed reset, the world ranks and the process group.
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        if self.root_device.type == "cuda":
            nccl_failure_env(self.strategy_options.watchdog_timeout)  # torch's NCCL watchdog settings, before the groups
        setup_distributed(self)
        # Torch's per-step noise of a correct 2D run, until teardown; the library's own warnings (parallel/ warns on
        # every rank, knowing nothing of ranks) shown by rank 0 only, as Lightning's rank_zero_warn would.
        self._known_warnings.install(ignore=(Lightning2DWarning,) if self.global_rank != 0 else ())
        self._meshes = self.parallel_dims.build_mesh(self.root_device.type, timeout=strategy_timeout(self))
        set_strategy_mesh(self, self._meshes.root)  # Lightning's `device_mesh`: every dimension, size 1 allowed
        destroy_process_group_at_exit()
        self._watchdog = start_watchdog(
            self.strategy_options.watchdog_timeout, self.global_rank, self.world_size,
            collective_timeout=strategy_timeout(self),
        )
        self._checkpoint_part = DistributedCheckpointIO(
            self.global_rank,
            self.world_size,
            self.barrier,
            self.broadcast,
            sharded=saves_distributed_checkpoint(self),
            async_save=self.strategy_options.async_checkpoint,
            layout=layout_of(self.world_size, self.parallel_dims),
            integrity=self.checkpoint_integrity,
            state_access=self.fsdp_backend.state_access,
        )
        self._use_checkpoint_io(self._checkpoint_part)

    @property
    def distributed_checkpoint_io(self) -> DistributedCheckpointIO:
        """The checkpoint part (created in ``setup_environment``, with the process group)."""
        if self._checkpoint_part is None:
            raise RuntimeError(f"{type(self).__name__}: checkpoints need the process group (setup_environment)")
        return self._checkpoint_part

    # ---- model -------------------------------------------------------------------------------
    @property
    def meshes(self) -> Optional[ParallelMeshes]:
        """The layout's meshes (``ParallelMeshes``: every named sub-mesh, size 1 allowed), built with the process
        group in ``setup_environment``; ``device_mesh`` is their root."""
        return self._meshes

    def _built_meshes(self) -> ParallelMeshes:
        """``meshes``, which everything the strategy parallelizes is given (never the root: the one mesh passed
        inward); a strategy without them was not set up."""
        if self._meshes is None:
            raise RuntimeError(f"{type(self).__name__}: parallelizing needs the meshes (setup_environment)")
        return self._meshes

    @property
    def pipeline(self) -> Optional[Pipeline]:
        """The ``Pipeline`` that steps the model under pipeline parallelism (``pipeline.train_step``/``eval_step``),
        else ``None``: what a Fabric loop steps (``fabric.strategy.pipeline``) and ``CausalLMModule`` reads."""
        return self.parallelized.pipeline if self.parallelized is not None else None

    def _current_pipeline(self) -> Optional[Pipeline]:
        # Handed to the precision plugin at construction: it asks when clipping (or refusing fabric.backward),
        # so nothing is pushed into it once the model is parallelized.
        return self.pipeline

    def _keep_parallelized(self, owner: Any, parallelized: Parallelized) -> None:
        """Keep what ``parallelize_and_materialize`` made of ``owner``'s model, and hand the checkpoint IO what a
        checkpoint of it keeps (its converters' subset: LoRA's adapters, with their settings and base: ``init_from``
        or the seed of its init, as ``owner.adapter_base()`` says if it can)."""
        self.parallelized = parallelized
        base_of = getattr(owner, "adapter_base", None)
        base = base_of() if callable(base_of) else {"init_from": None, "init_seed": parallelized.init_seed}
        self.distributed_checkpoint_io.trained_subset = TrainedSubset.of(parallelized.converters, base)

    def _parallelize_frozen(self, owner: Any, plan: Any, precision: str) -> None:
        """The models ``owner`` holds beside the trained one (``frozen_models()``: a preference loss's reference
        copy, a distillation teacher), parallelized and materialized as the trained one was: its plan (a teacher: its
        own, ``FrozenModel.plan_of``), the same meshes, its initial values (the same ``init_from``, or the same
        seed). Those whose outputs the owner finds already computed (``release_cached_frozen_models``:
        ``precompute_reference``'s cache) are let go first, never built."""
        release = getattr(owner, "release_cached_frozen_models", None)
        if callable(release):
            release()
        frozen_models = getattr(owner, "frozen_models", None)
        for frozen in (frozen_models() if callable(frozen_models) else []):
            plan_of = getattr(frozen, "plan_of", None)
            own = plan_of(self.parallel_config.resolve_dtypes(precision)) if plan_of is not None else plan
            self._parallelize_frozen_model(frozen, own, precision, seed_owner=owner)

    def _parallelize_frozen_model(self, frozen: nn.Module, plan: Any, precision: str, seed_owner: Any) -> None:
        """``parallelize_frozen`` of one frozen model (a ``FrozenModel`` the Trainer's module declares, or a model
        given frozen to ``fabric.setup``) on this strategy's meshes, initialized with ``seed_owner``'s seed (the
        trained model's, which its seeded init then reproduces), under a pipeline cut as the trained model is (its
        ``Pipeline.split``); kept in ``frozen_modules``."""
        pipeline = self.pipeline
        parallelize_frozen(frozen, self._built_meshes(), self.parallel_config, plan, precision, self.root_device,
                           seed=lambda: self._init_seed(seed_owner), known_init_hooks=registry.known_init_hooks,
                           pipeline_split=pipeline.split if pipeline is not None else None)
        self.frozen_modules.add(frozen)

    def _frozen_parameters(self) -> dict[int, tuple[nn.Module, str]]:
        """Every parameter of the frozen models this strategy set up, by ``id``: its model and name."""
        return {id(p): (module, name) for module in self.frozen_modules for name, p in module.named_parameters()}

    def _init_seed(self, owner: Any = None) -> int:
        """The strategy's ``init_seed``, else ``owner.init_seed``, else rank 0's torch seed (broadcast)."""
        seed = self.strategy_options.init_seed
        if seed is None:
            seed = getattr(owner, "init_seed", None)
        if seed is None:
            seed = self.broadcast(torch.initial_seed())
        return int(seed)

    # ---- training step -----------------------------------------------------------------------
    def _guarded_backward(self, loss: torch.Tensor, backward: Callable[[], Any]) -> Any:
        """The strategies' ``backward`` (each world names its parameters differently): ``backward()`` (Lightning's)
        under loss parallelism, between the step guard's checks of the loss."""
        self.step_guard.before_backward(loss)
        with backward_context(loss, self.parallel_config.loss_parallel):
            output = backward()
        self.step_guard.after_backward(loss)
        return output

    def finish_gradients(self) -> None:
        """Complete the trained model's gradients after the step's last backward (the tensor-parallel reductions
        deferred to one bucketed all-reduce, ``parallel.grad_sync``); the optimizer step and gradient clipping call
        it, a loop that reads gradients before either may too. Idempotent within a step."""
        if self.parallelized is not None:
            self.parallelized.finish_gradients()

    def _step_number(self) -> int:
        """The optimizer step about to be taken, counted from 1 (the Trainer's ``global_step + 1``)."""
        module = getattr(self, "lightning_module", None)
        trainer = trainer_of(module) if module is not None else None
        if trainer is not None:
            return int(trainer.global_step) + 1
        return self._optimizer_steps + 1

    def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Guard the step (``non_finite``: ``StepGuard``), update, then refresh float8 scales."""
        step = self._step_number()
        if self._watchdog is not None:
            self._watchdog.step, self._watchdog.started = step - 1, step
        args, kwargs = self.step_guard.guard_optimizer_step(optimizer, args, kwargs, step, self.root_device,
                                                            gradients_ready=self.finish_gradients)
        self._optimizer_steps += 1
        output = super().optimizer_step(optimizer, *args, **kwargs)
        if self._watchdog is not None:
            self._watchdog.step = step
        # Float8 all-gather weights: their scales for the next step, in one all-reduce.
        for module in self._float8_modules():
            precompute_float8_scales(module)
        return output

    # ---- checkpoints -------------------------------------------------------------------------
    def _checkpoint_to_load(self, path: Any, prefixes: Optional[tuple[str, ...]] = None) -> Path:
        return self.distributed_checkpoint_io.resolve(path, prefixes=prefixes)

    def _check_checkpoint_fits(self, path: Path, key: str, module: nn.Module, strict: bool = True,
                               trained_only: bool = False) -> None:
        self.distributed_checkpoint_io.check_fits(path, key, module, strict=strict, pipelined=self.pipeline is not None,
                                                  trained_only=trained_only)

    # ---- failure and teardown ------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """The Trainer's hook (before its teardown): tell the watchdog. A communication error waits there
        for the rank that caused it to be found; any other error is published to the other ranks."""
        if self._watchdog is not None:
            self._watchdog.on_failure(exception)
        parent = getattr(super(), "on_exception", None)
        if parent is not None:
            parent(exception)

    def teardown(self) -> None:
        if self._checkpoint_part is not None:
            self._checkpoint_part.wait()
        if self._watchdog is not None:
            self._watchdog.stop(done=True)  # finished (unless it failed): the other ranks stop watching this one
        self._watchdog = None
        super().teardown()
        self._known_warnings.remove()
