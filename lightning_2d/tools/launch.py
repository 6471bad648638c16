"""Start N local processes with the environment a cluster launcher sets, and watch them as one job.

Each rank is a plain ``python`` process with ``MASTER_ADDR``/``MASTER_PORT`` (a free port),
``RANK``, ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE``, so Lightning (and plain
``torch.distributed``) sees processes created externally, as under torchrun or SLURM. Several
simulated nodes are ranks split evenly by ``NODE_RANK``. When one rank fails (as torchrun does) or
the time runs out the whole job is killed, so no rank is left waiting in a collective; with
``kill_on_failure=False`` the launcher only waits, as a launcher that does not watch its workers
would (how the tests check that the ranks end a broken job by themselves). Used by
``lightning-2d benchmark`` and by the distributed tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


def free_port() -> int:
    """A TCP port free on this host now (torchrun's default port may still be held by a previous job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class JobResult:
    """What a job left behind: each rank's exit status and log, and the folder its outputs went to.

    Args:
        returncodes: Exit status per rank (negative: killed by that signal).
        logs: Combined stdout/stderr per rank.
        out_dir: The job's folder (``rank{N}.log``, and whatever the ranks wrote).
        timed_out: Whether the launcher killed the job because its time ran out.
        exit_times: Per rank, the wall-clock time (``time.time()``) the launcher saw it end (within 0.2 s).
    """

    returncodes: list[int]
    logs: list[str]
    out_dir: Path
    timed_out: bool = False
    exit_times: Optional[list[float]] = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def failed_rank(self) -> Optional[int]:
        """The first rank that exited with an error (not one the launcher killed afterwards), if any."""
        for rank, rc in enumerate(self.returncodes):
            if rc not in (0, -signal.SIGKILL):
                return rank
        return None

    def rank_output(self, rank: int) -> dict[str, Any]:
        """The JSON a rank wrote to ``out_dir/rank{rank}.json``."""
        return json.loads((self.out_dir / f"rank{rank}.json").read_text())

    def describe(self, ranks: Optional[list[int]] = None, tail: int = 3000) -> str:
        """Return codes, then the last ``tail`` characters of the logs of ``ranks`` (default: all)."""
        parts = [f"return codes {self.returncodes}" + (" (timed out)" if self.timed_out else "")]
        for rank in ranks if ranks is not None else range(len(self.logs)):
            parts.append(f"---- rank {rank} (last {tail} chars) ----\n{self.logs[rank][-tail:]}")
        return "\n".join(parts)


def cluster_env(rank: int, nprocs: int, num_nodes: int, port: int) -> dict[str, str]:
    """The variables torchrun/SLURM-style launchers set for ``rank`` of ``nprocs`` on ``num_nodes`` nodes."""
    per_node = nprocs // num_nodes
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nprocs),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "NODE_RANK": str(rank // per_node),
    }


def wait_for_job(
    returncodes: list[Callable[[], Optional[int]]], timeout: float, kill_on_failure: bool
) -> tuple[list[Optional[float]], bool]:
    """Poll each rank's return code (``None`` while it runs) until every rank ended, or one failed
    (``kill_on_failure``), or ``timeout`` seconds passed.

    Returns:
        When each rank was seen to end (``time.time()``, within 0.2 s; ``None`` for a rank still running),
        and whether the time ran out.
    """
    exit_times: list[Optional[float]] = [None] * len(returncodes)
    deadline = time.monotonic() + timeout
    while True:
        codes = [code() for code in returncodes]
        for rank, code in enumerate(codes):
            if code is not None and exit_times[rank] is None:
                exit_times[rank] = time.time()
        if all(code is not None for code in codes):
            return exit_times, False
        if kill_on_failure and any(code not in (None, 0) for code in codes):
            return exit_times, False
        if time.monotonic() > deadline:
            return exit_times, True
        time.sleep(0.2)


def launch_processes(
    argv: list[str],
    out_dir: Path,
    nprocs: int,
    num_nodes: int = 1,
    timeout: float = 300.0,
    env: Optional[dict[str, str]] = None,
    kill_on_failure: bool = True,
) -> JobResult:
    """Run ``argv`` as ``nprocs`` ranks and wait for all of them (or the first failure, or ``timeout``).

    Args:
        argv: The command every rank runs (``[sys.executable, "-m", ...]``); ranks tell themselves
            apart by ``RANK``.
        out_dir: Created if missing; rank ``N``'s output goes to ``out_dir/rank{N}.log``.
        nprocs: Number of processes (the world size).
        num_nodes: Simulated nodes; must divide ``nprocs``.
        timeout: Seconds before the whole job is killed.
        env: Variables added to this process's environment (after the cluster variables, so they
            can override them).
        kill_on_failure: Kill the job as soon as one rank fails (torchrun's behaviour); ``False``: wait
            for every rank (or ``timeout``).
    """
    if nprocs < 1 or num_nodes < 1 or nprocs % num_nodes:
        raise ValueError(
            f"nprocs ({nprocs}) must be a positive multiple of num_nodes ({num_nodes}); the ranks are split"
            " evenly over the nodes"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    exit_times: list[Optional[float]] = []
    timed_out = False
    try:
        for rank in range(nprocs):
            rank_env = {**os.environ, **cluster_env(rank, nprocs, num_nodes, port), "PYTHONUNBUFFERED": "1"}
            rank_env.update(env or {})
            # Kept open until every rank has ended (read back below): not a `with` block.
            log = open(out_dir / f"rank{rank}.log", "w+")  # noqa: SIM115
            logs.append(log)
            # Own session: the job's processes (and anything they start) are killed as one group.
            procs.append(
                subprocess.Popen(argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        exit_times, timed_out = wait_for_job([p.poll for p in procs], timeout, kill_on_failure)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for rank, p in enumerate(procs):
            p.wait()
            if rank < len(exit_times) and exit_times[rank] is None:
                exit_times[rank] = time.time()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if timed_out:
        texts[0] += f"\n[launcher] timed out after {timeout:.0f}s"
    return JobResult([p.returncode for p in procs], texts, out_dir, timed_out=timed_out,
                     exit_times=[t for t in exit_times if t is not None])
