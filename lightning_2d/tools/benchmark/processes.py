"""Where the variants run: each round of each variant as a fresh set of local processes (``run_spawned``,
``run_job``; one rank is ``worker_main``), or, started by torchrun/SLURM, one after the other in the
processes of the launch (``run_in_place``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_2d.tools import launch  # launch.launch_processes looked up per job: tests stand in for it
from lightning_2d.tools.benchmark.settings import BenchmarkSettings
from lightning_2d.tools.benchmark.variants import process_rank, run_variant


class BenchmarkJobError(RuntimeError):
    """A rank of a benchmark job failed or the job ran out of time."""


def started_by_launcher() -> bool:
    """Whether torchrun/SLURM (or anyone) already started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _child_env(settings: BenchmarkSettings) -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[3])  # lightning_2d/tools/benchmark/processes.py
    env = {"PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    if settings.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N processes each running as many threads as cores would oversubscribe.
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_job(variant: str, settings: BenchmarkSettings, settings_path: Path, job_dir: Path) -> list[dict[str, Any]]:
    """Start ``settings.world_size`` local processes running ``variant``; each rank's result, by rank."""
    argv = [sys.executable, "-m", "lightning_2d.tools.benchmark", "--worker", variant,
            "--settings", str(settings_path), "--out", str(job_dir)]
    job = launch.launch_processes(
        argv, job_dir, nprocs=settings.world_size, num_nodes=settings.num_nodes, timeout=settings.timeout,
        env=_child_env(settings),
    )
    if not job.ok:
        failed = job.failed_rank()
        what = f"rank {failed} failed" if failed is not None else f"timed out after {settings.timeout:.0f}s"
        ranks = [failed] if failed is not None else None
        raise BenchmarkJobError(f"benchmark variant {variant!r}: {what}\n{job.describe(ranks, tail=4000)}")
    return [job.rank_output(rank) for rank in range(settings.world_size)]


def run_spawned(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every round of every variant as its own local job; the runs in the order they ran."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="lightning-2d-benchmark-") as tmp:
        settings_path = Path(tmp) / "settings.json"
        settings_path.write_text(settings.to_json())
        for round_ in range(settings.rounds):
            for variant in settings.variants:
                log(f"[benchmark] round {round_ + 1}/{settings.rounds}: {variant} on {settings.world_size} processes")
                ranks = run_job(variant, settings, settings_path, Path(tmp) / f"round{round_}-{variant}")
                runs.append({"variant": variant, "round": round_, "ranks": ranks})
    return runs


def run_in_place(settings: BenchmarkSettings) -> Optional[list[dict[str, Any]]]:
    """Run every round of every variant in this process (one rank of an external launch).

    Returns the runs (all ranks' results) on rank 0, ``None`` elsewhere. Peak memory counts from each
    run's first step (on CPU where Linux lets the resident peak be reset; elsewhere the process's
    peak so far).
    """
    import torch.distributed as dist

    mine = []
    for round_ in range(settings.rounds):
        for variant in settings.variants:
            if process_rank() == 0:
                print(f"[benchmark] round {round_ + 1}/{settings.rounds}: {variant} (in place)", flush=True)
            mine.append({"variant": variant, "round": round_, "result": run_variant(variant, settings)})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    return [
        {"variant": run["variant"], "round": run["round"], "ranks": [ranks[i]["result"] for ranks in gathered]}
        for i, run in enumerate(mine)
    ]


def worker_main(variant: str, settings_path: Path, out_dir: Path) -> None:
    """One rank of a job started by ``run_job``: run ``variant``, write ``out_dir/rank{RANK}.json``."""
    settings = BenchmarkSettings.from_json(settings_path.read_text())
    result = run_variant(variant, settings)
    (out_dir / f"rank{process_rank()}.json").write_text(json.dumps(result))
