"""Progress watchdog: a rank that dies, stops or fails ends the whole job within a bound, named.

Without it, what a job does when one rank goes away depends on the launcher and on where the other
ranks are: torchrun ends the job when a worker *exits*, but a stopped (SIGSTOP, frozen node, swapped
out) or wedged worker keeps every other rank waiting in its next collective until the process-group
timeout — 30 minutes by default — and the dead or stopped rank is never named; gloo reports a peer's
death as "Connection reset by peer" on whichever rank noticed first.

Each rank runs a ``Watchdog`` thread (started by the strategies in ``setup_environment``, one
``all_gather_object`` of process identities at start, nothing per step on the training path but an
integer write). Every ``interval`` seconds it:

1. writes its heartbeat (a counter, the last optimizer step, a state) into the job's rendezvous store,
   through its own connection (``Store.clone()``), from a helper thread, so a store that stops
   answering never blocks the watchdog itself;
2. reads the job's *verdict* key: the first rank that finds a failure writes it (``compare_set``), and
   every other rank ends itself once it sees it;
3. checks the processes of the ranks on its own host (``/proc``): a rank whose process is gone (or a
   zombie) without having finished is dead — found within one interval;
4. checks the heartbeat of its successor in a ring (rank + 1, skipping finished ranks), so the store
   sees ``O(world)`` operations per interval: a counter unchanged for ``timeout`` seconds is a stalled
   rank (stopped, dead on another host, or starved); the message says which when the process is local;
5. notes when the store itself has not answered for ``timeout`` seconds: the store lives in rank 0's
   process (Lightning's launcher, plain ``MASTER_ADDR`` launches) or in the torchrun agent, so that
   names rank 0 (or the agent's node).

An exception on one rank's main thread (``on_failure``, called from the Trainer's ``on_exception``
hook and from ``sys.excepthook``) becomes the verdict at once, with the step and the error; a
communication error (gloo's "Connection reset", a collective timeout) is a *consequence*, so that rank
instead waits for the watchdog to find the cause, and publishes its own error only when none is found.
A rank ending because of a verdict prints it and calls ``os._exit(EXIT_CODE)``; stopped processes of
the job on its host are killed too (a stopped rank would otherwise hold its memory and devices forever,
e.g. under Lightning's launcher, where nothing else watches the children).

Bound: a dead local rank ends the job within about ``2 × interval`` (+ the grace below); a stopped or
remote-dead rank within ``timeout + 2 × interval``; an exception within ``interval + grace``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from lightning_2d._compat import default_store

#: The exit code of a rank ended by the watchdog (``EX_TEMPFAIL``: resume from the last checkpoint).
EXIT_CODE = 75

#: The default bound: a rank silent this long is declared stalled.
DEFAULT_WATCHDOG_TIMEOUT = timedelta(minutes=2)

_PREFIX = "lightning_2d/watchdog"


def interval_for(timeout: float) -> float:
    """Seconds between two heartbeats for a ``timeout``: an eighth of it, between 0.2 s and 10 s."""
    return min(10.0, max(0.2, timeout / 8))


@dataclass(frozen=True)
class ProcessIdentity:
    """Where a rank's process runs: PIDs are comparable only on one host inside one PID namespace."""

    host: str
    pid_namespace: str
    pid: int

    @staticmethod
    def of_this_process() -> "ProcessIdentity":
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:  # not Linux: no local process checks (heartbeats still work)
            namespace = f"unknown-{os.getpid()}"
        return ProcessIdentity(socket.gethostname(), namespace, os.getpid())

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"


