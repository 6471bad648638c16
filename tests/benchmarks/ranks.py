"""What the multi-process benchmarks share: run a script's ``--rank-main`` on ``nprocs`` ranks and read back what
each rank wrote (``rank{N}.json`` in a temporary folder, passed as the last argument)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_ranks(script: str, args: list[str], nprocs: int, env: dict[str, str], timeout: float = 600) -> list[dict[str, Any]]:
    """``python script --rank-main *args FOLDER`` on ``nprocs`` ranks (``lightning_2d.tools.launch``); each rank's
    JSON, in rank order. Exits with the job's description when a rank fails."""
    from lightning_2d.tools.launch import launch_processes

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        result = launch_processes([sys.executable, script, "--rank-main", *args, folder], out, nprocs=nprocs,
                                  timeout=timeout, env=env)
        if not result.ok:
            raise SystemExit(result.describe())
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]


def write_rank(out: Path, rank: int, figures: dict[str, Any]) -> None:
    """What a rank hands back to ``run_ranks``."""
    (out / f"rank{rank}.json").write_text(json.dumps(figures))


def parallel_llama(spec: dict[str, Any], config: Any, dims: Any) -> Any:
    """The Llama of ``spec`` (``ModelArgs`` fields) built on the meta device, parallelized by the library's own
    steps (``parallelize_model``, the strategies' path) on ``dims``'s CPU meshes, then materialized (seed 0):
    ``parallelize_model``'s ``Parallelized`` (the model, its pipeline if any, the meshes). ``config``: a
    ``ParallelConfig`` with its dtypes resolved."""
    import torch

    from lightning_2d.models.llama.model import ModelArgs, Transformer
    from lightning_2d.models.llama.plan import llama_plan
    from lightning_2d.parallel import materialize_model, parallelize_model

    args = ModelArgs(**spec)
    with torch.device("meta"):
        model = Transformer(args)
    parallelized = parallelize_model(model, dims.build_mesh("cpu"), llama_plan(args, config), config)
    materialize_model(model, torch.device("cpu"), seed=0)
    return parallelized
