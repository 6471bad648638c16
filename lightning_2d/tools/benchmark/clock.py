"""The step clock: wall time between the ends of consecutive optimizer steps (the device synchronized before
the clock is read) and each step's loss; ``StepClockCallback`` drives one from a Trainer.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch

from lightning_2d.integration.callbacks import reset_peak_memory, synchronize


class StepClock:
    """Wall time between the ends of consecutive optimizer steps, and each step's loss.

    Args:
        device: Synchronized before the clock is read, so queued kernels count for their step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_times: list[float] = []
        self.losses: list[float] = []
        #: One step's collectives by kind, where the run counted them (``collectives.CollectiveCountCallback``).
        self.collectives: Optional[dict[str, int]] = None
        #: Under ``--collectives``: that step's collectives by issuer, kind and group (``collectives.issuer_table``).
        self.collective_issuers: Optional[list[dict[str, Any]]] = None
        self._last: Optional[float] = None

    @property
    def started(self) -> bool:
        return self._last is not None

    def start(self) -> None:
        # Peak memory counts from the first step: what setup allocated and freed is not training's.
        reset_peak_memory(self.device)
        synchronize(self.device)
        self._last = time.perf_counter()

    def tick(self, loss: torch.Tensor) -> None:
        """One optimizer step has ended; ``loss`` is its loss (read after the clock)."""
        assert self._last is not None, "call start() before the first step"
        synchronize(self.device)
        now = time.perf_counter()
        self.step_times.append(now - self._last)
        self._last = now
        self.losses.append(float(loss))


class StepClockCallback(L.Callback):
    """A ``StepClock`` driven by the Trainer: started at the first batch, ticked at every batch end."""

    def __init__(self) -> None:
        self.clock: Optional[StepClock] = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.clock is None:
            self.clock = StepClock(pl_module.device)
            self.clock.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.clock is not None
        # LlamaLightningModule logs the global-batch mean; a module that logs nothing returns its loss.
        self.clock.tick(trainer.callback_metrics.get("train_loss", outputs["loss"]))
