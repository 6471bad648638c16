"""A rank that dies, stops, hangs or fails ends the whole job within a bound, named on every other rank.

2×2 CPU jobs (gloo) started by a launcher that does *not* kill the job when a rank fails (``kill_on_failure=False``):
the ranks must end it themselves, within ``min(timeout, watchdog_timeout)`` + 5 of the watchdog's rounds. The
killed-rank case is the crash job of test_checkpoints.py (a rank SIGKILLed in the middle of a save; its resume loses
only the steps after the last complete checkpoint). Exit times are printed (``-s``). The four jobs of the bound tests
spend most of their time waiting for a bound, so they are launched together (``bound_jobs``); each test reads its own
job. (Not the Lightning-launcher job: its fresh interpreters, started beside them, miss the 20 s rendezvous on 2
cores.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lightning_2d.parallel.watchdog_rules import Limits
from tests.distributed.conftest import PARITY
from tests.distributed.launcher import REPO, WORKER

pytestmark = pytest.mark.distributed

LAYOUT = {**PARITY, "strategy": "2d", "dp": 2, "tp": 2, "data_replicas": 2, "save_weights": False,
          "timeout_s": 20, "watchdog_timeout_s": 20}
#: The bound the stopped and stuck jobs are ended by. Not 10 s: with 16 ranks on 2 cores, CI once saw rank 0 of two
#: jobs send no heartbeat for 11 s in their first step and named it (stop 38); the ranks now print such stalls
#: (forkserver.py), and the bound leaves room for them.
BOUND_S = 20
#: What a job may take past its bound: five of its watchdog's rounds (a tenth of the bound each: one to see, one to
#: publish, one to read, and the store host's linger), as 5 s was for a 10 s bound.
ROUNDS_S = 5 * Limits.of(BOUND_S).interval
#: One round: a stopped rank's silence counts from its last heartbeat, which can precede the stop by up to a round.
ROUND_S = Limits.of(BOUND_S).interval
#: The jobs of the bound tests: a rank that raises, one stopped (the watchdog's bound, then the collectives' shorter
#: one), one alive but stuck.
BOUND_JOBS = {
    "watchdog_raise": {**LAYOUT, "fail": {"step": 3, "rank": 3, "how": "raise"}},
    "watchdog_sigstop": {**LAYOUT, "timeout_s": 3 * BOUND_S, "watchdog_timeout_s": BOUND_S,
                         "fail": {"step": 3, "rank": 1, "how": "sigstop"}},
    "watchdog_collective_timeout": {**LAYOUT, "timeout_s": BOUND_S, "watchdog_timeout_s": 3 * BOUND_S,
                                    "fail": {"step": 3, "rank": 1, "how": "sigstop"}},
    "watchdog_stuck": {**LAYOUT, "timeout_s": 3 * BOUND_S, "watchdog_timeout_s": BOUND_S,
                       "fail": {"step": 3, "rank": 2, "how": "hang"}},
}


@pytest.fixture(scope="module")
def bound_jobs(jobs):
    """Every job of ``BOUND_JOBS``, launched at once (each is cached by ``jobs`` under its name)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(BOUND_JOBS)) as pool:
        futures = {name: pool.submit(jobs.run, name, "fit", config, expect_ok=False, kill_on_failure=False)
                   for name, config in BOUND_JOBS.items()}
    return {name: future.result() for name, future in futures.items()}


def seconds_after_failure(result) -> list[float]:
    failed = json.loads((result.out_dir / "failed_at.json").read_text())["time"]
    after = [round(t - failed, 1) for t in result.exit_times]
    print(f"[{result.out_dir.name}] return codes {result.returncodes}, exits {after} s after the failure")
    return after


def test_an_exception_on_one_rank_ends_every_other_rank_naming_it(bound_jobs):
    result = bound_jobs["watchdog_raise"]
    assert not result.timed_out, result.describe(tail=8000)
    assert result.returncodes == [75, 75, 75, 1], result.describe(tail=8000)
    assert "ValueError: injected failure in step 3" in result.logs[3]
    for rank in range(3):
        assert ("Stopping rank {} (exit code 75): rank 3 raised ValueError during step 3: injected failure in"
                " step 3. Resume from the last complete checkpoint".format(rank)) in result.logs[rank], \
            result.describe(tail=8000)
    assert max(seconds_after_failure(result)) < 10  # seconds, well under the bound (20 s)


