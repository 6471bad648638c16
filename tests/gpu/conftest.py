"""The GPU lane's machinery: skipping without CUDA, the text corpus, job launches and the report.

Jobs are launched with ``lightning_2d.tools.launch.launch_processes`` (what ``tests/distributed/launcher.py``
uses: plain processes with the environment a cluster launcher sets, the whole job killed when a rank
fails or time runs out) running ``tests/gpu/worker.py``. Each job is launched once per
session and cached, so several tests read one launch. Every test adds the numbers it judged to a
report (``$LIGHTNING_2D_GPU_REPORT``, default ``<pytest basetemp>/report.json``), which
``tests/gpu/summary.py`` prints as a table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.lane import PARENT_PID_ENV, REPORT_ENV, SKIP_REASON, Lane, current_lane
from tests.gpu.record import COMMIT_ENV

GPU_TESTS = Path(__file__).resolve().parent
REPO = GPU_TESTS.parents[1]
WORKER = GPU_TESTS / "worker.py"
#: Bytes of real text (Python standard library sources) for every job: ~7,800 windows of 256
#: tokens for the parity runs, ~1,000 of 2,048 for the throughput run.
CORPUS_BYTES = 2_000_000


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test of this directory, with the reason, when there is no lane to run."""
    if current_lane() is not None:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if GPU_TESTS in Path(item.path).resolve().parents:
            item.add_marker(skip)


def worst_relative_error(losses: list[float], reference: list[float]) -> float:
    """Largest ``|a - b| / |b|`` over the steps; the two curves must have the same length."""
    if len(losses) != len(reference) or not reference:
        raise AssertionError(f"loss curves of different lengths: {len(losses)} vs {len(reference)}")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


class Report:
    """What the lane measured and judged, rewritten as JSON after every entry (so a run killed by
    ``run.sh``'s time limit still leaves what it measured).

    Args:
        lane: The mode and process count, recorded at the top.
        path: The JSON file.
    """

    def __init__(self, lane: Lane, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            # The commit run.sh ran on (git's, or the one the session passed), so a report read alone says it too.
            "lane": {"mode": lane.mode, "nprocs": lane.nprocs, "commit": os.environ.get(COMMIT_ENV)},
            "jobs": {},
            "checks": {},
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2))

    def job(self, name: str, **entry: Any) -> None:
        """Record a job's wall time and outcome."""
        self.data["jobs"][name] = entry
        self.save()

    def check(self, name: str, value: Any, bound: Any = None, **extra: Any) -> None:
        """Record one judged number (``value`` against ``bound``) or measurement (no bound)."""
        self.data["checks"][name] = {"value": value, "bound": bound, **extra}
        self.save()
        shown = f"{value:.3e}" if isinstance(value, float) else value
        print(f"[gpu-lane] {name}: {shown}" + (f" (bound {bound})" if bound is not None else ""))


class Runs(dict):
    """A job's results: run name → list of per-rank result dicts (index = global rank)."""

    def rank0(self, run: str) -> dict[str, Any]:
        return self[run][0]

    def losses(self, run: str) -> list[float]:
        return self[run][0]["losses"]


