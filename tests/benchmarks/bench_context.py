"""Context parallelism, measured side by side: activation memory and step time at context 1, 2 and 4.

    .venv/bin/python tests/benchmarks/bench_context.py [--seq-len 8192] [--sizes 1 2 4] [--steps 3]

For each context size ``C`` and with document masking off and on, starts ``C`` processes (CPU/gloo, one thread
each), builds the widened debug Llama with the library's own ``parallelize_model`` on a ``(context C)`` mesh
(FSDP over the context ranks, as the strategies do), and trains on one sequence of ``--seq-len`` tokens per step,
each rank on its load-balanced slice (``context_shard``) — the path ``CausalLMModule`` takes. A rank's
*activations* are what the measured step adds to the memory resident before it (Linux ``VmHWM`` reset before the
step, ``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave the resident set; gradients and optimizer state already
allocated by a first step); printed as the largest over the ranks, beside the planner's estimate for the same
layout (``lightning-2d plan --context-parallel-size C``, which counts CUDA's FlexAttention block mask), the
median step time and the size of the CPU path's dense additive mask (``T/C × T`` floats, CPU only: built once per
forward, shared by the layers, freed after the backward, so part of the step's growth; the README's table was
measured when the mask was kept from one forward to the next, outside that growth). With ``C`` processes on fewer
cores the step times of C 4 compete for cores: compare the memory column across sizes, the time columns within
one size (mask off vs on). Not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_2d.parallel.context import EXCHANGES  # noqa: E402

#: The debug model widened so that attention matters: 8 query heads of 64, 2 key/value heads.
MODEL = {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 1024, "multiple_of": 256,
         "max_seq_len": 16384}


def rank_main(cp: int, seq_len: int, steps: int, documents: bool, exchange: str, out: Path) -> None:
    import torch.distributed as dist

    from lightning_2d.data.loading import document_positions
    from lightning_2d.integration.callbacks import peak_memory_gib, reset_peak_memory
    from lightning_2d.parallel import ParallelConfig, ParallelDims
    from lightning_2d.parallel.context import ContextParallelAttention, context_shard
    from lightning_2d.parallel.loss import normalize_by_global_tokens
    from tests.benchmarks.ranks import parallel_llama

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    config = ParallelConfig(data_parallel_size=1, tensor_parallel_size=1, context_parallel_size=cp)
    config = config.resolve_dtypes("32-true")
    parallelized = parallel_llama(MODEL, config, ParallelDims(dp_replicate=1, dp_shard=1, tp=1, cp=cp))
    model, mesh = parallelized.model, parallelized.meshes
    for module in model.modules():  # the exchange measured (parallelize_model installs the default)
        if isinstance(getattr(module, "attend", None), ContextParallelAttention):
            module.attend.exchange = exchange
    args = model.args
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, args.vocab_size, (1, seq_len + 1), generator=generator)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if documents:  # documents of ~seq/16 tokens: end-of-text (id 1) at random places
        ends = torch.randperm(seq_len, generator=generator)[:16]
        batch["input_ids"][:, ends] = 1
        batch["position_ids"] = document_positions(batch["input_ids"], eos_id=1)
    part = context_shard(batch, mesh if cp > 1 else None)
    cpu = torch.device("cpu")
    times, grown = [], 0.0
    for step in range(steps):
        start = time.perf_counter()
        if step == steps - 1:
            import gc

            gc.collect()
            reset_peak_memory(cpu)
            before = peak_memory_gib(cpu)
        # A new positions tensor each step, as each batch brings (the mask is built once per forward from them).
        positions = {"position_ids": part["position_ids"].clone()} if "position_ids" in part else {}
        loss_sum = model(part["input_ids"], labels=part["labels"], **positions)
        loss, _, _ = normalize_by_global_tokens(loss_sum, part["labels"], mesh if cp > 1 else None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: the step's growth is its activations
        times.append(time.perf_counter() - start)
        if step == steps - 1:
            grown = (peak_memory_gib(cpu) - before) * 2**30
    from tests.benchmarks.ranks import write_rank

    write_rank(out, rank, {"times": times, "activations": grown})
    dist.destroy_process_group()


def measure(cp: int, seq_len: int, steps: int, documents: bool, exchange: str = "all_gather") -> dict[str, float]:
    from tests.benchmarks.ranks import run_ranks

    ranks = run_ranks(__file__, [str(cp), str(seq_len), str(steps), str(int(documents)), exchange], nprocs=cp, timeout=1800,
                      env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    step = statistics.median(max(r["times"][i] for r in ranks) for i in range(1, steps))
    return {"activations": max(r["activations"] for r in ranks), "step_s": step}


def dense_mask_bytes(cp: int, seq_len: int) -> int:
    """The CPU path's additive mask under context parallelism (fp32, local queries × the whole sequence, shared by
    the layers); the planner counts CUDA's FlexAttention block mask instead (next to nothing)."""
    return seq_len // cp * seq_len * 4 if cp > 1 else 0


def planned(cp: int, seq_len: int) -> int:
    from lightning_2d.parallel import ParallelConfig
    from lightning_2d.tools.planner import plan_run

    report = plan_run("debug", num_nodes=1, devices=cp, precision="32-true", seq_len=seq_len, micro_batch_size=1,
                      model_overrides=MODEL, config=ParallelConfig(data_parallel_size=1, tensor_parallel_size=1,
                                                                   context_parallel_size=cp))
    return report.activation_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    parser.add_argument("--exchanges", nargs="+", default=["all_gather"], choices=EXCHANGES,
                        help="the context-parallel exchanges to measure side by side (C > 1)")
    parser.add_argument("--rank-main", nargs=6, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.rank_main:
        cp, seq_len, steps, documents, exchange, out = options.rank_main
        rank_main(int(cp), int(seq_len), int(steps), documents == "1", exchange, Path(out))
        return
    print(f"seq {options.seq_len}, 1 sequence per step, model {MODEL}, fp32, CPU/gloo, one thread per rank")
    print(f"{'context':>7} {'exchange':>10} {'activations':>12} {'vs C1':>6} {'planned':>9} {'plan/meas':>9} {'CPU mask':>9}"
          f" {'step (causal)':>14} {'step (documents)':>17}")
    first = None
    runs = [(cp, exchange) for cp in options.sizes for exchange in (options.exchanges if cp > 1 else ["all_gather"])]
    for cp, exchange in runs:
        causal = measure(cp, options.seq_len, options.steps, documents=False, exchange=exchange)
        documents = measure(cp, options.seq_len, options.steps, documents=True, exchange=exchange)
        plan, mask = planned(cp, options.seq_len), dense_mask_bytes(cp, options.seq_len)
        first = first or causal["activations"]
        print(f"{cp:>7} {exchange if cp > 1 else '-':>10} {causal['activations'] / 2**30:>10.2f} G"
              f" {causal['activations'] / first:>5.2f}x {plan / 2**30:>7.2f} G {plan / causal['activations']:>9.2f}"
              f" {mask / 2**30:>7.2f} G {causal['step_s']:>12.2f} s {documents['step_s']:>15.2f} s", flush=True)


if __name__ == "__main__":
    main()
