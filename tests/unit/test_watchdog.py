"""The failure watchdog's rules, one round at a time (``Watchdog.check_once``) on an in-memory store with a fake clock,
fake process states and a fake exit: no thread, no process group. The real signals (SIGKILL, SIGSTOP, a rank stuck in
Python, an exception, Lightning's launcher, Fabric) run in tests/distributed/test_watchdog.py."""

from __future__ import annotations

import io
import json
import os
import re
import signal
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Optional

import pytest
import torch.distributed as dist

from lightning_2d.parallel.watchdog import (
    EXIT_CODE,
    Watchdog,
    is_communication_error,
    nccl_failure_env,
    process_state,
    record_for_torchrun,
)
from lightning_2d.parallel.watchdog_rules import (
    Beat,
    Failure,
    Finding,
    Job,
    Limits,
    Observations,
    Publish,
    State,
    decide,
    departure,
)

GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:21389: Connection reset by"
    " peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv"


class Exited(BaseException):
    """Raised by the fake ``os._exit``, so a test sees where the watchdog ended the process."""


class World:
    """``n`` ranks sharing a ``HashStore``, every process alive (``R``) unless told otherwise."""

    def __init__(self, n: int = 4, timeout: float = 20.0, collective_timeout: float | None = None,
                 hosts: list[str] | None = None) -> None:
        self.store, self.now, self.killed = dist.HashStore(), 0.0, []
        self.states = {1000 + r: "R" for r in range(n)}
        processes = [((hosts or ["node0"] * n)[r], "pid:[1]", 1000 + r) for r in range(n)]
        self.out = {r: io.StringIO() for r in range(n)}
        self.dogs = [Watchdog(self.store, r, processes, "run", timeout, collective_timeout) for r in range(n)]
        for rank, dog in enumerate(self.dogs):
            dog.clock, dog.sleep, dog.exit, dog.out = (lambda: self.now), self.sleep, self._exit, self.out[rank]
            dog.state_of, dog.kill = self.states.get, lambda pid, sig: self.killed.append((pid, sig))
            dog.start(thread=False)
        self.during_sleep = lambda: None

    def _exit(self, code: int) -> None:
        raise Exited(code)

    def sleep(self, seconds: float) -> None:
        """The fake ``time.sleep``: time passes, and what ``during_sleep`` says happens meanwhile (not re-entered)."""
        self.now += seconds
        hook, self.during_sleep = self.during_sleep, lambda: None
        try:
            hook()
        finally:
            self.during_sleep = hook

    def failed_collective(self, rank: int) -> None:
        """Rank ``rank``'s collective failed now (what ``on_failure`` records before it waits for the cause)."""
        dog = self.dogs[rank]
        error = RuntimeError(GLOO_TIMEOUT)
        dog._failure = (Failure(self.now, True, f"RuntimeError: {GLOO_TIMEOUT}", dog.step + 1), error)

    def beat(self, rank: int, status: str) -> None:
        """Rank ``rank`` writes a heartbeat with ``status`` (as its ``on_failure`` or its end would)."""
        self.dogs[rank]._status = status
        self.dogs[rank]._write_beat()

    def round(self, ranks=None, dt: float = 2.5) -> dict[int, object]:
        """Advance the clock by ``dt`` and run one round on ``ranks``; {rank: exit code or verdict}."""
        self.now += dt
        results = {}
        for r in ranks if ranks is not None else range(len(self.dogs)):
            try:
                results[r] = self.dogs[r].check_once()
            except Exited as ended:
                results[r] = ended.args[0]
        return results


def test_bound_and_interval_are_the_shorter_timeout_and_a_tenth_of_it():
    world = World(n=2, timeout=120.0, collective_timeout=20.0)  # the user's timeout is never extended
    limits = world.dogs[0].limits
    assert limits.bound == 20.0 and limits.interval == 2.0 and limits.patience == 7.0
    assert World(n=2, timeout=20.0).dogs[0].limits.bound == 20.0  # no collective timeout
    assert World(n=2, timeout=60.0, collective_timeout=1800.0).dogs[0].limits.interval == 5.0  # at most 5 s
    assert World(n=2, timeout=1.0).dogs[0].limits.interval == 0.2  # at least 0.2 s


def test_a_stopped_rank_is_named_by_its_predecessor_after_the_watchdog_timeout_and_killed():
    world = World(timeout=20.0)
    alive = [0, 2, 3]
    world.round()  # every rank beats once
    world.states[1001] = "T"  # rank 1 stopped: no more heartbeats
    for _ in range(9):  # rank 0 last saw its count change at t = 5 s; up to 20 s of silence: nothing happens
        assert world.round(alive) == {0: None, 2: None, 3: None}
    results = world.round(alive)  # 22.5 s: rank 0 (which watches rank 1) names it, publishes, ends
    assert results[0] == EXIT_CODE
    out = world.out[0].getvalue()
    assert re.search(r"Stopping rank 0 \(exit code 75\): rank 1 \(pid 1001 on node0\) has sent no heartbeat for 2\d s"
                     r" \(watchdog timeout 20 s\): its process is stopped \(SIGSTOP/SIGTSTP\); its last heartbeat"
                     r" reported 0 completed step\(s\)", out), out
    assert (1001, signal.SIGKILL) in world.killed  # a stopped rank would hold its memory forever
    assert world.round([2, 3], dt=0.1) == {2: EXIT_CODE, 3: EXIT_CODE}  # no grace: the verdict is no error of theirs
    assert "rank 1 (pid 1001 on node0) has sent no heartbeat" in world.out[2].getvalue()
    assert "[found by rank 0]" in world.out[2].getvalue()


