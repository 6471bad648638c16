"""The progress watchdog's decisions, one round at a time (``Watchdog.check_once``) on an in-memory store
with a fake clock, fake process states and a fake exit: no thread, no process group. The real thing
(SIGKILL, SIGSTOP, an exception, Lightning's launcher) runs in tests/distributed/test_watchdog.py."""

from __future__ import annotations

import io
import os
import re
import signal
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lightning_2d.parallel.watchdog import (
    EXIT_CODE,
    ProcessIdentity,
    Watchdog,
    interval_for,
    is_communication_error,
    process_state,
)

GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:21389: Connection reset by"
    " peer. This is typically caused by a remote worker hanging or bugs in the application."
)


class Exited(BaseException):
    """Raised by the fake ``os._exit``, so a test sees where the watchdog ended the process."""


class World:
    """``n`` ranks on one host sharing a ``HashStore``; every process alive (``R``) unless told otherwise."""

    def __init__(self, n: int = 4, timeout: float = 20.0, hosts: list[str] | None = None) -> None:
        self.store = dist.HashStore()
        self.now = 0.0
        self.states = {1000 + r: "R" for r in range(n)}
        self.killed: list[tuple[int, int]] = []
        hosts = hosts or ["node0"] * n
        self.identities = [ProcessIdentity(hosts[r], "pid:[1]", 1000 + r) for r in range(n)]
        self.out = {r: io.StringIO() for r in range(n)}
        self.marks = Path(tempfile.mkdtemp())
        self.dogs = [self._dog(r, timeout) for r in range(n)]

    def _dog(self, rank: int, timeout: float) -> Watchdog:
        def exit(code: int) -> None:
            raise Exited(code)

        dog = Watchdog(self.store, rank, self.identities, "run", timeout, clock=lambda: self.now, sleep=self.sleep, exit=exit,
                       out=self.out[rank], state_of=lambda pid: self.states.get(pid), kill=self._kill,
                       marks=self.marks)
        dog._store_ok_at = 0.0  # what start() does, without the thread
        return dog

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def _kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))

    def round(self, ranks=None, dt: float = 2.5) -> dict[int, object]:
        """Advance the clock by ``dt`` and run one round on ``ranks``; {rank: exit code or verdict}."""
        self.now += dt
        results = {}
        for r in ranks if ranks is not None else range(len(self.dogs)):  # noqa: SIM118
            try:
                results[r] = self.dogs[r].check_once()
            except Exited as ended:
                results[r] = ended.args[0]
        return results


def test_a_stopped_rank_is_named_by_its_predecessor_after_the_timeout_and_killed():
    world = World(timeout=20.0)
    alive = [0, 2, 3]
    world.round()  # every rank beats once
    world.states[1001] = "T"  # rank 1 stopped: no more heartbeats
    # Rank 0 first sees rank 1's heartbeat at t = 5 s (it checked before rank 1's first beat).
    for _ in range(6):  # up to 15 s of silence: under the bound, nothing happens
        assert world.round(alive) == {0: None, 2: None, 3: None}
    results = world.round(alive, dt=10.0)  # 25 s: rank 0 (which checks rank 1) finds it, publishes, ends
    assert results[0] == EXIT_CODE
    out = world.out[0].getvalue()
    assert re.search(r"Stopping rank 0 \(exit code 75\): rank 1 \(pid 1001 on node0\) has sent no heartbeat for 2\d s", out)
    assert "its process is stopped (SIGSTOP/SIGTSTP)" in out
    assert (1001, signal.SIGKILL) in world.killed  # a stopped rank would hold its memory forever
    # The others read the verdict and end after the grace (their main thread might be failing by itself).
    seen = world.round([2, 3], dt=0.1)
    assert seen[2]["ranks"] == seen[3]["ranks"] == [1]  # seen, not yet acted on
    results = world.round([2, 3], dt=5.0)
    assert results == {2: EXIT_CODE, 3: EXIT_CODE}
    assert "rank 1 (pid 1001 on node0) has sent no heartbeat" in world.out[2].getvalue()
    assert "[found by rank 0]" in world.out[2].getvalue()


def test_a_dead_local_rank_is_found_within_one_round_unless_it_finished():
    world = World()
    world.round()
    world.dogs[3].stop(done=True)  # rank 3 finished the run and exited: not a failure
    del world.states[1003]
    assert world.round([0, 1, 2]) == {0: None, 1: None, 2: None}
    del world.states[1002]  # rank 2 vanished mid-run (SIGKILL, OOM killer)
    results = world.round([0, 1])
    assert results[0] == EXIT_CODE or results[1] == EXIT_CODE
    text = world.out[0].getvalue() + world.out[1].getvalue()
    assert "rank 2 (pid 1002 on node0) died: its process is gone; its last heartbeat reported 0 completed step(s)" in text


def test_the_ring_skips_finished_ranks_and_checks_the_next_one():
    world = World(n=3)
    world.round()
    world.dogs[1].stop(done=True)  # rank 0's successor finished; rank 0 now watches rank 2
    world.round([0, 2])
    for _ in range(10):  # rank 2 silent (another host: no process state to read) for 25 s
        results = world.round([0])
    assert results[0] == EXIT_CODE
    assert "rank 2 (pid 1002 on node0) has sent no heartbeat" in world.out[0].getvalue()


def test_an_exception_is_published_with_its_step_and_the_others_end():
    world = World()
    world.round()
    world.dogs[2].step = 4
    world.dogs[2]._thread = object()  # on_failure acts only while running
    world.dogs[2].on_failure(ValueError("bad batch\nsecond line"))
    results = world.round([0, 1, 3], dt=0.5)  # verdict seen: grace for a failure raised everywhere at once
    assert all(verdict["ranks"] == [2] for verdict in results.values())
    results = world.round([0, 1, 3], dt=5.0)
    assert results == {0: EXIT_CODE, 1: EXIT_CODE, 3: EXIT_CODE}
    assert "rank 2 raised ValueError during step 5: bad batch." in world.out[0].getvalue()
    assert "second line" not in world.out[0].getvalue()


