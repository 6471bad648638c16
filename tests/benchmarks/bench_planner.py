"""The planner against measurements, by hand (not collected by pytest).

    .venv/bin/python tests/benchmarks/bench_planner.py            # CPU peaks vs estimates, preset timings
    .venv/bin/python tests/benchmarks/bench_planner.py --quick    # fewer shapes

For each shape × precision × activation-checkpointing mode, one training step of a small Llama runs in a
fresh subprocess (the measurement of ``tests/unit/test_planner.py``: resident-memory peak of the step
minus what was resident before it, glibc returning every freed allocation above 64 KiB), next to
``plan_run``'s activation estimate for the same shape on one device. Then the planner's own wall time
for the presets' layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.tools.planner import GIB, plan_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from tests.unit.test_planner import MEASURE  # noqa: E402  (one measurement for the test and this script)

SHAPES = {
    "dim256-L3-seq1024-b2": dict(dim=256, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=512, multiple_of=256),
    "dim512-L2-seq1024-b2-vocab8k": dict(
        dim=512, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=8192, multiple_of=256
    ),
}
PRESET_LAYOUTS = [("llama3-8b", 1, {}), ("llama3-70b", 4, {"activation_checkpointing": "full"}),
                  ("llama3-405b", 64, {"activation_checkpointing": "full"})]


def measure(model: dict, dtype: str, modes: list[str], batch: int, seq_len: int) -> dict[str, float]:
    spec = {"model": {**model, "max_seq_len": seq_len}, "batch": batch, "seq_len": seq_len, "modes": modes,
            "dtype": dtype}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE, json.dumps([("activations", spec)])], capture_output=True,
                            text=True, env=env, cwd=REPO, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, fp32 only")
    args = parser.parse_args()
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    modes = ["none", "full", "selective"]
    batch, seq_len = 2, 1024
    print(f"{'shape':32} {'dtype':9} {'AC':10} {'measured MiB':>13} {'estimate MiB':>13} {'error':>7}")
    for name, model in shapes.items():
        for dtype in dtypes:
            peaks = measure(model, dtype, modes, batch, seq_len)
            for mode in modes:
                report = plan_run(
                    "debug", num_nodes=1, devices=1, precision="32-true" if dtype == "float32" else "bf16-true",
                    seq_len=seq_len, micro_batch_size=batch, model_overrides={**model, "max_seq_len": seq_len},
                    config=ParallelConfig(activation_checkpointing=mode),
                )
                est = report.activation_bytes
                print(f"{name:32} {dtype:9} {mode:10} {peaks[mode] / 2**20:13.1f} {est / 2**20:13.1f}"
                      f" {100 * (est - peaks[mode]) / peaks[mode]:+6.1f}%", flush=True)
    print()
    for preset, nodes, options in PRESET_LAYOUTS:
        start = time.perf_counter()
        report = plan_run(preset, num_nodes=nodes, devices=8, seq_len=8192,
                          config=ParallelConfig(tensor_parallel_size=8, **options))
        print(f"{preset} on {nodes}x8 (tp 8{', AC full' if options else ''}): {report.total_bytes / GIB:.2f} GiB,"
              f" {report.verdict}; planned in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
