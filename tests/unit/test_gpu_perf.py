"""The GPU performance pass (``tests/gpu/perf.py``, ``bash tests/gpu/run.sh perf``) without a GPU: its budget, the
sweep's walk (every configuration recorded, whatever happens to it), the refusal without CUDA, and the whole pass in
its CPU smoke mode through ``run.sh``: every configuration measured, a best picked and measured again, LoRA and
QLoRA, ``grouped_mm``, the result files with their fields, filed by ``record.py save``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.gpu import budget, perf, record

REPO = Path(__file__).resolve().parents[2]


def test_the_phases_fit_the_deadline_and_none_takes_a_later_ones_time(monkeypatch):
    assert perf.DEADLINE_S <= 480  # one call of the device tool, the machine's start aside
    assert perf.STARTUP_S >= 15  # imports and the corpus before the first phase
    for i, phase in enumerate(perf.PHASES):
        later = sum(p.guaranteed_s for p in perf.PHASES[i + 1:])
        monkeypatch.setattr(perf, "STARTED", perf.time.monotonic() - 400)  # late: only the later guarantees left
        limit = perf.limit_now(phase.name, phase.first_cap_s, perf.DEADLINE_S)
        assert limit <= max(0, perf.DEADLINE_S - perf.RESERVE_S - 400 - later) + 1
        monkeypatch.setattr(perf, "STARTED", perf.time.monotonic())  # early: the cap
        assert perf.limit_now(phase.name, phase.cap_s, perf.DEADLINE_S) == int(phase.cap_s)
    monkeypatch.setattr(perf, "STARTED", perf.time.monotonic() - perf.DEADLINE_S)
    assert perf.limit_now("qlora", 70, perf.DEADLINE_S) == 0  # nothing left: not run, never `limit 0 = no limit`
    assert perf.measured(0, lambda: {})["status"] == "not run"
    assert budget.MIN_PART_S > 0


def test_the_sweep_records_every_configuration_and_walks_from_the_best(monkeypatch):
    """A fake fit: one configuration runs out of memory, one fails, one hangs past its limit; the walk still records
    every planned configuration, each with its status, and the best is the fastest measured one."""
    s = perf.Sizes(mode="cpu-smoke", accelerator="cpu", precision="32-true", model={}, seq_len=4, warmup=1, window=1,
                   best_window=1, compile_ok=False, lora_model={}, lora_micro_batch=1, qlora_micro_batch=1,
                   experts={})

    def fake_fit(s, corpus, cache, name, model, micro, window, options, module):
        if "loss_chunk_size=16384" in name:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        if "compile=simple_fsdp" in name:
            raise RuntimeError("refused (fake)")
        if name.endswith("activation_checkpointing=selective_double_batch"):
            perf.time.sleep(5)  # past its limit
        speed = micro * (2 if options["reshard_after_forward"] == "never" else 1)
        return {"tokens_per_sec": float(speed), "tflops": 0.0, "mfu_percent": None, "peak_memory_gib": None}

    monkeypatch.setattr(perf, "fit", fake_fit)
    monkeypatch.setattr(perf, "limit_now", lambda phase, cap, total: 0.5)
    # The device cleaned after each configuration; counted, not run: its gc.collect() over the whole test session's
    # heap cost ~0.7 s per configuration (7 s of the quick tier).
    cleaned = []
    monkeypatch.setattr(perf, "_clean_device", lambda: cleaned.append(1))
    results = {"configs": []}
    saves = []
    perf.sweep(s, Path("corpus"), Path("cache"), 470, lambda: saves.append(1), results)
    configs = results["configs"]
    assert len(configs) == perf.planned_points() == results["planned"] == 10 == len(saves) == len(cleaned)
    assert len({c["name"] for c in configs}) == len(configs)
    tried = {(c["axis"], c["value"]) for c in configs}
    assert tried == {(perf.AXES[0][0], perf.AXES[0][1][0])} | {(a, v) for a, values in perf.AXES for v in values[1:]}
    status = {c["value"]: c["status"] for c in configs}
    assert status[16384] == "oom" and status["simple_fsdp"] == "failed" and "refused" in configs[6]["error"]
    assert status["selective_double_batch"] == "timeout"
    assert all(c["status"] == "measured" for c in configs if c["value"] not in (16384, "simple_fsdp",
                                                                               "selective_double_batch"))
    # micro-batch 16 won its axis, reshard "never" its own; later points start from them
    assert results["best"] == ("micro_batch=16-loss_chunk_size=1024-compile=blocks-reshard_after_forward=never"
                               "-activation_checkpointing=none")
    assert configs[-1]["point"]["micro_batch"] == 16 and configs[-1]["point"]["reshard_after_forward"] == "never"


def test_lora_flops_count_no_frozen_weight_gradient():
    from lightning_2d import ModelArgs
    from lightning_2d.models.llama.model import PRESETS

    model = asdict(PRESETS["llama3-8b"])
    got = perf.lora_flops_per_token(model, adapters=42_000_000, seq_len=2048)
    n = ModelArgs(**model).num_params(exclude_embedding=True)
    assert got == 4 * n + 6 * 42_000_000 + 12 * 32 * 32 * 128 * 2048
    assert got < ModelArgs(**model).flops_per_token(2048)  # less than full training's 6N


def test_cuda_mode_without_cuda_refuses(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("LIGHTNING_2D_GPU_LANE_ON_CPU", raising=False)
    assert perf.main(["--out", str(tmp_path)]) == perf.REFUSAL_EXIT
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "LIGHTNING_2D_GPU_LANE_ON_CPU=1" in err
    assert not (tmp_path / "perf.json").exists()


@pytest.mark.distributed  # launches the GPU lane's perf job (run.sh perf: 14 fits in a process of its own)
def test_the_cpu_smoke_pass_runs_every_configuration_and_files_its_results(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "LIGHTNING_2D_GPU_LANE_ON_CPU": "1", "PYTHON": sys.executable, "OUT": str(out),
           "LIGHTNING_2D_GPU_WORK": str(work), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "tests/gpu/run.sh", "perf"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["perf.json", "perf.log", "perf.md"]  # no corpus, no caches
    m = json.loads((out / "perf.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert m["kind"] == "perf" and m["mode"] == "cpu-smoke" and m["commit"] == head
    assert m["environment"]["torch"] == torch.__version__ and "device_name" in m["environment"]
    assert set(m["phases"]) == {p.name for p in perf.PHASES} and m["finished_at"]
    assert m["total_seconds"] < m["budget"]["deadline_s"]

    configs = m["sweep"]["configs"]
    assert len(configs) == m["sweep"]["planned"] == perf.planned_points()
    bad = [(c["name"], c["status"], c.get("error")) for c in configs if c["status"] != "measured"]
    assert not bad, bad
    for c in configs:
        assert c["tokens_per_sec"] > 0 and c["seconds"] <= c["limit_s"]
        assert {"commit", "torch", "device_name", "mfu_percent", "peak_memory_gib", "losses"} <= set(c)
    fastest = max(configs, key=lambda c: c["tokens_per_sec"])
    assert m["sweep"]["best"] == fastest["name"]
    best = m["best"]
    assert best["status"] == "measured" and best["name"] == fastest["name"]
    assert best["window_steps"] == m["sizes"]["best_window"] and best["commit"] == head

    for kind, nf4 in (("lora", False), ("qlora", True)):
        r = m[kind]["result"]
        assert r is not None, m[kind]
        assert r["status"] == "measured" and r["adapters"] > 0 and r["frozen"] > r["adapters"]
        assert (r["nf4_weights"] > 0) == nf4
        assert r["flops_per_token"] == perf.lora_flops_per_token(m["sizes"]["lora_model"], r["adapters"],
                                                                 m["sizes"]["seq_len"])
        assert {"tokens_per_sec", "mfu_percent", "peak_memory_gib", "flop_formula", "commit", "torch"} <= set(r)
    g = m["grouped_mm"]
    assert g["status"] == "measured" and g["grouped_ms"] > 0 and g["loop_ms"] > 0 and g["layout"]["num_experts"] == 8

    text = (out / "perf.md").read_text()
    assert "**best, re-measured**" in text and text.count("| measured |") == len(configs) + 3
    assert "grouped_mm (8 experts" in text

    filed = record.save(out, results=tmp_path / "results")
    assert filed.name.endswith(f"_{head[:10]}_perf")
    assert sorted(p.name for p in filed.iterdir()) == ["perf.json", "perf.md"]
    assert json.loads((filed / "perf.json").read_text())["filed"]["same_sources_as_working_tree"] in (True, False)
