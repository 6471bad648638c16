"""Where the GPU check lane runs, with how many processes, and at what sizes.

Two modes:

- ``cuda``: the real lane, on NVIDIA GPUs with NCCL (``torch.cuda.is_available()``).
- ``cpu``: a smoke run of the same scenarios on CPU processes with gloo and tiny shapes, only
  when ``LIGHTNING_2D_GPU_LANE_ON_CPU=1`` is set. It exists so that typos and API drift in the
  lane's own code show up on a laptop instead of in a rationed GPU session; it proves nothing about
  GPU numerics or speed and never runs in CI.

Without CUDA and without that variable every test of ``tests/gpu`` is skipped (``conftest.py``).
This module imports only ``torch`` and the standard library, so collecting the lane never fails on
a machine without CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

CPU_SMOKE_ENV = "LIGHTNING_2D_GPU_LANE_ON_CPU"
CPU_PROCS_ENV = "LIGHTNING_2D_GPU_LANE_CPU_PROCS"
REPORT_ENV = "LIGHTNING_2D_GPU_REPORT"
MFU_MICRO_BATCH_ENV = "LIGHTNING_2D_GPU_MFU_MICRO_BATCH"
PEAK_TFLOPS_ENV = "LIGHTNING_2D_PEAK_TFLOPS"
#: Set by the launching pytest process for its ranks (worker.py dies with it).
PARENT_PID_ENV = "LIGHTNING_2D_GPU_LANE_PARENT_PID"

#: The torchtitan MFU target the issue sets for the ~1B model on one H200 (reported, not asserted).
MFU_TARGET_PERCENT = 45.0

#: Dense bf16 tensor-core peak, TFLOP/s, by a substring of ``torch.cuda.get_device_name()``
#: (vendor data sheets, SXM parts; torchtitan uses the same 989 for H100/H200). The lane keeps its
#: own figure instead of reading ``lightning_2d.integration.callbacks``: the MFU it reports cross-checks that
#: callback, so it must not share the callback's inputs.
DENSE_BF16_PEAK_TFLOPS: dict[str, float] = {"H200": 989.0, "H100": 989.0}

#: Largest tensor-parallel size the parity model divides (n_kv_heads = 8).
MAX_TP = 8


def _largest_power_of_two_at_most(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak for a CUDA device name, ``$LIGHTNING_2D_PEAK_TFLOPS`` if set, else ``None``.

    Args:
        device_name: ``torch.cuda.get_device_name()`` of the device the figure is for.
    """
    override = os.environ.get(PEAK_TFLOPS_ENV)
    if override:
        return float(override)
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS.items() if key in device_name), None)


@dataclass(frozen=True)
class Lane:
    """The sizes one mode runs at.

    Args:
        mode: ``"cuda"`` or ``"cpu"`` (the smoke mode).
        accelerator: Lightning's accelerator name for the Trainer.
        nprocs: Processes of every parallel job; on CUDA the largest power of two not above the
            number of GPUs (at most ``MAX_TP``), since NCCL refuses two ranks on one GPU and the
            parity model's heads must divide by the tensor-parallel size.
        model: ``ModelArgs`` fields of the parity/checkpoint model.
        seq_len: Tokens per sequence of the parity runs.
        global_batch: Sequences per optimizer step, over all data-parallel replicas.
        steps: Optimizer steps of each parity run.
        lr: Peak learning rate (high enough that the loss falls clearly within ``steps``).
        checkpoint_steps: Steps of the checkpoint runs (saves every 2 steps, resume from step 4).
        mfu: Settings of the throughput run (model, seq_len, micro_batch, warmup, window, compile).
        job_timeout: Seconds a parity job may take before the launcher kills it.
    """

    mode: str
    accelerator: str
    nprocs: int
    model: dict[str, Any]
    seq_len: int
    global_batch: int
    steps: int
    lr: float
    checkpoint_steps: int
    mfu: dict[str, Any] = field(default_factory=dict)
    job_timeout: float = 240.0

    @property
    def on_cuda(self) -> bool:
        return self.mode == "cuda"


def _cuda_lane() -> Lane:
    nprocs = _largest_power_of_two_at_most(min(torch.cuda.device_count(), MAX_TP))
    micro_batch = int(os.environ.get(MFU_MICRO_BATCH_ENV, "8"))
    return Lane(
        mode="cuda",
        accelerator="gpu",
        nprocs=nprocs,
        # Small enough that a step is launch-bound (the parity jobs are about numerics), with every
        # dimension a multiple of 16 (float8) and heads divisible by tensor-parallel sizes up to 8.
        model=dict(dim=512, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=512, multiple_of=256, max_seq_len=512),
        seq_len=256,
        global_batch=8,
        steps=10,
        lr=1e-3,
        checkpoint_steps=8,
        mfu=dict(
            # ~1.2B parameters without the embedding (Llama 3.2 1B's width and depth, 128 head size,
            # untied output head); ModelArgs.num_params() gives the exact count, printed by the test.
            model=dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                       ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=2048),
            seq_len=2048,
            micro_batch=micro_batch,
            warmup=5,  # compilation, allocator warm-up and FSDP's first all-gathers stay out of the window
            window=20,
            compile=True,
        ),
        job_timeout=150.0,
    )


def _cpu_lane() -> Lane:
    nprocs = int(os.environ.get(CPU_PROCS_ENV, "2"))
    if nprocs < 1 or nprocs > MAX_TP or nprocs & (nprocs - 1):
        raise ValueError(
            f"{CPU_PROCS_ENV}={nprocs} must be a power of two between 1 and {MAX_TP} (the parity model's heads"
            f" must divide by the tensor-parallel size); unset it for the default 2"
        )
    tiny = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=256, multiple_of=32, max_seq_len=128)
    return Lane(
        mode="cpu",
        accelerator="cpu",
        nprocs=nprocs,
        model=tiny,
        seq_len=32,
        global_batch=8,
        steps=6,
        lr=2e-3,
        checkpoint_steps=6,
        mfu=dict(model=tiny, seq_len=64, micro_batch=2, warmup=1, window=2, compile=False),
        job_timeout=600.0,
    )


def current_lane() -> Lane | None:
    """The lane this machine runs: CUDA if available, the CPU smoke mode if asked for, else ``None``."""
    if os.environ.get(CPU_SMOKE_ENV) == "1":
        return _cpu_lane()
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return _cuda_lane()
    return None


SKIP_REASON = (
    "needs CUDA (torch.cuda.is_available() is False); run tests/gpu/run.sh on a GPU machine, or set"
    f" {CPU_SMOKE_ENV}=1 for a CPU/gloo smoke run of the same scenarios"
)
