"""The simulated world: the real mesh and ``parallelize_model`` run for one rank of N on a meta-device model.

``fake_world`` sets up a fake process group of N ranks in this process; ``plan_rank_shards`` builds the model (our Llama,
or a Hugging Face decoder from its config: ``models.build_meta``) on the meta device inside it, parallelizes it
with the library's own code (under a pipeline, pruned to the rank's stages) and measures what the rank holds:
its local shards, buffers and FSDP units (``RankShards``). Nothing is allocated.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from lightning_2d._compat import fake_store
from lightning_2d.ops.lora import LoRA
from lightning_2d.ops.weights import weight_format
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.fsdp_backend import FSDPBackend, fsdp_backend
from lightning_2d.parallel.converters import ModelConverters
from lightning_2d.parallel.parallelize import Parallelized, convert_model, parallelize_model
from lightning_2d.parallel.pipeline import stage_plan
from lightning_2d.tools.planner.models import PlannedArgs, build_meta, plan_of, validation_inputs_of
from lightning_2d.tools.planner.units import FSDPUnit, fsdp_units


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process, as ``rank``; destroyed on exit.

    The fake backend answers every collective without communicating (its results are garbage), so
    meshes, DTensors and ``fully_shard`` can be set up for a world this machine does not have.

    Args:
        world_size: Ranks of the simulated world.
        rank: The rank this process plays (its mesh coordinates: under a pipeline, its stages).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "plan_run simulates its own world with a fake process group, but this process already has a"
            " default process group; call it in a process without one (e.g. before the Trainer starts)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _parallelize(model: torch.nn.Module, mesh: Any, plan: Any, config: ParallelConfig) -> Parallelized:
    """The real ``parallelize_model`` (its result: the pipeline, if any); compile and float8 fall back to being
    validated only if they cannot be set up on the meta device."""
    try:
        return parallelize_model(model, mesh, plan, config)
    except Exception as err:  # noqa: BLE001 - only the optional steps get a second chance
        if not (config.compile or config.float8):
            raise
        raise RetryWithout(str(err)) from err


class RetryWithout(RuntimeError):
    pass


@dataclass
class RankShards:
    """What one planned rank holds (``plan_rank_shards``)."""

    units: list[FSDPUnit]  # in forward order, stage after stage
    numel: int  # parameter elements (local shards)
    param_bytes: int
    buffer_bytes: int
    stage_indices: list[int]  # the pipeline stages it runs ([] without a pipeline)
    split: list[int]  # blocks of every stage of the pipeline ([] without a pipeline)
    model_numel: int = 0  # parameters of the whole model as built, before any parallelization (a tie once)
    trained_numel: Optional[int] = None  # of numel, the elements with gradients and optimizer state (None: all)

    @property
    def optimized_numel(self) -> int:
        return self.numel if self.trained_numel is None else self.trained_numel


def _stage_units(pipeline: Any, plan: Any, dims: ParallelDims, param_dtype: torch.dtype,
                 backend: FSDPBackend) -> list[FSDPUnit]:
    """The FSDP units of every stage this rank runs. Each stage view is its own FSDP root with the usual units (the
    embedding on the first, the output unit on the last); the pruned model holds exactly the stages' parameters. (A
    function of its own: no loop variable outlives it to keep a stage alive past the collection.)"""
    return [replace(unit, name=f"stage {index}: {unit.name}")
            for stage, index in zip(pipeline.stages, pipeline.stage_indices)
            for unit in fsdp_units(stage, stage_plan(stage, plan), dims, param_dtype, backend)]


@contextmanager
def _cycles_collected_on_exit() -> Iterator[None]:
    """Collect on exit the reference cycles made inside: FSDP's hooks and states hold a model in cycles, freed now
    rather than in some later, unrelated allocation (the API may be called many times in one process).

    The process's older objects are frozen meanwhile (``gc.freeze``), so the collection traverses only what was made
    inside: a plan costs the same in a large process as in a small one (in a test session a full collection took
    0.3 s, 96 of them a quarter of the planner tests' time). Objects frozen by the caller stay frozen.
    """
    if gc.get_freeze_count():  # the caller froze objects of its own, which ``gc.unfreeze`` would release
        try:
            yield
        finally:
            gc.collect()
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def plan_rank_shards(
    args: PlannedArgs, dims: ParallelDims, config: ParallelConfig, precision: str, loss_chunk_size: Optional[int],
    rank: int = 0, lora: Optional[LoRA] = None,
) -> RankShards:
    """Build, parallelize and measure the meta model in a fake world, as ``rank``.

    Args:
        args: The model: ``ModelArgs``, or a Hugging Face decoder's config (``models.HFDecoderArgs``).
        dims: The mesh sizes.
        config: The options, dtypes resolved.
        precision: Trainer precision (``bf16-true`` stores the shards in bf16).
        loss_chunk_size: The fused loss's chunk.
        rank: The global rank to play (under a pipeline: its stages, the model pruned to them).
        lora: Adapters on the model's projections (its base frozen: no gradients or optimizer state): the model
            converters the module's ``lora=`` asks for, applied as ``parallelize_and_materialize`` applies them.
    """
    plan = plan_of(args, config)
    with fake_world(dims.world_size, rank), warnings.catch_warnings(), _cycles_collected_on_exit():
        # Warnings of parallelizing in a fake world (torch's, and the library's own, which a fit shows) are not
        # the planner user's concern.
        warnings.simplefilter("ignore", UserWarning)
        # The mesh only needs shapes: "cpu" works with the fake backend on any machine.
        mesh = dims.build_mesh("cpu")
        model = build_meta(args, loss_chunk_size)
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # as parallelize_and_materialize: shards stored in bf16
        # As parallelize_and_materialize: the converters the module asks for (LoRA's adapters, their NF4 bases cut
        # into FSDP's shards), on the meta model before the parallelism.
        convert_model(model, mesh, ModelConverters.of(plan, validation_inputs_of(args, lora)), torch.device("cpu"))
        model_numel = sum(p.numel() for p in model.parameters())
        pipeline = _parallelize(model, mesh, plan, config).pipeline
        backend = fsdp_backend(config.fsdp_backend)
        if pipeline is None:
            units, stage_indices, split = fsdp_units(model, plan, dims, config.param_dtype, backend), [], []
        else:
            units = _stage_units(pipeline, plan, dims, config.param_dtype, backend)
            stage_indices, split = list(pipeline.stage_indices), list(pipeline.split)
        numel = param_bytes = trained = 0
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            numel += local.numel()
            trained += local.numel() if param.requires_grad else 0
            param_bytes += weight_format(local).nbytes(local.numel(), local.dtype)
        buffer_bytes = sum(b.numel() * b.dtype.itemsize for b in model.buffers())
        del model, mesh, pipeline
    return RankShards(units, numel, param_bytes, buffer_bytes, stage_indices, split, model_numel,
                   None if trained == numel else trained)