def process_state(pid: int) -> Optional[str]:
    """The state letter of ``pid`` in ``/proc`` (``R``, ``S``, ``D``, ``T`` stopped, ``t`` traced, ``Z``
    zombie, ...), or ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or parentheses.
    return stat[stat.rfind(")") + 2 :][:1] or None


#: What gloo/NCCL/c10d put in the text of a failed collective (gloo raises plain ``RuntimeError``s:
#: "[…/gloo/transport/tcp/pair.cc:537] Read error …: Connection reset by peer").
_COMMUNICATION = re.compile(r"gloo|nccl|NCCL|ProcessGroup|c10d|Connection (reset|closed|refused)|Broken pipe")


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a failed collective or store operation: the *consequence* of
    another rank's failure, not a cause."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        try:
            import torch.distributed as dist

            if isinstance(err, dist.DistError):
                return True
        except ImportError:  # pragma: no cover
            pass
        if isinstance(err, (RuntimeError, ConnectionError, TimeoutError)) and _COMMUNICATION.search(str(err)):
            return True
        todo += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


class StoreTimeout(RuntimeError):
    """The store did not answer one operation in time."""


class _StoreCaller:
    """Runs store operations one at a time in a daemon thread, so that a store that stops answering
    (its host process stopped: c10d's client ignores its own timeout on some operations) can never
    block the caller: each call waits at most ``timeout`` seconds, then raises ``StoreTimeout``."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._busy: Optional[threading.Event] = None

    def __call__(self, method: str, *args: Any, timeout: float) -> Any:
        with self._lock:
            if self._busy is not None and not self._busy.is_set():
                raise StoreTimeout("an earlier store operation has not returned")
            done = threading.Event()
            box: dict[str, Any] = {}

            def run() -> None:
                try:
                    box["value"] = getattr(self.store, method)(*args)
                except BaseException as err:  # noqa: BLE001 — handed to the caller
                    box["error"] = err
                finally:
                    done.set()

            self._busy = done
            threading.Thread(target=run, daemon=True, name="lightning_2d-watchdog-store").start()
        if not done.wait(timeout):
            raise StoreTimeout(f"store.{method} did not return within {timeout:.1f} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")


@dataclass
class _Peer:
    count: int = -1
    since: float = 0.0  # monotonic time the count last changed
    step: int = 0
    done: bool = False


class Watchdog:
    """One rank's watchdog (see the module docstring). ``start()`` it after the process group exists,
    ``stop()`` it when the run ends; set ``step`` after each optimizer step.

    Args:
        store: The job's store (``torch.distributed`` ``Store``); the watchdog uses it through its own
            thread, so give it a dedicated connection (``store.clone()``) when the main thread uses it too.
        rank: This rank.
        identities: Every rank's ``ProcessIdentity``, indexed by rank.
        run_id: Namespaces the keys (one per run: stale keys of an earlier run in the same store,
            e.g. a torchrun restart, are never read).
        timeout: Seconds of silence (heartbeat, store) after which a rank or the store is declared stalled.
        interval: Seconds between two rounds (default ``interval_for(timeout)``).
        store_host: Who hosts the store, for messages (``"rank 0"``; ``"the torchrun agent"``).
        store_host_rank: The rank whose process hosts the store, if a rank does (its local state is checked).
        grace: Seconds a rank gives its own main thread to fail by itself once another rank's verdict is
            seen (an error raised on every rank at once is then reported by each rank itself).
        marks: The folder of this host's marks (``done-R``/``ended-R`` files): how a rank on this host tells
            a peer that finished or was ended by a verdict from one that died, even when the store is gone
            (default: a folder per run in the temporary directory, removed by the last rank to finish).
        clock, sleep, exit, out, state_of, kill: Injected for tests (``time.monotonic``, ``time.sleep``,
            ``os._exit``, ``sys.stderr``, ``process_state``, ``os.kill``).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        identities: list[ProcessIdentity],
        run_id: str,
        timeout: float,
        interval: Optional[float] = None,
        store_host: str = "rank 0",
        store_host_rank: Optional[int] = 0,
        grace: Optional[float] = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
        exit: Callable[[int], Any] = os._exit,
        out: Optional[TextIO] = None,
        state_of: Callable[[int], Optional[str]] = process_state,
        kill: Callable[[int, int], None] = os.kill,
        marks: Optional[Path] = None,
    ) -> None:
        self.rank = rank
        self.world_size = len(identities)
        self.identities = identities
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else interval_for(self.timeout)
        self.grace = grace if grace is not None else min(5.0, 2 * self.interval)
        self.store_host = store_host
        self.store_host_rank = store_host_rank
        self.step = 0
        self._store = _StoreCaller(store)
        self._prefix = f"{_PREFIX}/{run_id}"
        self._clock, self._sleep, self._exit, self._out = clock, sleep, exit, out
        self._state_of, self._kill = state_of, kill
        self._marks = Path(marks) if marks is not None else Path(tempfile.gettempdir()) / f"lightning_2d-watchdog-{run_id}"
        self._store_host_done = False
        me = identities[rank]
        self._local = [
            r for r, ident in enumerate(identities)
            if r != rank and ident.host == me.host and ident.pid_namespace == me.pid_namespace
        ]
        self._count = 0
        self._state = "alive"
        self._peers = {r: _Peer() for r in range(self.world_size)}
        self._store_ok_at: float = 0.0
        self._verdict_seen_at: Optional[float] = None
        self._failing_since: Optional[float] = None
        self._failure: Optional[BaseException] = None
        self._waiting_for_cause = False
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- keys --------------------------------------------------------------------------------
    def _beat_key(self, rank: int) -> str:
        return f"{self._prefix}/beat/{rank}"

    @property
    def _verdict_key(self) -> str:
        return f"{self._prefix}/verdict"

    @property
    def _ack_key(self) -> str:
        return f"{self._prefix}/ended"

    @property
    def _done_key(self) -> str:
        return f"{self._prefix}/done"

    # ---- marks on this host (no store needed) ------------------------------------------------
    def _mark(self, kind: str, verdict: Optional[dict[str, Any]] = None) -> None:
        try:
            self._marks.mkdir(parents=True, exist_ok=True)
            tmp = self._marks / f".{kind}-{self.rank}.tmp"
            tmp.write_text(json.dumps(verdict or {}))
            tmp.replace(self._marks / f"{kind}-{self.rank}")
        except OSError:
            pass

    def _read_mark(self, rank: int) -> Optional[tuple[str, dict[str, Any]]]:
        for kind in ("done", "ended"):
            try:
                return kind, json.loads((self._marks / f"{kind}-{rank}").read_text() or "{}")
            except (OSError, ValueError):
                continue
        return None

    def _remove_marks_if_last(self) -> None:
        """The last rank of this host to finish (the others marked, or their processes gone) removes the marks."""
        if all(self._read_mark(r) is not None or self._state_of(self.identities[r].pid) in (None, "Z", "X")
               for r in self._local):
            shutil.rmtree(self._marks, ignore_errors=True)

    # ---- life cycle --------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        now = self._clock()
        self._store_ok_at = now
        for peer in self._peers.values():
            peer.since = now
        self._thread = threading.Thread(target=self._run, daemon=True, name="lightning_2d-watchdog")
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """End the thread; ``done``: tell the other ranks this one finished (its silence is not a stall).

        The rank hosting the store then waits (at most ``timeout``) for every other rank to finish too:
        its process takes the store with it, and a rank still working would take that for a failure.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 2.0)  # its round ends first: one store user at a time
        if done and self._failing_since is None:
            self._state = "done"
            self._mark("done")
            try:
                self._beat()
                self._call("add", self._done_key, 1)
                if self.store_host_rank == self.rank:
                    self._wait_for_count(self._done_key, self.world_size, self.timeout, unless_verdict=True)
            except Exception:  # noqa: BLE001 — best effort: the run is over
                pass
            self._remove_marks_if_last()
        if self._thread is None or not self._thread.is_alive():
            self._store.store = None  # close its connection now, not during interpreter finalization

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopped.is_set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.check_once()
            except Exception as err:  # noqa: BLE001 — the watchdog must never take the rank down by mistake
                self._print(f"the watchdog's check failed ({type(err).__name__}: {err}); checking again")

    # ---- one round ---------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        value = self._store(method, *args, timeout=max(1.0, self.interval))
        self._store_ok_at = self._clock()
        return value

    def _beat(self) -> None:
        self._count += 1
        self._call("set", self._beat_key(self.rank), f"{self._count} {self.step} {self._state}")

    def _read_beat(self, rank: int) -> Optional[tuple[int, int, str]]:
        key = self._beat_key(rank)
        if not self._call("check", [key]):
            return None
        count, step, state = self._call("get", key).decode().split()
        return int(count), int(step), state

    def _read_verdict(self) -> Optional[dict[str, Any]]:
        if not self._call("check", [self._verdict_key]):
            return None
        return json.loads(self._call("get", self._verdict_key).decode())

    def _publish(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """Write ``verdict`` unless another rank wrote one first; return the one that holds."""
        stored = self._call("compare_set", self._verdict_key, "", json.dumps(verdict))
        return json.loads(stored.decode()) if stored else verdict

    def check_once(self) -> Optional[dict[str, Any]]:
        """One round: heartbeat, verdict, local processes, successor, store. Returns the verdict acted on."""
        now = self._clock()
        verdict: Optional[dict[str, Any]] = None
        finding: Optional[dict[str, Any]] = None
        store_up = True
        try:
            self._beat()
            verdict = self._read_verdict()
            host = self.store_host_rank
            if host is not None and host != self.rank and not self._store_host_done:
                beat = self._read_beat(host)
                self._store_host_done = beat is not None and beat[2] == "done"
        except Exception:  # noqa: BLE001 — timeouts and connection errors: judged by the silence below
            store_up = False
        if verdict is None:
            finding = self._check_local_processes(store_up) or (self._check_successor(now) if store_up else None)
            if finding is None and now - self._store_ok_at > self.timeout and not self._store_host_done:
                # (Once the store's host has finished, its store going away is the end of the run.)
                finding = self._store_silence(now)
            if finding is not None:
                verdict = finding
                if store_up:
                    try:
                        verdict = self._publish(finding)
                    except Exception:  # noqa: BLE001 — act on our own finding
                        pass
        if verdict is not None:
            return self._act(verdict, now, own=verdict.get("by") == self.rank)
        return None

    def _check_local_processes(self, store_up: bool) -> Optional[dict[str, Any]]:
        """A rank on this host whose process is gone (or a zombie) and that never said it finished."""
        for r in self._local:
            if self._peers[r].done:
                continue
            state = self._state_of(self.identities[r].pid)
            if state not in (None, "Z", "X"):
                continue
            mark = self._read_mark(r)
            if mark is not None and mark[0] == "done" or (r == self.store_host_rank and self._store_host_done):
                self._peers[r].done = True
                continue
            if mark is not None:  # ended by a verdict it read: the same verdict, even with the store gone
                self._peers[r].done = True
                if mark[1].get("reason"):
                    return mark[1]
                continue
            if store_up:
                try:
                    beat = self._read_beat(r)
                except Exception:  # noqa: BLE001
                    beat = None
                if beat is not None and beat[2] in ("done", "ended"):  # finished, or ended by a verdict
                    self._peers[r].done = True
                    continue
                if beat is not None:
                    self._peers[r].step = beat[1]
            silence = self._clock() - self._store_ok_at
            if not store_up and r == self.store_host_rank and silence > 2 * self.interval:
                # Silent first, gone now: stopped or hung, then killed (by a rank of this job, or the launcher).
                reason = (
                    f"rank {r} ({self.identities[r]}), which hosts the job's store, stopped answering {silence:.0f} s"
                    " ago and its process is now gone"
                )
            else:
                reason = (
                    f"rank {r} ({self.identities[r]}) died: its process is gone"
                    + (" (a zombie: killed, e.g. by the OOM killer or a signal)" if state in ("Z", "X") else "")
                )
            return {
                "ranks": [r],
                "by": self.rank,
                "reason": reason + f"; its last heartbeat reported {self._peers[r].step} completed step(s)",
            }
        return None

    def _successor(self) -> Optional[int]:
        for k in range(1, self.world_size):
            r = (self.rank + k) % self.world_size
            if not self._peers[r].done:
                return r
        return None

    def _check_successor(self, now: float) -> Optional[dict[str, Any]]:
        r = self._successor()
        if r is None:
            return None
        peer = self._peers[r]
        try:
            beat = self._read_beat(r)
        except Exception:  # noqa: BLE001
            return None
        if beat is not None:
            count, step, state = beat
            if state in ("done", "ended"):
                peer.done = True
                return None
            if count != peer.count:
                peer.count, peer.step, peer.since = count, step, now
        silent = now - peer.since
        if silent <= self.timeout:
            return None
        return {
            "ranks": [r],
            "by": self.rank,
            "reason": f"rank {r} ({self.identities[r]}) has sent no heartbeat for {silent:.0f} s (watchdog timeout"
            f" {self.timeout:.0f} s){self._describe_state(r)}; its last heartbeat reported {peer.step} completed step(s)",
        }

    def _describe_state(self, rank: int) -> str:
        if rank not in self._local:
            return " (another host: stopped, dead or cut off)"
        state = self._state_of(self.identities[rank].pid)
        return {
            None: ": its process is gone",
            "Z": ": its process is a zombie (killed)",
            "T": ": its process is stopped (SIGSTOP/SIGTSTP)",
            "t": ": its process is stopped by a debugger",
            "D": ": its process is blocked in the kernel (I/O)",
        }.get(state, f": its process is alive (state {state}) but its watchdog has not run (starved, or wedged"
                     " holding the GIL)")

    def _store_silence(self, now: float) -> dict[str, Any]:
        host = self.store_host_rank
        ranks = [host] if host is not None else []
        state = self._describe_state(host) if host is not None and host != self.rank else ""
        return {
            "ranks": ranks,
            "by": self.rank,
            "reason": f"the job's store (hosted by {self.store_host}) has not answered for"
            f" {now - self._store_ok_at:.0f} s (watchdog timeout {self.timeout:.0f} s){state}",
        }

    # ---- acting ------------------------------------------------------------------------------
    def _act(self, verdict: dict[str, Any], now: float, own: bool) -> Optional[dict[str, Any]]:
        if self._failing_since is not None and not self._waiting_for_cause:
            # Failing by itself (its own error, or one raised on every rank): let it exit, within the bound.
            if now - self._failing_since > self.timeout:
                self._end(verdict, f"this rank did not exit within {self.timeout:.0f} s of its error")
            return verdict
        if self._verdict_seen_at is None:
            self._verdict_seen_at = now
        if own or self._waiting_for_cause or now - self._verdict_seen_at >= self.grace:
            self._end(verdict)
        return verdict

    def _end(self, verdict: dict[str, Any], why: str = "") -> None:
        culprits = verdict.get("ranks", [])
        lines = [
            f"Stopping rank {self.rank} (exit code {EXIT_CODE}): {verdict.get('reason', 'another rank failed')}"
            + (f" [found by rank {verdict['by']}]" if verdict.get("by") not in (None, self.rank, *culprits) else "")
            + (f"; {why}" if why else "")
            + ". Resume from the last complete checkpoint (ckpt_path='last')."
        ]
        if self._failure is not None:
            # Where this rank's main thread was (the message's first line only: c10 appends C++ frames).
            text = str(self._failure).strip().splitlines()
            what = "a consequence" if is_communication_error(self._failure) else "raised here"
            lines.append(
                f"This rank's own error ({what}): "
                + "".join(traceback.format_tb(self._failure.__traceback__, limit=-6))
                + f"{type(self._failure).__name__}: {text[0][:500] if text else ''}"
            )
        self._print("\n".join(lines))
        record_for_torchrun(lines[0])
        # Stopped processes of this job on this host would hold their memory and devices forever.
        for r in self._local:
            if r in culprits and self._state_of(self.identities[r].pid) in ("T", "t"):
                try:
                    self._kill(self.identities[r].pid, signal.SIGKILL)
                    self._print(f"killed the stopped rank {r} ({self.identities[r]})")
                except OSError:
                    pass
        self._state = "ended"
        self._mark("ended", verdict)
        try:  # "ended", not dead: the others must not take this exit for a new failure
            self._beat()
            self._call("add", self._ack_key, 1)
            self._hold_store(len(set(culprits)))
        except Exception:  # noqa: BLE001 — the store is gone: nothing left to tell
            pass
        self._remove_marks_if_last()
        self._stopped.set()
        self._exit(EXIT_CODE)

    def _hold_store(self, culprits: int) -> None:
        """On the rank hosting the store, before its process ends: wait (a few intervals at most) until the
        ranks not named in the verdict (``world - culprits``; each acknowledges once) have read it, so that
        none takes the store's end for a new failure."""
        if self.store_host_rank == self.rank:
            self._wait_for_count(self._ack_key, self.world_size - culprits, 3 * self.interval + self.grace + 1.0)

    def _wait_for_count(self, key: str, target: int, seconds: float, unless_verdict: bool = False) -> None:
        """Wait (at most ``seconds``) until the counter ``key`` reaches ``target`` (or, with ``unless_verdict``,
        a verdict appears: a failure ends the wait)."""
        deadline = self._clock() + seconds
        while self._clock() < deadline and int(self._call("add", key, 0)) < target:
            if unless_verdict and self._call("check", [self._verdict_key]):
                return
            self._sleep(min(0.2, self.interval / 4))

    def _print(self, message: str) -> None:
        out = self._out or sys.stderr
        try:
            print(f"[lightning_2d watchdog, rank {self.rank}] {message}", file=out, flush=True)
        except Exception:  # noqa: BLE001 — a closed stream must not stop the exit
            pass

    # ---- the main thread failed ----------------------------------------------------------------
    def on_failure(self, exc: BaseException) -> None:
        """This rank's main thread is failing with ``exc``. A communication error waits (up to
        ``timeout + 2 × interval``) for the watchdog to find the rank that caused it — the process then
        ends with that verdict; any other error is published at once as the cause."""
        if self._failing_since is not None or not self.running:
            return
        self._failure = exc
        self._failing_since = self._clock()
        self._state = "failed"
        if is_communication_error(exc):
            self._waiting_for_cause = True
            deadline = self._clock() + self.timeout + 2 * self.interval
            while self._clock() < deadline and not self._stopped.is_set():
                self._sleep(min(0.2, self.interval))
            self._waiting_for_cause = False
            self._failing_since = self._clock()  # from now on, `timeout` to exit by itself
            reason = (
                f"rank {self.rank}'s collective failed at step {self.step + 1} and no rank was found dead or stopped"
                f" ({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''})"
            )
        else:
            text = str(exc).strip().splitlines()
            reason = (
                f"rank {self.rank} raised {type(exc).__name__} during step {self.step + 1}"
                + (f": {text[0][:300]}" if text else "")
            )
        record_for_torchrun(reason)
        try:
            verdict = self._publish({"ranks": [self.rank], "by": self.rank, "reason": reason})
            culprits = set(verdict.get("ranks", []))
            if self.rank not in culprits:  # failing too (e.g. an error raised on every rank): has read the verdict
                self._call("add", self._ack_key, 1)
            self._hold_store(len(culprits))
        except Exception:  # noqa: BLE001 — the store is gone: the other ranks find the silence
            pass


def record_for_torchrun(message: str) -> None:
    """Write ``message`` into torchrun's error file for this worker (``TORCHELASTIC_ERROR_FILE``, the format
    of ``torch.distributed.elastic``'s ``ErrorHandler``), so that torchrun's failure summary ("Root Cause")
    says which rank failed and why instead of only an exit code. No-op outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"RankFailure: {message}",
                        "extraInfo": {"py_callstack": f"RankFailure: {message}", "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


# ---- process-wide wiring ----------------------------------------------------------------------
_ACTIVE: list[Watchdog] = []
_HOOKED = False


def _excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(kind: type, value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)  # the traceback first: a verdict may end the process
        for dog in list(_ACTIVE):
            dog.on_failure(value)

    return hook


def _stop_all_at_exit() -> None:
    for dog in list(_ACTIVE):
        stop_watchdog(dog)


def start_watchdog(timeout: Optional[timedelta], rank: int, world_size: int, **kwargs: Any) -> Optional[Watchdog]:
    """Start this rank's watchdog on the default process group's store (collective: every rank calls it).

    Returns ``None`` (no watchdog) when ``timeout`` is ``None`` or the world has one rank.
    """
    import atexit
    import uuid

    import torch.distributed as dist

    if timeout is None or world_size < 2:
        return None
    identity = ProcessIdentity.of_this_process()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (identity, uuid.uuid4().hex if rank == 0 else None))
    run_id = gathered[0][1]
    store = default_store()
    try:
        store = store.clone()  # its own connection: the main thread's store calls never wait behind ours
    except Exception:  # noqa: BLE001 — a store kind without clone() (FileStore): share it
        pass
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    dog = Watchdog(
        store, rank, [g[0] for g in gathered], run_id, timeout.total_seconds(),
        store_host="the torchrun agent on the master node" if agent else "rank 0 (MASTER_ADDR)",
        store_host_rank=None if agent else 0,
        **kwargs,
    ).start()
    global _HOOKED
    if not _HOOKED:
        _HOOKED = True
        sys.excepthook = _excepthook(sys.excepthook)
        atexit.register(_stop_all_at_exit)
    _ACTIVE.append(dog)
    return dog


def stop_watchdog(dog: Optional[Watchdog]) -> None:
    """Stop ``dog`` at the end of a run (the strategy's teardown, or at exit): finished (``done``) unless
    its rank failed. Until then it also guards a failing rank's own clean-up (a wait on a dead peer)."""
    if dog is None:
        return
    dog.stop(done=True)
    if dog in _ACTIVE:
        _ACTIVE.remove(dog)
