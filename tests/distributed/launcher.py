"""Launch real multi-process jobs (CPU, gloo) for the distributed tests.

Each rank is a plain ``python worker.py SCENARIO CONFIG`` process started by
``lightning_2d.tools.launch.launch_processes`` with the environment a cluster launcher would set
(``RANK``/``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_*``), so Lightning sees processes
created externally. Launching ourselves instead of through ``torchrun`` lets a test simulate several
nodes and keeps start-up light; the launcher kills the whole job when one rank fails or time runs
out, so a failing test never leaves ranks waiting in a collective.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lightning_2d.tools.launch import JobResult, free_port, launch_processes

__all__ = ["REPO", "WORKER", "JobResult", "free_port", "launch"]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


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
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return launch_processes(
        [sys.executable, str(WORKER), scenario, str(config_path)],
        out_dir,
        nprocs=nprocs,
        num_nodes=num_nodes,
        timeout=timeout,
        env=env,
        kill_on_failure=kill_on_failure,
    )