def test_a_dead_local_rank_is_found_within_one_round_unless_it_finished():
    world = World()
    world.round()
    world.dogs[3].stop(done=True)  # rank 3 finished the run and exited: not a failure
    del world.states[1003]
    assert world.round([0, 1, 2]) == {0: None, 1: None, 2: None}
    world.dogs[1].step = 2
    world.round([0, 1, 2], dt=0.5)
    del world.states[1002]  # rank 2 vanished mid-run (SIGKILL, OOM killer)
    assert world.round([0, 1], dt=2.0)[1] == EXIT_CODE  # its predecessor, within one round
    assert world.round([0], dt=0.1)[0] == EXIT_CODE
    text = world.out[1].getvalue()
    assert "rank 2 (pid 1002 on node0) died: its process is gone; its last heartbeat reported 0 completed step(s)" in text


def test_the_ring_skips_finished_ranks_and_a_silent_rank_on_another_host_is_named():
    world = World(n=3, hosts=["a", "a", "b"])
    world.round()
    world.dogs[1].stop(done=True)  # rank 0's successor finished; rank 0 now watches rank 2
    world.round([0, 2])
    for _ in range(10):  # rank 0 watches rank 2 from t = 7.5 s; 22.5 s later, silent all along
        results = world.round([0])
    assert results[0] == EXIT_CODE
    assert ("rank 2 (pid 1002 on b) has sent no heartbeat for 22 s (watchdog timeout 20 s) (another host: stopped, dead"
            " or cut off)") in world.out[0].getvalue()
    assert world.killed == []  # not on this host


def test_a_rank_alive_but_stuck_behind_the_others_is_named_within_the_watchdog_timeout():
    world = World(timeout=20.0)
    world.round()
    for rank in (0, 1, 3):  # they entered step 3 and wait in its collectives; rank 2 never starts it
        world.dogs[rank].started = 3
    world.dogs[2].started = world.dogs[2].step = 2
    for _ in range(9):  # behind from t = 5 s, its heartbeat beating: not named within 20 s
        assert world.round() == {0: None, 1: None, 2: None, 3: None}
    results = world.round()  # 22.5 s: its predecessor names it; the stuck rank itself reads it and ends too
    assert results[1] == EXIT_CODE and results[2] == EXIT_CODE
    assert ("rank 2 (pid 1002 on node0) is stuck at step 2 (others at step 3) for 22 s (watchdog timeout 20 s): alive"
            " (its heartbeat beats) but not progressing") in world.out[1].getvalue()
    assert world.killed == []  # alive, not stopped: it ends itself


def test_a_stopped_rank_behind_the_others_is_named_stopped_not_stuck():
    world = World(timeout=20.0)
    world.round()
    for rank in (0, 1, 3):
        world.dogs[rank].started = 3
    world.states[1002] = "T"  # its last heartbeat said step 2
    for _ in range(9):
        assert world.round([0, 1, 3]) == {0: None, 1: None, 3: None}
    assert world.round([0, 1, 3])[1] == EXIT_CODE
    assert "rank 2 (pid 1002 on node0) has sent no heartbeat for 22 s" in world.out[1].getvalue()


def test_a_rank_catching_up_is_not_stuck():
    world = World(timeout=20.0)
    world.round()
    for step in range(1, 6):  # rank 2 is a little behind at each round (its data arrives late), then catches up
        for rank in (0, 1, 3):
            world.dogs[rank].started = step
        assert world.round() == {0: None, 1: None, 2: None, 3: None}
        world.dogs[2].started = step
    for _ in range(10):
        assert world.round(dt=2.5) == {0: None, 1: None, 2: None, 3: None}


def test_after_a_failed_collective_a_stopped_rank_is_named_at_once_not_after_the_watchdog_timeout():
    """``timeout`` 8 s, ``watchdog_timeout`` 60 s: the collectives fail at 8 s and the cause is named then."""
    world = World(timeout=60.0, collective_timeout=8.0)  # interval 0.8 s
    world.round(dt=0.8)
    world.states[1001] = "T"
    for _ in range(10):  # 8 s: far under the watchdog timeout, nothing found
        assert world.round([0, 2, 3], dt=0.8) == {0: None, 2: None, 3: None}
    dog = world.dogs[0]  # its collective fails; it waits for the cause, its thresholds lowered to two intervals
    world.during_sleep = dog.check_once  # (its thread's rounds)
    failed_at = world.now
    try:
        dog.on_failure(RuntimeError(GLOO_TIMEOUT))
        raise AssertionError("not ended")
    except Exited as ended:
        assert ended.args[0] == EXIT_CODE
    # Named within a round; then rank 0, which hosts the store, holds it (2 rounds + 1 s at most) for the others.
    assert world.now - failed_at <= dog.limits.interval + 2 * dog.limits.interval + 1
    assert world.round([2, 3], dt=0.1) == {2: EXIT_CODE, 3: EXIT_CODE}
    assert re.search(r"Stopping rank 0 \(exit code 75\): rank 1 \(pid 1001 on node0\) has sent no heartbeat for \d s"
                     r" \(and rank 0's collective failed\): its process is stopped", world.out[0].getvalue())
    assert (1001, signal.SIGKILL) in world.killed
    assert "This rank's own error (a consequence): RuntimeError: [/pytorch" in world.out[0].getvalue()


