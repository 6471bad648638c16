"""Live throughput, MFU and memory: ``ThroughputMonitor``.

Tokens are counted once per data-parallel replica (the ranks of a tensor-parallel group process
the same batch), FLOPs with torchtitan's convention, and MFU against the dense bf16 peak of the
device (left out where the peak is unknown, e.g. on CPU).
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Optional

import lightning as L
import torch

#: Dense bf16 tensor-core peak per device, TFLOP/s (vendor data sheets; SXM unless named).
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H20", 148.0),
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("MI325X", 1307.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
]


def peak_bf16_tflops(device: torch.device) -> Optional[float]:
    """The dense bf16 peak of ``device`` in TFLOP/s, or ``None`` when unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process on ``device``: allocated CUDA memory, or the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class ThroughputMeter:
    """Windowed throughput arithmetic, shared by ``ThroughputMonitor`` (Trainer) and Fabric loops.

    Args:
        world_size: Number of processes (devices).
        device: This process's device (for MFU and memory).
        flops_per_token: ``seq_len -> FLOPs`` per trained token (enables TFLOP/s and MFU), or ``None``.
    """

    def __init__(
        self, world_size: int, device: torch.device, flops_per_token: Optional[Any] = None
    ) -> None:
        self.world_size, self.device, self.flops_per_token = world_size, device, flops_per_token
        self.reset()

    def reset(self) -> None:
        self.steps = self.tokens = 0
        self.seconds = 0.0

    def update(self, global_tokens: int, seconds: float) -> None:
        """One step that trained ``global_tokens`` tokens (counted once per data-parallel replica)."""
        self.steps += 1
        self.tokens += global_tokens
        self.seconds += seconds

    def compute(self, seq_len: int) -> dict[str, float]:
        tokens_per_sec = self.tokens / self.seconds
        metrics = {
            "perf/tokens_per_sec": tokens_per_sec,
            "perf/tokens_per_sec_per_device": tokens_per_sec / self.world_size,
            "perf/step_time_s": self.seconds / self.steps,
            "perf/peak_memory_gib": peak_memory_gib(self.device),
        }
        if self.flops_per_token is not None:
            tflops = self.flops_per_token(seq_len) * tokens_per_sec / self.world_size / 1e12
            metrics["perf/tflops_per_device"] = tflops
            peak = peak_bf16_tflops(self.device)
            if peak is not None:
                metrics["perf/mfu_percent"] = 100.0 * tflops / peak
        return metrics


class ThroughputMonitor(L.Callback):
    """Logs tokens/s, step time, TFLOP/s per device, MFU and peak memory every ``log_every_n_steps``.

    Shown in the progress bar (tokens/s, MFU) and sent to the Trainer's loggers under ``perf/``.
    The LightningModule's ``flops_per_token(seq_len)`` (``LlamaLightningModule`` has it) enables
    TFLOP/s and MFU.

    Args:
        log_every_n_steps: Averaging window; ``None`` uses the Trainer's ``log_every_n_steps``.
        skip_first_steps: Steps left out of every measurement (start-up, compilation).
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, skip_first_steps: int = 1) -> None:
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self.skip_first_steps = skip_first_steps
        self.last: dict[str, float] = {}  # the most recent measurements (for scripts and tests)
        self._meter: Optional[ThroughputMeter] = None
        self._last_end: Optional[float] = None

    @staticmethod
    def data_parallel_size(trainer: L.Trainer) -> int:
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
        return int(kwargs["num_replicas"]) if kwargs else 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._meter is None:
            flops = getattr(pl_module, "flops_per_token", None)
            self._meter = ThroughputMeter(trainer.world_size, pl_module.device, flops if callable(flops) else None)
        if self._last_end is None:
            self._last_end = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._meter is not None
        now = time.perf_counter()
        step_seconds, self._last_end = now - (self._last_end or now), now
        tokens = batch["input_ids"].numel() * self.data_parallel_size(trainer)  # global tokens of this step
        self.last["tokens_per_step"] = tokens
        if trainer.global_step <= self.skip_first_steps:
            return
        self._meter.update(tokens, step_seconds)
        if self._meter.steps >= (self.log_every_n_steps or trainer.log_every_n_steps):
            metrics = self._meter.compute(seq_len=batch["input_ids"].shape[-1])
            self._meter.reset()
            self.last.update(metrics)
            # Straight to the loggers, once per window (self.log would repeat the value every step).
            # Lightning files a step's metrics under the 0-based index of that step.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=max(trainer.global_step - 1, 0))
            for name in ("perf/tokens_per_sec", "perf/mfu_percent"):
                if name in metrics:
                    pl_module.log(name, metrics[name], prog_bar=True, logger=False, on_step=True, on_epoch=False)
