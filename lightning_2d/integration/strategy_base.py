"""What the Trainer and the Fabric strategies share: options, validation, the mesh, seed, checkpoints.

``lightning_2d.ModelParallel2DStrategy`` (Trainer) and ``lightning_2d.integration.fabric_strategy.ModelParallel2DStrategy``
are each Lightning's ``ModelParallelStrategy`` of their world with ``ModelParallel2DBase`` in front
of it in the MRO. The base owns everything that is not specific to one world:

- the options (one constructor, taking ``ParallelConfig``'s and ``StrategyOptions``' fields);
- validation before any process group (``validate``, in ``_configure_launcher`` and again in
  ``setup_environment``);
- the process group and the N-D device mesh, built by ``ParallelDims.build_mesh`` (Lightning's
  strategies build a 2D one from private size fields; ours replaces that step);
- the initialization seed, the precision plugin (``FSDP2Precision``), backward under loss
  parallelism, float8 scale updates after the optimizer step;
- the checkpoint writer, the layout a checkpoint records, the wait before a load or teardown and
  the fall-back from an incomplete checkpoint.

Each strategy keeps only what its world defines differently: the Trainer's ``setup`` and
checkpoint dict, Fabric's ``setup_module`` and ``fabric.save`` state.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d._compat import (
    saves_distributed_checkpoint,
    set_strategy_mesh,
    setup_distributed,
    strategy_timeout,
    trainer_of,
)
from lightning_2d.checkpoint.files import (
    CheckpointError,
    ShardedCheckpointWriter,
    layout_of,
    make_writer,
    resolve_on_rank_zero,
    restore_random_state,
    shape_mismatches,
    stored_shapes,
)
from lightning_2d.integration.options import StrategyOptions, split_options, takes_options
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan, Size
from lightning_2d.parallel.dims import ParallelDims, cuda_index, destroy_process_group_at_exit, validate_parallel_dims
from lightning_2d.parallel.float8 import precompute_float8_scales
from lightning_2d.parallel.grad_norm import clip_grad_norm_
from lightning_2d.parallel.guard import finite_flag, guard_step
from lightning_2d.parallel.known_warnings import KnownWarnings
from lightning_2d.parallel.loss import backward_context
from lightning_2d.parallel.pipeline import Pipeline, pipeline_of
from lightning_2d.parallel.watchdog import Watchdog, nccl_failure_env, start_watchdog, stop_watchdog


class FSDP2Precision(Precision):
    """Precision under the 2D strategies (Trainer and Fabric): FSDP2's ``MixedPrecisionPolicy`` casts.

    ``bf16-mixed``: parameters stay fp32 (sharded) for the optimizer; FSDP all-gathers them in
    bf16 and reduce-scatters gradients in fp32 (autocast on top would only add casts).
    ``bf16-true``: the shards themselves are bf16. ``32-true``: no casting. Gradient clipping
    computes the true global norm over DTensor gradients on any mix of meshes.

    This is the Trainer's plugin; ``FabricFSDP2Precision`` is the same for Fabric (a Trainer plugin's
    ``backward`` calls ``LightningModule.backward``, so one class cannot serve both).
    """

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]
        #: Set by the strategy under pipeline parallelism (``parallel/pipeline.py``).
        self.pipeline: Any = None

    @override
    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if not skip_pipelined_backward(tensor, self.pipeline):
            super().backward(tensor, model, *args, **kwargs)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        group = self.pipeline.pp_group if self.pipeline is not None else None
        clip_grad_norm_(self.main_params(optimizer), clip_val, pipeline_group=group)


class FabricFSDP2Precision(FabricPrecision):
    """``FSDP2Precision`` for Fabric: FSDP2's policy casts; clipping is the strategy's (``clip_gradients_norm``)."""

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]
        self.pipeline: Any = None

    @override
    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if not skip_pipelined_backward(tensor, self.pipeline):
            super().backward(tensor, model, *args, **kwargs)


def skip_pipelined_backward(loss: torch.Tensor, pipeline: Any) -> bool:
    """Under pipeline parallelism the model's call ran backward (the schedule did, micro-batch by
    micro-batch): its loss comes back without a graph and the strategy's backward does nothing but check
    that it was given that loss (``Pipeline.check_backward_loss``)."""
    if pipeline is None:
        return False
    pipeline.check_backward_loss(loss)
    return True


def _is_stock_precision(plugin: Any) -> bool:
    """Whether ``plugin`` is one of Lightning's stock plugins (autocast, module conversion), which give way
    to FSDP2's policy; a custom plugin the user passed is kept."""
    from lightning.fabric.plugins.precision import HalfPrecision as FabricHalf
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    return type(plugin) in (Precision, MixedPrecision, HalfPrecision, FabricPrecision, FabricMixed, FabricHalf)


