"""The distributed tests' job cache (tests/distributed/conftest.py) without launching anything: a job name
reused for another job is an error, so what a test reads never depends on which test launched first."""

from __future__ import annotations

import pytest

from lightning_2d.tools.launch import JobResult
from tests.distributed.conftest import Jobs


class FakeLauncher:
    def __init__(self, returncodes: list[int]) -> None:
        self.returncodes, self.calls = returncodes, []

    def __call__(self, scenario, config, out_dir, nprocs, num_nodes, kill_on_failure) -> JobResult:
        self.calls.append((scenario, dict(config), nprocs, num_nodes, kill_on_failure))
        return JobResult(list(self.returncodes), [""] * len(self.returncodes), out_dir)


def test_the_same_job_is_launched_once(tmp_path):
    launcher = FakeLauncher([0, 0])
    jobs = Jobs(tmp_path, launcher=launcher)
    first = jobs.run("a", "fit", {"steps": 6, "dp": 2}, nprocs=2)
    again = jobs.run("a", "fit", {"dp": 2, "steps": 6}, nprocs=2)  # key order does not matter
    assert again is first and len(launcher.calls) == 1


@pytest.mark.parametrize("change", [
    {"config": {"steps": 6, "dp": 1}},
    {"scenario": "train"},
    {"nprocs": 4},
    {"num_nodes": 2},
    {"kill_on_failure": False},
])
def test_a_name_reused_for_another_job_is_an_error(tmp_path, change):
    launcher = FakeLauncher([0, 0, 0, 0])
    jobs = Jobs(tmp_path, launcher=launcher)
    call = {"scenario": "fit", "config": {"steps": 6, "dp": 2}, "nprocs": 2, "num_nodes": 1, "kill_on_failure": True}
    jobs.run("a", **call)
    with pytest.raises(AssertionError, match="job name 'a' reused for another job"):
        jobs.run("a", **{**call, **change})
    assert len(launcher.calls) == 1


def test_expect_ok_is_checked_on_every_call(tmp_path):
    jobs = Jobs(tmp_path, launcher=FakeLauncher([0, 1]))
    failed = jobs.run("broken", "fit", {}, nprocs=2, expect_ok=False)
    assert not failed.ok
    with pytest.raises(AssertionError, match="job broken failed"):
        jobs.run("broken", "fit", {}, nprocs=2)  # a later reader that needs it to have succeeded
