"""Launch real multi-process jobs (CPU, gloo) for the distributed tests.

Each rank is a process running one ``worker.py SCENARIO CONFIG`` with the environment a cluster launcher
would set (``RANK``/``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_*``), so Lightning sees processes
created externally. Launching ourselves instead of through ``torchrun`` lets a test simulate several
nodes and keeps start-up light; the launcher kills the whole job when one rank fails or time runs
out, so a failing test never leaves ranks waiting in a collective.

The ranks are forked from a fork server that imported torch, Lightning and the worker once
(``forkserver.py``: ~10 s saved per 4-rank job on 2 cores). ``LIGHTNING_2D_TEST_FORK=0`` starts each
rank as a fresh ``python worker.py`` instead (``lightning_2d.tools.launch.launch_processes``), which is
what a forked rank must behave like.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from lightning_2d.tools.launch import JobResult, cluster_env, free_port, launch_processes, wait_for_job

__all__ = ["REPO", "WORKER", "JobResult", "free_port", "launch"]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
#: What every rank gets on top of the cluster variables.
RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _env() -> dict[str, str]:
    return {**RANK_ENV, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class ForkServer:
    """The client of ``forkserver.py``: spawns ranks there and learns their exit codes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("forkserver.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **_env()},
        )
        self._lock = threading.Condition()
        self._next = 0
        self._spawned: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "spawned" in message:
                    self._spawned[message["spawned"]] = message["pid"]
                else:
                    self._exited[message["exited"]] = message["returncode"]
                self._lock.notify_all()
        with self._lock:  # the server is gone: nothing more will be reported
            self._lock.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, env: dict[str, str], log: Path, scenario: str, config: Path) -> int:
        with self._lock:
            self._next += 1
            request_id = self._next
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(
                {"spawn": request_id, "env": env, "log": str(log), "scenario": scenario, "config": str(config)}
            ) + "\n")
            self.proc.stdin.flush()
            # The first request also waits for the server's imports: over 60 s on a 2-core machine under load.
            if not self._lock.wait_for(lambda: request_id in self._spawned or not self.alive, timeout=300):
                raise RuntimeError("the fork server did not fork a rank within 300 s")
            if request_id not in self._spawned:
                raise RuntimeError(f"the fork server ended (exit code {self.proc.poll()})")
            return self._spawned.pop(request_id)

    def returncode(self, pid: int) -> Optional[int]:
        with self._lock:
            return self._exited.get(pid)

    def wait(self, pid: int, timeout: float = 60.0) -> Optional[int]:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exited or not self.alive, timeout=timeout)
            return self._exited.get(pid)

    def close(self) -> None:
        if self.alive and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_server: Optional[ForkServer] = None


def fork_server() -> ForkServer:
    global _server
    if _server is None or not _server.alive:
        _server = ForkServer()
    return _server


def launch(
    scenario: str,
    config: dict,
    out_dir: Path,
    nprocs: int = 4,
    num_nodes: int = 1,
    timeout: float = 300.0,
    kill_on_failure: bool = True,
) -> JobResult:
    """Run ``worker.py scenario`` on ``nprocs`` processes (split evenly over ``num_nodes`` simulated nodes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps({**config, "out_dir": str(out_dir)}))
    if os.environ.get("LIGHTNING_2D_TEST_FORK", "1") == "0":
        return launch_processes(
            [sys.executable, str(WORKER), scenario, str(config_path)], out_dir, nprocs=nprocs, num_nodes=num_nodes,
            timeout=timeout, env=_env(), kill_on_failure=kill_on_failure,
        )
    return launch_forked(scenario, config_path, out_dir, nprocs, num_nodes, timeout, kill_on_failure)


def launch_forked(
    scenario: str, config_path: Path, out_dir: Path, nprocs: int, num_nodes: int, timeout: float,
    kill_on_failure: bool,
) -> JobResult:
    """``launch_processes``'s job, each rank forked by the fork server (same waiting, killing and result)."""
    if nprocs < 1 or num_nodes < 1 or nprocs % num_nodes:
        raise ValueError(f"nprocs ({nprocs}) must be a positive multiple of num_nodes ({num_nodes})")
    server = fork_server()
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    pids = [
        server.spawn({**base, **cluster_env(rank, nprocs, num_nodes, port), **_env()}, out_dir / f"rank{rank}.log",
                     scenario, config_path)
        for rank in range(nprocs)
    ]
    exit_times: list[Optional[float]] = [None] * nprocs
    timed_out = False
    try:
        exit_times, timed_out = wait_for_job(
            [functools.partial(server.returncode, pid) for pid in pids], timeout, kill_on_failure
        )
    finally:
        for pid in pids:
            if server.returncode(pid) is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        codes = [server.wait(pid) for pid in pids]
        for rank in range(nprocs):
            if exit_times[rank] is None:
                exit_times[rank] = time.time()
    texts = [(out_dir / f"rank{rank}.log").read_text(errors="replace") for rank in range(nprocs)]
    if timed_out:
        texts[0] += f"\n[launcher] timed out after {timeout:.0f}s"
    return JobResult([c if c is not None else -signal.SIGKILL for c in codes], texts, out_dir, timed_out=timed_out,
                     exit_times=[t for t in exit_times if t is not None])
