"""Save and load time of sharded checkpoints with and without digests (run by hand, not collected by pytest).

    OMP_NUM_THREADS=1 python tests/benchmarks/bench_checkpoint_digest.py [--gb 1.0] [--repeats 3]

Two states, each saved through ``ShardedCheckpointWriter`` (one process, DCP without a process group):

* ``debug``: the debug model's state (``LlamaLightningModule("debug")``: weights and AdamW's two moments), as a
  single process would save the 2x2 debug checkpoint (the same tensors, one shard file instead of four);
* ``synthetic``: fp32 tensors of 64 MiB each, ``--gb`` in all (default 1 GiB).

Without digests is DCP's own ``FileSystemWriter`` (what the writer used before digests); with digests, ours.
Load is ``dcp.load`` into preallocated tensors; "with digests" adds the check a load does first
(``digest_problems``: every item re-read and hashed). Each variant runs side by side in one process, repeated;
medians are printed as a Markdown table, with the added save time ratio, in wall time and in this process's CPU
time (less disturbed by other jobs on a shared machine).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def debug_state() -> dict[str, Any]:
    from lightning_2d import LlamaLightningModule

    module = LlamaLightningModule("debug")
    module.configure_model()
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    moments = {f"{k}.{m}": torch.randn_like(v) for k, v in weights.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"state_dict": weights, "optimizer_0": moments}


def synthetic_state(gb: float) -> dict[str, Any]:
    n = max(1, round(gb * 1024**3 / (64 * 1024**2)))
    generator = torch.Generator().manual_seed(0)
    return {"state_dict": {f"w{i}": torch.randn(16 * 1024**2, generator=generator) for i in range(n)}}


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for part in state.values() for t in part.values())


def save(state: dict[str, Any], path: Path, digests: bool) -> tuple[float, float]:
    """``ShardedCheckpointWriter.save``; without digests, with DCP's own ``FileSystemWriter`` in place of ours."""
    from torch.distributed.checkpoint import FileSystemWriter

    import lightning_2d.checkpoint.writer as module  # where the writer looks digesting_writer up
    from lightning_2d.checkpoint.writer import ShardedCheckpointWriter

    original = module.digesting_writer
    if not digests:
        module.digesting_writer = lambda folder, whole_files=None: FileSystemWriter(str(folder))
    try:
        start, cpu = time.perf_counter(), time.process_time()
        ShardedCheckpointWriter(0, lambda: None).save(state, {"global_step": 1}, path)
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        module.digesting_writer = original


def load(state: dict[str, Any], path: Path, digests: bool) -> float:
    import torch.distributed.checkpoint as dcp

    from lightning_2d.checkpoint.integrity import Integrity

    target = {key: {k: torch.empty_like(v) for k, v in part.items()} for key, part in state.items()}
    start = time.perf_counter()
    if digests:
        assert Integrity().digest_problems(path) == []
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the synthetic state (GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # "torch.distributed is disabled": one process on purpose
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_digest_"))
    rows = []
    for name, state in (("debug model + AdamW", debug_state()), ("synthetic fp32", synthetic_state(args.gb))):
        times: dict[tuple[str, bool], list[float]] = {}
        for repeat in range(args.repeats):
            for digests in (False, True):  # side by side, alternating
                path = root / f"{'with' if digests else 'without'}-{repeat}"
                wall, cpu = save(state, path, digests)
                times.setdefault(("save", digests), []).append(wall)
                times.setdefault(("save cpu", digests), []).append(cpu)
                times.setdefault(("load", digests), []).append(load(state, path, digests))
                shutil.rmtree(path)
        med = {key: statistics.median(value) for key, value in times.items()}
        rows.append((name, nbytes(state), med))
    print("| state | size | save without | save with | added save | save CPU without | save CPU with | added CPU"
          " | load without | check + load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, size, med in rows:
        added = med[("save", True)] / med[("save", False)] - 1
        added_cpu = med[("save cpu", True)] / med[("save cpu", False)] - 1
        print(f"| {name} | {size / 1024**2:,.0f} MiB | {med[('save', False)]:.3f} s | {med[('save', True)]:.3f} s"
              f" | {added:+.1%} | {med[('save cpu', False)]:.3f} s | {med[('save cpu', True)]:.3f} s"
              f" | {added_cpu:+.1%} | {med[('load', False)]:.3f} s | {med[('load', True)]:.3f} s |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
