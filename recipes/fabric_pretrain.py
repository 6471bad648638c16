"""Pretrain a Llama model with your own Fabric loop and 2D parallelism (FSDP2 × tensor parallel).

    python recipes/fabric_pretrain.py                                   # 4 CPU processes, (2, 2), debug model
    python recipes/fabric_pretrain.py --accelerator gpu --devices 8 --tensor-parallel-size 2 \\
        --model llama3-8b --precision bf16-mixed --data "/data/*.jsonl" --tokenizer /models/llama3/tokenizer.json \\
        --seq-len 8192 --batch-size 1 --accumulate 4
    python recipes/fabric_pretrain.py --resume checkpoints/step-000020    # continue, at any layout
    python recipes/fabric_pretrain.py --resume latest --save-every 20     # the newest in --checkpoint-dir
    python recipes/fabric_pretrain.py --lora-rank 16                      # LoRA adapters, the base frozen
    python recipes/fabric_pretrain.py --model debug-moe --tensor-parallel-size 1 --expert-parallel-size 2  # experts

The loop shows what the strategy does not hide: a meta-device model that ``fabric.setup`` shards
and initializes, gradient accumulation that synchronizes gradients only on the last micro-batch
(``fabric.no_backward_sync``), clipping to the global norm over the sharded gradients
(``fabric.clip_gradients``), a loss normalized by the tokens of the global batch, and sharded
checkpoints with the data position in them. A mixture of experts adds its load balancing (``LoadBalancing``, the
object the Trainer's module uses too): the auxiliary loss over the global batch to each micro-batch's loss (under a
pipeline the stages add it inside ``pipeline.train_step``, per pipeline micro-batch, and ``pipelined_loss`` reads its
value), or the aux-loss-free bias updated after each optimizer step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from lightning_2d import LoRA, ModelArgs, TextDataModule, Transformer
from lightning_2d.checkpoint import latest_checkpoint
from lightning_2d.fabric import ModelParallel2DStrategy
from lightning_2d.integration.callbacks import ThroughputMeter, compute_dtype_of, reset_peak_memory, synchronize
from lightning_2d.integration.module import warmup_cosine_schedule
from lightning_2d.models.registry import materialize_known_model
from lightning_2d.parallel.config import PIPELINE_SCHEDULES
from lightning_2d.parallel.context import context_shard
from lightning_2d.parallel.expert import LoadBalancing
from lightning_2d.parallel.loss import normalize_by_global_tokens


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="debug", help="a preset of lightning_2d.models.llama.model.PRESETS")
    parser.add_argument("--data", nargs="*", default=None, help="text/JSONL/Parquet files or globs (default: stdlib)")
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages' ranks (the Llama's blocks split into stages); 1: no pipeline")
    parser.add_argument("--pipeline-schedule", default="1F1B", choices=list(PIPELINE_SCHEDULES))
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="ranks each sequence is split over (long context)")
    parser.add_argument("--expert-parallel-size", type=int, default=1,
                        help="ranks each mixture-of-experts layer's experts are split over (--model debug-moe …)")
    parser.add_argument("--data-parallel-replicate-size", type=int, default=1,
                        help="HSDP: replica groups of the data-parallel ranks (FSDP shards inside each)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per data-parallel replica")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="train rank-R LoRA adapters on the seven projections, the base frozen (default: all weights)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--resume", default=None,
                        help="a checkpoint folder to continue from, or 'latest': the newest in --checkpoint-dir"
                             " (none there: start from scratch). An interrupted save falls back to the newest"
                             " complete checkpoint, with a warning")
    parser.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_2d)")
    return parser.parse_args(argv)


def batches(loader: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, one seeded permutation per epoch (resumed mid-epoch after fabric.load)."""
    epoch = loader.sampler.epoch
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def checkpoint_to_resume(fabric: L.Fabric, args: argparse.Namespace) -> Optional[str]:
    """What ``--resume`` asks for: a path (loaded exactly, or an error naming it), or for ``latest`` the
    newest complete checkpoint in ``--checkpoint-dir``.

    Newer saves that never finished are skipped with a warning naming them
    (``lightning_2d.checkpoint.latest_checkpoint``); rank 0 decides and every rank gets its answer. Rank 0 reads the
    one it takes whole: the 2D strategy's load, handed that check (``checkpoint_integrity``), does not read it again.

    Args:
        fabric: The launched Fabric.
        args: The parsed arguments (``resume``, ``checkpoint_dir``).
    """
    if args.resume != "latest":
        return args.resume or None
    found = None
    if fabric.global_rank == 0:
        checks = fabric.strategy.checkpoint_integrity if isinstance(fabric.strategy, ModelParallel2DStrategy) else None
        found = latest_checkpoint(Path(args.checkpoint_dir), warn=fabric.print, integrity=checks)
    found = fabric.broadcast(None if found is None else str(found))
    if found is None:
        fabric.print(f"No checkpoint in {args.checkpoint_dir}: starting from scratch")
    return found


