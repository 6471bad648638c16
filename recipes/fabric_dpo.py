"""Preference-tune (DPO and its kin) a Llama model with your own Fabric loop: the trained model and its frozen reference
parallelized side by side (FSDP2 × tensor parallel).

    python recipes/fabric_dpo.py                                  # 4 CPU processes, (2, 2), debug model, built-in pairs
    python recipes/fabric_dpo.py --loss-type simpo                # reference-free: no second model
    python recipes/fabric_dpo.py --accelerator gpu --devices 8 --tensor-parallel-size 2 --model llama3-8b \\
        --precision bf16-mixed --data pairs.jsonl --tokenizer /models/llama3 --seq-len 4096 --batch-size 2

The loop shows what the strategy does not hide: the policy and a frozen copy of it built on the meta device, both
given to ``fabric.setup`` (the copy, every parameter frozen, is sharded by the same plan on the same meshes, with the
same seeded initial values, and gets no gradients, no optimizer and no checkpoint), and the preference loss of
``PreferenceDataModule``'s packed pairs (``preference_step``: each sequence's log-probability summed from the fused
head, the reference's beside it, the mean over the optimizer step's pairs of every replica, TRL's metrics).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any, Optional

import lightning as L
import torch

from lightning_2d import ModelArgs, PreferenceDataModule, PreferenceLoss, Transformer
from lightning_2d.fabric import ModelParallel2DStrategy, preference_step
from lightning_2d.integration.module import warmup_cosine_schedule
from lightning_2d.models.registry import materialize_known_model
from lightning_2d.ops.preference import LOSSES
from lightning_2d.parallel.context import context_shard

#: The built-in byte-level ChatML tokenizer's 259 ids, padded to a multiple of 8 (the ``debug`` preset has 256).
BYTE_VOCAB = 264


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="debug", help="a preset of lightning_2d.models.llama.model.PRESETS")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"the model's vocabulary (default: the preset's; {BYTE_VOCAB} with --tokenizer byte)")
    parser.add_argument("--data", default=None, help="pairs in TRL's formats (JSONL, Parquet …); default: built-in")
    parser.add_argument("--tokenizer", default="byte", help="a model folder (its chat template), or 'byte'")
    parser.add_argument("--max-length", type=int, default=200, help="most tokens of each sequence, prompt included")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--loss-type", default="sigmoid", choices=[t for t in LOSSES if t != "kto"],
                        help="sigmoid (DPO), ipo, hinge, robust against the reference; simpo, orpo without one")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seq-len", type=int, default=512, help="positions per window of whole pairs")
    parser.add_argument("--batch-size", type=int, default=2, help="windows per data-parallel replica and micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_2d)")
    return parser.parse_args(argv)


def batches(loader: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, one seeded permutation per epoch."""
    epoch = loader.sampler.epoch
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def log_probs(model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """``batch → (B, T)``: each position's log-probability of its label under ``model``, 0 where ignored, from the
    fused head (``per_token=True``: never the full logits; vocabulary-parallel under tensor parallelism)."""
    return lambda batch: model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                               per_token=True)


def train(fabric: L.Fabric, args: argparse.Namespace, on_step: Any = None) -> dict[str, list]:
    """Train and return the history (each step's global mean loss, pre-clip gradient norm and TRL's metrics)."""
    fabric.seed_everything(args.seed)
    data = PreferenceDataModule(args.data, tokenizer=args.tokenizer, max_length=args.max_length, seq_len=args.seq_len,
                                batch_size=args.batch_size, val_fraction=0.0, seed=args.seed, cache_dir=args.cache_dir)
    data.prepare()  # the first process of each machine tokenizes, the others wait for its cache on a file lock
    replicas = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    data.set_data_parallel(**replicas, accumulate_grad_batches=args.accumulate)  # step_pairs: the step's pairs
    data.setup("fit")
    loader = data.train_dataloader()

    vocab_size = args.vocab_size or (BYTE_VOCAB if args.tokenizer == "byte" else None)
    model_args = ModelArgs.from_name(args.model, **({"vocab_size": vocab_size} if vocab_size else {}))
    data.check_model(model_args.vocab_size)
    loss_fn = PreferenceLoss(loss_type=args.loss_type, beta=args.beta)
    sharded = isinstance(fabric.strategy, ModelParallel2DStrategy)
    with fabric.init_module(empty_init=True), torch.device("meta"):
        policy = Transformer(model_args)
        reference = Transformer(model_args) if loss_fn.needs_reference else None
    if reference is not None:
        reference.requires_grad_(False)  # frozen: fabric.setup shards it beside the policy, never trains it
    if not sharded:  # a plain single-device loop: what fabric.setup does on one device, the same seeded values
        for model in (policy, reference):
            if model is not None:
                materialize_known_model(model, fabric.device, seed=args.seed)
    policy = fabric.setup(policy)  # 2D: TP/SP plan → FSDP2, then each rank's shards of the seeded init
    if reference is not None:
        reference = fabric.setup(reference)  # the same plan, meshes and seed: the policy's initial weights
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine_schedule(args.warmup_steps, args.max_steps, min_lr_ratio=0.1)
    )

    mesh = fabric.strategy.meshes if sharded else None  # the loss's data-parallel group, the context split
    reference_log_probs = log_probs(reference) if reference is not None else None
    history: dict[str, list] = {"loss": [], "grad_norm": [], "metrics": []}
    stream = batches(loader)
    for step in range(1, args.max_steps + 1):
        step_loss = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            batch = context_shard(fabric.to_device(next(stream)), mesh)  # context parallel: this rank's part
            with fabric.no_backward_sync(policy, enabled=micro < args.accumulate - 1):
                # The mean over the step's pairs (``step_pairs``) of every replica; the reference runs without
                # gradients inside.
                loss, global_mean, _, metrics = preference_step(
                    loss_fn, batch, log_probs(policy), reference_log_probs, mesh,
                    step_pairs=batch["step_pairs"], accumulate=args.accumulate,
                )
                fabric.backward(loss / args.accumulate)
            step_loss += global_mean / args.accumulate
        grad_norm = fabric.clip_gradients(policy, optimizer, max_norm=args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        history["loss"].append(step_loss.item())
        history["grad_norm"].append(float(grad_norm))
        history["metrics"].append({name: float(value) for name, value in metrics.items()})  # the last batch's
        if on_step is not None:
            on_step(step, policy, reference)
        if step % args.log_every == 0:
            fabric.print(f"step {step:>5}  loss {history['loss'][-1]:.4f}  grad norm {float(grad_norm):.3f}"
                         f"  margin {history['metrics'][-1]['rewards/margins']:.3f}")
    return history


def main() -> None:
    args = parse_args()
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=ModelParallel2DStrategy(tensor_parallel_size=args.tensor_parallel_size,
                                         context_parallel_size=args.context_parallel_size),
        precision=args.precision,
    )
    fabric.launch()
    history = train(fabric, args)
    fabric.print(f"final loss: {history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
