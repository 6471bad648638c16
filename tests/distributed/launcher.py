"""Launch real multi-process jobs (CPU, gloo) for the distributed tests.

Each rank is a plain ``python`` process with the environment a cluster launcher would set
(``RANK``/``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_*``), so Lightning sees processes
created externally. Launching ourselves instead of through ``torchrun`` lets a test simulate several
nodes and keeps start-up light; the launcher kills the whole job when one rank fails or time runs
out, so a failing test never leaves ranks waiting in a collective.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class JobResult:
    returncodes: list[int]
    logs: list[str]
    out_dir: Path

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def rank_output(self, rank: int) -> dict:
        return json.loads((self.out_dir / f"rank{rank}.json").read_text())

    def describe(self) -> str:
        parts = [f"return codes {self.returncodes}"]
        for rank, log in enumerate(self.logs):
            parts.append(f"---- rank {rank} (last 3000 chars) ----\n{log[-3000:]}")
        return "\n".join(parts)


def launch(
    scenario: str,
    config: dict,
    out_dir: Path,
    nprocs: int = 4,
    num_nodes: int = 1,
    timeout: float = 300.0,
) -> JobResult:
    """Run ``worker.py scenario`` on ``nprocs`` processes (split evenly over ``num_nodes`` simulated nodes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps({**config, "out_dir": str(out_dir)}))
    port = free_port()
    per_node = nprocs // num_nodes
    procs, logs = [], []
    for rank in range(nprocs):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nprocs),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "NODE_RANK": str(rank // per_node),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHONUNBUFFERED": "1",
        }
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(config_path)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    if time.monotonic() > deadline:
        texts[0] += f"\n[launcher] timed out after {timeout:.0f}s"
    return JobResult(codes, texts, out_dir)