class ModelParallel2DBase:
    """Mixin in front of Lightning's ``ModelParallelStrategy`` (Trainer or Fabric); see the module docstring.

    Its constructor takes the options of ``ParallelConfig`` and ``StrategyOptions``
    (``lightning_2d.integration.options``) as explicit parameters whose defaults are the fields'; its docstring is
    built from the fields' docstrings.
    """

    #: Tells a LightningModule to build its model on the meta device in ``configure_model``.
    materializes_meta_modules = True
    #: The precision plugin that replaces Lightning's stock ones (the Trainer's or Fabric's kind).
    fsdp2_precision_class: type = FSDP2Precision

    # Every option, in ``PARAMETER_ORDER``, with its field's type and default (read from the field, so that IDEs and
    # type checkers see the real signature); tests/unit/test_options.py names any parameter that differs from its field.
    @takes_options("The strategy's options (the fields of ``ParallelConfig`` and ``StrategyOptions``).")
    def __init__(
        self,
        data_parallel_size: Size = ParallelConfig.data_parallel_size,
        tensor_parallel_size: Size = ParallelConfig.tensor_parallel_size,
        data_parallel_replicate_size: int = ParallelConfig.data_parallel_replicate_size,
        pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
        pipeline_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B"] = ParallelConfig.pipeline_schedule,
        pipeline_microbatches: Optional[int] = ParallelConfig.pipeline_microbatches,
        pipeline_stages_per_rank: Optional[int] = ParallelConfig.pipeline_stages_per_rank,
        pipeline_layers_per_stage: Optional[list[int]] = ParallelConfig.pipeline_layers_per_stage,
        sequence_parallel: bool = ParallelConfig.sequence_parallel,
        loss_parallel: bool = ParallelConfig.loss_parallel,
        activation_checkpointing: Literal["none", "full", "selective"] = ParallelConfig.activation_checkpointing,
        selective_ac_option: Union[str, int] = ParallelConfig.selective_ac_option,
        compile: bool = ParallelConfig.compile,
        param_dtype: Optional[Union[str, torch.dtype]] = ParallelConfig.param_dtype,
        reduce_dtype: Optional[Union[str, torch.dtype]] = ParallelConfig.reduce_dtype,
        reshard_after_forward: Literal["default", "always", "never"] = ParallelConfig.reshard_after_forward,
        reduce_every_micro_batch: bool = ParallelConfig.reduce_every_micro_batch,
        float8: Union[bool, Literal["emulate"]] = ParallelConfig.float8,
        float8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = ParallelConfig.float8_recipe,
        fsdp_float8_all_gather: bool = ParallelConfig.fsdp_float8_all_gather,
        async_tensor_parallel: bool = ParallelConfig.async_tensor_parallel,
        plan: Optional[ParallelPlan] = StrategyOptions.plan,
        init_seed: Optional[int] = StrategyOptions.init_seed,
        save_distributed_checkpoint: bool = StrategyOptions.save_distributed_checkpoint,
        async_checkpoint: bool = StrategyOptions.async_checkpoint,
        non_finite: Literal["raise", "skip", "off"] = ParallelConfig.non_finite,
        process_group_backend: Optional[str] = StrategyOptions.process_group_backend,
        timeout: Optional[timedelta] = StrategyOptions.timeout,
        watchdog_timeout: Optional[timedelta] = StrategyOptions.watchdog_timeout,
    ) -> None:
        # Validate the options first: a typo fails here, at construction, with every problem listed.
        parallel, options = split_options(locals())
        self.parallel_config, self.strategy_options = parallel, options
        # Lightning's own size fields are left "auto": the mesh is ours (``setup_environment``).
        super().__init__(  # type: ignore[call-arg]
            **self._lightning_strategy_kwargs(),
            save_distributed_checkpoint=options.save_distributed_checkpoint,
            process_group_backend=options.process_group_backend,
            timeout=options.timeout,
        )
        self._checkpoint_writer: Optional[ShardedCheckpointWriter] = None
        self.parallel_dims: Optional[ParallelDims] = None
        self._watchdog: Optional[Watchdog] = None
        self._loss_flag: Optional[torch.Tensor] = None
        self._first_loss_checked = False
        self._optimizer_steps = 0
        self._pipeline: Optional[Pipeline] = None
        self._known_warnings = KnownWarnings()

    def _lightning_strategy_kwargs(self) -> dict[str, Any]:
        """Extra arguments of the Lightning strategy's constructor (Fabric: ``parallelize_fn``)."""
        return {}

    # ---- what differs between the worlds -----------------------------------------------------
    def _precision_plugin_2d(self) -> Any:
        raise NotImplementedError

    def _set_precision_plugin_2d(self, plugin: Any) -> None:
        raise NotImplementedError

    def _validation_context(self) -> dict[str, Any]:
        """``plan`` and ``seq_len`` known at this point (the Trainer knows its LightningModule)."""
        return {"plan": self.strategy_options.plan, "seq_len": None}

    def _float8_modules(self) -> list[nn.Module]:
        """Modules whose float8 all-gather scales are recomputed after each optimizer step."""
        return []

    # ---- validation, process group, mesh ------------------------------------------------------
    def validate(
        self,
        device_index: Optional[int] = None,
        plan: Optional[ParallelPlan] = None,
        seq_len: Optional[int] = None,
        batch_size: Optional[int] = None,
    ) -> ParallelDims:
        """Check the layout against the world, the model, the precision and the hardware; raises
        ``ParallelConfigError`` listing every problem.

        Runs before any process group is created: when the Trainer/Fabric is constructed (world
        size, precision, float8/async-TP requirements), and again in each process once the model's
        plan (its divisibility constraints), the sequence length and the process's GPU
        (``device_index``: float8 tensor cores) are known.
        """
        context = self._validation_context()
        if plan is not None:
            context["plan"] = plan
        if seq_len is not None:
            context["seq_len"] = seq_len
        if batch_size is not None:
            context["batch_size"] = batch_size
        plugin = self._precision_plugin_2d()
        devices = self.parallel_devices  # type: ignore[attr-defined]
        return validate_parallel_dims(
            self.parallel_config,
            world_size=self.num_nodes * self.num_processes,  # type: ignore[attr-defined]
            devices_per_node=self.num_processes,  # type: ignore[attr-defined]
            precision=getattr(plugin, "precision", None),
            num_nodes=self.num_nodes,  # type: ignore[attr-defined]
            device_type=devices[0].type if devices else None,
            device_index=device_index,
            **context,
        )

    def _configure_launcher(self) -> None:
        # Called by the Trainer's/Fabric's constructor, before any process is launched: fail there.
        self.validate()
        if _is_stock_precision(self._precision_plugin_2d()):
            self._set_precision_plugin_2d(self.fsdp2_precision_class(self._precision_plugin_2d().precision))
        super()._configure_launcher()  # type: ignore[misc]

    def setup_environment(self) -> None:
        """Validate in this process, start the process group, build the mesh (not Lightning's 2D one)."""
        self.parallel_dims = self.validate(device_index=cuda_index(self.root_device))  # type: ignore[attr-defined]
        self._known_warnings.install()  # torch's per-step noise of a correct 2D run, until teardown
        if self.parallel_config.loss_parallel and self.parallel_dims.tp == 1:
            rank_zero_warn(
                "loss_parallel=True has no effect with tensor_parallel_size=1: the logits are not sharded over a"
                " vocabulary dimension. Set loss_parallel=False (or tensor_parallel_size > 1)."
            )
        # What Lightning's ModelParallelStrategy.setup_environment does before building its 2D mesh:
        # the accelerator's device, then the seed reset, the world ranks and the process group.
        self.accelerator.setup_device(self.root_device)  # type: ignore[attr-defined]
        if self.root_device.type == "cuda":  # type: ignore[attr-defined]
            nccl_failure_env(self.strategy_options.watchdog_timeout)  # torch's NCCL watchdog settings, before the groups
        setup_distributed(self)
        set_strategy_mesh(self, self.parallel_dims.build_mesh(self.root_device.type, timeout=strategy_timeout(self)))
        destroy_process_group_at_exit()
        self._watchdog = start_watchdog(
            self.strategy_options.watchdog_timeout, self.global_rank, self.world_size,  # type: ignore[attr-defined]
            collective_timeout=strategy_timeout(self),
        )
        self._checkpoint_writer = make_writer(
            self.global_rank,  # type: ignore[attr-defined]
            self.barrier,  # type: ignore[attr-defined]
            saves_distributed_checkpoint(self),
            self.strategy_options.async_checkpoint,
        )

    # ---- model -------------------------------------------------------------------------------
    def _attach_pipeline(self, module: nn.Module) -> None:
        """After parallelizing: under pipeline parallelism the precision plugin skips the backward (the
        model's call ran it) and clips over every stage's gradients."""
        self._pipeline = pipeline_of(module)
        if self._pipeline is not None:
            self._precision_plugin_2d().pipeline = self._pipeline

    def _init_seed(self, owner: Any = None) -> int:
        """The strategy's ``init_seed``, else ``owner.init_seed``, else rank 0's torch seed (broadcast)."""
        seed = self.strategy_options.init_seed
        if seed is None:
            seed = getattr(owner, "init_seed", None)
        if seed is None:
            seed = self.broadcast(torch.initial_seed())  # type: ignore[attr-defined]
        return int(seed)

    # ---- training step -----------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self._first_loss_checked:
            self._first_loss_checked = True
            check_first_loss(tensor)
        with backward_context(tensor, self.parallel_config.loss_parallel):
            output = super().backward(tensor, *args, **kwargs)  # type: ignore[misc]
        if self.parallel_config.non_finite == "off":
            return output
        # Every micro-batch's loss as a device flag (no host sync here), read by the step guard; after
        # backward, so that what `on_before_backward` hooks did to the loss counts too.
        local = tensor.detach().to_local() if hasattr(tensor, "to_local") else tensor.detach()
        finite = finite_flag([local], local.device)
        flag = self._loss_flag
        self._loss_flag = finite if flag is None else flag * finite.to(flag.device)
        return output

    def _step_number(self) -> int:
        """The optimizer step about to be taken, counted from 1 (the Trainer's ``global_step + 1``)."""
        module = getattr(self, "lightning_module", None)
        trainer = trainer_of(module) if module is not None else None
        if trainer is not None:
            return int(trainer.global_step) + 1
        return self._optimizer_steps + 1

    def _guard_step(self, optimizer: Optimizer) -> bool:
        """All ranks agree whether the losses and gradients since the last step are finite (``guard_step``)."""
        flag, self._loss_flag = self._loss_flag, None
        if self.parallel_config.non_finite == "off":
            return True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if flag is None:  # no backward through the strategy (e.g. a manual loop without it)
            flag = torch.ones((), device=self.root_device)  # type: ignore[attr-defined]
        return guard_step(params, flag, self._step_number(), self.parallel_config.non_finite)

    def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Guard the step (``non_finite``), update, then refresh float8 scales.

        The Trainer passes a closure that runs forward and backward inside the step: the guard runs
        right after it, before gradient clipping and ``on_before_optimizer_step``. Fabric calls this
        after the user's ``fabric.backward``: the guard runs first.
        """
        completed = self._step_number() - 1
        if self._watchdog is not None:
            self._watchdog.step, self._watchdog.started = completed, completed + 1
        closure = kwargs.get("closure", args[0] if args and callable(args[0]) else None)
        if closure is not None:

            def guarded_closure() -> Any:
                result = closure()
                self._guard_step(getattr(optimizer, "optimizer", optimizer))
                return result

            if "closure" in kwargs:
                kwargs["closure"] = guarded_closure
            else:
                args = (guarded_closure, *args[1:])
        else:
            self._guard_step(getattr(optimizer, "optimizer", optimizer))
        self._optimizer_steps += 1
        output = super().optimizer_step(optimizer, *args, **kwargs)  # type: ignore[misc]
        if self._watchdog is not None:
            self._watchdog.step = completed + 1
        # Float8 all-gather weights: their scales for the next step, in one all-reduce.
        for module in self._float8_modules():
            precompute_float8_scales(module)
        return output

    # ---- checkpoints -------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        return layout_of(self.world_size, self.parallel_dims)  # type: ignore[attr-defined]

    def _checkpoint_path_to_save(self, path: Any, storage_options: Optional[Any]) -> Path:
        """Rank 0's path (every rank writes into one folder); refuses Lightning's cloud options."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        assert self._checkpoint_writer is not None, "setup_environment() has not run"
        return Path(self.broadcast(str(path)))  # type: ignore[attr-defined]

    def _wait_for_checkpoint_writes(self) -> None:
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()

    def _checkpoint_to_load(self, path: Any) -> Path:
        """``path`` if complete and intact, else an error naming it; only a "last" checkpoint
        (``ckpt_path="last"`` resolves to ``last*.ckpt``) falls back to the newest complete one."""
        self._wait_for_checkpoint_writes()
        fall_back = Path(str(path)).name.startswith("last")
        return resolve_on_rank_zero(path, self.global_rank, self.broadcast, rank_zero_warn, fall_back=fall_back)  # type: ignore[attr-defined]

    def _check_checkpoint_fits(self, path: Path, key: str, module: nn.Module, strict: bool = True) -> None:
        """Refuse, on every rank and before anything is loaded, a checkpoint whose tensors under ``key``
        do not fit ``module`` (another model size, fewer layers): quoting both shapes. Rank 0 reads the
        metadata; every rank raises the same error."""
        problems: Any = None
        pipelined = self._pipeline is not None
        expected: dict[str, tuple[int, ...]] = {}
        if self.global_rank == 0 or pipelined:  # type: ignore[attr-defined]
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            # The names DCP saved under (wrapper prefixes of AC/compile removed); DTensors give full shapes.
            state = get_model_state_dict(module)
            expected = {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}
        if pipelined:  # each rank holds some stages: the model is the union of every rank's tensors
            import torch.distributed as dist

            parts: list[Any] = [None] * self.world_size  # type: ignore[attr-defined]
            dist.all_gather_object(parts, expected)
            expected = {name: shape for part in parts for name, shape in part.items()}
        if self.global_rank == 0:  # type: ignore[attr-defined]
            try:
                problems = shape_mismatches(stored_shapes(path, key), expected, strict=strict)
            except Exception as err:  # metadata unreadable: resolve_checkpoint reported damage already
                problems = [f"its metadata cannot be read ({type(err).__name__}: {err})"]
        problems = self.broadcast(problems)  # type: ignore[attr-defined]
        if problems:
            raise CheckpointError(
                f"Checkpoint {path} does not fit the model {type(module).__name__} ({len(problems)} problem(s)):\n  - "
                + "\n  - ".join(problems[:12]) + ("\n  - …" if len(problems) > 12 else "")
                + "\nLoad it into the model it was saved from (its model args/config are in the checkpoint)."
            )

    def _restore_random_state(self, path: Path, saved: Optional[dict[str, Any]]) -> None:
        restore_random_state(path, saved or {}, self._layout(), self.global_rank, rank_zero_info)  # type: ignore[attr-defined]

    def on_exception(self, exception: BaseException) -> None:
        """The Trainer's hook (before its teardown): tell the watchdog. A communication error waits there
        for the rank that caused it to be found; any other error is published to the other ranks."""
        if self._watchdog is not None:
            self._watchdog.on_failure(exception)
        parent = getattr(super(), "on_exception", None)
        if parent is not None:
            parent(exception)

    def teardown(self) -> None:
        self._wait_for_checkpoint_writes()
        stop_watchdog(self._watchdog)  # finished: the other ranks stop watching this one
        self._watchdog = None
        super().teardown()  # type: ignore[misc]
        self._known_warnings.remove()


class NonFiniteLossError(RuntimeError):
    """The first loss of a run is NaN/inf: the initial weights or the inputs are broken."""


def check_first_loss(loss: torch.Tensor) -> None:
    """Stop before the first backward when the first loss is not finite on any rank (every rank raises).

    A model materialized from uninitialized memory, or a broken input pipeline, shows here; training
    on would spread NaN through every weight while the run looks alive. One all-reduce of a flag, once.
    """
    import torch.distributed as dist

    value = loss.detach()
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    finite = torch.isfinite(value).all().to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not bool(finite.item()):
        raise NonFiniteLossError(
            f"The loss of the first training step is not finite (this rank: {value.float().flatten()[:1].item()};"
            " every rank checked): the initial weights or the inputs are broken — e.g. tensors of a meta-device"
            " model left uninitialized, weights loaded from a corrupt checkpoint, or token ids outside the"
            " vocabulary. Stopped before the first optimizer step, so nothing was trained or saved on top of it."
        )