def test_after_a_failed_collective_a_stuck_rank_is_named_but_not_a_lag_that_began_with_the_failure():
    world = World(timeout=60.0, collective_timeout=8.0)
    world.round(dt=0.8)
    for rank in (0, 1, 3):
        world.dogs[rank].started = 3
    for _ in range(10):
        assert world.round(dt=0.8) == {0: None, 1: None, 2: None, 3: None}
    world.failed_collective(1)  # rank 1's collective failed at 8 s
    assert world.round([1], dt=0.8)[1] == EXIT_CODE
    assert "rank 2 (pid 1002 on node0) is stuck at step 0 (others at step 3) for 8 s (and rank 1's collective failed)" \
        in world.out[1].getvalue()

    world = World(timeout=60.0, collective_timeout=8.0)
    world.round(dt=0.8)
    world.failed_collective(1)  # failed first; rank 2 falls behind after
    world.dogs[1].started = 3
    for _ in range(3):
        assert world.round([1, 2], dt=0.8) == {1: None, 2: None}


def test_a_dead_rank_is_named_rather_than_a_rank_stuck_waiting_on_it():
    """Rank 1 dies during a save; rank 3, slower, is still behind at step 3 (blocked with the dead rank). Rank 2,
    whose collective failed, watches rank 3: the dead rank on its host is the cause, not rank 3's lag (a race seen
    in CI: rank 2 named rank 3 stuck before rank 0 found rank 1 dead). A rank that finished is not taken for dead."""
    world = World(timeout=60.0, collective_timeout=8.0)
    world.round(dt=0.8)
    for rank in (0, 1, 2):
        world.dogs[rank].started = 4
    world.dogs[3].started = 3
    for _ in range(3):
        world.round(dt=0.8)
    world.states[1001] = "X"  # killed
    world.failed_collective(2)
    assert world.round([2], dt=0.8)[2] == EXIT_CODE
    assert re.search(r"Stopping rank 2 \(exit code 75\): rank 1 \(pid 1001 on node0\) died: its process is gone",
                     world.out[2].getvalue()), world.out[2].getvalue()

    world = World(timeout=60.0, collective_timeout=8.0)  # the same lag, but rank 1 finished and exited
    world.round(dt=0.8)
    for rank in (0, 1, 2):
        world.dogs[rank].started = 4
    world.dogs[3].started = 3
    world.dogs[1]._status = "done"
    world.round([1], dt=0.8)
    world.states[1001] = "X"
    for _ in range(3):
        assert world.round([0, 2], dt=0.8) == {0: None, 2: None}


def test_a_failed_collective_with_no_cause_found_reports_itself_within_a_few_seconds():
    world = World(timeout=120.0, collective_timeout=20.0)
    world.round()
    dog = world.dogs[1]
    start = world.now
    dog.on_failure(RuntimeError(GLOO_RESET))  # a consequence: it waits for a cause (none here)
    assert world.now - start == dog.limits.patience <= 7.0  # seconds, not the 120 s watchdog timeout
    verdict = world.round([0], dt=0.1)[0]
    assert verdict.ranks == (1,)  # then it names itself, with what it saw
    assert ("rank 1's collective failed during step 1 (RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/"
            "pair.cc:537] Read error") in verdict.reason
    assert verdict.reason.endswith("and no rank was found dead, stopped or stuck within 7 s")
    world.round([2, 3], dt=0.1)  # (ranks not failing give it the grace: their own error may be coming)
    assert world.round([0, 2, 3], dt=5.0) == {0: EXIT_CODE, 2: EXIT_CODE, 3: EXIT_CODE}


def test_a_failed_collective_ends_with_the_cause_another_rank_found():
    world = World(timeout=20.0)
    world.round()
    dog = world.dogs[3]
    world.during_sleep = lambda: world.dogs[0]._publish(Finding((1,), 0, "rank 1 died"))
    try:
        dog.on_failure(RuntimeError(GLOO_RESET))
        raise AssertionError("not ended")
    except Exited as ended:
        assert ended.args[0] == EXIT_CODE
    assert "Stopping rank 3 (exit code 75): rank 1 died [found by rank 0]" in world.out[3].getvalue()


def test_an_exception_is_published_with_its_step_and_the_others_end_after_the_grace():
    world = World()
    world.round()
    world.dogs[2].step = 4
    world.dogs[2].on_failure(ValueError("bad batch\nsecond line"))
    results = world.round([0, 1, 3], dt=0.5)  # seen: the grace for an error raised everywhere at once
    assert all(verdict.ranks == (2,) for verdict in results.values())
    assert world.round([0, 1, 3], dt=5.0) == {0: EXIT_CODE, 1: EXIT_CODE, 3: EXIT_CODE}
    assert "rank 2 raised ValueError during step 5: bad batch." in world.out[0].getvalue()
    assert "second line" not in world.out[0].getvalue()


