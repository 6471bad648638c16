"""Live throughput, MFU and memory: ``TokenThroughputMonitor`` (Trainer) and ``ThroughputMeter`` (any loop).

What is measured, per window of ``log_every_n_steps`` training steps:

- tokens/s: the tokens of the global batch (counted once per data-parallel replica: the ranks of a
  tensor-parallel group process the same batch) over the wall time of the window, data loading
  included, validation excluded;
- TFLOP/s per device: ``flops_per_token(seq_len)`` (torchtitan's convention: 6 × non-embedding
  parameters + attention) × tokens/s ÷ devices;
- MFU: TFLOP/s per device ÷ the **dense** peak of the device for the compute dtype actually used
  (``peak_tflops``): the bf16/fp16 tensor-core peak under ``bf16-*``/``16-*``; under ``32-true`` the
  TF32 peak when fp32 matmuls run as TF32 (``torch.set_float32_matmul_precision("high")``), else
  the plain fp32 peak. Dense, as torchtitan reports it: an H100 SXM is 989 TFLOP/s in bf16, not
  the 1979 "with sparsity" of the data sheet. Left out where the peak is unknown (CPU).

CUDA runs asynchronously: ``time.perf_counter()`` read right after a step returns sees the kernels
queued, not finished. The clock is therefore read after ``synchronize(device)`` at every window
boundary. Inside a window the per-step readings are not synchronized (a synchronization per step
would stall the host's queueing of the next step); their sum telescopes to the synchronized length
of the window, which is all that tokens/s and the mean step time use.

Lightning's ``Throughput`` is not used for the arithmetic: it keeps a rolling window of
cumulative counters (``N`` updates cover ``N - 1`` steps) and counts per-device items, whereas this
module logs tumbling windows of global tokens under our ``perf/`` names. Its peak table is used as
the fallback for chips ours does not list (``get_available_flops``); ours comes first because
Lightning's Hopper NVL/H200 entries are the with-sparsity figures, a GPU named plain
"NVIDIA H200" is not found there, and an "L40S" is read as an "L4".
"""

from __future__ import annotations

import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from lightning_2d.parallel.config import DTYPE_NAMES, ParallelConfig


@dataclass(frozen=True)
class DevicePeaks:
    """Dense peaks of one device in TFLOP/s (vendor data sheets, sparsity figures halved).

    Args:
        bf16: bf16/fp16 tensor-core peak (equal on every listed chip).
        tf32: TF32 (AMD: xf32) tensor-core peak for fp32 matmuls, ``None`` where there is none.
        fp32: Plain fp32 peak (AMD: fp32 matrix cores).
    """

    bf16: float
    tf32: Optional[float]
    fp32: float


#: Device-name pattern → dense peaks. A pattern matches whole words of ``torch.cuda.get_device_name``
#: (case-insensitive), and the first matching entry wins, so variants come before their base name.
#: Sources: NVIDIA A100, H100 (SXM/PCIe, 2024 NVL), H200 (SXM/NVL), H20, HGX B100/B200, GB200
#: NVL72, L40S, L40, L4 data sheets; AMD Instinct MI250X, MI300X and MI325X data sheets.
DEVICE_PEAKS: list[tuple[str, DevicePeaks]] = [
    ("H100 NVL", DevicePeaks(bf16=835.0, tf32=417.5, fp32=60.0)),
    ("H100 PCIe", DevicePeaks(bf16=756.0, tf32=378.0, fp32=51.0)),
    ("H100", DevicePeaks(bf16=989.0, tf32=494.5, fp32=67.0)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800 PCIe", DevicePeaks(bf16=756.0, tf32=378.0, fp32=51.0)),
    ("H800", DevicePeaks(bf16=989.0, tf32=494.5, fp32=67.0)),
    ("H200 NVL", DevicePeaks(bf16=835.0, tf32=417.5, fp32=60.0)),
    ("H200", DevicePeaks(bf16=989.0, tf32=494.5, fp32=67.0)),
    ("H20", DevicePeaks(bf16=148.0, tf32=74.0, fp32=44.0)),
    ("GB200", DevicePeaks(bf16=2500.0, tf32=1250.0, fp32=80.0)),
    ("B200", DevicePeaks(bf16=2250.0, tf32=1100.0, fp32=75.0)),
    ("B100", DevicePeaks(bf16=1750.0, tf32=875.0, fp32=60.0)),
    ("A100", DevicePeaks(bf16=312.0, tf32=156.0, fp32=19.5)),
    ("A800", DevicePeaks(bf16=312.0, tf32=156.0, fp32=19.5)),
    ("L40S", DevicePeaks(bf16=362.0, tf32=183.0, fp32=91.6)),
    ("L40", DevicePeaks(bf16=181.0, tf32=90.5, fp32=90.5)),
    ("L4", DevicePeaks(bf16=121.0, tf32=60.0, fp32=30.3)),
    ("MI325X", DevicePeaks(bf16=1307.4, tf32=653.7, fp32=163.4)),
    ("MI300X", DevicePeaks(bf16=1307.4, tf32=653.7, fp32=163.4)),
    ("MI250X", DevicePeaks(bf16=383.0, tf32=None, fp32=95.7)),
]

#: Lightning precision (``Trainer(precision=...)``) → the dtype matmuls run in.
PRECISION_COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "bf16": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "16": torch.float16,
    "32-true": torch.float32,
    "32": torch.float32,
    "64-true": torch.float64,
    "64": torch.float64,
}


