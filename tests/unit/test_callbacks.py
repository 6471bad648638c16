"""Peaks, synchronized timing, MFU arithmetic, and the monitor's metrics reaching CSV and TensorBoard.

No GPU here: CUDA is faked by patching ``torch.cuda`` (name, availability, synchronize) and the clock.
"""

from __future__ import annotations

import csv
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch

from lightning_2d import (
    LlamaLightningModule,
    ModelArgs,
    ModelParallel2DStrategy,
    TextDataModule,
    TokenThroughputMonitor,
)
from lightning_2d.data import stdlib_sources
from lightning_2d.fabric import ModelParallel2DStrategy as FabricModelParallel2DStrategy
from lightning_2d.integration import callbacks
from lightning_2d.integration.callbacks import (
    ThroughputMeter,
    compute_dtype_of,
    fp32_matmuls_use_tf32,
    peak_memory_gib,
    peak_tflops,
    reset_peak_memory,
    synchronize,
)

CUDA = torch.device("cuda", 0)


def test_flops_per_token_follows_torchtitan():
    args = ModelArgs.from_name("llama3-8b")
    non_embedding = args.num_params() - args.vocab_size * args.dim
    assert args.flops_per_token(8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    # 6 × 7.5 B (every parameter but the embedding lookup; the output projection counts) + 12.9
    # GFLOP of attention: ~5.8e10 FLOPs per token at 8k context.
    assert args.flops_per_token(8192) == pytest.approx(5.79e10, rel=0.01)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device named ``fake_gpu.name`` (compute capability 9.0) whose synchronize calls are counted."""
    gpu = SimpleNamespace(name="NVIDIA H100 80GB HBM3", syncs=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu.name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: gpu.syncs.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: gpu.peak_resets.append(device))
    gpu.peak_resets = []
    return gpu


@pytest.fixture
def matmul_precision():
    """Lets a test change the fp32 matmul precision, and restores it afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM: dense, not the 1979 with sparsity
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),  # not in Lightning's table
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H20", 148.0),  # not an H200
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),  # not a B200
        ("NVIDIA L40S", 362.0),  # Lightning reads it as an L4
        ("NVIDIA L4", 121.0),
        ("AMD Instinct MI300X", 1307.4),
        ("AMD Instinct MI325X", 1307.4),
    ],
)
def test_dense_16bit_peaks_by_device_name(fake_gpu, name, bf16):
    fake_gpu.name = name
    assert peak_tflops(CUDA, torch.bfloat16) == bf16
    assert peak_tflops(CUDA, torch.float16) == bf16


def test_a_name_never_claims_a_longer_one(fake_gpu, monkeypatch):
    # Whole-word matching: "H20" is not a prefix match for "H200", nor "B200" for "GB200", whatever the order.
    monkeypatch.setattr(callbacks, "DEVICE_PEAKS", list(reversed(callbacks.DEVICE_PEAKS)))
    for name, bf16 in (("NVIDIA H200", 989.0), ("NVIDIA GB200", 2500.0), ("NVIDIA L40S", 362.0), ("NVIDIA H20", 148.0)):
        fake_gpu.name = name
        assert peak_tflops(CUDA, torch.bfloat16) == bf16


def test_fp32_peak_follows_the_matmul_precision(fake_gpu, matmul_precision):
    matmul_precision("highest")
    assert not fp32_matmuls_use_tf32()
    assert peak_tflops(CUDA, torch.float32) == 67.0  # H100 SXM, plain fp32
    matmul_precision("high")
    assert fp32_matmuls_use_tf32()
    assert peak_tflops(CUDA, torch.float32) == 494.5  # dense TF32
    fake_gpu.name = "NVIDIA A100-SXM4-80GB"
    assert peak_tflops(CUDA, torch.float32) == 156.0
    fake_gpu.name = "AMD Instinct MI250X"  # no TF32 on MI200: the fp32 matrix-core peak
    assert peak_tflops(CUDA, torch.float32) == 95.7


def test_rocm_uses_xf32_only_when_hipblaslt_is_told(fake_gpu, matmul_precision, monkeypatch):
    fake_gpu.name = "AMD Instinct MI300X"
    matmul_precision("high")
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
    assert peak_tflops(CUDA, torch.float32) == 163.4
    monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "1")
    assert peak_tflops(CUDA, torch.float32) == 653.7


def test_new_fp32_precision_api_is_read_without_error(fake_gpu, matmul_precision):
    matmul_precision("highest")
    cublas = torch.backends.cuda.matmul
    before = cublas.fp32_precision
    cublas.fp32_precision = "tf32"  # torch >= 2.9's API: the legacy getter now raises (mixed APIs)
    try:
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.get_float32_matmul_precision()
        assert peak_tflops(CUDA, torch.float32) == 494.5
    finally:
        cublas.fp32_precision = before


def test_torch_before_2_9_reads_the_legacy_precision(fake_gpu, matmul_precision, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace())  # no fp32_precision attribute
    matmul_precision("high")
    assert peak_tflops(CUDA, torch.float32) == 494.5
    matmul_precision("highest")
    assert peak_tflops(CUDA, torch.float32) == 67.0