def stopped_rank_1(result, why: str) -> tuple[list[float], list[int]]:
    """The survivors exit with the watchdog's code naming rank 1; rank 1, stopped, which would hold its memory (and
    GPU) forever, is killed by a rank on its host. Returns the exit times after the stop, and the silences (s) the
    survivors' messages report."""
    assert not result.timed_out, result.describe(tail=8000)
    assert result.returncodes == [75, -signal.SIGKILL, 75, 75], result.describe(tail=8000)
    pid = json.loads((result.out_dir / "failed_at.json").read_text())["pid"]
    silences = []
    for rank in (0, 2, 3):
        found = re.search(
            rf"Stopping rank {rank} \(exit code 75\): rank 1 \(pid {pid} on .+\) has sent no heartbeat for (\d+) s"
            rf" {why}: its process is stopped \(SIGSTOP/SIGTSTP\)", result.logs[rank]
        )
        assert found, result.describe(tail=8000)
        silences.append(int(found.group(1)))
    assert f"killed the stopped rank 1 (pid {pid}" in "".join(result.logs)
    return seconds_after_failure(result), silences


def test_a_stopped_rank_is_named_and_the_job_ends_within_the_watchdog_timeout(bound_jobs):
    result = bound_jobs["watchdog_sigstop"]
    after, silences = stopped_rank_1(result, rf"\(watchdog timeout {BOUND_S} s\)")
    assert min(silences) >= BOUND_S  # not named before the bound, by the watcher's clock
    # By the stop's clock: its last heartbeat can precede the stop by a round (a clean-clone run saw 19.3 s).
    assert BOUND_S - ROUND_S <= max(after) <= BOUND_S + ROUNDS_S  # within the bound + 5 rounds


def test_a_collective_timeout_shorter_than_the_watchdogs_is_never_extended(bound_jobs):
    """``timeout`` 20 s, ``watchdog_timeout`` 60 s: the collectives fail at 20 s, and the rank that caused it is named
    then (silent since it stopped), not 60 s later."""
    result = bound_jobs["watchdog_collective_timeout"]
    after, _ = stopped_rank_1(result, r"\(and rank \d's collective failed\)")
    assert BOUND_S <= max(after) <= BOUND_S + ROUNDS_S


def test_a_rank_alive_but_stuck_is_named_and_the_job_ends_within_the_watchdog_timeout(bound_jobs):
    """Rank 2 sleeps before its step 3 (a stuck data loader or callback would), its watchdog thread beating; the others
    wait in step 3's collectives. Its predecessor names it; every rank ends, the stuck one printing where it is."""
    result = bound_jobs["watchdog_stuck"]
    assert not result.timed_out, result.describe(tail=8000)
    assert result.returncodes == [75, 75, 75, 75], result.describe(tail=8000)
    assert (result.out_dir / "failed_at.json").exists(), "rank 2 never reached its hang:\n" + result.describe(tail=8000)
    pid = json.loads((result.out_dir / "failed_at.json").read_text())["pid"]
    for rank in range(4):
        found = re.search(
            rf"Stopping rank {rank} \(exit code 75\): rank 2 \(pid {pid} on .+\) is stuck at step 2 \(others at step"
            rf" 3\) for (\d+) s \(watchdog timeout {BOUND_S} s\): alive \(its heartbeat beats\) but not progressing",
            result.logs[rank])
        assert found, result.describe(tail=8000)
        assert int(found.group(1)) >= BOUND_S, found.group(0)  # not named before the bound
    assert "in on_train_batch_start" in result.logs[2]  # its stack, where it is stuck
    # The lag counts from when its predecessor first saw it behind (the others had started step 3), which can come a
    # moment before it reached the sleep and wrote failed_at.json: by the file's clock the job ends up to a round
    # before BOUND_S (measured 19.1-21.1 s; "not before the bound" is the watcher's lag, asserted above). It sleeps
    # after Lightning's per-batch broadcast (``_broadcast_sigterm_tensor``, rank 0 its root): sleeping before it
    # leaves rank 0 waiting there, behind as well, and the two are named by whichever watcher counts BOUND_S first
    # (CONTRIBUTING, traps: the watchdog).
    assert BOUND_S - ROUND_S <= max(seconds_after_failure(result)) <= BOUND_S + ROUNDS_S