def test_a_rank_failing_with_its_own_error_is_left_to_exit_by_itself():
    world = World(timeout=20.0)
    world.round()
    world.dogs[2].on_failure(ValueError("boom"))  # rank 2 publishes its error
    world.dogs[1].on_failure(RuntimeError("raised on every rank"))  # rank 1 fails by itself too, not a consequence
    for _ in range(10):
        assert world.round([1], dt=2.5)[1].ranks == (2,)  # never ended by the watchdog: exits with its own error
    assert world.out[1].getvalue() == ""


def test_a_silent_store_names_the_rank_hosting_it():
    world = World(n=2, timeout=20.0)

    class DeadStore:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("Connection refused")

            return fail

    world.states[1000] = "T"  # rank 0, which hosts the store, is stopped
    world.dogs[1]._store.store = DeadStore()
    world.now = 19.0
    assert world.round([1], dt=0.0) == {1: None}
    assert world.round([1], dt=2.0) == {1: EXIT_CODE}
    assert ("Stopping rank 1 (exit code 75): the job's store (hosted by rank 0 (MASTER_ADDR)) has not answered for 21 s"
            " (watchdog timeout 20 s): its process is stopped (SIGSTOP/SIGTSTP)") in world.out[1].getvalue()
    assert world.killed == [(1000, signal.SIGKILL)]


def test_the_rank_hosting_the_store_waits_for_every_rank_to_finish():
    world = World(n=3)
    world.round()
    finished = []

    def others_finish_one_by_one():
        if len(finished) < 2:
            finished.append(len(finished) + 1)
            world.dogs[finished[-1]].stop(done=True)

    world.during_sleep = others_finish_one_by_one
    world.dogs[0].stop(done=True)  # returns once ranks 1 and 2 said they finished
    assert finished == [1, 2] and all(out.getvalue() == "" for out in world.out.values())


def test_the_store_host_ending_waits_for_a_rank_still_waiting_for_the_cause():
    """A rank whose collective failed waits for the cause ("failed"): the rank hosting the store must not take the
    store away before that rank has read the verdict, or it would name the store's host instead (seen with a
    collective timeout shorter than the watchdog's: rank 3 named rank 0)."""
    world = World(n=4, timeout=10.0)
    world.round()
    world.states[1001] = "T"  # rank 1 stopped: its heartbeat is not renewed from here on
    world.round([0, 2, 3], dt=1.0)
    world.beat(3, "failed")  # rank 3's collective failed; it waits for the cause
    world.beat(2, "ended")  # rank 2 has ended already
    read = []

    def rank_3_reads_the_verdict_late():
        if world.now > world.dogs[0]._state.seen_at + 1 and not read:
            read.append(world.now)
            world.beat(3, "ended")

    world.during_sleep = rank_3_reads_the_verdict_late
    results = world.round([0], dt=11.0)  # rank 0 finds rank 1 silent, ends, waits before leaving
    assert results == {0: EXIT_CODE} and read, "rank 0 left before rank 3 (still waiting for a cause) read the verdict"


def test_when_every_rank_raises_the_store_host_leaves_once_the_others_are_gone_not_after_linger():
    """Every rank stops on the same error (a non-finite loss: each raises it). The others stay "failed" in the store
    after they exit; the rank hosting the store, whose own report became the verdict, waited ``linger`` for them
    (11 s under the default timeout). It leaves as soon as their processes are gone."""
    world = World(n=4, timeout=20.0)
    world.round()
    for r in (1, 2, 3):
        world.beat(r, "failed")  # each raised its own error, then exits
    exits = []

    def the_others_exit():
        if not exits:
            exits.append(world.now)
            for r in (1, 2, 3):
                world.states[1000 + r] = None

    world.during_sleep = the_others_exit
    start = world.now
    world.dogs[0].on_failure(ValueError("non-finite loss"))  # rank 0's own error: the verdict, then it leaves
    assert world.dogs[0].verdict is not None and world.dogs[0].verdict.ranks == (0,)
    assert exits and world.now - start < world.dogs[0].limits.linger / 2, world.now - start


def test_the_store_host_ending_waits_for_a_stuck_culprit_to_read_the_verdict():
    """A stuck rank is alive (its watchdog runs): it must read the verdict naming it, and end with it, before the rank
    hosting the store leaves; else it reports the store's host as gone instead (seen once in the stuck-rank job)."""
    world = World(n=4, timeout=10.0)
    world.round()
    for r in (1, 3):  # the others have ended already
        world.beat(r, "ended")
    host = world.dogs[0]
    host._state = replace(host._state, verdict=Finding((2,), 1, "rank 2 is stuck"), seen_at=world.now)
    read = []

    def the_stuck_rank_reads_the_verdict():
        if world.now > host._state.seen_at + 1 and not read:
            read.append(world.now)
            world.beat(2, "ended")

    world.during_sleep = the_stuck_rank_reads_the_verdict
    try:
        host.check_once()  # it holds the verdict: it ends
    except Exited as ended:
        assert ended.args[0] == EXIT_CODE
    assert read, "the store's host left before the stuck rank read the verdict naming it"


