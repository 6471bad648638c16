"""One rank of the Fabric crash test: ``python fabric_crash_worker.py CONFIG_JSON`` (see test_fabric_crash.py).

Runs ``recipes/fabric_pretrain.py``'s loop under ``lightning_2d.fabric.ModelParallel2DStrategy``
(dp = 2, tp = 1 on CPU/gloo), saving a sharded checkpoint every step. Config keys:

* ``corpus``, ``cache_dir``, ``checkpoint_dir``, ``out_dir``, ``max_steps``: the run;
* ``resume``: passed to the recipe's ``--resume`` (a path, or ``latest``);
* ``crash``: ``{"folder": "step-000003", "rank": 1}``: that rank SIGKILLs itself in the middle of
  writing its DCP shard into that folder (after the first item's bytes are on disk);
* ``dump_steps``: steps after which rank 0 writes the full weights to ``weights_step{N}.pt``.

Rank 0 also writes ``loaded.pt`` (the full weights right after ``fabric.load``) and every rank
writes ``rank{N}.json`` (the path given to ``fabric.load``, the step it resumed at, the losses it
trained).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[2]


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter; a collective, so every rank calls it.

    Args:
        model: The model as ``fabric.setup`` returned it (DTensor parameters).
    """
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for name, p in model.named_parameters()
    }


def die_while_writing_into(folder_name: str) -> None:
    """SIGKILL this process once DCP has written the first item of its shard into ``folder_name``.

    DCP writes a rank's shard item by item (``filesystem._write_item``, looked up as a module global
    on every call); killing right after the first one leaves a genuinely half-written shard, with
    neither DCP's ``.metadata`` nor ``meta.pt`` in the folder, as a lost node would.

    Args:
        folder_name: The name of the checkpoint folder whose save is interrupted (``step-000003``).
    """
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    original = dcp_filesystem._write_item

    def write_then_die(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(transforms, stream, *args, **kwargs)
        if Path(getattr(stream, "name", "")).parent.name == folder_name:
            stream.flush()
            os.fsync(stream.fileno())  # the first bytes are on disk, the rest never will be
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp_filesystem._write_item = write_then_die


def main(cfg: dict[str, Any]) -> None:
    from lightning_2d.fabric import ModelParallel2DStrategy

    spec = importlib.util.spec_from_file_location("fabric_pretrain", REPO / "recipes" / "fabric_pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out_dir = Path(cfg["out_dir"])
    argv = ["--data", cfg["corpus"], "--cache-dir", cfg["cache_dir"], "--seq-len", "32", "--batch-size", "2",
            "--max-steps", str(cfg["max_steps"]), "--warmup-steps", "1", "--lr", "1e-3", "--log-every", "1000",
            "--save-every", "1", "--checkpoint-dir", cfg["checkpoint_dir"]]
    if cfg.get("resume"):
        argv += ["--resume", cfg["resume"]]
    args = recipe.parse_args(argv)

    strategy = ModelParallel2DStrategy(data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    crash = cfg.get("crash")
    if crash and fabric.global_rank == crash["rank"]:
        die_while_writing_into(crash["folder"])

    # The weights right after fabric.load: what the fall-back restored.
    resumed: dict[str, Any] = {"path": None, "step": None}
    load = fabric.load

    def load_and_dump(path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> Any:
        remainder = load(path, state, strict=strict, **kwargs)
        resumed.update(path=str(path), step=state["step"])
        weights = full_weights(state["model"])
        if fabric.global_rank == 0:
            torch.save(weights, out_dir / "loaded.pt")
        return remainder

    fabric.load = load_and_dump

    def on_step(step: int, model: torch.nn.Module) -> None:
        if step in cfg.get("dump_steps", ()):
            weights = full_weights(model)
            if fabric.global_rank == 0:
                torch.save(weights, out_dir / f"weights_step{step}.pt")

    history = recipe.train(fabric, args, on_step=on_step)
    result = {"loaded_from": resumed["path"], "resumed_step": resumed["step"], "loss": history["loss"]}
    (out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