def test_a_rank_failing_by_itself_is_left_to_exit_then_ended_if_it_hangs():
    world = World(timeout=20.0)
    world.round()
    world.dogs[2]._thread = object()
    world.dogs[2].on_failure(ValueError("boom"))  # rank 2 publishes its error
    world.dogs[1]._thread = object()
    world.dogs[1].on_failure(RuntimeError("raised on every rank"))  # rank 1 fails by itself too
    for _ in range(7):
        assert world.round([1], dt=2.5)[1] != EXIT_CODE  # left to exit by itself
    assert world.round([1], dt=5.0) == {1: EXIT_CODE}  # … within the bound, else ended
    assert "this rank did not exit within 20 s of its error" in world.out[1].getvalue()


def test_a_communication_error_waits_for_the_cause_then_reports_itself():
    world = World(timeout=20.0)
    world.round()
    dog = world.dogs[1]
    dog._thread = object()
    start = world.now
    dog.on_failure(RuntimeError(GLOO_RESET))  # a consequence: waits for a rank to be found (none here)
    assert world.now - start >= 20.0 + 2 * dog.interval  # the whole bound
    verdict = world.round([0], dt=0.1)[0]
    assert verdict["ranks"] == [1]  # then it names itself, with what it saw
    assert "rank 1's collective failed at step 1 and no rank was found dead or stopped (RuntimeError:" in verdict["reason"]


def test_a_silent_store_names_the_rank_hosting_it():
    class DeadStore:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("Connection refused")

            return fail

    out = io.StringIO()
    ended = []
    identities = [ProcessIdentity("a", "ns", 10), ProcessIdentity("a", "ns", 11)]
    dog = Watchdog(DeadStore(), 1, identities, "run", 20.0, clock=lambda: now, exit=ended.append, out=out,
                   state_of=lambda pid: "T", kill=lambda pid, sig: None, marks=Path(tempfile.mkdtemp()))
    now = 0.0
    dog._store_ok_at = 0.0
    now = 19.0
    assert dog.check_once() is None and not ended
    now = 21.0
    verdict = dog.check_once()
    assert ended == [EXIT_CODE] and verdict["ranks"] == [0]
    assert "the job's store (hosted by rank 0) has not answered for 21 s (watchdog timeout 20 s): its process is stopped" in out.getvalue()


def test_communication_errors_are_told_from_causes():
    from torch.distributed import DistBackendError

    assert is_communication_error(RuntimeError(GLOO_RESET))
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


def test_process_states_and_intervals():
    assert process_state(os.getpid()) in ("R", "S")
    assert process_state(2**22 + 12345) is None
    assert interval_for(20.0) == 2.5 and interval_for(timedelta(minutes=2).total_seconds()) == 10.0
    assert interval_for(1.0) == 0.2


def test_torchrun_reads_the_verdict_from_its_error_file(tmp_path, monkeypatch):
    """torchrun's failure summary ("Root Cause … traceback :") shows a worker's error file: ours holds the verdict."""
    import json

    from lightning_2d.parallel.watchdog import record_for_torchrun

    record_for_torchrun("ignored outside torchrun")  # no TORCHELASTIC_ERROR_FILE: nothing written, no error
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    record_for_torchrun("rank 2 raised ValueError during step 3: boom")
    data = json.loads((tmp_path / "error.json").read_text())["message"]
    assert data["extraInfo"]["py_callstack"] == "RankFailure: rank 2 raised ValueError during step 3: boom"


class Gone:
    """A store whose host process has ended: every call fails at once."""

    def __getattr__(self, name):
        def fail(*args):
            raise RuntimeError("Connection reset by peer")

        return fail


def test_with_the_store_gone_a_peer_ended_by_the_verdict_is_not_a_new_failure():
    world = World()
    world.round()
    verdict = {"ranks": [1], "by": 0, "reason": "rank 1 (pid 1001 on node0) has sent no heartbeat for 25 s"}
    for rank in (0, 2):  # ranks 0 and 2 read the verdict and ended (their marks on this host say so) …
        try:
            world.dogs[rank]._end(verdict)
        except Exited:
            pass
    for dog in world.dogs:
        dog._store.store = Gone()  # … and the store went away with rank 0
    del world.states[1000], world.states[1002]
    seen = world.round([3], dt=0.5)[3]  # rank 3 never read the verdict from the store
    assert seen["reason"] == verdict["reason"]  # it takes theirs, not "rank 0 died" or "rank 2 died"
    assert world.round([3], dt=5.0)[3] == EXIT_CODE
    out = world.out[3].getvalue()
    assert "Stopping rank 3 (exit code 75): rank 1 (pid 1001 on node0) has sent no heartbeat for 25 s" in out
    assert "died" not in out


def test_a_finished_store_host_going_away_is_the_end_of_the_run_not_a_failure():
    world = World(n=2, timeout=20.0)
    world.round()
    world.dogs[0]._thread = None
    world.dogs[0].stop(done=True)  # rank 0 (the store's host) finished; it waits for rank 1 at most 20 s
    world.round([1])  # rank 1, still working, reads that its host is done
    world.dogs[1]._store.store = Gone()
    del world.states[1000]  # rank 0's process, and the store with it, are gone
    for _ in range(12):  # 30 s without a store
        assert world.round([1]) == {1: None}
    assert world.out[1].getvalue() == ""
