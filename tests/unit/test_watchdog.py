"""The failure watchdog's rules, one round at a time (``Watchdog.check_once``) on an in-memory store with a fake clock,
fake process states and a fake exit: no thread, no process group. The real signals (SIGKILL, SIGSTOP, a rank stuck in
Python, an exception, Lightning's launcher, Fabric) run in tests/distributed/test_watchdog.py."""

from __future__ import annotations

import io
import json
import os
import re
import signal
from dataclasses import replace
from datetime import timedelta

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
from lightning_2d.parallel.watchdog_rules import Failure, Finding

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
