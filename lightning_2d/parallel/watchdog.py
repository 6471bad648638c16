"""Failure watchdog: a rank that dies, stops, hangs or raises ends the job within a bound, named on every rank.

torch's own mechanisms first (torchrun's error files, ``nccl_failure_env``); this module names the rank that *caused*
a failure, ends a job whose rank is stopped or stuck, on gloo and NCCL alike. Its rules are a pure function
(``watchdog_rules.decide``, with their table); this module is their shell: the thread, the store, the exit."""

from __future__ import annotations

import atexit
import faulthandler
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
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_2d._compat import default_store
from lightning_2d.parallel.watchdog_rules import (
    EXIT_CODE,  # noqa: F401 (re-exported: callers import it from here)
    GONE,
    RUNNING,
    Beat,
    End,
    Failure,
    Finding,
    Job,
    Limits,
    Observations,
    Publish,
    State,
    Verdict,
    Wait,
    decide,
    departure,
    own_reason,
)

DEFAULT_WATCHDOG_TIMEOUT = timedelta(minutes=2)
#: gloo's plain ``RuntimeError`` for a dead or silent peer: "[…/gloo/transport/tcp/pair.cc:537] Read error …".
_GLOO = ("gloo/transport", "Connection reset by peer", "Connection closed by peer")
_STORE_ERRORS = (RuntimeError, TimeoutError)  # c10d's DistStoreError and DistNetworkError are RuntimeErrors


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
    """Turn on torch's NCCL failure handling (docs/reliability.md, "When a rank dies") for the process groups created afterwards,
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
    every rank's (host, PID namespace, PID); ``store_host_rank`` ``None``: torchrun's agent hosts the store. The
    shell of ``watchdog_rules.decide``: it observes, decides, acts. Tests replace ``clock``, ``sleep``, ``exit``,
    ``out``, ``state_of`` and ``kill``."""

    def __init__(self, store: Any, rank: int, processes: list[tuple[str, str, int]], run_id: str,
                 watchdog_timeout: float, collective_timeout: Optional[float] = None,
                 store_host_rank: Optional[int] = 0) -> None:
        self.limits = Limits.of(watchdog_timeout, collective_timeout)
        self.started = self.step = 0
        self.clock, self.sleep, self.exit, self.out, self.state_of, self.kill = (
            time.monotonic, time.sleep, os._exit, None, process_state, os.kill)
        self._state = State(Job(rank, tuple((host, ns, pid) for host, ns, pid in processes), store_host_rank))
        self._lock, self._ending, self._stopped = threading.Lock(), threading.Lock(), threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store, self._prefix, self._answered_at = _Store(store), f"lightning_2d/watchdog/{run_id}", 0.0
        self._beats, self._status = 0, "alive"
        self._failure: Optional[tuple[Failure, BaseException]] = None
        self._write_beat()  # every key a round reads exists: multi_get waits for one
        if rank == 0:
            self._call("set", self._key("verdict"), "")

    @property
    def verdict(self) -> Optional[Finding]:
        """The verdict this rank holds (``None``: none yet)."""
        return self._state.verdict

    def start(self, thread: bool = True) -> "Watchdog":
        self._answered_at = now = self.clock()
        self._state = replace(self._state, watched=self._state.job.rank, since=now)
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
            self._thread.join(timeout=self.limits.interval + 2.0)
        self._store.calls.put(None)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _run(self) -> None:
        while not self._stopped.wait(self.limits.interval):
            try:
                self.check_once()
            except Exception as err:  # noqa: BLE001 — the watchdog must never take the rank down by mistake
                self._print(f"the watchdog's check failed ({type(err).__name__}: {err}); checking again")

    # ---- the store ---------------------------------------------------------------------------------------------------
    def _key(self, name: object) -> str:
        return f"{self._prefix}/{name}"

    def _call(self, method: str, *args: Any) -> Any:
        value = self._store(method, *args, timeout=max(1.0, self.limits.interval))  # a round's length at least
        self._answered_at = self.clock()
        return value

    def _write_beat(self) -> None:
        self._beats += 1
        rank = self._state.job.rank
        self._call("set", self._key(rank), str(Beat(self._beats, self.started, self.step, self._status)))

    def _publish(self, finding: Finding) -> Finding:
        """Write ``finding`` unless another rank wrote a verdict first; the verdict that holds."""
        with suppress(*_STORE_ERRORS):
            held = self._call("compare_set", self._key("verdict"), "", finding.to_json())
            return Finding.from_json(held) if held else finding
        return finding  # the store is gone: act on this rank's own finding

    # ---- observe, decide, act ----------------------------------------------------------------------------------------
    def _observe(self, read_store: bool) -> Observations:
        """This call's observations: the local processes' states, and in a round (``read_store``) what ``_read``
        gives."""
        now, state = self.clock(), self._state
        states = {r: self.state_of(state.job.processes[r][2]) for r in state.job.local}
        seen = self._read(state, states) if read_store else {}
        failure = self._failure[0] if self._failure is not None else None
        return Observations(now, self.started, self._answered_at, states, failure=failure, round=read_store, **seen)

    def _read(self, state: State, states: dict[int, Optional[str]]) -> dict[str, Any]:
        """A round's store calls: this rank's heartbeat written, then the verdict, the watched successor's heartbeat
        and those of the local ranks whose process is gone read in one ``multi_get``; nothing when the store is
        silent (the rules judge that)."""
        job, successor = state.job, state.successor
        gone = [r for r in job.local if states[r] in GONE and r not in state.done and r != successor]
        ranks = ([successor] if successor != job.rank else []) + gone
        with suppress(*_STORE_ERRORS):
            self._write_beat()
            verdict, *raw = self._call("multi_get", [self._key("verdict"), *map(self._key, ranks)])
            beats = {r: Beat.parse(b) if b else None for r, b in zip(ranks, raw)}
            successor_beat = beats.get(successor)
            return {"verdict": Finding.from_json(verdict) if verdict else None, "gone": {r: beats[r] for r in gone},
                    "successor": None if successor_beat is None else (successor, successor_beat)}
        return {}

    def _decide(self, obs: Observations) -> Verdict:
        """``decide`` under the lock (the thread and a failing main thread both call it), publishing as it says."""
        while True:
            with self._lock:
                self._state, verdict = decide(obs, self._state, self.limits)
            if not isinstance(verdict, Publish):
                return verdict
            obs = replace(obs, verdict=self._publish(verdict.finding))

    def check_once(self) -> Optional[Finding]:
        """One round; acts on the verdict, and returns the verdict held."""
        verdict = self._decide(self._observe(read_store=True))
        if isinstance(verdict, End):
            self._end(verdict)
        return self._state.verdict

    def on_failure(self, exc: BaseException) -> None:
        """This rank's main thread fails with ``exc``. Any error but a communication one is the verdict at once, with
        its step. A failed collective is a consequence: wait (``patience`` at most, the thread's thresholds lowered)
        for its cause and end with that verdict; else report this rank's failure, saying so."""
        if self._failure is not None or self._stopped.is_set():
            return
        failure = Failure(self.clock(), is_communication_error(exc), _error(exc), self.step + 1)
        self._failure, self._status = (failure, exc), "failed"
        while isinstance(verdict := self._decide(self._observe(read_store=False)), Wait):
            self.sleep(min(0.2, self.limits.interval / 4))
        if isinstance(verdict, End):
            self._end(verdict)  # a consequence: end with its cause
        record_for_torchrun(own_reason(failure, self._state.job.rank, self.limits), exc)
        if self._state.verdict is not None and self._state.job.rank in self._state.verdict.ranks:
            self._leave("failed")

    def _end(self, end: End) -> None:
        with self._ending:  # once, from whichever thread comes first; the other waits for the exit
            self._print(end.message)
            if end.dump_stacks:  # named but alive (stuck): where its threads are
                with suppress(OSError, ValueError):  # (a stream without a file descriptor)
                    faulthandler.dump_traceback(self.out or sys.stderr, all_threads=True)
            record_for_torchrun(end.message.splitlines()[0])
            for rank in end.kill:
                pid = self._state.job.processes[rank][2]
                with suppress(OSError):  # a stopped rank would hold its memory and devices forever
                    self.kill(pid, signal.SIGKILL)
                    self._print(f"killed the stopped rank {rank} (pid {pid})")
            self._leave("ended")
            self._stopped.set()
            self.exit(end.code)

    def _leave(self, status: str) -> None:
        """Write this rank's ``status`` ("done", "ended", "failed"); the rank hosting the store then waits for the
        ranks ``departure`` names to leave (its exit takes the store along)."""
        self._status = status
        job = self._state.job

        def waits_for() -> tuple[tuple[int, ...], float]:
            states = {r: self.state_of(job.processes[r][2]) for r in job.local}
            return departure(self._state, states, self.clock(), self.limits, finished=status == "done")

        ranks, until = waits_for()
        with suppress(*_STORE_ERRORS):
            self._write_beat()
            while ranks and self.clock() < until and any(Beat.parse(beat).status in RUNNING
                                                         for beat in self._call("multi_get", list(map(self._key, ranks)))):
                self.sleep(min(0.2, self.limits.interval / 4))
                ranks = waits_for()[0]  # asked again: a rank whose process has gone since is not waited for

    def _print(self, message: str) -> None:
        with suppress(OSError, ValueError):  # a closed stream must not stop the exit
            print(f"[lightning_2d watchdog, rank {self._state.job.rank}] {message}", file=self.out or sys.stderr,
                  flush=True)


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