def test_unlisted_gpus_fall_back_to_lightning_then_none(fake_gpu):
    fake_gpu.name = "NVIDIA A10G"  # only in Lightning's table
    assert peak_tflops(CUDA, torch.bfloat16) == 125.0
    fake_gpu.name = "NVIDIA Imaginary X1"
    with pytest.warns(UserWarning, match="FLOPs not found"):
        assert peak_tflops(CUDA, torch.bfloat16) is None


def test_no_peak_on_cpu_or_for_other_dtypes(fake_gpu):
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None
    assert peak_tflops(CUDA, torch.float64) is None  # listed chip, dtype we do not list
    with pytest.raises(TypeError, match="torch.dtype such as torch.bfloat16, got 'bf16'"):
        peak_tflops(CUDA, "bf16")


def test_synchronize_waits_on_cuda_only(fake_gpu):
    synchronize(torch.device("cpu"))
    assert fake_gpu.syncs == []
    synchronize(CUDA)
    assert fake_gpu.syncs == [CUDA]


def test_mfu_uses_the_peak_of_the_compute_dtype(fake_gpu, matmul_precision):
    fake_gpu.name = "NVIDIA A100-SXM4-80GB"
    matmul_precision("high")

    def mfu(dtype):
        # 2 devices, 1e8 FLOPs per token, 312_000 tokens in 1 s: 15.6 TFLOP/s per device.
        meter = ThroughputMeter(2, CUDA, lambda seq_len: 1e8, dtype=dtype)
        meter.update(156_000, 0.5)
        meter.update(156_000, 0.5)
        metrics = meter.compute(seq_len=128)
        assert metrics["perf/tflops_per_device"] == pytest.approx(15.6)
        return metrics["perf/mfu_percent"]

    assert mfu(torch.bfloat16) == pytest.approx(5.0)  # of 312
    assert mfu(None) == pytest.approx(5.0)  # bf16 by default
    assert mfu(torch.float32) == pytest.approx(10.0)  # of 156 (TF32)
    matmul_precision("highest")
    assert mfu(torch.float32) == pytest.approx(80.0)  # of 19.5


def test_meter_keeps_its_positional_signature_and_rejects_bad_input():
    meter = ThroughputMeter(4, torch.device("cpu"), ModelArgs.from_name("debug").flops_per_token)
    with pytest.raises(ValueError, match="needs steps with a positive duration"):
        meter.compute(seq_len=32)
    meter.update(400, 2.0)
    metrics = meter.compute(seq_len=32)
    assert metrics["perf/tokens_per_sec"] == 200 and metrics["perf/tokens_per_sec_per_device"] == 50
    assert metrics["perf/step_time_s"] == 2.0 and "perf/mfu_percent" not in metrics
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        ThroughputMeter(0, torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype='fp8' is not a compute dtype"):
        ThroughputMeter(1, torch.device("cpu"), dtype="fp8")


@pytest.mark.parametrize(
    "precision, dtype",
    [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16),
     ("16-true", torch.float16), ("32-true", torch.float32), ("64-true", torch.float64)],
)
def test_compute_dtype_of_precisions(precision, dtype):
    assert compute_dtype_of(precision) == dtype


def test_compute_dtype_of_trainer_and_fabric():
    assert compute_dtype_of(L.Trainer(accelerator="cpu", precision="bf16-true", logger=False)) == torch.bfloat16
    assert compute_dtype_of(L.Trainer(accelerator="cpu", logger=False)) == torch.float32
    # Under our strategy FSDP2's param_dtype decides: implied by the precision, or explicit.
    implied = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallel2DStrategy(), precision="bf16-mixed",
                        logger=False)
    assert compute_dtype_of(implied) == torch.bfloat16
    explicit = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallel2DStrategy(param_dtype="float32"),
                         precision="bf16-mixed", logger=False)
    assert compute_dtype_of(explicit) == torch.float32
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricModelParallel2DStrategy(param_dtype="bf16"))
    assert compute_dtype_of(fabric) == torch.bfloat16  # precision 32-true, explicit bf16 parameters


def test_compute_dtype_of_rejects_what_it_cannot_tell():
    with pytest.raises(ValueError, match=r"precision 'transformer-engine'.*TokenThroughputMonitor\(dtype='bfloat16'\)"):
        compute_dtype_of("transformer-engine")
    with pytest.raises(TypeError, match="got int"):
        compute_dtype_of(16)


class FakeCUDAQueue:
    """Host clock + a queue of GPU work: a step returns to the host at once, synchronize waits for it."""

    def __init__(self, monkeypatch) -> None:
        self.host = self.gpu_done = 0.0
        self.syncs = 0
        monkeypatch.setattr(time, "perf_counter", lambda: self.host)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def run(self, gpu_seconds: float) -> None:
        self.gpu_done = max(self.gpu_done, self.host) + gpu_seconds
        self.host += 0.001  # the host only queues the kernels

    def synchronize(self, device: Any = None) -> None:
        self.syncs += 1
        self.host = max(self.host, self.gpu_done)


