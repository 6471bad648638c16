"""Tokenization throughput of the token-cache builder: 1 process vs N worker processes, side by side.

    .venv/bin/python tests/benchmarks/bench_prepare.py [--workers 2] [--repeats 2] [--vocab-size 8192] [--before PATH]

Builds the cache of the built-in corpus (the standard library's ``.py`` files, ~30 MB) into fresh
temporary folders with ``prepare_token_cache`` (what ``lightning-2d prepare-data`` runs), for the
byte tokenizer and, when the ``tokenizers`` package is installed, a byte-level BPE
``tokenizer.json`` trained here on a sample of the same corpus. Prints tokens/s and MB/s of each
(the best of ``--repeats`` builds) and the CPU time they took (this process + its workers: what
the rows cost whatever else runs on the machine), checks that every build gives the same token file, and also
times the Hugging Face tokenizer in one process with its own thread pool on (``encode_batch`` of a
task's documents in parallel), the way a single process could already use several cores.
``TOKENIZERS_PARALLELISM`` is ``false`` otherwise: one process = one core. ``--before PATH`` adds,
for each tokenizer, a row for ``build_token_cache`` of the ``lightning_2d`` in another checkout
(e.g. ``git archive HEAD lightning_2d | tar -x -C /tmp/before``), in a subprocess. Not a test: the
numbers depend on the machine and its load; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before `tokenizers` is imported: one core per process unless a row turns the thread pool on.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_2d.data import (  # noqa: E402
    CacheReport,
    corpus_bytes,
    default_num_workers,
    prepare_token_cache,
    stdlib_sources,
)
from lightning_2d.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer  # noqa: E402


def train_bpe(sources: list[Path], folder: Path, vocab_size: int, sample_bytes: int = 4_000_000) -> Path:
    """A byte-level BPE ``tokenizer.json`` (GPT-2 style) trained on the first ``sample_bytes`` of the corpus.

    Args:
        sources: The corpus.
        folder: Where to write ``tokenizer.json``.
        vocab_size: Vocabulary size (with the end-of-text token).
        sample_bytes: Characters of text to train on.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for path in sources:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        texts.append(text)
        size += len(text)
        if size >= sample_bytes:
            break
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers, joined after a build)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def build(
    sources: list[Path], tokenizer: Tokenizer, workers: int, root: Path, repeats: int
) -> tuple[CacheReport, float]:
    """The fastest of ``repeats`` builds from scratch (a new cache folder each time), and its CPU seconds.

    Args:
        sources: The corpus.
        tokenizer: The tokenizer.
        workers: Tokenizing processes.
        root: Parent of the cache folders.
        repeats: Builds to time.
    """
    best, best_cpu = None, 0.0
    for i in range(repeats):
        cpu = cpu_seconds()
        report = prepare_token_cache(sources, tokenizer, root / f"w{workers}-{i}", strict=False, num_workers=workers)
        cpu = cpu_seconds() - cpu
        assert report.built
        if best is None or report.seconds < best.seconds:
            best, best_cpu = report, cpu
    assert best is not None
    return best, best_cpu


