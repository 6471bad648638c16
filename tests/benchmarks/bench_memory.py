"""Peak memory per device during training, side by side: this checkout's variants and another checkout.

    .venv/bin/python tests/benchmarks/bench_memory.py [--before PATH] [--steps 6]

Each variant is a 4-process (dp, tp) = (2, 2) CPU job at the reference 2D example's shape (dim 256,
2 layers, 16 heads, vocab 32000, seq 256, global batch 8, fp32). A rank's peak is its peak resident
memory *during training*: the kernel's high-water mark (``VmHWM``) is reset when training starts
(``/proc/self/clear_refs``), so what setup allocated and freed does not count; the figures printed
are the largest over the ranks of that peak and of what training adds to the memory resident when
it starts (libraries, model shards), with the median step time. ``--before PATH`` also runs the default
configuration against the ``lightning_2d`` of another checkout (e.g. ``git worktree add /tmp/before
HEAD~3``), so a change can be measured before and after in one run. Not a test: the numbers depend
on the machine; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SHAPE = {"dim": 256, "n_layers": 2, "n_heads": 16, "vocab_size": 32000}
SEQ_LEN, GLOBAL_BATCH, DP, TP = 256, 8, 2, 2
#: name -> (LlamaLightningModule options, ModelParallel2DStrategy options)
VARIANTS = {
    "defaults (fused loss)": ({}, {}),
    "logits + F.cross_entropy": ({"fused_loss": False}, {}),
    "logits + loss_parallel": ({"fused_loss": False}, {"loss_parallel": True}),
}


def _status_gib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 2**20


def worker(config_path: str) -> None:
    """One rank; uses only APIs that older checkouts have too (the code measured may be one)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy

    cfg = json.loads(Path(config_path).read_text())

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0
            self.resident_at_start = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak: count training only
            self.resident_at_start = _status_gib("VmRSS")  # libraries, model shards, optimizer (lazy)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start)

    accepted = inspect.signature(LlamaLightningModule).parameters
    module_options = {k: v for k, v in cfg["module"].items() if k in accepted}
    if module_options != cfg["module"]:
        raise SystemExit(f"this checkout's LlamaLightningModule lacks {set(cfg['module']) - set(module_options)}")
    L.seed_everything(0, verbose=False)
    module = LlamaLightningModule("debug", model_overrides={**SHAPE, "max_seq_len": SEQ_LEN}, warmup_steps=2,
                                  **module_options)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (GLOBAL_BATCH * cfg["steps"], SEQ_LEN + 1), generator=g)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu", devices=DP * TP, max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
        strategy=ModelParallel2DStrategy(data_parallel_size=DP, tensor_parallel_size=TP, **cfg["strategy"]),
    )
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // DP))
    import lightning_2d

    result = {"peak_gib": _status_gib("VmHWM"), "start_gib": probe.resident_at_start, "step_times": probe.times[1:],
              "lightning_2d": lightning_2d.__file__}
    Path(cfg["out_dir"], f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run_variant(name: str, module: dict, strategy: dict, steps: int, code: Path, root: Path) -> dict:
    from lightning_2d.tools.launch import launch_processes

    out_dir = root / re.sub(r"\W+", "_", name)
    out_dir.mkdir(parents=True)
    config = out_dir / "config.json"
    config.write_text(json.dumps({"module": module, "strategy": strategy, "steps": steps, "out_dir": str(out_dir)}))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = launch_processes([sys.executable, __file__, "--worker", str(config)], out_dir, nprocs=DP * TP, env=env,
                           timeout=900)
    if not job.ok:
        raise SystemExit(f"{name} failed:\n{job.describe(tail=2000)}")
    ranks = [job.rank_output(r) for r in range(DP * TP)]
    assert all(Path(r["lightning_2d"]).resolve().is_relative_to(code.resolve()) for r in ranks), "wrong code measured"
    return {
        "peak_gib": max(r["peak_gib"] for r in ranks),
        "added_gib": max(r["peak_gib"] - r["start_gib"] for r in ranks),
        "step_s": statistics.median(t for r in ranks for t in r["step_times"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout whose lightning_2d runs the defaults too")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    sys.path.insert(0, str(REPO))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(name, module, strategy, REPO) for name, (module, strategy) in VARIANTS.items()]
        if args.before:
            runs.insert(0, ("before: defaults", {}, {}, args.before))
        for name, module, strategy, code in runs:
            result = run_variant(name, module, strategy, args.steps, code, Path(tmp))
            rows.append((name, result))
            print(f"{name:<28} peak {result['peak_gib']:.3f} GiB/device (training adds {result['added_gib']:.3f})"
                  f"   step {result['step_s']:.2f} s", flush=True)
    base, base_added = rows[0][1]["peak_gib"], rows[0][1]["added_gib"]
    print(f"\nshape {SHAPE}, seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, (dp, tp) = ({DP}, {TP}), fp32")
    for name, result in rows:
        print(f"{name:<28} peak {result['peak_gib'] / base:.2f}x, added by training"
              f" {result['added_gib'] / base_added:.2f}x of {rows[0][0]!r}")


if __name__ == "__main__":
    main()
