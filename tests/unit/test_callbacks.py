"""Throughput/MFU arithmetic, and the monitor's metrics reaching CSV and TensorBoard loggers."""

from __future__ import annotations

import csv
import shutil

import lightning as L
import pytest
import torch

from lightning_2d import LlamaLightningModule, ModelArgs, TextDataModule, ThroughputMonitor
from lightning_2d.callbacks import PEAK_BF16_TFLOPS, peak_bf16_tflops
from lightning_2d.data import stdlib_sources


def test_flops_per_token_follows_torchtitan():
    args = ModelArgs.from_name("llama3-8b")
    non_embedding = args.num_params() - args.vocab_size * args.dim
    assert args.flops_per_token(8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    # 6 × 7.5 B (every parameter but the embedding lookup; the output projection counts) + 12.9
    # GFLOP of attention: ~5.8e10 FLOPs per token at 8k context.
    assert args.flops_per_token(8192) == pytest.approx(5.79e10, rel=0.01)


def test_peak_table_and_cpu_has_no_mfu():
    names = [name for name, _ in PEAK_BF16_TFLOPS]
    for gpu in ("A100", "H100", "H200", "B200"):
        assert gpu in names
    # More specific names come first, so an "H100 PCIe" is not taken for an SXM H100.
    assert names.index("H100 PCIe") < names.index("H100") and names.index("GB200") < names.index("B200")
    assert peak_bf16_tflops(torch.device("cpu")) is None


def test_monitor_logs_to_csv_and_tensorboard(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in stdlib_sources()[:10]:
        shutil.copy(path, corpus / path.name)
    loggers = [L.pytorch.loggers.CSVLogger(tmp_path, name="csv"), L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb")]
    monitor = ThroughputMonitor(log_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=loggers, callbacks=[monitor], log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False,
    )
    data = TextDataModule(str(corpus), seq_len=32, batch_size=2, val_fraction=0, cache_dir=str(tmp_path / "cache"))
    trainer.fit(LlamaLightningModule("debug", warmup_steps=1), datamodule=data)

    assert monitor.last["tokens_per_step"] == 64
    assert monitor.last["perf/tokens_per_sec"] > 0 and monitor.last["perf/tflops_per_device"] > 0
    assert "perf/mfu_percent" not in monitor.last  # no known peak on CPU
    with open(loggers[0].log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("perf/tokens_per_sec")]
    assert len(logged) == 2 and all(float(r["perf/peak_memory_gib"]) > 0 for r in logged)  # steps 2-6, window 2
    # TensorBoard event files are protobuf records that carry each scalar's tag as plain bytes.
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events and any(b"perf/tokens_per_sec" in e.read_bytes() for e in events)