def test_communication_errors_are_told_from_causes():
    from torch.distributed import DistBackendError

    assert is_communication_error(RuntimeError(GLOO_RESET)) and is_communication_error(RuntimeError(GLOO_TIMEOUT))
    assert is_communication_error(DistBackendError("NCCL watchdog timeout"))
    wrapped = RuntimeError("checkpoint failed")
    wrapped.__cause__ = RuntimeError(GLOO_RESET)
    assert is_communication_error(wrapped)

    class CheckpointException(Exception):  # DCP's: {rank: (error, traceback)}
        failures = {1: (RuntimeError(GLOO_RESET), None)}

    assert is_communication_error(CheckpointException())
    assert not is_communication_error(ValueError("injected failure"))
    assert not is_communication_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_communication_error(RuntimeError("DataLoader timed out after 60 seconds"))


def test_process_states():
    assert process_state(os.getpid()) in ("R", "S")
    assert process_state(2**22 + 12345) is None


def test_torchruns_root_cause_names_the_failing_rank(tmp_path, monkeypatch):
    """torchrun's failure summary ("Root Cause", read by torch's own ``ProcessFailure``) shows a worker's error file:
    the one the watchdog writes names the failing rank, on the failing rank and on every rank it ends."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    record_for_torchrun("ignored outside torchrun")  # no TORCHELASTIC_ERROR_FILE: nothing written, no error
    for rank, error_file in ((2, tmp_path / "rank2.json"), (0, tmp_path / "rank0.json")):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        world = World() if rank == 2 else world
        if rank == 2:
            world.round()
            world.dogs[2].step = 2
            world.dogs[2].on_failure(ValueError("boom"))  # the failing rank's own file, with its traceback
        else:
            world.round([0], dt=0.1)
            assert world.round([0], dt=5.0) == {0: EXIT_CODE}  # a rank the watchdog ends, after the grace
        failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1 if rank == 2 else EXIT_CODE,
                                 error_file=str(error_file))
        summary = ChildFailedError("train.py", {rank: failure}).format_msg()
        assert "Root Cause" in summary and "rank 2 raised ValueError during step 3: boom" in summary, summary
    assert json.loads((tmp_path / "rank0.json").read_text())["message"]["message"].startswith(
        "RuntimeError: Stopping rank 0 (exit code 75): rank 2 raised ValueError during step 3: boom")


NCCL_NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
              "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def test_nccl_failure_handling_is_set_where_the_user_did_not(monkeypatch):
    for name in NCCL_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")
    assert nccl_failure_env(None) == {}
    added = nccl_failure_env(timedelta(minutes=3))
    assert added == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1",
                     "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "180", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7"  # the user's own
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ  # its new name would win over the user's old one
    assert all(os.environ[name] == value for name, value in added.items())


@pytest.mark.parametrize(("version", "buffer"), [("2.13.0", "TORCH_FR_BUFFER_SIZE"), ("2.9.0", "TORCH_FR_BUFFER_SIZE"),
                                                 ("2.8.1", "TORCH_NCCL_TRACE_BUFFER_SIZE")])
def test_the_flight_recorder_is_turned_on_under_the_name_torch_reads(version, buffer, monkeypatch):
    for name in NCCL_NAMES:
        monkeypatch.delenv(name, raising=False)
    added = nccl_failure_env(timedelta(seconds=10), torch_version=version)
    assert added[buffer] == "2000" and added["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert added["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "60"  # not below a minute
    assert {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(added) == {buffer}  # one name, no warning


# ---- the rules, as a table: rounds of observations -> verdicts (``watchdog_rules.decide``, no store, no clock) ------
LIMITS = Limits.of(20.0)  # interval 2 s, settle 4 s, linger 5 s, patience 7 s
ON_ONE_HOST = tuple(("node0", "pid:[1]", 1000 + r) for r in range(4))
RANK_1_ELSEWHERE = tuple(("node1" if r == 1 else "node0", "pid:[1]", 1000 + r) for r in range(4))
COLLECTIVE = Failure(8.0, True, "RuntimeError: gloo timeout", 3)  # rank 0's collective failed at 8 s
RAISED = Failure(1.0, False, "ValueError: boom", 3)


@dataclass(frozen=True)
class Expect:
    """What one call must return: ``kind`` ("continue", "wait", "end"; "publish": a finding naming ``ranks``, then
    ``then`` once it holds), the finding's reason or the end's message matching ``pattern``, what the end kills."""

    kind: str
    ranks: tuple[int, ...] = ()
    pattern: str = ""
    then: str = "end"
    kill: tuple[int, ...] = ()
    dump_stacks: bool = False


CONTINUE, WAIT = Expect("continue"), Expect("wait")


def named(ranks, pattern, then="end", kill=(), dump_stacks=False) -> Expect:
    return Expect("publish", tuple(ranks), pattern, then, tuple(kill), dump_stacks)


def ends(pattern, kill=(), dump_stacks=False) -> Expect:
    return Expect("end", (), pattern, "", tuple(kill), dump_stacks)


@dataclass(frozen=True)
class Call:
    """One call of ``decide`` by rank 0 (a round unless ``round`` is False): the watched rank's heartbeat (count,
    started, completed step, status), what else it saw, and what it must return."""

    now: float
    beat: Optional[tuple] = None
    expect: Expect = CONTINUE
    watched: int = 1
    started: int = 0
    answered: Optional[float] = None
    states: Optional[dict] = None
    gone: Optional[dict] = None
    verdict: Optional[Finding] = None
    failure: Optional[Failure] = None
    round: bool = True

    def observations(self) -> Observations:
        states = {r: "R" for r in range(1, 4)} | (self.states or {})
        return Observations(self.now, self.started, self.now if self.answered is None else self.answered, states,
                            verdict=self.verdict, round=self.round, failure=self.failure,
                            successor=None if self.beat is None else (self.watched, Beat(*self.beat)),
                            gone={r: b and Beat(*b) for r, b in (self.gone or {}).items()})


@dataclass(frozen=True)
class Scenario:
    """Rank 0's calls, on 4 ranks (``processes``), the store hosted by ``store_host`` (``None``: torchrun's agent)."""

    calls: list[Call]
    processes: tuple = ON_ONE_HOST
    store_host: Optional[int] = 0


def beating(start: float, stop: float, every: float = 2.0, **call) -> list[Call]:
    """A heartbeat that changes at each call from ``start`` to ``stop`` (``call``: the other fields of each)."""
    beat = call.pop("beat", (0, 0, 0, "alive"))
    calls, t = [], start
    while t <= stop:
        calls.append(Call(t, (beat[0] + len(calls) + 1, *beat[1:]), **call))
        t += every
    return calls


SCENARIOS = {
    # -- the watchdog timeout: silence, lag, the store -----------------------------------------------------------------
    "a silent successor is named once silent longer than the timeout, not at it": [
        Call(1.0, (1, 0, 0, "alive")), Call(21.0, (1, 0, 0, "alive")),
        Call(21.5, (1, 0, 0, "alive"), named([1], r"^rank 1 \(pid 1001 on node0\) has sent no heartbeat for 20 s"
                                               r" \(watchdog timeout 20 s\): its process is alive \(state R\) but its"
                                               r" watchdog does not run; its last heartbeat reported 0 completed")),
    ],
    "a stopped successor is named silent, and killed by the rank that ends": [
        Call(1.0, (1, 0, 2, "alive"), states={1: "T"}),
        Call(21.5, (1, 0, 2, "alive"), named([1], r"its process is stopped \(SIGSTOP/SIGTSTP\); its last heartbeat"
                                               r" reported 2 completed step\(s\)", kill=[1]), states={1: "T"}),
    ],
    "a silent successor on another host is named, not killed": Scenario([
        Call(1.0, (1, 0, 0, "alive")),
        Call(21.5, (1, 0, 0, "alive"), named([1], r"^rank 1 \(pid 1001 on node1\) has sent no heartbeat for 20 s"
                                               r" \(watchdog timeout 20 s\) \(another host: stopped, dead or cut off\);"
                                               r" its last"), states={1: "T"}),
    ], processes=RANK_1_ELSEWHERE),
    "a successor alive but behind is named stuck once behind longer than the timeout": [
        *beating(1.0, 21.0, beat=(0, 2, 2, "alive"), started=3),
        Call(21.5, (99, 2, 2, "alive"), named([1], r"rank 1 \(pid 1001 on node0\) is stuck at step 2 \(others at step"
                                                r" 3\) for 20 s \(watchdog timeout 20 s\): alive \(its heartbeat beats\)"
                                                r" but not progressing"), started=3),
    ],
    "a rank catching up is not stuck": [
        *[Call(t, (t, t // 2, 0, "alive"), started=(t + 1) // 2) for t in range(1, 40)],  # behind, then caught up
    ],
    "the store silent longer than the timeout names its host, described and killed": Scenario([
        Call(20.0, answered=0.0, states={2: "T"}), Call(20.5, answered=0.0, states={2: "T"}, expect=named(
            [2], r"^the job's store \(hosted by rank 2 \(MASTER_ADDR\)\) has not answered for 20 s \(watchdog timeout"
                 r" 20 s\): its process is stopped \(SIGSTOP/SIGTSTP\)$", kill=[2])),
    ], store_host=2),
    "the store hosted by torchrun's agent names no rank": Scenario([
        Call(20.5, answered=0.0, expect=named([], r"^the job's store \(hosted by the torchrun agent\) has not answered")),
    ], store_host=None),
    # -- within a round: a dead process on this host, a finished rank ----------------------------------------------------
    "a successor whose process is gone (this host) is named at once": [
        Call(1.0, (1, 4, 3, "alive"), named([1], r"^rank 1 \(pid 1001 on node0\) died: its process is gone; its last"
                                             r" heartbeat reported 3 completed step\(s\)$"), states={1: None}),
    ],
    "a finished successor is skipped: the ring watches the next rank from then": [
        Call(1.0, (1, 0, 0, "alive")), Call(3.0, (2, 0, 0, "done"), states={1: None}),
        Call(4.0, (5, 0, 0, "alive"), watched=2), Call(24.0, (5, 0, 0, "alive"), watched=2),
        Call(24.5, (5, 0, 0, "alive"), named([2], r"^rank 2 \(pid 1002 on node0\) has sent no heartbeat for 20 s"),
             watched=2),
    ],
    "a dead rank on this host is named rather than a silent or stuck successor waiting on it": [
        Call(1.0, (1, 0, 0, "alive"), states={3: None}, gone={3: (5, 0, 0, "alive")}),
        Call(21.0, (1, 0, 0, "alive"), states={3: None}, gone={3: (5, 0, 0, "alive")}),
        Call(21.5, (1, 0, 0, "alive"), named([3], r"^rank 3 \(pid 1003 on node0\) died: its process is gone$"),
             states={3: None}, gone={3: (5, 0, 0, "alive")}),
    ],
    "a dead rank on this host that had finished is no cause": [
        Call(1.0, (1, 0, 0, "alive")),
        Call(21.5, (1, 0, 0, "alive"), named([1], r"^rank 1 .* has sent no heartbeat"), states={3: None},
             gone={3: (5, 0, 0, "done")}),
    ],
    "a dead rank whose heartbeat the store did not give is not judged": [
        Call(1.0, (1, 0, 0, "alive")),
        Call(21.5, (1, 0, 0, "alive"), named([1], r"^rank 1 .* has sent no heartbeat"), states={3: None}),
    ],
    # -- patience: a fresh heartbeat (a stopped rank's stale one looks behind) ------------------------------------------
    "behind, its heartbeat changed within patience: stuck": [
        *beating(1.0, 15.0, beat=(0, 2, 2, "alive"), started=3),
        Call(22.0, (8, 2, 2, "alive"), named([1], r"is stuck at step 2 \(others at step 3\) for 21 s"), started=3),
    ],
    "behind, its heartbeat stale for longer than patience: not stuck, named silent after the timeout": [
        *beating(1.0, 13.0, beat=(0, 2, 2, "alive"), started=3), Call(14.5, (8, 2, 2, "alive"), started=3),
        Call(22.0, (8, 2, 2, "alive"), started=3), Call(34.5, (8, 2, 2, "alive"), started=3),
        Call(34.6, (8, 2, 2, "alive"), named([1], r"has sent no heartbeat for 20 s"), started=3),
    ],
    # -- a failed collective: the limit drops to settle, a cause within patience -----------------------------------------
    "after this rank's collective failed, a successor silent longer than settle is named": [
        Call(6.0, (1, 0, 0, "alive")), Call(9.0, (1, 0, 0, "alive"), WAIT, failure=COLLECTIVE),
        Call(10.0, (1, 0, 0, "alive"), WAIT, failure=COLLECTIVE),
        Call(10.5, (1, 0, 0, "alive"), named([1], r"has sent no heartbeat for 4 s \(and rank 0's collective failed\)"
                                               r": its process is alive"), failure=COLLECTIVE),
    ],
    "after this rank's collective failed, a lag from before it is named stuck past settle": [
        *beating(0.0, 3.0, beat=(0, 3, 3, "alive"), every=3.0), Call(6.0, (3, 2, 2, "alive"), started=3),
        Call(8.5, (4, 2, 2, "alive"), WAIT, started=3, failure=COLLECTIVE),
        Call(10.0, (5, 2, 2, "alive"), WAIT, started=3, failure=COLLECTIVE),
        Call(10.5, (6, 2, 2, "alive"), named([1], r"is stuck at step 2 \(others at step 3\) for 4 s \(and rank 0's"
                                              r" collective failed\)"), started=3, failure=COLLECTIVE),
    ],
    "after this rank's collective failed, a lag that began with it (within an interval) is the collective's own": [
        *beating(0.0, 3.0, beat=(0, 3, 3, "alive"), every=3.0), Call(6.01, (3, 2, 2, "alive"), started=3),
        *beating(8.5, 14.5, beat=(3, 2, 2, "alive"), every=1.0, started=3, failure=COLLECTIVE, expect=WAIT),
    ],
    "a failed collective with no cause found within patience reports itself, left to its own error": [
        Call(14.99, expect=WAIT, failure=COLLECTIVE, round=False),
        Call(15.0, expect=named([0], r"^rank 0's collective failed during step 3 \(RuntimeError: gloo timeout\) and"
                                     r" no rank was found dead, stopped or stuck within 7 s$", then="continue"),
             failure=COLLECTIVE, round=False),
        Call(99.0, failure=COLLECTIVE, round=False),
    ],
    "no judging outside a round (the failing main thread reads no store)": [
        Call(1.0, (1, 0, 0, "alive"), round=False), Call(99.0, (1, 0, 0, "alive"), answered=0.0, round=False),
    ],
    # -- a verdict held: settle for an error raised elsewhere; this rank's own error ------------------------------------
    "an error raised here is published at once with its step, and left to end the rank": [
        Call(1.0, expect=named([0], r"^rank 0 raised ValueError during step 3: boom$", then="continue"),
             failure=RAISED, round=False),
    ],
    "an error raised on another rank ends this one after settle": [
        Call(1.0, verdict=Finding((2,), 2, "rank 2 raised ValueError during step 3: boom", raised=True)),
        Call(4.9), Call(5.0, expect=ends(r"^Stopping rank 0 \(exit code 75\): rank 2 raised ValueError during step 3:"
                                         r" boom\. Resume from the last complete checkpoint \(ckpt_path='last'\)\.$")),
    ],
    "a cause another rank found ends this one at once, naming who found it": [
        Call(1.0, verdict=Finding((1,), 3, "rank 1 died"), states={1: "T"},
             expect=ends(r"^Stopping rank 0 \(exit code 75\): rank 1 died \[found by rank 3\]\. Resume", kill=[1])),
    ],
    "a rank named stuck ends with its stacks": [
        Call(1.0, verdict=Finding((0,), 3, "rank 0 is stuck"), expect=ends(r"rank 0 is stuck \[found", dump_stacks=True)),
    ],
    "a rank failing with its own error is never ended by the watchdog": [
        Call(2.0, failure=RAISED, verdict=Finding((2,), 2, "rank 2 raised", raised=True)), Call(99.0, failure=RAISED),
    ],
    "a failed collective ends at once with another rank's cause, its own error a consequence": [
        Call(9.0, failure=COLLECTIVE, round=False, verdict=Finding((2,), 2, "rank 2 raised", raised=True),
             expect=ends(r"rank 2 raised\. Resume .*\nThis rank's own error \(a consequence\): RuntimeError: gloo")),
    ],
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_the_rules_over_a_table_of_scenarios(scenario):
    """Rank 0 of 4, ``watchdog_timeout`` 20 s: each call's verdict as expected; a published finding is held (as the
    store gives it back) and acted on in the same call, as the shell does."""
    scenario = scenario if isinstance(scenario, Scenario) else Scenario(scenario)
    state = State(Job(0, scenario.processes, scenario.store_host))
    for i, call in enumerate(scenario.calls):
        obs = call.observations()
        state, verdict = decide(obs, state, LIMITS)
        got, want = verdict, call.expect
        if want.kind == "publish":
            assert isinstance(verdict, Publish), (i, call, verdict)
            assert verdict.finding.ranks == want.ranks and re.search(want.pattern, verdict.finding.reason), (i, verdict)
            state, got = decide(replace(obs, verdict=verdict.finding), state, LIMITS)
            assert state.verdict == verdict.finding and state.seen_at == call.now
        kind = want.then if want.kind == "publish" else want.kind
        assert type(got).__name__.lower() == kind, (i, call, got)
        if kind == "end":
            assert got.code == EXIT_CODE and got.kill == want.kill and got.dump_stacks == want.dump_stacks, (i, got)
            assert want.kind == "publish" or re.search(want.pattern, got.message), (i, got.message)


@pytest.mark.parametrize(("watchdog_timeout", "collective_timeout", "limits"), [
    (20.0, None, Limits(20.0, 20.0, 2.0, settle=4.0, linger=5.0, patience=7.0)),
    (120.0, 20.0, Limits(120.0, 20.0, 2.0, settle=4.0, linger=5.0, patience=7.0)),  # the shorter bound sets the pace
    (60.0, 1800.0, Limits(60.0, 60.0, 5.0, settle=10.0, linger=11.0, patience=16.0)),  # rounds 5 s apart at most
    (1.0, None, Limits(1.0, 1.0, 0.2, settle=0.4, linger=1.4, patience=1.6)),  # 0.2 s at least
])
def test_every_limit_derives_from_the_two_timeouts(watchdog_timeout, collective_timeout, limits):
    assert Limits.of(watchdog_timeout, collective_timeout) == pytest.approx(limits)


VERDICT = Finding((1, 2), 3, "ranks 1 and 2 failed")


@pytest.mark.parametrize(("rank", "processes", "states", "verdict", "finished", "waits_for", "until"), [
    (0, ON_ONE_HOST, {}, VERDICT, True, (1, 2, 3), 30.0 + 20.0),  # finished: every other rank, the bound at most
    (1, ON_ONE_HOST, {}, VERDICT, True, (), 30.0),  # not hosting the store: nobody
    (0, ON_ONE_HOST, {}, VERDICT, False, (1, 2, 3), 10.0 + 5.0),  # a verdict: linger after it was seen
    (0, ON_ONE_HOST, {1: "T", 2: None}, VERDICT, False, (3,), 15.0),  # culprits stopped or gone: not them
    (0, RANK_1_ELSEWHERE, {}, VERDICT, False, (2, 3), 15.0),  # a culprit on another host: not it
    (0, ON_ONE_HOST, {}, replace(VERDICT, raised=True), False, (3,), 15.0),  # culprits that raised: not them
    (0, ON_ONE_HOST, {3: None}, replace(VERDICT, raised=True), False, (), 15.0),  # a rank gone since: not it
    (0, ON_ONE_HOST, {3: "Z"}, VERDICT, False, (1, 2), 15.0),  # (an unreaped one is gone too)
    (0, RANK_1_ELSEWHERE, {1: None}, replace(VERDICT, ranks=(3,)), False, (1, 2, 3), 15.0),  # none elsewhere
])
def test_the_store_host_leaves_last(rank, processes, states, verdict, finished, waits_for, until):
    """``departure``: the rank hosting the store (0) waits for these ranks while "alive" or "failed", until then."""
    state = State(Job(rank, processes, store_host=0), verdict=verdict, seen_at=10.0)
    assert departure(state, {r: "R" for r in range(4)} | states, 30.0, LIMITS, finished) == (waits_for, until)
