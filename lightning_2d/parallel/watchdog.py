"""Failure watchdog: a rank that dies, stops, hangs or raises ends the job within a bound, named on every rank.

torch's own mechanisms first (torchrun's error files, ``nccl_failure_env``); this module names the rank that *caused*
a failure, ends a job whose rank is stopped or stuck, on gloo and NCCL alike. CONTRIBUTING.md has the rules."""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_2d._compat import default_store

#: The exit code of a rank ended by the watchdog (``EX_TEMPFAIL``: resume from the last checkpoint).
EXIT_CODE = 75
DEFAULT_WATCHDOG_TIMEOUT = timedelta(minutes=2)
#: gloo's plain ``RuntimeError`` for a dead or silent peer: "[…/gloo/transport/tcp/pair.cc:537] Read error …".
_GLOO = ("gloo/transport", "Connection reset by peer", "Connection closed by peer")
_STORE_ERRORS = (RuntimeError, TimeoutError)  # c10d's DistStoreError and DistNetworkError are RuntimeErrors
_GONE, _STOPPED = (None, "Z", "X"), ("T", "t")  # process states (``/proc/PID/stat``; ``None``: no such process)


def process_state(pid: int) -> Optional[str]:
    """``pid``'s state letter in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, …); ``None``: no such process."""
    with suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2 :][:1] or None  # the command name (field 2) may hold spaces and parentheses
    return None


def is_communication_error(exc: Optional[BaseException], _seen: Optional[set[int]] = None) -> bool:
    """Whether ``exc`` (or what it wraps) is a failed collective or store call: another rank's failure's consequence."""
    if exc is None or id(exc) in (_seen := _seen or set()):
        return False
    _seen.add(id(exc))
    if isinstance(exc, (dist.DistError, ConnectionError)) or type(exc) is RuntimeError and any(s in str(exc) for s in _GLOO):
        return True
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
    wrapped = [exc.__cause__, exc.__context__, *[f[0] for f in (failures or {}).values() if isinstance(f, tuple)]]
    return any(is_communication_error(e, _seen) for e in wrapped)


#: The flight recorder's ring buffer of recent collectives and its dump file, each as (torch >= 2.9's name, the
#: older one). torch 2.9 renamed them; it still reads the old names, with a deprecation warning, and the new one wins
#: where both are set. ``TORCH_NCCL_DUMP_ON_TIMEOUT`` kept its name.
FLIGHT_RECORDER_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FLIGHT_RECORDER_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FLIGHT_RECORDER_RENAMED_IN = "2.9"


def nccl_failure_env(watchdog_timeout: Optional[timedelta], torch_version: Optional[str] = None) -> dict[str, str]:
    """Turn on torch's NCCL failure handling (README, "When a rank dies") for the process groups created afterwards,
    each variable only where the environment lacks it; returns what it set (nothing without a ``watchdog_timeout``).

    Args:
        watchdog_timeout: The strategy's; NCCL's heartbeat monitor aborts a hung rank after it (60 s at least).
        torch_version: Which names the flight recorder reads (``FLIGHT_RECORDER_BUFFER``); default: this torch's.
    """
    if watchdog_timeout is None:
        return {}
    from torch.torch_version import TorchVersion

    renamed = TorchVersion(torch_version or torch.__version__) >= FLIGHT_RECORDER_RENAMED_IN
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(60, int(watchdog_timeout.total_seconds()))),
    }
    if not any(name in os.environ for name in FLIGHT_RECORDER_BUFFER):  # the user's size, under either name, stays
        wanted[FLIGHT_RECORDER_BUFFER[0 if renamed else 1]] = "2000"
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    return added


