"""Shared launches: each multi-process job runs once per session and several tests read its output."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import JobResult, launch

PARITY = {"steps": 6, "global_batch": 4, "seq_len": 32, "init_seed": 7, "seed": 1234}
#: A job's key for the ``debug`` model cut to 2 of its 4 blocks (``worker.model_overrides``): for the jobs whose tests
#: name no block past the second (an option, a precision, a backend's layout), against references of 2 blocks too.
#: A 4-rank fit then issues about a third fewer collectives, each a wait for the 4 ranks sharing 2 cores: 7 fits of
#: test_options.py's launch took 25 s instead of 40. Pipeline schedules, the parity table and the checkpoints that
#: earlier versions resume keep the 4 blocks.
SMALL = {"blocks": 2}


def job_spec(scenario: str, config: dict, nprocs: int, num_nodes: int, kill_on_failure: bool) -> str:
    """Everything a launch depends on, as canonical JSON: two calls reuse one launch only if these match."""
    return json.dumps({"scenario": scenario, "config": config, "nprocs": nprocs, "num_nodes": num_nodes,
                       "kill_on_failure": kill_on_failure}, sort_keys=True)


def shared_timeout(runs: int) -> float:
    """The limit of a launch of ``runs`` fits one after another: the launcher's 300 s for one job, and 60 s more per
    further fit (a 4-rank fit of the parity model takes 10-20 s on 2 free cores), so that a long shared launch on a
    busy machine is not killed for its length alone."""
    return 300.0 + 60.0 * max(0, runs - 1)


class Jobs:
    def __init__(self, root: Path, launcher: Callable[..., JobResult] = launch) -> None:
        self.root = root
        self._launch = launcher
        self._cache: dict[str, tuple[str, JobResult]] = {}

    def run(
        self, name: str, scenario: str, config: dict, nprocs: int = 4, num_nodes: int = 1, expect_ok: bool = True,
        kill_on_failure: bool = True, timeout: float | None = None,
    ) -> JobResult:
        """Launch job ``name`` once per session; a later call with the same name gets the same launch.

        The cache is keyed by the name (the job's folder), so a name reused with another scenario, config,
        size or launcher policy is an error: otherwise a test would read another job's output, depending on
        which test ran first. ``expect_ok`` is checked on every call, not only the launching one. ``timeout``:
        the launch's limit in seconds (``None``: the launcher's default).
        """
        spec = job_spec(scenario, config, nprocs, num_nodes, kill_on_failure)
        if name not in self._cache:
            limit = {} if timeout is None else {"timeout": timeout}
            result = self._launch(scenario, config, self.root / name, nprocs=nprocs, num_nodes=num_nodes,
                                  kill_on_failure=kill_on_failure, **limit)
            self._cache[name] = (spec, result)
        cached_spec, result = self._cache[name]
        assert cached_spec == spec, (
            f"job name {name!r} reused for another job: the cached launch ran\n  {cached_spec}\nbut this call asks"
            f" for\n  {spec}\nGive the second job its own name."
        )
        if expect_ok:
            assert result.ok, f"job {name} failed:\n{result.describe()}"
        return result

    @staticmethod
    def reference_job(**extra) -> tuple[str, dict, int, int]:
        """``(name, config, nprocs, num_nodes)`` of ``reference(**extra)``."""
        name = "reference" + "".join(f"_{k}-{v}" for k, v in sorted(extra.items()))
        return name, {**PARITY, "strategy": "single", **extra}, 1, 1

    @staticmethod
    def layout_job(dp: int, tp: int, nprocs: int | None = None, num_nodes: int = 1, **extra) -> tuple[str, dict, int, int]:
        """``(name, config, nprocs, num_nodes)`` of ``layout(dp, tp, nprocs, num_nodes, **extra)``."""
        name = f"dp{dp}_tp{tp}_nodes{num_nodes}" + "".join(f"_{k}-{v}" for k, v in sorted(extra.items()))
        nprocs = nprocs or dp * tp
        replicas = dp if dp != "auto" else nprocs // (tp if tp != "auto" else nprocs // num_nodes)
        config = {**PARITY, "strategy": "2d", "dp": dp, "tp": tp, "num_nodes": num_nodes, "data_replicas": replicas}
        return name, {**config, **extra}, nprocs, num_nodes

    def reference(self, **extra) -> JobResult:
        """Single-device training with a plain Trainer: what every layout must reproduce."""
        name, config, nprocs, _ = self.reference_job(**extra)
        return self.run(name, "fit", config, nprocs=nprocs)

    def layout(self, dp: int, tp: int, nprocs: int | None = None, num_nodes: int = 1, **extra) -> JobResult:
        """Train under ``ModelParallel2DStrategy(dp, tp, **extra)``; ``dp``/``tp`` may be ``"auto"``."""
        name, config, nprocs, num_nodes = self.layout_job(dp, tp, nprocs, num_nodes, **extra)
        return self.run(name, "fit", config, nprocs=nprocs, num_nodes=num_nodes)

    def share(self, name: str, jobs: list[tuple[str, dict, int, int]], scenario: str = "fit") -> None:
        """Run the single-node ``jobs`` (``reference_job``/``layout_job`` tuples) not run yet, those of one process
        count in one launch (``fits``: one fit after another in the same processes, in the order given; the
        launches in the order each count first appears); each is then cached under its own name, so
        ``reference``/``layout``/``run`` return it as if launched alone. Not for jobs whose outputs depend on what
        ran before them in the process (torch.compile's graph counters). ``scenario``: ``"fit"``, or ``"train"``
        (``trains``: a run may resume from what an earlier one of the launch saved)."""
        pending: dict[int, dict[str, dict]] = {}
        for job, config, nprocs, num_nodes in jobs:
            assert num_nodes == 1, f"{job}: a shared launch is one node"
            if job not in self._cache:
                pending.setdefault(nprocs, {})[job] = config
        for nprocs, runs in pending.items():
            shared = self.run(f"{name}_{nprocs}procs", f"{scenario}s", {"runs": runs}, nprocs=nprocs,
                              timeout=shared_timeout(len(runs)))
            for job, config in runs.items():
                self._cache[job] = (job_spec(scenario, config, nprocs, 1, True),
                                    replace(shared, out_dir=shared.out_dir / job))


    def layouts(self, name: str, runs: dict[str, tuple[int, int, dict]], nprocs: int) -> dict[str, JobResult]:
        """Several ``layout`` runs (``{run: (dp, tp, extra)}``) of ``nprocs`` processes in one launch, one ``fit``
        after another in the same processes: each run's result reads its own folder. What a launch costs on its
        own (forking, the process group's connections) is paid once."""
        configs = {run: {**PARITY, "strategy": "2d", "dp": dp, "tp": tp, "num_nodes": 1, "data_replicas": dp, **extra}
                   for run, (dp, tp, extra) in runs.items()}
        result = self.run(name, "fits", {"runs": configs}, nprocs=nprocs, timeout=shared_timeout(len(configs)))
        return {run: replace(result, out_dir=result.out_dir / run) for run in runs}


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("jobs"))


def load_weights(result: JobResult, which: str) -> dict[str, torch.Tensor]:
    """The full weights a job saved; under pipeline parallelism merged from one file per pipeline rank."""
    path = result.out_dir / f"{which}.pt"
    if path.exists():
        return torch.load(path)
    parts = sorted(result.out_dir.glob(f"{which}_pp*.pt"))
    assert parts, f"no {which}.pt or {which}_pp*.pt in {result.out_dir}"
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        state = torch.load(part)
        assert not merged.keys() & state.keys(), f"two pipeline ranks hold {sorted(merged.keys() & state.keys())[:3]}"
        merged.update(state)
    return merged