BEFORE = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from lightning_2d.data import build_token_cache, stdlib_sources
from lightning_2d.data.tokenizers import load_tokenizer
sources, tokenizer = stdlib_sources(), load_tokenizer(sys.argv[2])
started, cpu = time.perf_counter(), time.process_time()
folder = build_token_cache(sources, tokenizer, sys.argv[3], strict=False)
seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
meta = json.loads((folder / "meta.json").read_text())
print(json.dumps({"seconds": seconds, "cpu": cpu, "tokens": meta["num_tokens"], "documents": meta["num_documents"]}))
"""


def build_before(checkout: Path, tokenizer: str, cache_dir: Path) -> tuple[CacheReport, float]:
    """``build_token_cache`` of the ``lightning_2d`` in ``checkout`` (its own process, one core).

    Args:
        checkout: A folder holding another version's ``lightning_2d`` package.
        tokenizer: ``"byte"`` or a ``tokenizer.json`` path.
        cache_dir: Where it writes its cache.
    """
    import lightning_2d

    if Path(lightning_2d.__file__).resolve().parent == (checkout / "lightning_2d").resolve():
        raise SystemExit(f"--before {checkout} is this checkout")
    out = subprocess.run([sys.executable, "-c", BEFORE, str(checkout), tokenizer, str(cache_dir)],
                         capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    sources = stdlib_sources()
    report = CacheReport(cache_dir, True, len(sources), corpus_bytes(sources), result["tokens"], result["documents"],
                         result["seconds"], 1)
    return report, result["cpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=min(2, default_num_workers()),
                        help="processes of the parallel rows")
    parser.add_argument("--repeats", type=int, default=2, help="builds per row; the fastest is shown")
    parser.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained for the benchmark")
    parser.add_argument("--before", type=Path, default=None, help="another checkout: its single-process builder too")
    args = parser.parse_args()

    sources = stdlib_sources()
    total = corpus_bytes(sources)
    print(f"corpus: {len(sources):,} standard-library files, {total / 1e6:.1f} MB;"
          f" cores usable: {default_num_workers()}; load average: {os.getloadavg()[0]:.1f}")
    rows: list[tuple[str, str, CacheReport, float, float]] = []  # + CPU seconds, load average after
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizers: list[tuple[str, Tokenizer, str]] = [("byte", ByteTokenizer(), "byte")]
        try:
            started = time.perf_counter()
            path = train_bpe(sources, root, args.vocab_size)
            tokenizers.append((f"BPE {args.vocab_size} (tokenizer.json)", load_tokenizer(str(path)), str(path)))
            print(f"trained the BPE tokenizer in {time.perf_counter() - started:.1f} s")
        except ImportError:
            print("tokenizers is not installed: byte tokenizer only")
        for name, tokenizer, spec in tokenizers:
            if args.before is not None:
                report, cpu = build_before(args.before, spec, root / "before" / name.split()[0])
                rows.append((name, "before: 1 process", report, cpu, os.getloadavg()[0]))
            reports = []
            for workers in (1, args.workers):
                report, cpu = build(sources, tokenizer, workers, root / name.split()[0] / "cache", args.repeats)
                rows.append((name, f"{workers} process{'es' if workers > 1 else ''}", report, cpu, os.getloadavg()[0]))
                reports.append(report)
            assert filecmp.cmp(reports[0].folder / "tokens.bin", reports[1].folder / "tokens.bin", shallow=False), (
                "the parallel build differs from the single-process one"
            )
            if name != "byte":
                os.environ["TOKENIZERS_PARALLELISM"] = "true"
                report, cpu = build(sources, tokenizer, 1, root / "threads" / "cache", args.repeats)
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
                rows.append((name, "1 process, tokenizers' threads", report, cpu, os.getloadavg()[0]))
    print()
    print(f"{'tokenizer':<27} {'processes':<31} {'tokens':>11} {'seconds':>8} {'tokens/s':>11} {'MB/s':>6}"
          f" {'speed-up':>8} {'CPU s':>7} {'tokens/CPU s':>12} {'load':>5}")
    # Speed-ups against this checkout's single process.
    base = {name: report.tokens_per_second for name, how, report, *_ in rows if how == "1 process"}
    for name, how, report, cpu, load in rows:
        speed = report.tokens_per_second
        print(f"{name:<27} {how:<31} {report.tokens:>11,} {report.seconds:>8.2f} {speed:>11,.0f}"
              f" {report.bytes / report.seconds / 1e6:>6.1f} {speed / base[name]:>7.2f}x {cpu:>7.2f}"
              f" {report.tokens / cpu:>12,.0f} {load:>5.1f}")
    print("\nEvery build of one tokenizer wrote the same tokens.bin (checked byte for byte). load: the 1-minute load"
          " average after the row; above the number of cores, other processes took part of them and wall-clock"
          " speed-ups understate what free cores give (the CPU-second columns do not depend on it as much).")


if __name__ == "__main__":
    main()
