"""One rank of a GPU-lane job: ``python tests/gpu/worker.py runs CONFIG_JSON`` (started by
``tests/gpu/conftest.py`` through ``lightning_2d.tools.launch.launch_processes``, which sets
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*).

A job runs several fits one after another in the same processes (``cfg["runs"]``), so process
start-up, CUDA context and NCCL initialization are paid once per job instead of once per run: the
lane must fit in 5 minutes. Each fit reseeds everything and builds a fresh module, data module,
strategy and Trainer; Lightning reuses the existing process group. After every run, each rank
rewrites ``rank{N}.json`` with all results so far, so a crash still leaves the earlier runs'
numbers for diagnosis.

A run's config (all JSON):

- ``name``; ``strategy``: ``"single"`` (plain Trainer, one device: the reference) or ``"2d"``;
  ``dp``, ``tp``; ``options``: extra ``ModelParallel2DStrategy`` keyword arguments.
- ``accelerator``, ``precision``, ``model`` (``ModelArgs`` fields), ``seq_len``, ``global_batch``,
  ``steps``, ``lr``, ``warmup_steps``, ``fused`` (AdamW), ``seed``, ``init_seed``.
- ``corpus``, ``cache_dir``: ``TextDataModule`` input (byte tokens of real text).
- ``checkpoint``: ``ModelCheckpoint`` keyword arguments; ``resume``: a checkpoint path for ``ckpt_path``.
- ``measure``: ``{"warmup": W, "window": K}``: time steps ``W+1 .. W+K`` with the device synchronized
  at both ends, and attach ``TokenThroughputMonitor`` over the same window.
- ``grad_norms``: record the global gradient norm of every step (one all-reduce per step).
- ``module``: extra ``LlamaLightningModule`` keyword arguments (e.g. ``{"lora": {"rank": 8}}``); the result
  then counts trained and frozen elements and how many frozen tensors changed during the fit.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make `tests.gpu` and `lightning_2d` importable
    sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_2d import LlamaLightningModule, ModelArgs, ModelParallel2DStrategy, TextDataModule  # noqa: E402
from lightning_2d.integration.callbacks import TokenThroughputMonitor  # noqa: E402
from lightning_2d.ops.nf4 import is_nf4, nf4_equal, nf4_state  # noqa: E402
from lightning_2d.parallel.grad_norm import total_grad_norm  # noqa: E402
from tests.gpu.lane import PARENT_PID_ENV, dense_bf16_peak_tflops  # noqa: E402


class Recorder(L.Callback):
    """Per-step losses (kept as device tensors until the end: no host sync inside the step loop),
    optional gradient norms, and host timestamps of each step's end."""

    def __init__(self, grad_norms: bool) -> None:
        self.record_grad_norms = grad_norms
        self._losses: list[torch.Tensor] = []
        self.grad_norms: list[float] = []
        self.step_end_times: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.record_grad_norms:
            self.grad_norms.append(float(total_grad_norm(pl_module.model.parameters())))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._losses.append(trainer.callback_metrics["train_loss"].detach().clone())
        self.step_end_times.append(time.perf_counter())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The frozen tensors as they start (this rank's shards), to show that training left them alone.
        self._frozen = {name: _snapshot(_local(p)) for name, p in pl_module.model.named_parameters()
                        if not p.requires_grad}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = dict(pl_module.model.named_parameters())
        self.frozen_changed = [name for name, start in self._frozen.items() if not _same(_local(params[name]), start)]
        self.nf4 = sum(is_nf4(p) for p in params.values())
        self.numel = {"trained": sum(_local(p).numel() for p in params.values() if p.requires_grad),
                      "frozen": sum(_local(p).numel() for p in params.values() if not p.requires_grad)}

    @property
    def losses(self) -> list[float]:
        return [float(x) for x in self._losses]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _snapshot(tensor: torch.Tensor) -> Any:
    """A copy of a tensor's bits (an NF4 base's inner tensors: cloning an NF4Tensor quantizes it again)."""
    return nf4_state(tensor) if is_nf4(tensor) else tensor.detach().clone()


def _same(tensor: torch.Tensor, snapshot: Any) -> bool:
    return nf4_equal(tensor, snapshot) if is_nf4(tensor) else torch.equal(tensor, snapshot)


class WindowTimer(L.Callback):
    """Wall time of optimizer steps ``warmup+1 .. warmup+window``, the device synchronized at both
    ends: queued kernels are inside the window, not after it (torchtitan measures the same way)."""

    def __init__(self, warmup: int, window: int) -> None:
        self.warmup, self.window = warmup, window
        self._start: float | None = None
        self.seconds: float | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # optimizer steps done, this one included
        if step not in (self.warmup, self.warmup + self.window):
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        if step == self.warmup:
            self._start = now
        elif self._start is not None:
            self.seconds = now - self._start


def module_chain(block: torch.nn.Module) -> list[str]:
    """Class names from a block's outermost wrapper inwards (FSDP, compile, activation checkpointing)."""
    names = []
    while block is not None:
        names.append(type(block).__name__)
        block = getattr(block, "_orig_mod", None) or getattr(block, "_checkpoint_wrapped_module", None)
    return names


def inductor_micro_pipeline_tp() -> bool | None:
    """Whether Inductor's async-TP pass (``_micro_pipeline_tp``) is switched on in this process."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return None
    return getattr(inductor_config, "_micro_pipeline_tp", None)


def build_strategy(run: dict[str, Any]) -> tuple[Any, int]:
    """The Trainer's strategy and device count for ``run``."""
    if run["strategy"] == "single":
        return "auto", 1
    strategy = ModelParallel2DStrategy(
        data_parallel_size=run["dp"], tensor_parallel_size=run["tp"], **run.get("options", {})
    )
    return strategy, int(os.environ["WORLD_SIZE"])


def fit_one(run: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration and return what the tests compare (see the module docstring)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    # The previous fit's module, optimizer and Trainer sit in reference cycles until the collector runs; without
    # this its tensors still occupy the device during this fit and inflate this run's peak memory (seen on the
    # H200: +0.2 GiB per earlier fit of the parity model).
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    started = time.perf_counter()
    L.seed_everything(run["seed"], verbose=False)
    torch._dynamo.reset()  # a previous run's compiled code must not serve this run's new modules
    module = LlamaLightningModule(
        run["model"],
        learning_rate=run["lr"],
        warmup_steps=run["warmup_steps"],
        max_steps=run["steps"],
        init_seed=run["init_seed"],
        fused=run.get("fused"),
        **run.get("module", {}),
    )
    dp = 1 if run["strategy"] == "single" else run["dp"]
    if run["global_batch"] % dp:
        raise ValueError(f"run {run['name']}: global_batch {run['global_batch']} is not divisible by dp {dp}")
    # One data-parallel replica reads global_batch // dp sequences per step; TextDataModule's sampler
    # gives every dp size the same global batches, so the single-device reference reads the union.
    data = TextDataModule(run["corpus"], seq_len=run["seq_len"], batch_size=run["global_batch"] // dp,
                          val_fraction=0.0, cache_dir=run["cache_dir"], seed=run["seed"])
    recorder = Recorder(grad_norms=run.get("grad_norms", False))
    callbacks: list[L.Callback] = [recorder]
    timer = monitor = None
    if run.get("measure"):
        warmup, window = run["measure"]["warmup"], run["measure"]["window"]
        timer = WindowTimer(warmup, window)
        monitor = TokenThroughputMonitor(log_every_n_steps=window, skip_first_steps=warmup)
        callbacks += [timer, monitor]
    if run.get("checkpoint"):
        callbacks.append(ModelCheckpoint(**run["checkpoint"]))
    strategy, devices = build_strategy(run)
    trainer = L.Trainer(
        accelerator=run["accelerator"],
        devices=devices,
        strategy=strategy,
        precision=run["precision"],
        max_steps=run["steps"],
        logger=False,
        enable_checkpointing=bool(run.get("checkpoint")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=run.get("resume"))
    # Not module.device: a single-device strategy's teardown has moved the module to the CPU.
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    optimizer = trainer.optimizers[0]
    model = module.model
    first_block = next(iter(model.layers.values()))
    result: dict[str, Any] = {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "global_step": trainer.global_step,
        "optimizer": {"fused": optimizer.defaults.get("fused"), "foreach": optimizer.defaults.get("foreach")},
        "block_chain": module_chain(first_block),
        "float8_linears": sum(type(m).__name__.startswith("Float8") for m in model.modules()),
        "simple_fsdp_modules": sum(type(m).__name__.startswith("SimpleFSDP") for m in model.modules()),
        "micro_pipeline_tp": inductor_micro_pipeline_tp(),
        "numel": recorder.numel,
        "frozen_changed": recorder.frozen_changed,
        "nf4_weights": recorder.nf4,
        "device": str(device),
        "fit_seconds": time.perf_counter() - started,
    }
    mesh = module.device_mesh
    if mesh is not None:
        # (data_parallel, tensor_parallel) sizes: the root mesh has every dimension (pipeline, replicate,
        # shard, context, tensor), size 1 where unused, so its raw shape says nothing about the layout.
        result["mesh_shape"] = [mesh["data_parallel"].size(), mesh["tensor_parallel"].size()]
        result["mesh_dims"] = dict(zip(mesh.mesh_dim_names, mesh.shape))
        result["dp_rank"] = mesh["data_parallel"].get_local_rank()
        result["tp_rank"] = mesh["tensor_parallel"].get_local_rank()
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    if timer is not None:
        result["throughput"] = throughput(run, module.model_args, timer, monitor, trainer.world_size, dp, device)
    if trainer.global_rank == 0:
        losses = [round(x, 4) for x in result["losses"]]
        print(f"[gpu-lane] run {run['name']}: {result['fit_seconds']:.1f}s, losses {losses}", flush=True)
    return result


def throughput(
    run: dict[str, Any],
    args: ModelArgs,
    timer: WindowTimer,
    monitor: TokenThroughputMonitor,
    world_size: int,
    dp: int,
    device: torch.device,
) -> dict[str, Any]:
    """Tokens/s, TFLOP/s per device and MFU of the timed window (torchtitan's FLOP convention:
    ``ModelArgs.flops_per_token``), with ``TokenThroughputMonitor``'s own figures beside them."""
    if timer.seconds is None:
        raise RuntimeError(
            f"run {run['name']}: the timed window (steps {timer.warmup + 1}..{timer.warmup + timer.window}) did not"
            f" complete in {run['steps']} steps; steps must be at least warmup + window"
        )
    tokens = timer.window * run["global_batch"] * run["seq_len"]
    tokens_per_sec = tokens / timer.seconds
    tflops = args.flops_per_token(run["seq_len"]) * tokens_per_sec / world_size / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = dense_bf16_peak_tflops(name) if device.type == "cuda" else None
    return {
        "device_name": name,
        "num_params": args.num_params(),
        "num_params_without_embedding": args.num_params(exclude_embedding=True),
        "flops_per_token": args.flops_per_token(run["seq_len"]),
        "data_parallel": dp,
        "window_steps": timer.window,
        "window_seconds": timer.seconds,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / world_size,
        "tflops_per_device": tflops,
        "peak_tflops": peak,
        "mfu_percent": 100.0 * tflops / peak if peak else None,
        "monitor": {k: v for k, v in monitor.last.items() if isinstance(v, (int, float)) and math.isfinite(v)},
    }


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def die_with_parent() -> None:
    """Have the kernel kill this rank when the process that launched it dies.

    The launcher starts each rank in its own session; when ``run.sh``'s time limit kills pytest,
    orphaned ranks would otherwise keep the GPU busy under the next step's measurement.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    launcher = os.environ.get(PARENT_PID_ENV)
    if launcher is not None and os.getppid() != int(launcher):  # it died before the line above took effect
        os._exit(1)


def run_all(cfg: dict[str, Any]) -> None:
    """Every run of the job in order; ``rank{N}.json`` rewritten after each."""
    die_with_parent()
    out_dir = Path(cfg["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    if cfg.get("deterministic"):
        # cuBLAS reads this when its handle is created (first matmul), i.e. after this line.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: an op without a deterministic kernel warns instead of failing the job; the
        # checkpoint test measures run-to-run equality itself instead of trusting this switch.
        torch.use_deterministic_algorithms(True, warn_only=True)
    results: dict[str, Any] = {}
    meta = {"torch": torch.__version__, "lightning": L.__version__, "cuda": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", "0")))
            if torch.cuda.is_available() else "cpu"}
    # Lightning's environment teardown deletes WORLD_SIZE at the end of a fit; the next fit of this
    # process must see the launcher's variables again.
    launch_env = {k: os.environ[k] for k in LAUNCH_VARIABLES if k in os.environ}
    for run in cfg["runs"]:
        os.environ.update(launch_env)
        try:
            results[run["name"]] = fit_one(run)
        finally:
            (out_dir / f"rank{rank}.json").write_text(json.dumps({"meta": meta, "runs": results}))


SCENARIOS = {"runs": run_all}

if __name__ == "__main__":
    scenario, config_path = sys.argv[1], sys.argv[2]
    SCENARIOS[scenario](json.loads(Path(config_path).read_text()))
