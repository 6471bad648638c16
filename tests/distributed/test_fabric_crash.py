"""Fabric crash safety: a rank killed in the middle of ``fabric.save`` loses only that save.

A 2-process Fabric job (``recipes/fabric_pretrain.py``'s loop, (dp, tp) = (2, 1), CPU/gloo) saves
``step-000001/`` and ``step-000002/``; while it writes ``step-000003/`` rank 1 is SIGKILLed after
the first bytes of its shard, and the launcher kills the rest. A second job started with
``--resume latest`` skips ``step-000003/`` (incomplete) naming it, loads ``step-000002/``, restores
the weights saved at step 2 and trains on exactly as the first job did. Two launches, their ranks forked from the
fork server (``worker.py``'s ``fabric_crash`` scenario): ~20 s on 2 free cores.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from lightning_2d.checkpoint.discovery import is_complete
from lightning_2d.data import stdlib_sources
from lightning_2d.tools.launch import JobResult
from tests.distributed.launcher import launch

pytestmark = pytest.mark.distributed

MAX_STEPS = 4  # the LR schedule spans 4 steps in both jobs


def run_job(name: str, root: Path, **config: object) -> JobResult:
    """Launch ``fabric_crash_worker.py``'s ``main`` on 2 processes with a cluster launcher's environment (forked
    from the fork server, as every job's ranks: see launcher.py).

    Args:
        name: The job's folder under ``root`` (logs, weight dumps, ``rank{N}.json``).
        root: The test's folder.
        config: The worker's config (see fabric_crash_worker.py).
    """
    out_dir = root / name
    out_dir.mkdir(parents=True)
    start = time.perf_counter()
    result = launch("fabric_crash", {**config, "max_steps": MAX_STEPS}, out_dir, nprocs=2, timeout=180)
    print(f"[{name}] {time.perf_counter() - start:.1f} s, return codes {result.returncodes}")
    return result


@pytest.fixture(scope="module")
def crash_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fabric_crash")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "text.txt").write_text(stdlib_sources()[0].read_text()[:4096])
    base = {"corpus": str(corpus), "cache_dir": str(root / "cache")}
    crashed = run_job("crash", root, **base, checkpoint_dir=str(root / "ckpt"),
                      crash={"folder": "step-000003", "rank": 1}, dump_steps=[2, 3])

    # Resume from a copy: the crash's folder stays as it was left for the checks below (the resumed
    # run rewrites step-000003). Unrelated entries beside the checkpoints must never be taken for one.
    resume_dir = root / "ckpt_resume"
    shutil.copytree(root / "ckpt", resume_dir)
    (resume_dir / "logs").mkdir()
    (resume_dir / "logs" / "metrics.csv").write_text("step,loss\n")
    (resume_dir / "config.yaml").write_text("max_steps: 4\n")
    resumed = run_job("resume", root, **base, checkpoint_dir=str(resume_dir), resume="latest", dump_steps=[3])
    return {"crashed": crashed, "resumed": resumed, "ckpt": root / "ckpt", "resume_dir": resume_dir}


def load_dump(job: JobResult, name: str) -> dict[str, torch.Tensor]:
    return torch.load(job.out_dir / f"{name}.pt", weights_only=True)


def assert_bit_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name  # same layout: no tolerance


def test_a_rank_killed_mid_save_leaves_a_recognisably_incomplete_folder(crash_jobs):
    crashed, ckpt = crash_jobs["crashed"], crash_jobs["ckpt"]
    assert crashed.returncodes[1] == -9, crashed.describe()  # rank 1 SIGKILLed itself inside DCP's writer
    assert not crashed.ok
    assert is_complete(ckpt / "step-000001") and is_complete(ckpt / "step-000002")
    broken = ckpt / "step-000003"
    assert broken.is_dir() and not is_complete(broken)
    assert not (broken / ".metadata").exists() and not (broken / "meta.pt").exists()
    # Genuinely mid-save: rank 1's shard was started and is shorter than the one it wrote at step 2.
    half = (broken / "__1_0.distcp").stat().st_size
    assert 0 < half < (ckpt / "step-000002" / "__1_0.distcp").stat().st_size


def test_resuming_latest_takes_the_previous_step_names_the_lost_save_and_trains_on(crash_jobs):
    resumed, resume_dir = crash_jobs["resumed"], crash_jobs["resume_dir"]
    assert resumed.ok, resumed.describe()
    broken, fallback = resume_dir / "step-000003", resume_dir / "step-000002"
    assert (f"Skipping interrupted save(s) in {resume_dir} (step-000003 is incomplete); resuming from"
            f" {fallback}") in resumed.logs[0]
    for rank in range(2):
        out = resumed.rank_output(rank)
        assert out["loaded_from"] == str(fallback)  # "latest": the newest complete save; fabric.load loads it
        assert out["resumed_step"] == 2 and len(out["loss"]) == MAX_STEPS - 2
    # The weights saved at step 2; then step 3 exactly as the crashed job trained it (optimizer, LR
    # schedule, data position and random states came back too).
    assert_bit_equal(load_dump(resumed, "loaded"), load_dump(crash_jobs["crashed"], "weights_step2"))
    assert_bit_equal(load_dump(resumed, "weights_step3"), load_dump(crash_jobs["crashed"], "weights_step3"))
    # The interrupted save was redone, complete, and the run went on.
    assert is_complete(broken) and is_complete(resume_dir / f"step-{MAX_STEPS:06d}")