def test_under_lightnings_launcher_a_stopped_rank_0_is_named_and_killed(tmp_path):
    """Lightning's launcher: rank 0 is the script's process (and hosts the job's store), ranks 1-3 its
    children. Rank 0 stopped: the store stops answering; the children name rank 0 and kill it."""
    config = {**LAYOUT, "lightning_launched_devices": 4, "watchdog_timeout_s": 10, "out_dir": str(tmp_path),
              "fail": {"step": 2, "rank": 0, "how": "sigstop"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    start = time.time()
    proc = subprocess.Popen([sys.executable, str(WORKER), "fit", str(tmp_path / "config.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ended = time.time()
    (tmp_path / "log.txt").write_text(log)
    failed = json.loads((tmp_path / "failed_at.json").read_text())
    print(f"[lightning launcher] rank 0 rc {proc.returncode}, killed {ended - failed['time']:.1f} s after it"
          f" stopped ({ended - start:.1f} s in all)")
    assert proc.returncode == -signal.SIGKILL, log[-4000:]  # the stopped rank 0, killed by a child
    for rank in (1, 2, 3):
        # Found as the store's silence, its host's process stopped (or already killed by another child).
        assert re.search(rf"\[lightning_2d watchdog, rank {rank}\] Stopping rank {rank} \(exit code 75\): the job's"
                         r" store \(hosted by rank 0 \(MASTER_ADDR\)\) has not answered for \d+ s \(watchdog timeout 10 s\):"
                         r" its process is (stopped \(SIGSTOP/SIGTSTP\)|gone)", log), log[-4000:]
    assert f"killed the stopped rank 0 (pid {failed['pid']}" in log
    assert ended - failed["time"] <= 10 + 5
    # No rank outlives the job: the children ended themselves (a process group holds none of them).
    time.sleep(1)
    left = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    print("left:", left)
    assert all(line.split()[1].startswith("Z") for line in left.splitlines()), left  # at most unreaped zombies


FABRIC_SCRIPT = '''
import json, os, sys, time
from datetime import timedelta
import lightning as L
import torch
from lightning_2d import LlamaLightningModule
from lightning_2d.fabric import ModelParallel2DStrategy
from lightning_2d.models.llama.model import Transformer

out = sys.argv[1]
fabric = L.Fabric(accelerator="cpu", devices=2,
                  strategy=ModelParallel2DStrategy(2, 1, watchdog_timeout=timedelta(seconds=10)))
fabric.launch()
with torch.device("meta"):
    model = Transformer(LlamaLightningModule("debug").model_args)
model = fabric.setup(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
for step in range(1, 5):
    if step == 3 and fabric.global_rank == 1:
        with open(os.path.join(out, "failed_at.json"), "w") as f:
            json.dump({"time": time.time()}, f)
        raise ValueError("a bug on rank 1")
    fabric.backward(model(torch.randint(0, 256, (2, 32))).float().mean())
    optimizer.step()
    optimizer.zero_grad()
'''


def test_under_fabric_an_uncaught_exception_ends_the_other_ranks(tmp_path):
    """A Fabric script has no Trainer hook: the exception reaches ``sys.excepthook``, which the watchdog wraps."""
    from lightning_2d.tools.launch import launch_processes

    script = tmp_path / "fabric_fail.py"
    script.write_text(FABRIC_SCRIPT)
    result = launch_processes([sys.executable, str(script), str(tmp_path)], tmp_path, nprocs=2, timeout=180,
                              env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, kill_on_failure=False)
    assert not result.timed_out and result.returncodes == [75, 1], result.describe(tail=8000)
    assert "ValueError: a bug on rank 1" in result.logs[1]
    assert ("Stopping rank 0 (exit code 75): rank 1 raised ValueError during step 3: a bug on rank 1."
            in result.logs[0]), result.describe(tail=8000)
    assert max(seconds_after_failure(result)) < 15
