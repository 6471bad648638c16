"""``ModelParallel2DStrategy``: Lightning's ``ModelParallelStrategy`` that parallelizes the model itself.

Lightning's strategy builds the ``(data_parallel, tensor_parallel)`` mesh and leaves the TP plan,
activation checkpointing and FSDP2 to a hand-written ``configure_model``. This one validates the
layout before any process group exists, then applies ``lightning_2d.parallel.parallelize_model``
(the same function the Fabric strategy calls) and materializes the meta-device model shard by
shard with layout-independent values. Launching, the sampler, and checkpoint I/O are Lightning's.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d.checkpoint import (
    ShardedCheckpointWriter,
    layout_of,
    make_writer,
    remove_path,
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
from lightning_2d.parallel.parallelize import parallelize_and_materialize, resolve_plan

if TYPE_CHECKING:
    import lightning.pytorch as pl


class FSDP2Precision(Precision):
    """Precision under the 2D strategy: FSDP2's ``MixedPrecisionPolicy`` does the casting.

    ``bf16-mixed``: parameters stay fp32 (sharded) for the optimizer; FSDP all-gathers them in
    bf16 and reduce-scatters gradients in fp32 (autocast on top would only add casts).
    ``bf16-true``: the shards themselves are bf16. ``32-true``: no casting. Gradient clipping
    computes the true global norm over DTensor gradients on any mix of meshes.
    """

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)


class ModelParallel2DStrategy(ModelParallelStrategy):
    """2D parallelism (FSDP2 × tensor/sequence parallel) applied by the strategy.

    ``Trainer(strategy=ModelParallel2DStrategy(tensor_parallel_size=8))`` or
    ``Trainer(strategy="model_parallel_2d")``. The LightningModule builds its model in
    ``configure_model`` (on the meta device when ``strategy.materializes_meta_modules``), and the
    strategy applies, in order: the TP/SP plan → activation checkpointing → ``torch.compile`` →
    FSDP2, then allocates and initializes each rank's shards.

    Which modules are parallelized comes from ``plan`` or from the LightningModule's
    ``parallel_plan(config)``; any step can be replaced by a LightningModule method of the same
    name (``apply_tensor_parallel``, ``apply_activation_checkpointing``, ``apply_compile``,
    ``apply_fully_shard``; see ``lightning_2d.parallel.parallelize``). A ``configure_model`` that
    parallelizes the model itself (as with Lightning's strategy) is respected: the strategy then
    only materializes it.

    Args:
        data_parallel_size: FSDP degree, or ``"auto"`` (world size / ``tensor_parallel_size``;
            the number of nodes when both are auto).
        tensor_parallel_size: TP degree, or ``"auto"`` (world size / ``data_parallel_size``; the
            devices per node when both are auto). TP groups are consecutive ranks, inside a node.
        sequence_parallel: Shard activations and norms along the sequence between TP regions.
        loss_parallel: Compute the cross-entropy on vocabulary-sharded logits.
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        selective_ac_option: ``"op"`` or every N-th block (an integer), for ``"selective"``.
        compile: ``torch.compile`` each transformer block.
        param_dtype: FSDP compute dtype; default from the Trainer's ``precision``.
        reduce_dtype: FSDP gradient-reduction dtype; default fp32.
        reshard_after_forward: ``"default"``, ``"always"`` or ``"never"``.
        reduce_every_micro_batch: With ``accumulate_grad_batches > 1``, reduce-scatter gradients after
            every micro-batch (least memory) instead of only after the last one (default).
        float8: Float8 training of the block projections (torchao; GPUs with compute capability
            >= 8.9); ``"emulate"`` computes the same rounding on any device (tests, debugging).
        float8_recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        fsdp_float8_all_gather: All-gather the float8 weights in float8 (tensorwise only).
        async_tensor_parallel: Overlap the sequence-parallel collectives with the matmuls (CUDA,
            NCCL, ``compile=True``).
        plan: Module names to parallelize, for a model that does not provide ``parallel_plan``.
        save_distributed_checkpoint: Save one shard per rank (``True``, resumable at any layout) or a
            single full file assembled on rank 0.
        async_checkpoint: Write sharded checkpoints in a background thread after copying them to CPU
            memory, so training continues during the write.
        process_group_backend: ``"nccl"``/``"gloo"``; default from the device.
        timeout: Process-group timeout.
    """

    strategy_name = "model_parallel_2d"
    #: Tells a LightningModule to build its model on the meta device in ``configure_model``.
    materializes_meta_modules = True

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
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        # Validate the options first: a typo fails here, at construction, with every problem listed.
        self.parallel_config = ParallelConfig.from_options(locals())
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._plan = plan
        self._async_checkpoint = async_checkpoint
        self._checkpoint_writer: Optional[ShardedCheckpointWriter] = None
        self.parallel_dims: Optional[ParallelDims] = None

    # ---- validation and mesh ------------------------------------------------------------------
    def validate(self, device_index: Optional[int] = None) -> ParallelDims:
        """Check the layout against the world, the model, the precision and the hardware; raises listing
        every problem.

        Runs twice, both times before any process group is created: when the Trainer is constructed
        (world size, precision, float8/async-TP requirements), and again in each process at the start
        of ``fit`` once the LightningModule (its plan's divisibility constraints), the datamodule (its
        ``seq_len``) and the process's GPU (``device_index``: float8 tensor cores) are known.
        """
        module = self.lightning_module
        plan = resolve_plan(module, self.parallel_config, self._plan) if module is not None else self._plan
        trainer = getattr(module, "_trainer", None) if module is not None else None
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        precision = self._precision_plugin.precision if self._precision_plugin is not None else None
        return validate_parallel_dims(
            self.parallel_config,
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            plan=plan,
            precision=precision,
            seq_len=getattr(datamodule, "seq_len", None),
            num_nodes=self.num_nodes,
            device_type=self.parallel_devices[0].type if self.parallel_devices else None,
            device_index=device_index,
        )

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer's constructor, before it launches any process: fail there.
        self.validate()
        if type(self.precision_plugin) in (Precision, MixedPrecision, HalfPrecision):
            # Lightning's stock plugins (autocast, module conversion) give way to FSDP2's policy;
            # a custom plugin the user passed is kept.
            self.precision_plugin = FSDP2Precision(self.precision_plugin.precision)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self.parallel_dims = self.validate(device_index=cuda_index(self.root_device))
        self._data_parallel_size = self.parallel_dims.dp
        self._tensor_parallel_size = self.parallel_dims.tp
        # Lightning's: process group, seed reset, the (data_parallel, tensor_parallel) mesh.
        super().setup_environment()
        destroy_process_group_at_exit()
        self._checkpoint_writer = make_writer(
            self.global_rank, self.barrier, self._save_distributed_checkpoint, self._async_checkpoint
        )

    # ---- parallelize and materialize ----------------------------------------------------------
    def _init_seed(self) -> int:
        seed = getattr(self.lightning_module, "init_seed", None)
        if seed is None:
            seed = self.broadcast(torch.initial_seed())
        return int(seed)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        parallelize_and_materialize(
            self.lightning_module,
            self.device_mesh,
            self.parallel_config,
            self._plan,
            self.precision_plugin.precision,
            self.root_device,
            seed=self._init_seed,
        )
        self.model_to_device()  # metrics and anything else outside the parallelized model
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ---- checkpoints --------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        dims = self.parallel_dims
        return layout_of(self.world_size, dims.dp if dims else None, dims.tp if dims else None)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Sharded (DCP) or full checkpoint that is complete or recognisably incomplete, never half-valid."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        assert self._checkpoint_writer is not None
        path = Path(self.broadcast(str(filepath)))
        checkpoint["lightning_2d"] = {"layout": self._layout()}
        if self._save_distributed_checkpoint:
            state = {"state_dict": checkpoint.pop("state_dict")}
            for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{idx}"] = optim_state
            self._checkpoint_writer.save(state, checkpoint, path)
            return
        self._checkpoint_writer.wait()
        save_full_checkpoint(checkpoint, path, self.global_rank, self.world_size, self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()
        path = resolve_on_rank_zero(checkpoint_path, self.global_rank, self.broadcast, rank_zero_warn)
        metadata = super().load_checkpoint(path, weights_only=weights_only)
        restore_random_state(path, metadata.get("lightning_2d", {}), self._layout(), self.global_rank, rank_zero_info)
        return metadata

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # ModelCheckpoint removes an older checkpoint right after saving a newer one: never before
        # the newer one is complete on disk.
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()
        if self.is_global_zero:
            remove_path(Path(filepath))

    @override
    def teardown(self) -> None:
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()
        super().teardown()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.parallel_config.fsdp_float8_all_gather:
            # The float8 all-gather weights' scales for the next step, in one all-reduce.
            precompute_float8_scales(self.lightning_module)
        return output

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for the non-final micro-batches of gradient accumulation. Its own
        version only knows DDP; here FSDP2 skips the gradient reduce-scatter until the last one."""
        with gradient_sync(self.lightning_module, enabled=self.parallel_config.reduce_every_micro_batch):
            yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with backward_context(closure_loss, self.parallel_config.loss_parallel):
            return super().backward(closure_loss, optimizer, *args, **kwargs)


StrategyRegistry.register(
    ModelParallel2DStrategy.strategy_name,
    ModelParallel2DStrategy,
    description="2D parallelism (FSDP2 × TP/SP) applied by lightning_2d",
    override=True,
)
