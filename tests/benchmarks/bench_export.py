"""Peak memory of `lightning-2d export`: the streaming exporter against the previous one (every tensor
collected before writing), on the same sharded (DCP) and full checkpoints.

    .venv/bin/python tests/benchmarks/bench_export.py [--dim 1024] [--layers 24] [--max-shard-gb 0.25]

Builds a Llama checkpoint of random fp32 weights (default ≈ 1.4 GB: dim 1024, 24 layers, vocabulary
32000) as a DCP folder with a ``meta.pt`` shaped like the library's, and as a full ``torch.save``
file, then exports each with each exporter in a fresh subprocess. Each subprocess resets its
``VmHWM`` after its imports (``5 > /proc/self/clear_refs``, Linux) and reports the peak resident
memory of the export alone (anonymous memory plus the mapped checkpoint pages it touched) and the
wall time. Not a test: times are noisy on shared machines; the peaks are what to compare.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_2d.models.llama.model import ModelArgs, Transformer  # noqa: E402


# ---- the exporter before streaming (lightning_2d/hf.py before the change), for the side by side ----
def _previous_iter_weights(checkpoint: Path, prefix: str = "model.") -> Iterator[tuple[str, ModelArgs, torch.Tensor]]:
    from lightning_2d.hf import checkpoint_model_args

    if checkpoint.is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = torch.load(checkpoint / "meta.pt", weights_only=False)
        args = checkpoint_model_args(metadata)
        stored = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        key_prefix = f"state_dict.{prefix}"
        for key, meta in stored.items():
            if not key.startswith(key_prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            dcp.load({key: tensor}, checkpoint_id=str(checkpoint), no_dist=True)
            yield key[len(key_prefix):], args, tensor
    else:
        full = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
        args = checkpoint_model_args(full)
        for key, tensor in full["state_dict"].items():
            if key.startswith(prefix):
                yield key[len(prefix):], args, tensor


def previous_export_hf(checkpoint: Path, out_dir: Path, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: int = 5 * 2**30) -> Path:
    from safetensors.torch import save_file

    from lightning_2d.hf import INDEX_FILE, SINGLE_FILE, hf_config, hf_name, meta_to_hf, rotary_heads

    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, args, out_dtype = 0, None, dtype
    for name, args, tensor in _previous_iter_weights(checkpoint):
        heads = rotary_heads(name, args)
        tensor = tensor.to(dtype or tensor.dtype)
        out_dtype = tensor.dtype
        if heads is not None:
            tensor = meta_to_hf(tensor, heads)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name(name)] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out_dir / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out_dir / file, metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out_dir / "config.json").write_text(json.dumps(hf_config(args, out_dtype), indent=1))
    return out_dir


# ---- measuring -------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def child(exporter: str, checkpoint: Path, out_dir: Path, max_shard_bytes: int) -> None:
    """One export in this (fresh) process; prints its peak memory and time as JSON."""
    from lightning_2d.hf import export_hf

    export = export_hf if exporter == "new" else previous_export_hf
    for module in ("safetensors.torch", "torch.distributed.checkpoint"):  # in the baseline, like torch
        importlib.import_module(module)

    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of what follows
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(checkpoint, out_dir, max_shard_bytes=max_shard_bytes)
    seconds = time.perf_counter() - start
    print(json.dumps({"baseline_kib": baseline, "peak_kib": _status_kib("VmHWM"), "seconds": seconds}))


def build_checkpoints(args: ModelArgs, root: Path) -> tuple[Path, Path, int]:
    """A DCP folder and a full file holding the same random fp32 weights; returns (sharded, full, bytes)."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {f"model.{k}": torch.empty(s).normal_(0, 0.02, generator=generator) for k, s in shapes.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    metadata = {
        "epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6",
        "hyper_parameters": {"model": "debug", "model_overrides": {}}, "model_args": asdict(args),
        "lightning_2d": {"layout": {"world_size": 1, "data_parallel": 1, "tensor_parallel": 1}},
    }
    sharded, full = root / "sharded.ckpt", root / "full.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": on purpose
        dcp.save({"state_dict": state}, checkpoint_id=sharded, no_dist=True)
    torch.save(metadata, sharded / "meta.pt")
    torch.save({**metadata, "state_dict": state}, full)
    return sharded, full, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-gb", type=float, default=0.25)
    parser.add_argument("--child", nargs=4, metavar=("EXPORTER", "CHECKPOINT", "OUT", "MAX_SHARD_BYTES"),
                        help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        exporter, checkpoint, out, max_bytes = options.child
        child(exporter, Path(checkpoint), Path(out), int(max_bytes))
        return

    args = ModelArgs(dim=options.dim, n_layers=options.layers, n_heads=16, n_kv_heads=8, vocab_size=options.vocab,
                     multiple_of=256)
    max_bytes = int(options.max_shard_gb * 2**30)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        sharded, full, nbytes = build_checkpoints(args, root)
        print(f"checkpoint: {args.num_params() / 1e6:.0f}M parameters, {nbytes / 2**30:.2f} GiB of fp32 weights"
              f" (built in {time.perf_counter() - start:.0f} s); output files of at most {options.max_shard_gb} GiB")
        rows: list[dict[str, Any]] = []
        for kind, checkpoint in (("sharded", sharded), ("full", full)):
            for exporter in ("old", "new"):
                out = root / f"out_{kind}_{exporter}"
                done = subprocess.run(
                    [sys.executable, __file__, "--child", exporter, str(checkpoint), str(out), str(max_bytes)],
                    capture_output=True, text=True,
                )
                if done.returncode != 0:
                    raise SystemExit(done.stderr)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                files = len(list(out.glob("*.safetensors")))
                shutil.rmtree(out)
                rows.append({"kind": kind, "exporter": exporter, "files": files, **result})
                peak = result["peak_kib"] - result["baseline_kib"]
                print(f"{kind:>7} {exporter}: peak {result['peak_kib'] / 2**20:.2f} GiB (after imports"
                      f" {result['baseline_kib'] / 2**20:.2f} GiB, export +{peak / 2**20:.2f} GiB),"
                      f" {result['seconds']:.1f} s, {files} files", flush=True)
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
