"""The distillation loss fused with both heads (``ops.distillation.linear_distillation``) against the dense one on
full logits (``dense_linear_distillation``), side by side: peak memory and step time on CPU.

    .venv/bin/python tests/benchmarks/bench_distillation.py [--tokens 2048] [--student-dim 256] [--teacher-dim 512]
        [--vocab 128256] [--beta 0.5] [--temperature 1.0] [--chunk-size 512] [--steps 3] [--threads 1]

Each variant runs in a fresh interpreter (``MALLOC_MMAP_THRESHOLD_=65536``: every allocation above 64 KiB its own
mapping, returned to the kernel when freed, so the resident set follows the live tensors) on the same seeded
inputs: the student's hidden states and head (requiring gradients), the teacher's (not). A step is the loss and its
backward; after one warm-up step (gradients allocated and kept), the peak resident memory is reset
(``integration.callbacks.reset_peak_memory``) and the printed peak is what the measured steps add to what was
resident before them (inputs, head weights, their gradients). The losses of both variants are printed to show they
agree. Not a test: the numbers depend on the machine; compare the rows of one run. The dense variant at the default
shape needs ~10 GiB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("fused", "dense")


def worker(cfg: dict) -> dict:
    import gc

    import torch

    from lightning_2d.integration.callbacks import peak_memory_gib, reset_peak_memory
    from lightning_2d.ops.distillation import dense_linear_distillation, linear_distillation

    torch.set_num_threads(cfg["threads"])
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    n, vocab = cfg["tokens"], cfg["vocab"]
    student_hidden = torch.randn(n, cfg["student_dim"], generator=g).requires_grad_()
    student_weight = (torch.randn(vocab, cfg["student_dim"], generator=g) * 0.05).requires_grad_()
    teacher_hidden = torch.randn(n, cfg["teacher_dim"], generator=g)
    teacher_weight = torch.randn(vocab, cfg["teacher_dim"], generator=g) * 0.05
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[: n // 8] = -100  # a prompt's worth of tokens not counted
    options = {"beta": cfg["beta"], "temperature": cfg["temperature"]}
    if cfg["variant"] == "fused":
        def loss():
            return linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                       chunk_size=cfg["chunk_size"], **options)[0]
    else:
        def loss():
            return dense_linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                             **options)[0]

    def step() -> float:
        total = loss()
        total.backward()
        return float(total)

    value = step()  # gradients allocated, thread pools and allocator warm
    gc.collect()
    reset_peak_memory(cpu)
    before = peak_memory_gib(cpu)  # the reset sets the peak to what is resident now
    times = []
    for _ in range(cfg["steps"]):
        start = time.perf_counter()
        value = step()
        times.append(time.perf_counter() - start)
    return {"added_gib": peak_memory_gib(cpu) - before, "resident_gib": before, "step_s": statistics.median(times),
            "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2 * 1024)
    parser.add_argument("--student-dim", type=int, default=256)
    parser.add_argument("--teacher-dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: fused, dense")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cfg = {k: v for k, v in vars(args).items() if k not in ("worker", "variants")}
    print(f"{args.tokens} tokens, student dim {args.student_dim}, teacher dim {args.teacher_dim}, vocab {args.vocab},"
          f" beta {args.beta}, T {args.temperature}, fp32, {args.threads} thread(s); fused chunk {args.chunk_size}",
          flush=True)
    for variant in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps({**cfg, "variant": variant})],
                             env=env, cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{variant:<6} peak added {r['added_gib']:6.3f} GiB (resident before {r['resident_gib']:.3f})"
              f"   step {r['step_s']:6.2f} s   loss {r['loss']:.6f}", flush=True)


if __name__ == "__main__":
    main()
