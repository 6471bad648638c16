"""The parallel mechanics, shared by the Trainer and Fabric strategies: options and plans as data
(``config``), mesh sizes and validation (``dims``), applying TP/SP, activation checkpointing, compile and
FSDP2 (``parallelize``), pipeline stages and schedules, materialization, the loss under parallelism, the
step guard and the watchdog. Knows no model family (those are in ``lightning_2d.models``)."""

from lightning_2d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_2d.parallel.compile import apply_compile
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError, ParallelPlan
from lightning_2d.parallel.dims import (
    DP_DIM,
    DP_REPLICATE_DIM,
    DP_SHARD_DIM,
    PP_DIM,
    TP_DIM,
    ParallelDims,
    build_device_mesh,
    validate_parallel_dims,
)
from lightning_2d.parallel.fsdp import apply_fully_shard
from lightning_2d.parallel.hooks import ModelInitHooks, ParallelHooks
from lightning_2d.parallel.materialize import materialize_model
from lightning_2d.parallel.meshes import ParallelMeshes
from lightning_2d.parallel.parallelize import Parallelized, parallelize_model
from lightning_2d.parallel.pipeline import Pipeline, pipeline_of  # pipeline_of: deprecated (0.1.0's), until 0.3
from lightning_2d.parallel.tensor_parallel import apply_tensor_parallel

__all__ = [
    "DP_DIM",
    "DP_REPLICATE_DIM",
    "DP_SHARD_DIM",
    "ModelInitHooks",
    "ParallelHooks",
    "PP_DIM",
    "Pipeline",
    "TP_DIM",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelDims",
    "ParallelMeshes",
    "ParallelPlan",
    "Parallelized",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fully_shard",
    "apply_tensor_parallel",
    "build_device_mesh",
    "pipeline_of",
    "materialize_model",
    "parallelize_model",
    "validate_parallel_dims",
]
