"""The variants, one rank each: ``lightning_2d`` (Trainer + ``ModelParallel2DStrategy`` +
``LlamaLightningModule``) and each compared variant of it (the same with a row's overrides:
``comparisons.COMPARISONS``), ``lightning`` (Lightning's ``ModelParallelStrategy`` with the plan written by hand in
``configure_model``) and ``plain`` (a torch loop); ``run_variant`` runs one and returns its step times, losses and
peak memory.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Optional

import lightning as L
import torch

from lightning_2d.integration.callbacks import peak_memory_gib, peak_tflops
from lightning_2d.integration.module import LlamaLightningModule
from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy
from lightning_2d.models.llama.model import Transformer
from lightning_2d.parallel.config import PRECISION_TO_DTYPES
from lightning_2d.parallel.dims import destroy_process_group_at_exit
from lightning_2d.tools.benchmark.clock import StepClock, StepClockCallback
from lightning_2d.tools.benchmark.reference import build_reference_model, mean_cross_entropy
from lightning_2d.tools.benchmark.collectives import CollectiveCountCallback, counted_collectives
from lightning_2d.tools.benchmark.comparisons import COMPARISONS
from lightning_2d.tools.benchmark.settings import OURS, BenchmarkSettings
from lightning_2d.tools.benchmark.workload import (
    build_adamw,
    load_seeded_init,
    lr_warmup_steps,
    synthetic_data,
    synthetic_loader,
)


def process_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _quiet_lightning() -> None:
    # The synthetic loader needs no workers, and the benchmark sets no logger on purpose.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*`self.log\(\)` but .*logger.*")


def _trainer(settings: BenchmarkSettings, strategy: Any, precision: str, *callbacks: L.Callback) -> L.Trainer:
    return L.Trainer(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=strategy,
        precision=precision,
        max_steps=settings.total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # Each rank gets its own synthetic loader (see synthetic_loader): no sampler on top.
        use_distributed_sampler=False,
        callbacks=list(callbacks),
        default_root_dir=tempfile.gettempdir(),
    )


def run_lightning_2d(settings: BenchmarkSettings, variant: str = OURS) -> tuple[StepClock, torch.device, torch.dtype]:
    """Variant ``lightning_2d`` and each compared variant of it (``simple_fsdp``, ``lora``, ``expert_parallel`` …):
    Trainer + ``ModelParallel2DStrategy`` + ``LlamaLightningModule``, their arguments as the variant says
    (``BenchmarkSettings.strategy_kwargs``, ``module_kwargs``), on synthetic tokens or, under ``--preference``,
    synthetic packed pairs (``workload.synthetic_data``). The collectives of the last warm-up step are counted, as
    in every variant (``collectives.CollectiveCountCallback``; its profile costs a step that is dropped)."""
    module = LlamaLightningModule(
        model=settings.model_args,
        init_seed=settings.seed,
        warmup_steps=lr_warmup_steps(settings),
        max_steps=settings.total_steps,
        **settings.module_kwargs(variant),
    )
    strategy = ModelParallel2DStrategy(**settings.strategy_kwargs(variant))
    callback = StepClockCallback()
    counter = _counter(settings)
    trainer = _trainer(settings, strategy, settings.precision, callback, *([counter] if counter else []))
    trainer.fit(module, **synthetic_data(settings, process_rank()))
    dtype = strategy.parallel_config.resolve_dtypes(settings.precision).param_dtype
    assert callback.clock is not None and dtype is not None
    _keep_counts(callback.clock, counter)
    return callback.clock, strategy.root_device, dtype


def _counter(settings: BenchmarkSettings) -> Optional[CollectiveCountCallback]:
    """The callback counting the last warm-up step's collectives (by issuer under ``--collectives``); ``None``
    without a warm-up step."""
    if not settings.warmup:
        return None
    return CollectiveCountCallback(settings.warmup - 1, by_issuer=settings.collectives_by_issuer)


def _keep_counts(clock: StepClock, counter: Optional[CollectiveCountCallback]) -> None:
    if counter is not None:
        clock.collectives, clock.collective_issuers = counter.counts, counter.issuers


class HandWritten2DModule(L.LightningModule):
    """What a user writes for Lightning's ``ModelParallelStrategy`` today: the 2D plan in ``configure_model``.

    Args:
        settings: Model shape, precision, seed and optimizer schedule.
    """

    def __init__(self, settings: BenchmarkSettings) -> None:
        super().__init__()
        self.settings = settings
        self.model: Optional[Transformer] = None

    def configure_model(self) -> None:
        if self.model is None:
            mesh = self.device_mesh
            self.model = build_reference_model(self.settings, mesh["tensor_parallel"], mesh["data_parallel"])

    def on_fit_start(self) -> None:
        # Lightning materialized the meta model with each module's reset_parameters(), whose values
        # depend on the layout (and the Transformer's rotary table has none): load the seeded
        # values the other variants start from.
        assert self.model is not None
        load_seeded_init(self.model, self.settings.seed)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return mean_cross_entropy(self.model(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        optimizer, scheduler = build_adamw(self.model, self.device, self.settings)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run_lightning(settings: BenchmarkSettings) -> tuple[StepClock, torch.device, torch.dtype]:
    """Variant ``lightning``: Lightning's ``ModelParallelStrategy``, ``reference_2d_plan`` in ``configure_model``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    # Replaced by the seeded init in on_fit_start (see HandWritten2DModule).
    warnings.filterwarnings("ignore", message=r"Parameter initialization incomplete.*")
    strategy = ModelParallelStrategy(data_parallel_size=settings.dp, tensor_parallel_size=settings.tp)
    callback = StepClockCallback()
    counter = _counter(settings)
    # Precision goes through FSDP2's policy in reference_2d_plan, as in the other variants; Lightning's
    # bf16 plugins would add autocast or a module conversion on top.
    trainer = _trainer(settings, strategy, "32-true", callback, *([counter] if counter else []))
    trainer.fit(HandWritten2DModule(settings), train_dataloaders=synthetic_loader(settings, process_rank()))
    assert callback.clock is not None
    _keep_counts(callback.clock, counter)
    return callback.clock, strategy.root_device, PRECISION_TO_DTYPES[settings.precision][0]


