"""Everything parallel: mesh sizes, the TP/SP plan, activation checkpointing, compile, FSDP2, init."""

import logging


class _QuietSequentialCollectives(logging.Filter):
    # DTensor logs a warning on each process the first time a 2D redistribution (a strided FSDP x TP
    # shard gathered, a gradient norm reduced over both mesh dims) needs two collectives. Expected
    # here, and not actionable by a user.
    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_" not in record.getMessage()


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_QuietSequentialCollectives())

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
from lightning_2d.parallel.parallelize import parallelize_model, resolve_plan
from lightning_2d.parallel.pipeline import Pipeline, pipeline_of
from lightning_2d.parallel.tensor_parallel import apply_tensor_parallel, llama_tensor_parallel_plan

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
    "ParallelPlan",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fully_shard",
    "apply_tensor_parallel",
    "build_device_mesh",
    "llama_tensor_parallel_plan",
    "pipeline_of",
    "materialize_model",
    "parallelize_model",
    "resolve_plan",
    "validate_parallel_dims",
]
