"""The pipeline bubble, measured: the idle fraction of each schedule on CPU/gloo.

    .venv/bin/python tests/benchmarks/bench_pipeline.py [--stages 2] [--microbatches 2 4 8] [--steps 6] [--plot PNG]

For each schedule (GPipe, 1F1B, and with 2 stages per rank Interleaved1F1B and the zero-bubble
InterleavedZeroBubble, ZBVZeroBubble and DualPipeV) and micro-batch count the library accepts, starts
``--stages`` processes (one core each: ``OMP_NUM_THREADS=1``; keep ``--stages`` at most the number of
cores, or waiting ranks compete with computing ones), builds a Llama with the library's own
``parallelize_model`` (the stages, FSDP2 over a 1-rank data-parallel mesh) and runs training steps
through ``Pipeline.train_step``, the path both strategies take. Each rank times its stages' forward and
backward calls, the zero-bubble schedules' separate weight passes included (``Pipeline.measure``), and the whole
step; the idle fraction is
``1 - busy / step time``, averaged over ranks and over the steps after the first. Printed next to
the textbook bubble ``(p - 1) / (v·m + p - 1)`` (``p`` pipeline ranks, ``m`` micro-batches, ``v``
stages per rank; ~0 for the zero-bubble schedules, their ideal). What is not compute in the measured figure: the bubble, point-to-point transfers
(a copy through loopback here) and the schedule's own Python. ``--plot PNG`` draws the last step of each run: a row
per rank, its forward, backward (and weight-gradient) passes on the idle time (``Pipeline.actions``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: Big enough that a micro-batch's compute (not the schedule's Python) dominates on one core.
MODEL = {"dim": 256, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 2048, "multiple_of": 64,
         "max_seq_len": 512}
SEQ_LEN, MICRO_BATCH = 128, 1
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def rank_main(schedule: str, microbatches: int, steps: int, out: Path) -> None:
    import torch.distributed as dist

    from lightning_2d.parallel import ParallelConfig, ParallelDims
    from tests.benchmarks.ranks import parallel_llama

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    config = ParallelConfig(
        data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=world, pipeline_schedule=schedule,
        pipeline_microbatches=microbatches,
    ).resolve_dtypes("32-true")
    parallelized = parallel_llama(MODEL, config, ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=world))
    model, pipeline = parallelized.model, parallelized.pipeline
    args = model.args
    pipeline.measure = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (microbatches * MICRO_BATCH, SEQ_LEN), generator=g)
    labels = torch.randint(0, args.vocab_size, tokens.shape, generator=g)
    busy, wall = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pipeline.train_step(tokens, labels)
        end = time.perf_counter()
        wall.append(end - start)
        busy.append(pipeline.busy_s)
        optimizer.step()
        optimizer.zero_grad()
    from tests.benchmarks.ranks import write_rank

    # The last step's timeline: perf_counter is the host's monotonic clock, shared by the ranks' processes.
    timeline = {"step_start": start, "step_end": end, "actions": pipeline.actions}
    write_rank(out, rank, {"busy": busy, "wall": wall, "timeline": timeline})
    dist.destroy_process_group()


def measure(stages: int, schedule: str, microbatches: int, steps: int) -> dict[str, Any]:
    """The idle fraction (mean over ranks and steps after the first), the median step time and the last step's
    timeline of every rank (``lightning_2d.tools.plots.plot_pipeline``'s run)."""
    from tests.benchmarks.ranks import run_ranks

    ranks = run_ranks(__file__, [schedule, str(microbatches), str(steps)], nprocs=stages, env={"OMP_NUM_THREADS": "1"})
    idle = [1 - b / w for r in ranks for b, w in zip(r["busy"][1:], r["wall"][1:])]
    step = statistics.median(max(r["wall"][i] for r in ranks) for i in range(1, steps))
    timeline = {"schedule": schedule, "microbatches": microbatches, "ranks": [r["timeline"] for r in ranks]}
    return {"idle": statistics.mean(idle), "step_s": step, "timeline": timeline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="draw each rank's forward, backward and idle time in the last step, a panel per schedule"
                        " and micro-batch count (needs the plot extra: pip install 'lightning-2d[plot]')")
    parser.add_argument("--rank-main", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.rank_main:
        schedule, microbatches, steps, out = options.rank_main
        rank_main(schedule, int(microbatches), int(steps), Path(out))
        return
    p = options.stages
    print(f"{p} pipeline ranks, {MODEL['n_layers']} blocks of dim {MODEL['dim']}, {SEQ_LEN} tokens per micro-batch,"
          f" CPU/gloo, one thread per rank")
    print(f"{'schedule':<22} {'m':>3} {'measured idle':>14} {'textbook':>9} {'step':>9}")
    from lightning_2d.parallel import ParallelConfig, ParallelConfigError
    from lightning_2d.parallel.config import ZERO_BUBBLE_SCHEDULES

    timelines = []
    for microbatches in options.microbatches:
        for schedule in SCHEDULES:
            try:  # the library's own rules for the micro-batch count
                v = ParallelConfig(pipeline_parallel_size=p, pipeline_schedule=schedule,
                                   pipeline_microbatches=microbatches).stages_per_rank
            except ParallelConfigError:
                continue
            figures = measure(p, schedule, microbatches, options.steps)
            # The zero-bubble schedules' ideal is no bubble, when a forward, an input and a weight pass take equal time.
            textbook = "~0" if schedule in ZERO_BUBBLE_SCHEDULES else f"{(p - 1) / (v * microbatches + p - 1):.1%}"
            print(f"{schedule:<22} {microbatches:>3} {figures['idle']:>13.1%} {textbook:>9}"
                  f" {figures['step_s'] * 1e3:>7.0f} ms", flush=True)
            timelines.append(figures["timeline"])
    if options.plot:
        from lightning_2d.tools.plots import plot_pipeline

        title = (f"One measured step per schedule (the last of {options.steps}): {p} pipeline ranks on CPU/gloo,"
                 f" {MODEL['n_layers']} blocks of width {MODEL['dim']}, {SEQ_LEN}-token micro-batches")
        print(plot_pipeline(timelines, options.plot, title=title))


if __name__ == "__main__":
    main()
