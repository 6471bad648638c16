"""Distil a small Llama student from a larger frozen teacher with your own Fabric loop, both sharded side by side
(FSDP2 × tensor parallel).

    python recipes/fabric_distill.py                                  # 4 CPU processes, (2, 2), seeded teacher
    python recipes/fabric_distill.py --teacher-init-from exported/    # a Hugging Face Llama folder (its weights)
    python recipes/fabric_distill.py --accelerator gpu --devices 8 --tensor-parallel-size 2 --model llama3.2-1b \\
        --teacher-init-from /models/Llama-3.1-8B --precision bf16-mixed --data "/data/*.jsonl" \\
        --tokenizer /models/Llama-3.1-8B/tokenizer.json --seq-len 4096 --batch-size 2

The loop shows what the strategy does not hide: the student and the teacher built on the meta device, the teacher
frozen (every parameter ``requires_grad=False``) and given to ``fabric.setup`` beside the student: sharded by its own
family's plan on the same meshes (FSDP over the data ranks, its head's vocabulary rows on the tensor ranks where the
student's are), its values from ``--teacher-init-from`` (``weights_source``: read block by block, each rank its
shards) or its seeded init; no gradients, no optimizer, no checkpoint. ``distillation_step`` computes the student's
divergence from the teacher chunk by chunk over both heads' vocabulary shards (neither model's logits exist), mixed
with the next-token loss as ``--alpha`` says.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from lightning_2d import ModelArgs, TextDataModule, Transformer
from lightning_2d.checkpoint.hf import HFWeights, model_args_from_hf
from lightning_2d.fabric import ModelParallel2DStrategy, distillation_step
from lightning_2d.integration.module import warmup_cosine_schedule
from lightning_2d.models.registry import materialize_known_model
from lightning_2d.ops.distillation import DIVERGENCES, DistillationConfig


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="debug", help="the student: a preset of lightning_2d.models.llama PRESETS")
    parser.add_argument("--student-layers", type=int, default=2, help="the student's blocks (default 2; 0: the preset's)")
    parser.add_argument("--teacher", default="debug", help="the teacher's preset, when not --teacher-init-from")
    parser.add_argument("--teacher-dim", type=int, default=256, help="the teacher preset's width (0: the preset's)")
    parser.add_argument("--teacher-layers", type=int, default=4, help="the teacher preset's blocks (0: the preset's)")
    parser.add_argument("--teacher-init-from", default=None,
                        help="a Hugging Face Llama-family folder: the teacher's shape and weights")
    parser.add_argument("--loss", default="forward_kl", choices=list(DIVERGENCES))
    parser.add_argument("--beta", type=float, default=None, help="jsd's mixture weight (default 0.5)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--alpha", type=float, default=0.5, help="the divergence's weight against the next-token loss")
    parser.add_argument("--data", nargs="*", default=None, help="text/JSONL/Parquet files or globs (default: stdlib)")
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch per data-parallel replica")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_2d)")
    return parser.parse_args(argv)


def batches(loader: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, one seeded permutation per epoch."""
    epoch = loader.sampler.epoch
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def teacher_of(args: argparse.Namespace) -> Transformer:
    """The teacher on the meta device, frozen; from ``--teacher-init-from`` its folder's shape and, when set up,
    its weights (``weights_source``, which ``fabric.setup`` reads instead of the seeded init)."""
    if args.teacher_init_from:
        folder = Path(args.teacher_init_from)
        model_args = model_args_from_hf(folder)
        teacher = Transformer(model_args)
        teacher.weights_source = lambda: HFWeights(folder, model_args)
    else:
        shape = {"dim": args.teacher_dim, "n_layers": args.teacher_layers}
        teacher = Transformer(ModelArgs.from_name(args.teacher, **{k: v for k, v in shape.items() if v}))
    return teacher.requires_grad_(False)  # frozen: fabric.setup shards it beside the student, never trains it


def train(fabric: L.Fabric, args: argparse.Namespace, on_step: Any = None) -> dict[str, list]:
    """Train the student and return the history (each step's global mean loss, divergence and next-token loss, and
    pre-clip gradient norm)."""
    fabric.seed_everything(args.seed)
    data = TextDataModule(args.data, tokenizer=args.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
                          val_fraction=0.0, seed=args.seed, cache_dir=args.cache_dir)
    data.prepare()  # the first process of each machine tokenizes, the others wait for its cache on a file lock
    replicas = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    data.set_data_parallel(**replicas)
    data.setup("fit")
    loader = data.train_dataloader()

    config = DistillationConfig(loss=args.loss, beta=args.beta, temperature=args.temperature, alpha=args.alpha)
    sharded = isinstance(fabric.strategy, ModelParallel2DStrategy)
    with fabric.init_module(empty_init=True), torch.device("meta"):
        teacher = teacher_of(args)
        shape = {"n_layers": args.student_layers} if args.student_layers else {}
        student = Transformer(ModelArgs.from_name(args.model, vocab_size=teacher.args.vocab_size, **shape))
    data.check_model(student.args.vocab_size)
    if not sharded:  # a plain single-device loop: what fabric.setup does on one device, the same values
        for model in (student, teacher):
            materialize_known_model(model, fabric.device, seed=args.seed)
    student = fabric.setup(student)  # 2D: TP/SP plan → FSDP2, then each rank's shards of the seeded init
    teacher = fabric.setup(teacher)  # frozen: its own plan on the same meshes, its weights or seeded init
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine_schedule(args.warmup_steps, args.max_steps, min_lr_ratio=0.1)
    )

    mesh = fabric.strategy.meshes if sharded else None  # the loss's data-parallel group, the context split
    history: dict[str, list] = {"loss": [], "grad_norm": [], "metrics": []}
    stream = batches(loader)
    for step in range(1, args.max_steps + 1):
        # Whole rows: the step takes this rank's context slices itself, after marking the distilled positions.
        batch = fabric.to_device(next(stream))
        # The mixed loss over the global batch's tokens; the teacher runs inside the student's head, without a graph.
        loss, global_mean, _, metrics = distillation_step(student.module, teacher.module, batch, config, mesh)
        fabric.backward(loss)
        grad_norm = fabric.clip_gradients(student, optimizer, max_norm=args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        history["loss"].append(global_mean.item())
        history["grad_norm"].append(float(grad_norm))
        history["metrics"].append({name: float(value) for name, value in metrics.items()})
        if on_step is not None:
            on_step(step, student, teacher)
        if step % args.log_every == 0:
            divergence = history["metrics"][-1][config.metric]
            fabric.print(f"step {step:>5}  loss {history['loss'][-1]:.4f}  {config.metric} {divergence:.4f}"
                         f"  grad norm {float(grad_norm):.3f}")
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
