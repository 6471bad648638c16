"""How much step time async checkpointing hides: sync, async and no saves side by side in one run.

    .venv/bin/python tests/benchmarks/bench_async_checkpoint.py [--steps 24] [--every 4]

Runs three 4-process (2, 2) jobs on CPU/gloo in turn, with a model large enough that a save takes
a noticeable time, and prints the mean step time of each and the fraction of the synchronous
save's cost that the async save removes from the training loop. Not a test: timings are noisy on
shared machines; compare the three numbers of one run, never absolute values across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launcher import launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    overrides = {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 256}
    base = {"dp": 2, "tp": 2, "steps": args.steps, "every": args.every, "seq_len": 128, "batch_size": 2,
            "model_overrides": overrides}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "sync", "async"):
            job = launch("bench_checkpoint", {**base, "mode": mode}, Path(tmp) / mode, nprocs=4, timeout=1200)
            if not job.ok:
                raise SystemExit(job.describe())
            times = json.loads((Path(tmp) / mode / "rank0.json").read_text())["step_times"][1:]  # skip warm-up
            results[mode] = statistics.mean(times)
            size = sum(f.stat().st_size for f in (Path(tmp) / mode).rglob("*.distcp"))
            print(f"{mode:>5}: mean step {results[mode] * 1e3:7.1f} ms over {len(times)} steps"
                  + (f", {size / 2**20:.0f} MiB of shards written" if size else ""))
    cost_sync = results["sync"] - results["none"]
    cost_async = results["async"] - results["none"]
    print(f"save cost per step: sync {cost_sync * 1e3:.1f} ms, async {cost_async * 1e3:.1f} ms;"
          f" async hides {100 * (1 - cost_async / cost_sync):.0f}% of it" if cost_sync > 0 else "no measurable save cost")


if __name__ == "__main__":
    main()