def record_for_torchrun(message: str, cause: Optional[BaseException] = None) -> None:
    """Write ``message`` (after ``cause``'s traceback) into this worker's torchrun error file, for its "Root Cause"."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        raise RuntimeError(message) from cause
    except RuntimeError as failure:
        with suppress(OSError):
            ErrorHandler().record_exception(failure)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()  # (c10d appends C++ frames to its messages)
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


class _Store:
    """The job's store, called from one long-lived thread: a read from a store whose host is stopped never returns
    (c10d's client ignores its timeout then), so a caller waits ``timeout`` at most, then gets a ``TimeoutError``."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="lightning_2d-watchdog-store").start()

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            try:
                call[2].put((True, getattr(self.store, call[0])(*call[1])))
            except Exception as err:  # noqa: BLE001 — the caller's to handle
                call[2].put((False, err))
        self.store = None  # its connection closes now, not during interpreter finalization

    def __call__(self, method: str, *args: Any, timeout: float) -> Any:
        self.calls.put((method, args, reply := queue.SimpleQueue()))
        with suppress(queue.Empty):
            ok, value = reply.get(timeout=timeout)
            if not ok:
                raise value
            return value
        raise TimeoutError(f"the job's store did not answer {method} within {timeout:.1f} s")


class Watchdog:
    """One rank's watchdog (``start_watchdog`` makes it): set ``started``/``step`` (optimizer step entered/completed) on
    the training path, call ``on_failure(exc)`` when the main thread fails and ``stop()`` at the end. ``processes``:
    every rank's (host, PID namespace, PID); ``store_host_rank`` ``None``: torchrun's agent hosts the store. Tests
    replace ``clock``, ``sleep``, ``exit``, ``out``, ``state_of`` and ``kill``."""

    def __init__(self, store: Any, rank: int, processes: list[tuple[str, str, int]], run_id: str,
                 watchdog_timeout: float, collective_timeout: Optional[float] = None,
                 store_host_rank: Optional[int] = 0) -> None:
        self.rank, self.processes, self.world_size = rank, processes, len(processes)
        self.watchdog_timeout, self.store_host_rank = float(watchdog_timeout), store_host_rank
        self.bound = min(self.watchdog_timeout, collective_timeout or float("inf"))  # neither timeout is extended
        self.interval = min(5.0, max(0.2, self.bound / 10))  # seconds between two rounds
        self.grace, self.wait_for_cause = min(5.0, 2 * self.interval), 3 * self.interval + 1.0
        self.started = self.step = 0
        self.verdict: Optional[dict[str, Any]] = None
        self.clock, self.sleep, self.exit, self.out, self.state_of, self.kill = (
            time.monotonic, time.sleep, os._exit, None, process_state, os.kill)
        self._store, self._prefix = _Store(store), f"lightning_2d/watchdog/{run_id}"
        self._local = [r for r, p in enumerate(processes) if r != rank and p[:2] == processes[rank][:2]]
        self._done: set[int] = set()  # ranks that finished: the ring skips them
        self._watched, self._count, self._since, self._behind_since = rank, -1, 0.0, None  # the watched successor
        self._beats, self._state, self._store_ok_at, self._seen_at, self._failed_at = 0, "alive", 0.0, 0.0, 0.0
        self._failure: Optional[BaseException] = None
        self._waiting, self._stopped, self._ending, self._thread = False, threading.Event(), threading.Lock(), None
        self._call("set", self._key(rank), self._beat())  # every key a round reads exists: multi_get waits for one
        if rank == 0:
            self._call("set", self._key("verdict"), "")

    def start(self, thread: bool = True) -> "Watchdog":
        self._store_ok_at = self._since = self.clock()
        if thread:
            self._thread = threading.Thread(target=self._run, daemon=True, name="lightning_2d-watchdog")
            self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """End the thread; ``done``: this rank finished, unless it failed (see ``_leave``)."""
        if done and self._failure is None and not self._stopped.is_set():
            self._leave("done")
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 2.0)
        self._store.calls.put(None)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.check_once()
            except Exception as err:  # noqa: BLE001 — the watchdog must never take the rank down by mistake
                self._print(f"the watchdog's check failed ({type(err).__name__}: {err}); checking again")

    def _key(self, name: object) -> str:
        return f"{self._prefix}/{name}"

    def _call(self, method: str, *args: Any) -> Any:
        value = self._store(method, *args, timeout=max(1.0, self.interval))
        self._store_ok_at = self.clock()
        return value

    def _beat(self) -> str:
        self._beats += 1
        return f"{self._beats} {self.started} {self.step} {self._state}"

    # ---- one round: heartbeat, verdict, finding, action ------------------------------------------------------------
    def check_once(self) -> Optional[dict[str, Any]]:
        """One round; acts on the verdict, and returns it."""
        now, beat = self.clock(), None
        successor = next((r for r in ((self.rank + k) % self.world_size for k in range(1, self.world_size))
                          if r not in self._done), self.rank)
        if successor != self._watched:
            self._watched, self._count, self._since, self._behind_since = successor, -1, now, None
        with suppress(*_STORE_ERRORS):  # (a silent store is judged below)
            self._call("set", self._key(self.rank), self._beat())
            verdict, beat = self._call("multi_get", [self._key("verdict"), self._key(successor)])
            if verdict and self.verdict is None:
                self.verdict, self._seen_at = json.loads(verdict), now
        if self.verdict is None and (found := self._judge(beat, now)):
            self.verdict, self._seen_at = self._publish({"ranks": found[0], "by": self.rank, "reason": found[1]}), now
        verdict = self.verdict or {}  # acted on unless this rank fails by itself, with its own error (its own exit);
        if verdict and (self._failure is None or self._waiting) and (  # the grace: an error raised on every rank at
                not verdict.get("raised") or self.rank in verdict["ranks"] or now - self._seen_at >= self.grace):
            self._end()  # once is each rank's own to report
        return self.verdict

    def _judge(self, beat: Optional[bytes], now: float) -> Optional[tuple[list[int], str]]:
        """The store silent, or the watched successor gone (on this host), silent or behind, longer than the limit?"""
        limit, why = (2 * self.interval, f"(and rank {self.rank}'s collective failed)") if self._waiting else (
            self.watchdog_timeout, f"(watchdog timeout {self.watchdog_timeout:.0f} s)")
        if now - self._store_ok_at > limit:
            host, where = self.store_host_rank, f"rank {self.store_host_rank} (MASTER_ADDR)"
            return [] if host is None else [host], (
                f"the job's store (hosted by {where if host is not None else 'the torchrun agent'}) has not answered"
                f" for {now - self._store_ok_at:.0f} s {why}{self._describe(host)}")
        if beat is None or (r := self._watched) == self.rank:
            return None
        count, started, step, state = beat.decode().split()
        if state in ("done", "ended"):
            self._done.add(r)  # the next round watches the next rank
            return None
        if int(count) != self._count:
            self._count, self._since = int(count), now
        self._behind_since = None if int(started) >= self.started else self._behind_since or now
        who = f"rank {r} (pid {self.processes[r][2]} on {self.processes[r][0]})"
        steps = f"; its last heartbeat reported {step} completed step(s)"
        if r in self._local and self.state_of(self.processes[r][2]) in _GONE:
            return [r], f"{who} died: its process is gone{steps}"
        # Silence or a lag may be waiting on a rank that died (a save or a collective with it): a dead rank on this
        # host is the cause, whichever rank watches it (the race seen: rank 3 named stuck while rank 1 was dead).
        if (now - self._since > limit or self._behind_since is not None) and (dead := self._dead_local(r)) is not None:
            return [dead], f"rank {dead} (pid {self.processes[dead][2]} on {self.processes[dead][0]}) died: its process is gone"
        if now - self._since > limit:
            return [r], f"{who} has sent no heartbeat for {now - self._since:.0f} s {why}{self._describe(r)}{steps}"
        # Stuck: behind the step this rank started, its heartbeat fresh (else it is stopped).
        behind = self._behind_since  # (while waiting for a cause: behind since before the collective failed)
        lag = 0.0 if behind is None or self._waiting and behind > self._failed_at - self.interval else now - behind
        if lag > limit and now - self._since <= 3 * self.interval:
            return [r], (f"{who} is stuck at step {started} (others at step {self.started}) for {lag:.0f} s {why}:"
                         " alive (its heartbeat beats) but not progressing")
        return None

    def _dead_local(self, watched: int) -> Optional[int]:
        """A rank on this host, other than this one and the watched one, whose process is gone without having
        finished (its last heartbeat not "done"/"ended"); ``None``: none (or the store cannot tell)."""
        gone = [d for d in self._local if d != watched and d not in self._done
                and self.state_of(self.processes[d][2]) in _GONE]
        if gone:
            with suppress(*_STORE_ERRORS):
                for d, beat in zip(gone, self._call("multi_get", [self._key(d) for d in gone])):
                    if not beat or beat.decode().split()[3] not in ("done", "ended"):
                        return d
        return None

    def _describe(self, rank: Optional[int]) -> str:
        if rank is None or rank == self.rank:
            return ""
        if rank not in self._local:
            return " (another host: stopped, dead or cut off)"
        state = self.state_of(self.processes[rank][2])
        if state in _GONE + _STOPPED:
            return f": its process is {'stopped (SIGSTOP/SIGTSTP)' if state in _STOPPED else 'gone'}"
        return f": its process is alive (state {state}) but its watchdog does not run"

    def _publish(self, finding: dict[str, Any]) -> dict[str, Any]:
        """Write ``finding`` unless another rank wrote a verdict first; the verdict that holds."""
        with suppress(*_STORE_ERRORS):
            held = self._call("compare_set", self._key("verdict"), "", json.dumps(finding))
            return json.loads(held) if held else finding
        return finding  # the store is gone: act on this rank's own finding

    def _end(self) -> None:
        with self._ending:  # once, from whichever thread comes first; the other waits for the exit
            verdict = self.verdict or {}
            culprits, by = verdict.get("ranks", []), verdict.get("by")
            line = (f"Stopping rank {self.rank} (exit code {EXIT_CODE}): {verdict.get('reason', 'another rank failed')}"
                    + (f" [found by rank {by}]" if by not in (None, self.rank, *culprits) else "")
                    + ". Resume from the last complete checkpoint (ckpt_path='last').")
            if self._failure is not None:
                kind = "a consequence" if is_communication_error(self._failure) else "raised here"
                line += f"\nThis rank's own error ({kind}): {_error(self._failure)}"
            self._print(line)
            if self.rank in culprits:  # named but alive (stuck): where its threads are
                with suppress(OSError, ValueError):  # (a stream without a file descriptor)
                    faulthandler.dump_traceback(self.out or sys.stderr, all_threads=True)
            record_for_torchrun(line.splitlines()[0])
            for r in (r for r in culprits if r in self._local and self.state_of(self.processes[r][2]) in _STOPPED):
                with suppress(OSError):  # a stopped rank would hold its memory and devices forever
                    self.kill(self.processes[r][2], signal.SIGKILL)
                    self._print(f"killed the stopped rank {r} (pid {self.processes[r][2]})")
            self._leave("ended")
            self._stopped.set()
            self.exit(EXIT_CODE)

    def _leave(self, state: str) -> None:
        """Write this rank's ``state`` ("done", "ended": no failure). The rank hosting the store (its exit takes it along)
        then waits while another rank is "alive" or "failed" (waiting for a cause): the bound at most after finishing;
        two rounds after a verdict, not for culprits that raised, are stopped, gone or elsewhere (need not read it)."""
        self._state, finished = state, state == "done"
        verdict = {} if finished else self.verdict or {}
        skip = {r for r in verdict.get("ranks", []) if verdict.get("raised") or r not in self._local
                or self.state_of(self.processes[r][2]) in _GONE + _STOPPED}
        until = self.clock() + self.bound if finished else self._seen_at + 2 * self.interval + 1
        keys = [self._key(r) for r in range(self.world_size) if r != self.rank and r not in skip]
        with suppress(*_STORE_ERRORS):
            self._call("set", self._key(self.rank), self._beat())
            while self.store_host_rank == self.rank and keys and self.clock() < until and any(
                    beat.rsplit(b" ", 1)[-1] in (b"alive", b"failed") for beat in self._call("multi_get", keys)):
                self.sleep(min(0.2, self.interval / 4))

    def _print(self, message: str) -> None:
        with suppress(OSError, ValueError):  # a closed stream must not stop the exit
            print(f"[lightning_2d watchdog, rank {self.rank}] {message}", file=self.out or sys.stderr, flush=True)

    def on_failure(self, exc: BaseException) -> None:
        """This rank's main thread fails with ``exc``. Any error but a communication one is the verdict at once, with
        its step. A failed collective is a consequence: wait (``wait_for_cause`` at most, thresholds lowered to two
        intervals) for its cause and end with that verdict; else report this rank's failure, saying so."""
        if self._failure is not None or self._stopped.is_set():
            return
        self._failure, self._failed_at, self._state = exc, self.clock(), "failed"
        self._waiting = is_communication_error(exc)
        if self._waiting:
            while self.verdict is None and self.clock() < self._failed_at + self.wait_for_cause:
                self.sleep(min(0.2, self.interval / 4))
            reason = (f"rank {self.rank}'s collective failed during step {self.step + 1} ({_error(exc)}) and no rank"
                      f" was found dead, stopped or stuck within {self.wait_for_cause:.0f} s")
        else:
            reason = f"rank {self.rank} raised {_error(exc).replace(':', f' during step {self.step + 1}:', 1)}"
        if self.verdict is None:
            finding = {"ranks": [self.rank], "by": self.rank, "reason": reason, "raised": True}
            self.verdict, self._seen_at = self._publish(finding), self.clock()
        if self._waiting and self.rank not in self.verdict["ranks"]:
            self._end()  # a consequence: end with its cause
        self._waiting = False
        record_for_torchrun(reason, exc)
        if self.rank in self.verdict["ranks"]:
            self._leave("failed")


