"""Probe for pipeline parallelism (issue #12): ``torch.distributed.pipelining`` with our ``Transformer``
on CPU/gloo, split into stages by transformer blocks, against single-device training.

    .venv/bin/python tests/benchmarks/bench_pipeline_probe.py [--stages 2] [--schedule 1f1b] [--microbatches 4]

Starts ``--stages`` processes (no Lightning, no FSDP/TP): each keeps its blocks of the ``debug``
model (the first also the embedding, the last the norm and head), runs 3 AdamW steps of one schedule,
and the last stage compares its losses with a single-device run of the same model, seed and batch.
Also prints the median step time per schedule. Not a test and not the feature: what the next
session builds ``pipeline_parallel_size`` on (what it found is in CONTRIBUTING.md, "Traps").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_2d.model import PRESETS, Transformer  # noqa: E402

BATCH, SEQ_LEN, STEPS = 8, 32, 3


class Stage(nn.Module):
    """Blocks ``keys`` of ``model``; the first stage embeds, the last normalizes and projects to logits."""

    def __init__(self, model: Transformer, keys: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({k: model.layers[k] for k in keys})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = self.rope[: h.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.output is None:
            return h
        return self.output(self.norm(h)).float()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Normalized by the whole batch's tokens: the micro-batch losses add up to the batch mean.
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (BATCH * SEQ_LEN)


def rank_main(schedule: str, microbatches: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    args = PRESETS["debug"]
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_buffers()
    keys = list(model.layers.keys())
    if len(keys) % world:
        raise SystemExit(f"{len(keys)} blocks do not split evenly over {world} stages")
    per = len(keys) // world
    module = Stage(model, keys[rank * per : (rank + 1) * per], rank == 0, rank == world - 1)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    # scale_grads=False: the schedules divide gradients by the number of micro-batches by default, which
    # with a loss already normalized over the whole batch makes them `microbatches` times too small
    # (AdamW then drifts from single-device training by ~1e-5 relative, through its epsilon).
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipe = kind(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    torch.manual_seed(1)
    x = torch.randint(0, args.vocab_size, (BATCH, SEQ_LEN))
    y = torch.randint(0, args.vocab_size, (BATCH, SEQ_LEN))
    losses, times = [], []
    for _ in range(STEPS):
        step_losses: list[torch.Tensor] = []
        start = time.perf_counter()
        if rank == 0:
            pipe.step(x)
        elif rank == world - 1:
            pipe.step(target=y, losses=step_losses)
        else:
            pipe.step()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(sum(step_losses)) if step_losses else None)
    if rank == world - 1:
        torch.manual_seed(0)
        reference = Transformer(args)
        reference.init_buffers()
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        expected = []
        for _ in range(STEPS):
            loss = loss_fn(reference(x), y)
            loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            expected.append(float(loss))
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        print(f"{schedule}: {world} stages, {microbatches} micro-batches: losses {losses}")
        print(f"{schedule}: single device           losses {expected}")
        print(f"{schedule}: worst relative loss error {worst:.2e}; median step {statistics.median(times) * 1e3:.0f} ms")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.rank_main:
        rank_main(options.schedule, options.microbatches)
        return
    import tempfile

    from lightning_2d.launch import launch_processes

    with tempfile.TemporaryDirectory() as folder:
        result = launch_processes(
            [sys.executable, __file__, "--rank-main", "--schedule", options.schedule,
             "--microbatches", str(options.microbatches)],
            Path(folder), nprocs=options.stages, timeout=300, env={"OMP_NUM_THREADS": "1"},
        )
    print(result.logs[-1] if result.ok else result.describe())


if __name__ == "__main__":
    main()