class GpuJobs:
    """Launches worker jobs (once each per session) with runs derived from the lane's sizes.

    Args:
        root: Folder of the jobs' outputs (per-rank logs and JSON, checkpoints).
        lane: The sizes and mode.
        corpus: The text file every run trains on.
        report: Where job wall times are recorded.
    """

    def __init__(self, root: Path, lane: Lane, corpus: Path, report: Report) -> None:
        self.root, self.lane, self.corpus, self.report = root, lane, corpus, report
        self._cache: dict[str, Any] = {}

    def make_run(self, name: str, strategy: str = "2d", **overrides: Any) -> dict[str, Any]:
        """A run of the parity model on the lane's sizes; ``overrides`` replace any field."""
        lane = self.lane
        run = {
            "name": name,
            "strategy": strategy,
            "dp": 1,
            "tp": lane.nprocs,
            "options": {},
            "accelerator": lane.accelerator,
            "precision": "bf16-mixed",
            "model": lane.model,
            "seq_len": lane.seq_len,
            "global_batch": lane.global_batch,
            "steps": lane.steps,
            "lr": lane.lr,
            "warmup_steps": 2,
            # None is the default that must pick the fused AdamW kernel on CUDA; on CPU it picks
            # foreach, so the smoke mode asks for fused to keep every run on the same kernel.
            "fused": None if lane.on_cuda else True,
            "seed": 1234,
            "init_seed": 7,  # layout-independent init: every run starts from the same weights
            "corpus": str(self.corpus),
            "cache_dir": str(self.root / "token_cache"),
            "grad_norms": True,
        }
        run.update(overrides)
        return run

    def run(
        self,
        name: str,
        runs: list[dict[str, Any]],
        nprocs: int,
        timeout: float | None = None,
        deterministic: bool = False,
    ) -> Runs:
        """Launch job ``name`` (or return its cached result); fails the calling test if any rank failed."""
        if name not in self._cache:
            from lightning_2d.tools.launch import launch_processes

            started = time.perf_counter()
            out_dir = self.root / name
            out_dir.mkdir(parents=True, exist_ok=True)
            config_path = out_dir / "config.json"
            config_path.write_text(json.dumps({"runs": runs, "deterministic": deterministic, "out_dir": str(out_dir)}))
            env = {
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                PARENT_PID_ENV: str(os.getpid()),
            }
            if not self.lane.on_cuda:
                env["OMP_NUM_THREADS"] = "1"  # the smoke mode's ranks share a few cores
            result = launch_processes([sys.executable, str(WORKER), "runs", str(config_path)], out_dir,
                                      nprocs=nprocs, timeout=timeout or self.lane.job_timeout, env=env)
            seconds = time.perf_counter() - started
            self.report.job(name, seconds=round(seconds, 1), ok=result.ok, nprocs=nprocs,
                            runs=[r["name"] for r in runs])
            print(f"[gpu-lane] job {name} ({nprocs} process(es), runs {[r['name'] for r in runs]}):"
                  f" {seconds:.1f}s, {'ok' if result.ok else 'FAILED'}")
            self._cache[name] = result
        result = self._cache[name]
        assert result.ok, f"job {name} failed (outputs in {result.out_dir}):\n{result.describe()}"
        outputs = [result.rank_output(rank) for rank in range(nprocs)]
        if "meta" not in self.report.data:
            self.report.data["meta"] = outputs[0]["meta"]
            self.report.save()
        return Runs({run["name"]: [out["runs"][run["name"]] for out in outputs] for run in runs})


def write_corpus(path: Path, max_bytes: int = CORPUS_BYTES) -> Path:
    """Concatenate standard-library sources (UTF-8, non-empty) into one text file of about ``max_bytes``."""
    from lightning_2d.data import stdlib_sources

    pieces, size = [], 0
    for source in stdlib_sources():
        raw = source.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            pieces.append(text)
            size += len(raw)
        if size >= max_bytes:
            break
    path.write_text("\n".join(pieces), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def lane() -> Lane:
    found = current_lane()
    assert found is not None, "collection should have skipped this test"  # see pytest_collection_modifyitems
    return found


@pytest.fixture(scope="session")
def report(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Report]:
    rep = Report(lane, Path(os.environ.get(REPORT_ENV) or tmp_path_factory.getbasetemp() / "report.json"))
    rep.save()
    yield rep
    print(f"\n[gpu-lane] report: {rep.path}")


@pytest.fixture(scope="session")
def gpu_jobs(lane: Lane, report: Report, tmp_path_factory: pytest.TempPathFactory) -> GpuJobs:
    root = tmp_path_factory.mktemp("gpu_jobs")
    return GpuJobs(root, lane, write_corpus(root / "corpus.txt"), report)