def drive(monitor: TokenThroughputMonitor, queue: FakeCUDAQueue, steps: int, validate_after: int = 0) -> list[dict]:
    """Runs ``steps`` training steps of 1 GPU-second through the monitor's hooks; returns the logged metrics."""
    logged: list[dict] = []
    trainer = SimpleNamespace(
        global_step=0, world_size=1, log_every_n_steps=50, sanity_checking=False, strategy=None,
        loggers=[SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))],
    )
    module = SimpleNamespace(device=CUDA, flops_per_token=lambda seq_len: 1e9, log=lambda *args, **kwargs: None)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    monitor.setup(trainer, module, "fit")
    monitor.on_train_start(trainer, module)
    for step in range(steps):
        monitor.on_train_batch_start(trainer, module, batch, step)
        queue.run(gpu_seconds=1.0)
        trainer.global_step += 1
        monitor.on_train_batch_end(trainer, module, None, batch, step)
        if trainer.global_step == validate_after:
            monitor.on_validation_start(trainer, module)
            queue.run(gpu_seconds=7.0)
            monitor.on_validation_end(trainer, module)
    return logged


def test_monitor_times_gpu_work_not_kernel_queueing(fake_gpu, monkeypatch):
    queue = FakeCUDAQueue(monkeypatch)
    logged = drive(TokenThroughputMonitor(log_every_n_steps=2, skip_first_steps=1, dtype="bfloat16"), queue, steps=6)
    # Windows: steps 2-3 and 4-5 (step 1 skipped, step 6 opens a window that never closes).
    assert len(logged) == 2
    for metrics in logged:
        assert metrics["perf/step_time_s"] == pytest.approx(1.0)  # not the host's 0.001 s
        assert metrics["perf/tokens_per_sec"] == pytest.approx(32.0)
        assert metrics["perf/mfu_percent"] == pytest.approx(100 * 32e9 / 1e12 / 989.0)
    # Synchronized at window boundaries only: the first start, the end of step 1, 3 and 5.
    assert queue.syncs == 4


def test_monitor_leaves_validation_time_out(fake_gpu, monkeypatch):
    queue = FakeCUDAQueue(monkeypatch)
    logged = drive(TokenThroughputMonitor(log_every_n_steps=2, skip_first_steps=0, dtype="bfloat16"), queue, steps=4,
                   validate_after=3)
    assert [m["perf/step_time_s"] for m in logged] == pytest.approx([1.0, 1.0])  # not 4.5 for steps 3-4


def test_monitor_refuses_an_unknown_precision_at_setup():
    trainer = L.Trainer(accelerator="cpu", logger=False)
    trainer.strategy.precision_plugin.precision = "transformer-engine"
    with pytest.raises(ValueError, match="Cannot tell the compute dtype"):
        TokenThroughputMonitor().setup(trainer, None, "fit")
    with pytest.raises(ValueError, match="skip_first_steps must be a non-negative integer, got -1"):
        TokenThroughputMonitor(skip_first_steps=-1)


def test_monitor_logs_to_csv_and_tensorboard(tmp_path, monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in stdlib_sources()[:10]:
        shutil.copy(path, corpus / path.name)
    loggers = [L.pytorch.loggers.CSVLogger(tmp_path, name="csv"), L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb")]
    monitor = TokenThroughputMonitor(log_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=loggers, callbacks=[monitor], log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False,
    )
    data = TextDataModule(str(corpus), seq_len=32, batch_size=2, val_fraction=0, cache_dir=str(tmp_path / "cache"))
    trainer.fit(LlamaLightningModule("debug", warmup_steps=1), datamodule=data)

    assert monitor.last["tokens_per_step"] == 64
    assert monitor.last["perf/tokens_per_sec"] > 0 and monitor.last["perf/tflops_per_device"] > 0
    assert "perf/mfu_percent" not in monitor.last  # no known peak on CPU
    assert syncs == []  # nothing to wait for on CPU
    with open(loggers[0].log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("perf/tokens_per_sec")]
    assert len(logged) == 2 and all(float(r["perf/peak_memory_gib"]) > 0 for r in logged)  # steps 2-6, window 2
    # TensorBoard event files are protobuf records that carry each scalar's tag as plain bytes.
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events and any(b"perf/tokens_per_sec" in e.read_bytes() for e in events)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the CPU peak can be reset on Linux only")
def test_cpu_peak_memory_counts_from_the_last_reset():
    cpu = torch.device("cpu")
    block = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB, touched
    before = peak_memory_gib(cpu)
    del block
    reset_peak_memory(cpu)
    after = peak_memory_gib(cpu)
    assert before - after > 0.2  # the freed 256 MiB no longer counts


def test_the_old_name_is_a_deprecated_alias_not_lightning_s_class():
    import lightning.pytorch.callbacks

    import lightning_2d

    assert "ThroughputMonitor" not in lightning_2d.__all__  # `import *` no longer shadows Lightning's
    with pytest.warns(DeprecationWarning, match="renamed TokenThroughputMonitor"):
        from lightning_2d import ThroughputMonitor
    assert ThroughputMonitor is TokenThroughputMonitor
    assert ThroughputMonitor is not lightning.pytorch.callbacks.ThroughputMonitor