def run_plain(settings: BenchmarkSettings) -> tuple[StepClock, torch.device, torch.dtype]:
    """Variant ``plain``: a torch training loop, no Lightning."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if settings.accelerator == "gpu":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():  # in place, an earlier variant may have created it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (settings.dp, settings.tp), mesh_dim_names=("dp", "tp"))
    model = build_reference_model(settings, mesh["tp"], mesh["dp"])
    model.to_empty(device=device)
    load_seeded_init(model, settings.seed)
    optimizer, scheduler = build_adamw(model, device, settings)
    loader = synthetic_loader(settings, dist.get_rank())

    clock = StepClock(device)
    clock.start()
    for step, batch in enumerate(loader):
        # The same step the Trainer variants count (their CollectiveCountCallback): the last warm-up one.
        with counted_collectives(settings.collectives_by_issuer) if step == settings.warmup - 1 else nullcontext(
                ) as counted:
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            loss = mean_cross_entropy(model(input_ids), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if counted is not None:
            clock.collectives, clock.collective_issuers = counted.counts, counted.issuers
        clock.tick(loss.detach())
    return clock, device, PRECISION_TO_DTYPES[settings.precision][0]


RUNNERS: dict[str, Callable[[BenchmarkSettings], tuple[StepClock, torch.device, torch.dtype]]] = {
    OURS: run_lightning_2d,
    "lightning": run_lightning,
    "plain": run_plain,
    **{row.name: partial(run_lightning_2d, variant=row.name) for row in COMPARISONS},
}


def run_variant(variant: str, settings: BenchmarkSettings) -> dict[str, Any]:
    """Run one variant on this rank; returns its step times, losses, peak memory and the device's peak."""
    _quiet_lightning()
    clock, device, dtype = RUNNERS[variant](settings)
    destroy_process_group_at_exit()
    return {
        "variant": variant,
        "rank": process_rank(),
        "device": str(device),
        "step_times": clock.step_times,
        "losses": clock.losses,
        "peak_memory_gib": peak_memory_gib(device),
        "peak_tflops": peak_tflops(device, dtype),
        "compute_dtype": str(dtype).removeprefix("torch."),
        "collectives": clock.collectives,  # one step's, by kind
        "collective_issuers": clock.collective_issuers,  # under --collectives: by issuer, kind and group
    }