def train(fabric: L.Fabric, args: argparse.Namespace, on_step: Any = None) -> dict[str, list]:
    """Train and return the history (global mean loss and pre-clip gradient norm of every step)."""
    fabric.seed_everything(args.seed)
    data = TextDataModule(args.data, tokenizer=args.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
                          val_fraction=0.0, seed=args.seed, cache_dir=args.cache_dir)
    # Every rank, no collective: the first process of each machine tokenizes with every core, the
    # others wait for its cache on a file lock (a barrier would time out on a large corpus).
    data.prepare()
    replicas = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    data.set_data_parallel(**replicas)
    data.setup("fit")
    loader = data.train_dataloader()

    model_args = ModelArgs.from_name(args.model)
    data.check_model(model_args.vocab_size)
    sharded = isinstance(fabric.strategy, ModelParallel2DStrategy)
    with fabric.init_module(empty_init=True), torch.device("meta"):
        model = Transformer(model_args)  # on the meta device, nothing is allocated yet
    if args.lora_rank:  # declared: fabric.setup adds the adapters beside the projections, everything else frozen
        model.lora = LoRA(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    if not sharded:  # a plain single-device loop: what fabric.setup does on one device, the same seeded values
        materialize_known_model(model, fabric.device, seed=args.seed)
    model = fabric.setup(model)  # 2D: adapters → TP/SP plan → AC → compile → FSDP2, then each rank's shards
    # Under pipeline parallelism the strategy keeps the pipeline of the model's stages, stepped below.
    pipeline = fabric.strategy.pipeline if sharded else None
    trained = [p for p in model.parameters() if p.requires_grad]  # under LoRA the adapters only
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.1,
                                                          betas=(0.9, 0.95), foreach=True))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine_schedule(args.warmup_steps, args.max_steps, min_lr_ratio=0.1)
    )
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader, "step": 0}
    resume = checkpoint_to_resume(fabric, args)
    if resume is not None:
        # If `resume` is a save interrupted by a crash, fabric.load falls back to the newest complete
        # checkpoint beside it and warns, naming the one skipped.
        fabric.load(resume, state)
        fabric.print(f"Resumed at step {state['step']} (asked for {resume})")

    # The 2D strategy's meshes: the loss's data-parallel group, the context-parallel split (None on one device).
    mesh = fabric.strategy.meshes if sharded else None
    # A mixture of experts' load balancing. Under a pipeline the stages add the auxiliary loss inside the schedule
    # (each pipeline micro-batch's, over every stage's layers); the loop only reads its value.
    balancing = LoadBalancing(model_args.moe, mesh)
    # MFU against the peak of the dtype the matmuls run in (bf16 under bf16-mixed, fp32/TF32 at 32-true).
    meter = ThroughputMeter(
        fabric.world_size, fabric.device, model_args.flops_per_token, dtype=compute_dtype_of(fabric)
    )
    reset_peak_memory(fabric.device)
    history: dict[str, list] = {"loss": [], "grad_norm": []}
    if balancing.uses_aux_loss:
        history["aux_loss"] = []  # the auxiliary loss trained each step (coef × its micro-batches' mean)
    stream = batches(loader)  # not fabric.setup_dataloaders: its wrapper would reset the sampler's epoch
    while state["step"] < args.max_steps:
        synchronize(fabric.device)  # GPU work is asynchronous: time what ran, not what was queued
        start = time.perf_counter()
        step_loss = torch.zeros((), device=fabric.device)
        step_aux = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            full = fabric.to_device(next(stream))
            batch = context_shard(full, mesh)  # under context parallelism: this rank's part of each sequence
            positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
            # Gradients are reduce-scattered once, after the last micro-batch.
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                if pipeline is not None:
                    # The schedule runs every micro-batch's forward and backward here: the gradients of
                    # loss / accumulate, as fabric.backward below (no backward call of ours).
                    _, global_mean, _ = pipeline.train_step(batch["input_ids"], batch["labels"],
                                                            grad_scale=1.0 / args.accumulate, **positions)
                    aux_value = balancing.pipelined_loss(pipeline)  # trained by the stages already, or None
                    if aux_value is not None:
                        step_aux += aux_value / args.accumulate
                else:
                    # The summed cross-entropy from the fused head (no (batch, seq, vocab) logits), then
                    # divided by the global batch's target tokens.
                    loss_sum = model(batch["input_ids"], labels=batch["labels"], **positions)
                    loss, global_mean, _ = normalize_by_global_tokens(loss_sum, batch["labels"], mesh)
                    aux = balancing.loss(model)  # this rank's share of the global batch's auxiliary loss, or None
                    if aux is not None:
                        loss = loss + aux[0]
                        step_aux += aux[1] / args.accumulate
                    fabric.backward(loss / args.accumulate)
            step_loss += global_mean / args.accumulate
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        balancing.after_optimizer_step(model)  # aux-loss-free balancing (layers balanced by their bias), else nothing
        scheduler.step()
        state["step"] += 1
        history["loss"].append(step_loss.item())
        history["grad_norm"].append(float(grad_norm))
        if "aux_loss" in history:
            history["aux_loss"].append(step_aux.item())
        if state["step"] > 1:  # the first step includes start-up
            synchronize(fabric.device)
            meter.update(full["input_ids"].numel() * replicas["num_replicas"] * args.accumulate, time.perf_counter() - start)
        if on_step is not None:
            on_step(state["step"], model)
        if state["step"] % args.log_every == 0 and meter.steps:
            perf = meter.compute(args.seq_len)
            meter.reset()
            mfu = f", MFU {perf['perf/mfu_percent']:.1f}%" if "perf/mfu_percent" in perf else ""
            fabric.print(f"step {state['step']:>5}  loss {history['loss'][-1]:.4f}  grad norm {grad_norm:.3f}"
                         f"  {perf['perf/tokens_per_sec']:,.0f} tokens/s{mfu}")
        if args.save_every and state["step"] % args.save_every == 0:
            fabric.save(f"{args.checkpoint_dir}/step-{state['step']:06d}", state)
    return history


def main() -> None:
    args = parse_args()
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=ModelParallel2DStrategy(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_replicate_size=args.data_parallel_replicate_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            pipeline_schedule=args.pipeline_schedule,
            context_parallel_size=args.context_parallel_size,
            expert_parallel_size=args.expert_parallel_size,
        ),
        precision=args.precision,
    )
    fabric.launch()
    history = train(fabric, args)
    fabric.print(f"final loss: {history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