def _listed_peaks(device_name: str) -> Optional[DevicePeaks]:
    for pattern, peaks in DEVICE_PEAKS:
        if re.search(rf"\b{re.escape(pattern)}\b", device_name, re.IGNORECASE):
            return peaks
    return None


def fp32_matmuls_use_tf32() -> bool:
    """Whether CUDA fp32 matmuls run on TF32 (xf32 on ROCm) tensor cores under the current settings."""
    # torch >= 2.9 resolves the per-backend setting ("none" inherits); unlike
    # get_float32_matmul_precision() it does not raise when the legacy and new APIs were mixed.
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is None:
        uses_tf32 = torch.get_float32_matmul_precision() != "highest"
    else:
        uses_tf32 = precision == "tf32"
    # ROCm runs fp32 GEMMs as xf32 only when hipBLASLt is also told to (MI300 and later).
    return uses_tf32 and (torch.version.hip is None or os.environ.get("HIPBLASLT_ALLOW_TF32") == "1")


def peak_tflops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Dense peak of ``device`` in TFLOP/s for matmuls in ``dtype``, or ``None`` when unknown.

    Listed chips (``DEVICE_PEAKS``) come from our table: bf16/fp16 → the 16-bit tensor-core peak;
    fp32 → the TF32 peak when ``fp32_matmuls_use_tf32()``, else the plain fp32 peak; other dtypes
    → ``None``. Other CUDA devices fall back to Lightning's ``get_available_flops`` (which warns and
    gives ``None`` for chips it does not know either). CPUs give ``None``.

    Args:
        device: The device the model computes on.
        dtype: The compute dtype of the matmuls (``compute_dtype_of`` gives it for a run).
    """
    device = torch.device(device)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    peaks = _listed_peaks(torch.cuda.get_device_name(device))
    if peaks is None:
        flops = get_available_flops(device, dtype)
        return None if flops is None else flops / 1e12
    if dtype in (torch.bfloat16, torch.float16):
        return peaks.bf16
    if dtype == torch.float32:
        return peaks.tf32 if peaks.tf32 is not None and fp32_matmuls_use_tf32() else peaks.fp32
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; nothing to wait for on CPU) before reading a clock.

    Args:
        device: The device whose queued kernels must finish.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process on ``device`` since the last ``reset_peak_memory``: allocated CUDA
    memory, or on CPU the peak resident memory (Linux ``VmHWM``; elsewhere the lifetime peak RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if status.exists():
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
        if match:
            return int(match.group(1)) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for ``peak_memory_gib`` (e.g. after setup, so only training counts).

    CUDA: the allocator's peak statistics. CPU on Linux: writing ``5`` to ``/proc/self/clear_refs``
    resets the kernel's resident high-water mark; elsewhere the CPU peak cannot be reset.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    clear_refs = Path("/proc/self/clear_refs")
    if clear_refs.exists():
        try:
            clear_refs.write_text("5")
        except OSError:  # read-only /proc in some sandboxes: keep the lifetime peak
            pass


def _as_dtype(value: Union[torch.dtype, str], name: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    raise ValueError(f"{name}={value!r} is not a compute dtype; use a torch.dtype or one of {', '.join(DTYPE_NAMES)}")


def compute_dtype_of(source: Union[L.Trainer, L.Fabric, str]) -> torch.dtype:
    """The dtype a run's matmuls compute in: what selects the peak for MFU.

    Under ``ModelParallel2DStrategy`` (Trainer or Fabric) it is FSDP2's ``param_dtype``: the
    strategy's explicit ``param_dtype`` or the one its precision implies. Otherwise it follows the
    precision: ``bf16-*`` → bf16, ``16-*`` → fp16, ``32-true`` → fp32, ``64-true`` → fp64.

    Args:
        source: A ``Trainer``, a ``Fabric``, or a Lightning precision string such as ``"bf16-mixed"``.
    """
    if isinstance(source, str):
        precision = source
    elif isinstance(source, L.Trainer):
        precision = str(source.precision)
    elif isinstance(source, L.Fabric):
        precision = str(source.strategy.precision.precision)
    else:
        raise TypeError(
            f"compute_dtype_of takes a Trainer, a Fabric or a precision string, got {type(source).__name__}"
        )
    config = getattr(getattr(source, "strategy", None), "parallel_config", None)
    if isinstance(config, ParallelConfig):
        param_dtype = config.resolve_dtypes(precision).param_dtype
        assert param_dtype is not None  # resolve_dtypes fills it in
        return param_dtype
    if precision not in PRECISION_COMPUTE_DTYPES:
        raise ValueError(
            f"Cannot tell the compute dtype of precision {precision!r} (known: {', '.join(PRECISION_COMPUTE_DTYPES)});"
            " pass it explicitly, e.g. TokenThroughputMonitor(dtype='bfloat16') or"
            " ThroughputMeter(..., dtype=torch.bfloat16)"
        )
    return PRECISION_COMPUTE_DTYPES[precision]


class ThroughputMeter:
    """Windowed throughput arithmetic, shared by ``TokenThroughputMonitor`` (Trainer) and Fabric loops.

    Time each step with ``synchronize(device)`` before reading the clock (at least at the start and
    end of each window), ``update`` once per step, ``compute`` once per window, then ``reset``.
    The peak for MFU is looked up once, here.

    Args:
        world_size: Number of processes (devices).
        device: This process's device (for MFU and memory).
        flops_per_token: ``seq_len -> FLOPs`` per trained token (enables TFLOP/s and MFU), or ``None``.
        dtype: Compute dtype of the matmuls (``compute_dtype_of``), which selects the peak for MFU;
            ``None`` means bf16, what this library trains in on GPUs.
    """

    def __init__(
        self,
        world_size: int,
        device: torch.device,
        flops_per_token: Optional[Callable[[int], float]] = None,
        dtype: Optional[Union[torch.dtype, str]] = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer (the number of devices), got {world_size!r}")
        if flops_per_token is not None and not callable(flops_per_token):
            raise TypeError(
                "flops_per_token must be a function seq_len -> FLOPs (e.g. ModelArgs.flops_per_token),"
                f" got {flops_per_token!r}"
            )
        self.world_size, self.device, self.flops_per_token = world_size, torch.device(device), flops_per_token
        self.dtype = torch.bfloat16 if dtype is None else _as_dtype(dtype, "dtype")
        self.peak_tflops = peak_tflops(self.device, self.dtype)
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.steps = self.tokens = 0
        self.seconds = 0.0

    def update(self, global_tokens: int, seconds: float) -> None:
        """One step that trained ``global_tokens`` tokens (counted once per data-parallel replica) in ``seconds``."""
        self.steps += 1
        self.tokens += global_tokens
        self.seconds += seconds

    def compute(self, seq_len: int) -> dict[str, float]:
        """The window's metrics (``perf/...``); MFU only where the device's peak is known.

        Args:
            seq_len: Sequence length of the batches (attention FLOPs grow with it).
        """
        if self.steps == 0 or self.seconds <= 0:
            raise ValueError(
                f"compute() needs steps with a positive duration since the last reset(); got {self.steps} steps"
                f" in {self.seconds} s (call update(global_tokens, seconds) once per step first)"
            )
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
            if self.peak_tflops is not None:
                metrics["perf/mfu_percent"] = 100.0 * tflops / self.peak_tflops
        return metrics


class TokenThroughputMonitor(L.Callback):
    """Logs tokens/s, step time, TFLOP/s per device, MFU and peak memory every ``log_every_n_steps``.

    Shown in the progress bar (tokens/s, MFU) and sent to the Trainer's loggers under ``perf/``.
    The LightningModule's ``flops_per_token(seq_len)`` (``LlamaLightningModule`` has it) enables
    TFLOP/s and MFU. The device is synchronized at window boundaries only (see the module
    docstring); time spent in validation during ``fit`` is left out. Not Lightning's
    ``lightning.pytorch.callbacks.ThroughputMonitor`` (samples, from a ``batch_size_fn``): this one counts
    tokens once per data-parallel replica and needs no arguments.

    Args:
        log_every_n_steps: Averaging window; ``None`` uses the Trainer's ``log_every_n_steps``.
        skip_first_steps: Steps of each ``fit`` left out of every measurement (start-up, compilation).
        dtype: Compute dtype for the MFU peak (``"bfloat16"``, ``torch.float32``, ...); ``None``
            derives it from the Trainer (``compute_dtype_of``).

    Raises:
        ValueError: A ``log_every_n_steps`` below 1, a negative ``skip_first_steps`` or a ``dtype`` that names no
            dtype.

    Example:
        ```python
        import lightning as L
        from lightning_2d import TokenThroughputMonitor

        trainer = L.Trainer(callbacks=[TokenThroughputMonitor(log_every_n_steps=20, skip_first_steps=5)])
        # logs perf/tokens_per_sec, perf/step_time_s, perf/tflops_per_device, perf/mfu_percent, ...
        ```

        ``lightning-2d fit`` adds one to every run (``--throughput.log_every_n_steps=...``).
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        skip_first_steps: int = 1,
        dtype: Optional[Union[str, torch.dtype]] = None,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be a positive integer or None, got {log_every_n_steps!r}")
        if isinstance(skip_first_steps, bool) or skip_first_steps < 0:
            raise ValueError(f"skip_first_steps must be a non-negative integer, got {skip_first_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self.skip_first_steps = skip_first_steps
        self.dtype = None if dtype is None else _as_dtype(dtype, "dtype")
        self.last: dict[str, float] = {}  # the most recent measurements (for scripts and tests)
        self._compute_dtype: Optional[torch.dtype] = None
        self._meter: Optional[ThroughputMeter] = None
        self._first_step = 0
        self._last_end: Optional[float] = None  # clock at the end of the previous step
        self._paused_at: Optional[float] = None  # clock when a validation run started

    @staticmethod
    def data_parallel_size(trainer: L.Trainer) -> int:
        """Number of data-parallel replicas (the ranks that read different batches)."""
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
        return int(kwargs["num_replicas"]) if kwargs else 1

    @staticmethod
    def _clock(device: torch.device, sync: bool) -> float:
        if sync:
            synchronize(device)
        return time.perf_counter()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # an unknown precision fails here, before any step
            self._compute_dtype = self.dtype or compute_dtype_of(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        flops = getattr(pl_module, "flops_per_token", None)
        self._meter = ThroughputMeter(
            trainer.world_size, pl_module.device, flops if callable(flops) else None, dtype=self._compute_dtype
        )
        # Counted from this fit's first step: a resumed run's first steps pay start-up costs too.
        self._first_step = trainer.global_step
        self._last_end = self._paused_at = None
        reset_peak_memory(pl_module.device)  # the peak of training, not of building the model

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._last_end is None:
            self._last_end = self._clock(pl_module.device, sync=True)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._meter is not None and self._last_end is not None
        tokens = batch["input_ids"].numel() * self.data_parallel_size(trainer)  # global tokens of this step
        self.last["tokens_per_step"] = tokens
        if trainer.global_step - self._first_step <= self.skip_first_steps:
            self._last_end = self._clock(pl_module.device, sync=True)  # the next window may start here
            return
        closes_window = self._meter.steps + 1 >= (self.log_every_n_steps or trainer.log_every_n_steps)
        now = self._clock(pl_module.device, sync=closes_window)
        self._meter.update(tokens, now - self._last_end)
        self._last_end = now
        if closes_window:
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

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_end is not None and not trainer.sanity_checking:
            self._paused_at = self._clock(pl_module.device, sync=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._paused_at is not None and self._last_end is not None:
            # Shift the open step's start by the validation time, so that step measures training only.
            self._last_end += self._clock(pl_module.device, sync=True) - self._paused_at
            self._paused_at = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = self._paused_at = None