_ACTIVE: list[Watchdog] = []
_RUNS = [0]


def _at_exit() -> None:
    """An uncaught exception (a Fabric script has no Trainer hook) is ``sys.last_value`` by now: report it."""
    for dog in list(_ACTIVE):
        if getattr(sys, "last_value", None) is not None:
            dog.on_failure(sys.last_value)
        dog.stop(done=True)


def start_watchdog(watchdog_timeout: Optional[timedelta], rank: int, world_size: int,
                   collective_timeout: Optional[timedelta] = None) -> Optional[Watchdog]:
    """Start this rank's watchdog on the default process group's store (collective: every rank calls it); ``None``
    without a ``watchdog_timeout`` or with one rank. The job ends within the shorter of ``watchdog_timeout`` and
    ``collective_timeout`` (the process groups' ``timeout``), plus a few intervals."""
    if watchdog_timeout is None or world_size < 2:
        return None
    _RUNS[0] += 1  # every rank starts its watchdogs in the same order: the same run id on every rank
    namespace = os.readlink("/proc/self/ns/pid") if os.path.exists("/proc/self/ns/pid") else f"no-proc-{os.getpid()}"
    processes: list[Any] = [None] * world_size  # PIDs compare only on one host inside one PID namespace
    dist.all_gather_object(processes, (socket.gethostname(), namespace, os.getpid()))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    run_id = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}-{_RUNS[0]}"
    dog = Watchdog(default_store().clone(), rank, processes, run_id, watchdog_timeout.total_seconds(),
                   collective_timeout and collective_timeout.total_seconds(), store_host_rank=None if agent else 0)
    dist.barrier()  # every rank's keys are written
    if _RUNS[0] == 1:
        atexit.register(_at_exit)
    _ACTIVE.append(dog.start())
    return dog
