"""``ModelParallel2DStrategy``: Lightning's ``ModelParallelStrategy`` that parallelizes the model itself.

Lightning's strategy builds a ``(data_parallel, tensor_parallel)`` mesh and leaves the TP plan,
activation checkpointing and FSDP2 to a hand-written ``configure_model``. This one validates the
layout before any process group exists, builds the N-D mesh (``ParallelDims``: HSDP replicas ×
FSDP shards × tensor parallel), then applies ``lightning_2d.parallel.parallelize_model`` (the same
function the Fabric strategy calls) and materializes the meta-device model shard by shard with
layout-independent values. What both strategies share lives in
``lightning_2d.integration.strategy_base`` (a strategy composed of parts: validation, precision, step guard,
checkpoint IO, watchdog); launching and the sampler are Lightning's.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_2d._compat import optimizers_to_device, set_module_mesh, trainer_of, trainer_precision_plugin
from lightning_2d.checkpoint.safe_load import check_weights_only, trusted_globals
from lightning_2d.integration.checkpoint_io import DistributedCheckpointIO
from lightning_2d.integration.launcher import ValidatingLauncher
from lightning_2d.integration.precision import FSDP2Precision
from lightning_2d.integration.strategy_base import STRATEGY_NAME, ModelParallel2DBase
from lightning_2d.integration.validation import model_context
from lightning_2d.models import registry
from lightning_2d.models.registry import resolve_plan
from lightning_2d.parallel.config import ParallelConfigError
from lightning_2d.parallel.guard import check_finite_weights
from lightning_2d.parallel.parallelize import parallelize_and_materialize

__all__ = ["FSDP2Precision", "ModelParallel2DStrategy"]


class ModelParallel2DStrategy(ModelParallel2DBase, ModelParallelStrategy):
    """2D parallelism (FSDP2 or HSDP × tensor/sequence parallel) applied by the strategy.

    ``Trainer(strategy=ModelParallel2DStrategy(tensor_parallel_size=8))`` or
    ``Trainer(strategy="model_parallel_2d")``. The LightningModule builds its model in
    ``configure_model`` (on the meta device when ``strategy.materializes_meta_modules``), and the
    strategy applies, in order: the TP/SP plan → activation checkpointing → ``torch.compile`` →
    FSDP2, then allocates and initializes each rank's shards.

    Which modules are parallelized comes from ``plan`` or from the LightningModule's
    ``parallel_plan(config)``; any step can be replaced by a LightningModule method of the same
    name (``lightning_2d.parallel.hooks.ParallelHooks`` lists what a LightningModule may define).
    A ``configure_model`` that parallelizes the model itself (as with Lightning's strategy) is
    respected: the strategy then only materializes it.

    The options (``data_parallel_size``, ``tensor_parallel_size``, ``data_parallel_replicate_size``,
    ``sequence_parallel``, ``activation_checkpointing``, ``compile``, ``float8``, checkpoints …) are the fields of
    ``ParallelConfig`` and ``StrategyOptions`` (``lightning_2d.integration.strategy_options``), each the constructor's
    argument of the same name; ``help(ModelParallel2DStrategy.__init__)`` documents every one.

    ``device_mesh`` has every dimension, ``pipeline_parallel``, ``data_parallel_replicate``, ``data_parallel_shard``,
    ``context_parallel`` and ``tensor_parallel`` (size 1 allowed), and the flattened ``data_parallel`` (replicate ×
    shard), so code written for Lightning's strategy (``device_mesh["data_parallel"]``, ``["tensor_parallel"]``) works
    unchanged; ``meshes`` names every sub-mesh (``ParallelMeshes``), ``pipeline`` is the model's pipeline (or
    ``None``), ``parallelized`` what ``parallelize_model`` returned.

    Raises:
        ParallelConfigError: At construction, options out of their range or contradicting each other; before the
            other ranks are launched and again at ``setup``, a layout that the world, the model's plan or the data
            cannot take (sizes that do not divide the world, heads or sequence length; a step the model refuses).
            Every problem is listed in one message, with the values and the way out.
        TypeError: An argument the strategy does not take, as a Python call would.

    Example:
        ```python
        import lightning as L
        from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy, TextDataModule

        strategy = ModelParallel2DStrategy(tensor_parallel_size=4, activation_checkpointing="selective")
        trainer = L.Trainer(accelerator="cuda", devices=8, precision="bf16-mixed", strategy=strategy)
        # 8 devices: 2 FSDP shards x 4 tensor-parallel ranks
        trainer.fit(LlamaLightningModule("llama3-8b"), TextDataModule("corpus/", tokenizer="Llama-3-8B/", seq_len=8192))
        ```
    """

    strategy_name = STRATEGY_NAME

    # ---- what differs from Fabric -------------------------------------------------------------
    def _precision_plugin_2d(self) -> Any:
        return trainer_precision_plugin(self)

    def _set_precision_plugin_2d(self, plugin: Any) -> None:
        self.precision_plugin = plugin

    def _validation_context(self) -> dict[str, Any]:
        # In each process at the start of fit the LightningModule (its plan) and the datamodule (its
        # seq_len) are known; at Trainer construction neither is.
        module = self.lightning_module
        if module is None:
            return {"plan": self.strategy_options.plan, "seq_len": None}
        trainer = trainer_of(module)
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        return model_context(module, datamodule, self.parallel_config, self.strategy_options.plan)

    @override
    def _configure_launcher(self) -> None:
        if type(self.checkpoint_io) is not TorchCheckpointIO:  # Lightning's default, replaced by ours at setup
            raise ParallelConfigError([
                f"{type(self).__name__} writes checkpoints with its own CheckpointIO (sharded or full, complete or"
                f" recognisably incomplete, optionally in the background); got {type(self.checkpoint_io).__name__}"
                " from the Trainer's plugins. Remove it (for background writes: async_checkpoint=True)."
            ])
        super()._configure_launcher()
        # Lightning's strategy starts the other ranks as copies of the script unless they were created
        # externally (torchrun, SLURM: each validates at setup). Ours checks the plan's sizes and the
        # sequence length first, in the launching process, before any rank starts.
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ValidatingLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, validate=self._validate_before_launch
            )

    def _validate_before_launch(self, arguments: list[Any]) -> None:
        """``validate`` with the plan of the LightningModule and the ``seq_len`` of the datamodule found in
        ``trainer.fit/validate/test/predict``'s arguments (skipped parts: found again in each process)."""
        module = next((a for a in arguments if isinstance(a, pl.LightningModule)), None)
        datamodule = next((a for a in arguments if isinstance(a, pl.LightningDataModule)), None)
        if module is None and datamodule is None:
            return  # nothing known beyond what construction checked
        self.validate(**model_context(module, datamodule, self.parallel_config, self.strategy_options.plan,
                                      before_launch=True))

    def _use_checkpoint_io(self, io: DistributedCheckpointIO) -> None:
        self.checkpoint_io = io  # Lightning's teardown and ``remove_checkpoint`` (rank 0) call it too

    def _float8_modules(self) -> list[nn.Module]:
        module = self.lightning_module
        return [module] if self.parallel_config.fsdp_float8_all_gather and module is not None else []

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Users can reach the mesh in `LightningModule.configure_model()` (as with Lightning's strategy).
        assert self.lightning_module is not None
        set_module_mesh(self.lightning_module, self.device_mesh)

    # ---- parallelize and materialize ----------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        assert self.model is not None and self.accelerator is not None and module is not None
        self.accelerator.setup(trainer)
        precision = self.precision_plugin.precision
        resolved = self.parallel_config.resolve_dtypes(precision)  # the plan may read the dtypes
        plan = resolve_plan(module, resolved, self.strategy_options.plan)
        self.validate(plan=plan)  # the model as built (adapters a configure_model added too), before any allocation
        self._keep_parallelized(module, parallelize_and_materialize(
            module,
            self._built_meshes(),  # the meshes built in setup_environment (expert parallelism's too)
            self.parallel_config,
            plan,
            precision,
            self.root_device,
            seed=lambda: self._init_seed(module),
            known_init_hooks=registry.known_init_hooks,
            inputs=registry.validation_inputs_of(module),  # the converters it asks for (lora=)
        ))
        self._parallelize_frozen(module, plan, precision)  # a preference loss's reference copy, if it holds one
        self.model_to_device()  # metrics and anything else outside the parallelized model
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        return self._guarded_backward(closure_loss, partial(super().backward, closure_loss, optimizer, *args, **kwargs))

    # ---- checkpoints --------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Sharded (DCP) or full checkpoint that is complete or recognisably incomplete, never half-valid.

        Every rank writes (``DistributedCheckpointIO``), where Lightning's base strategy calls its
        ``CheckpointIO`` on rank 0 only."""
        io = self.distributed_checkpoint_io
        path = io.path_to_save(filepath, storage_options)
        if self.lightning_module is not None:
            check_finite_weights(self.lightning_module, path)  # never a checkpoint of NaN weights
        io.save_checkpoint(checkpoint, path)

    # Lightning's state-dict methods run through the checkpoint IO, which has the FSDP backend read the stored shards
    # where the state-dict APIs' getattr walk reaches each parameter (never a gather). Its load_model_state_dict and
    # load_optimizer_state_dict read nothing: load_checkpoint loads the states.
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.distributed_checkpoint_io.state_dict_call(super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.distributed_checkpoint_io.state_dict_call(super().optimizer_state, optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        check_weights_only(weights_only, checkpoint_path)  # every load is weights-only: False is refused, not ignored
        # Digests checked for what the load reads: validate/test/predict read the weights only.
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path = self._checkpoint_to_load(checkpoint_path, prefixes=None if fitting else ("state_dict.",))
        # An adapters-only checkpoint (LoRA): its base is the module's own (init_from, or the seeded init), which must
        # be the one it was trained on; only the adapters and their optimizer state are read.
        io = self.distributed_checkpoint_io
        adapters = io.adapters_to_load(path)
        self._check_checkpoint_fits(path, "state_dict", self.lightning_module, strict=self.lightning_module.strict_loading,
                                    trained_only=adapters is not None)
        if adapters is not None:
            optimizers = {f"optimizer_{i}": o for i, o in enumerate(self.optimizers)} if fitting else {}
            metadata = io.load_trained(path, "state_dict", self.model, optimizers)
        else:
            with trusted_globals():  # Lightning's own torch.load of meta.pt (or the full file), weights-only
                metadata = io.state_dict_call(super().load_checkpoint, path, weights_only=True)
        io.restore_random_state(path, metadata.get("lightning_2d"))
        return metadata

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for the non-final micro-batches of gradient accumulation. Its own
        version only knows DDP; here FSDP2 skips the gradient reduce-scatter until the last one (the FSDP backend's
        ``gradient_sync``)."""
        assert self.lightning_module is not None
        with self.fsdp_backend.gradient_sync(self.lightning_module,
                                             enabled=self.parallel_config.reduce_every_micro_batch):
            yield


if ModelParallel2DStrategy.strategy_name not in StrategyRegistry:
    # The name for `Trainer(strategy="model_parallel_2d")`; one registered by someone else is left alone.
    StrategyRegistry.register(
        ModelParallel2DStrategy.strategy_name,
        ModelParallel2DStrategy,
        description="FSDP2/HSDP × tensor/sequence × pipeline × context parallelism, applied by lightning_2d",
    )
