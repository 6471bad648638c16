"""One rank of a distributed test job: ``python worker.py SCENARIO CONFIG_JSON`` (see launcher.py).

Writes ``rank{N}.json`` (and, on rank 0, weight files) into the config's ``out_dir``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, ClassVar

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy

REPO = Path(__file__).resolve().parents[2]
from lightning_2d.ops.nf4 import dequantize, is_nf4
from lightning_2d.parallel.grad_norm import total_grad_norm
from lightning_2d.integration.preference import metric_names as preference_metric_names
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.parallel.simple_fsdp import sharded_parameters


class SyntheticTokens(Dataset):
    """``n`` fixed random sequences; sample ``i`` ignores its first ``i % 5`` targets (uneven token
    counts) unless ``even``. ``documents``: about one token in 8 is end-of-text (id 0), and each sample
    carries its documents' ``position_ids``, as ``TextDataModule(document_mask=True)``; ``prompts``: the first
    ``prompts`` targets of each document are ignored too, as a chat's prompt."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0, even: bool = False,
                 documents: bool = False, prompts: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
        if documents:
            self.tokens[torch.rand(self.tokens.shape, generator=g) < 0.125] = 0
        self.even, self.documents, self.prompts = even, documents, prompts

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = self.tokens[i]
        labels = seq[1:].clone()
        if not self.even:
            labels[: i % 5] = -100
        sample = {"input_ids": seq[:-1], "labels": labels}
        if self.documents:
            from lightning_2d.data.loading import document_positions

            sample["position_ids"] = document_positions(sample["input_ids"], 0)
            sample["labels"][sample["position_ids"] < self.prompts] = -100
        return sample


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter, by canonical name; a collective on every rank. Under
    pipeline parallelism: this rank's stages only (``save_state`` writes one file per stage)."""
    out = {}
    for name, p in module.named_parameters():
        if is_nf4(p):  # a QLoRA base: its dequantized values (the same bits give the same values), gathered
            local = p.to_local() if hasattr(p, "to_local") else p
            full = dequantize(local)
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import DTensor

                full = DTensor.from_local(full, p.device_mesh, p.placements).full_tensor()
        else:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[canonical_name(name)] = full.detach().float().cpu().clone()
    return out


def pipeline_of_run(owner: Any) -> Any:
    """The ``Pipeline`` of a pipelined run, from its strategy or LightningModule (both have ``pipeline``: the result
    the strategy keeps from ``parallelize_model``), else ``None``: the one place the tests reach a pipeline."""
    return getattr(owner, "pipeline", None)


def pipeline_group_of(strategy: Any) -> Any:
    """The pipeline group of the strategy's pipeline (``strategy.pipeline``), else ``None``."""
    pipeline = pipeline_of_run(strategy)
    return pipeline.pp_group if pipeline is not None else None


def save_state(model: torch.nn.Module, mesh, global_rank: int, out_dir: Path, which: str) -> None:
    """``which.pt`` from rank 0, or under pipeline parallelism ``which_pp{R}.pt`` from the first rank of
    each pipeline rank's sub-mesh (``load_weights`` merges them); a collective on every rank."""
    from lightning_2d.parallel.meshes import as_meshes

    state = full_state(model)
    meshes = as_meshes(mesh)
    if meshes is not None and meshes.optional("pipeline_parallel") is not None:
        if meshes.get("data_parallel").get_local_rank() == 0 and meshes.get("tensor_parallel").get_local_rank() == 0:
            torch.save(state, out_dir / f"{which}_pp{meshes.get('pipeline_parallel').get_local_rank()}.pt")
    elif global_rank == 0:
        torch.save(state, out_dir / f"{which}.pt")


def save_trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, global_rank: int,
                       out_dir: Path) -> None:
    """``final_optimizer.pt`` (each optimized parameter's full optimizer state, by canonical name) and, for QLoRA,
    ``final_nf4.pt`` (each NF4 weight's inner tensors, the row shards' pieces joined in rank order: the bits one device
    would hold) from rank 0; a collective on every rank. Not under pipeline parallelism (a rank holds its stages)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from lightning_2d.ops.nf4 import nf4_state

    def full(value):
        return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu().clone()

    optimizer_state, nf4 = {}, {}
    for name, p in model.named_parameters():
        if p in optimizer.state:
            optimizer_state[canonical_name(name)] = {k: full(v) if isinstance(v, torch.Tensor) else v
                                                     for k, v in sorted(optimizer.state[p].items())}
        if not is_nf4(p):
            continue
        with torch.no_grad():
            state = nf4_state(p.to_local() if hasattr(p, "to_local") else p)
        rows = [d for d, pl in enumerate(getattr(p, "placements", ())) if isinstance(pl, Shard) and pl.dim == 0]
        if rows:  # torchao cuts the codes, scalers and factors of row shards contiguously (nf4_split)
            group = p.device_mesh.get_group(rows[0])
            pieces: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(pieces, state, group=group)
            state = {k: torch.cat([piece[k] for piece in pieces]) if k in ("quantized_data", "quantized_scalers",
                                                                            "quantization_factor") else v
                     for k, v in state.items()}
        nf4[canonical_name(name)] = {k: v.cpu() for k, v in state.items()}
    if global_rank == 0:
        torch.save(optimizer_state, out_dir / "final_optimizer.pt")
        if nf4:
            torch.save(nf4, out_dir / "final_nf4.pt")


def persistent_buffers(module: torch.nn.Module) -> dict[str, list[float]]:
    """This rank's buffers that a checkpoint saves (``state_dict``'s, not the derived ones such as the rotary table),
    by canonical name, as lists (exact for float32 values): a bias-balanced mixture of experts' ``expert_bias``, which
    routes but is no parameter (``full_state`` reads parameters only). Under pipeline parallelism: this rank's stages'."""
    saved = module.state_dict().keys()
    return {canonical_name(name): (b.full_tensor() if hasattr(b, "full_tensor") else b).detach().float().cpu().tolist()
            for name, b in module.named_buffers() if name in saved}


def model_overrides(cfg: dict) -> dict | None:
    """``model_overrides`` of ``cfg``, with the short keys of a job's name (no dict in it) merged: ``blocks`` the
    number of blocks (``n_layers``: 2 for a job whose tests name no block past the second, about a third of a 4-rank
    fit's collectives fewer), ``moe_bias_rate`` turning the preset's experts into aux-loss-free, bias-balanced ones
    moving by that rate."""
    overrides = cfg.get("model_overrides")
    if "blocks" in cfg:
        overrides = {**(overrides or {}), "n_layers": cfg["blocks"]}
    if "moe_bias_rate" not in cfg:
        return overrides
    from dataclasses import asdict, replace

    from lightning_2d.models.llama.model import PRESETS

    moe = replace(PRESETS[cfg["model"]].moe, load_balancing="bias", bias_update_rate=cfg["moe_bias_rate"])
    return {**(overrides or {}), "moe": asdict(moe)}


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own shards of every parameter, by canonical name (no collective)."""
    return {canonical_name(name): (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()
            for name, p in module.named_parameters()}


class Recorder(L.Callback):
    """Per step: losses, batches, random draws, gradient norms (and weights at ``weights_at_steps``).

    ``save_weights``: the full weights at train end (``final.pt``) and, with ``initial_weights``, at train start
    (``initial.pt``). ``grad_norms``: each step's total gradient norm before clipping and after the step (each a
    norm over the DTensor gradients with its all-reduces); of a mixture of experts also the routed experts' own norm
    before clipping (``expert_grad_norms``: a small share of the total, which a scale error of theirs barely moves).

    ``local_weights_at_steps`` and ``local_weights_on_exception``: every rank writes its own shards
    (``local_rank{R}_step{S}.pt``, ``local_rank{R}_exception.pt`` with the step reached), so a test can
    compare each rank's weights where a collective is no longer possible (a run stopping on every rank).
    """

    def __init__(self, out_dir: Path, save_weights: bool, weights_at_steps: tuple[int, ...] = (),
                 local_weights_at_steps: tuple[int, ...] = (), local_weights_on_exception: bool = False,
                 grad_norms: bool = True, initial_weights: bool = True) -> None:
        self.out_dir, self.save_weights, self.weights_at_steps = out_dir, save_weights, weights_at_steps
        self.save_initial_weights = save_weights and initial_weights
        self.record_grad_norms = grad_norms
        self.local_weights_at_steps = local_weights_at_steps
        self.local_weights_on_exception = local_weights_on_exception
        self.batch_started_at: list[float] = []  # time.time() of each on_train_batch_start
        self.losses: list[float] = []
        self.batches: list[str] = []
        self.draws: list[float] = []
        self.grad_norms: list[float] = []  # before clipping
        self.expert_grad_norms: list[float] = []  # the routed experts' alone, before clipping
        self.stepped_grad_norms: list[float] = []  # what the optimizer step sees (after clipping)
        self.step_tokens: list[float] = []
        self.global_tokens: list[float] = []
        self.preference_metrics: list[dict[str, float]] = []
        self.trained_tokens: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.record_grad_norms:
            return
        group = pipeline_group_of(trainer.strategy)
        self.grad_norms.append(float(total_grad_norm(pl_module.model.parameters(), pipeline_group=group)))
        if getattr(getattr(pl_module, "model_args", None), "moe", None) is not None:  # every rank: a collective
            experts = [p for name, p in pl_module.model.named_parameters() if ".experts." in name]
            self.expert_grad_norms.append(float(total_grad_norm(experts, pipeline_group=group)))

    def on_train_start(self, trainer, pl_module) -> None:
        if self.save_initial_weights:
            save_state(pl_module.model, pl_module.device_mesh, trainer.global_rank, self.out_dir, "initial")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch_started_at.append(time.time())
        digest = hashlib.sha256(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        self.batches.append(digest)
        if "step_tokens" in batch:  # ChatDataModule
            self.step_tokens.append(float(batch["step_tokens"]))
            self.trained_tokens.append(int((batch["labels"] != -100).sum()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.record_grad_norms:  # the optimizer step leaves the gradients as it used them (after clipping)
            self.stepped_grad_norms.append(float(
                total_grad_norm(pl_module.model.parameters(), pipeline_group=pipeline_group_of(trainer.strategy))))
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if "step_pairs" in batch or "step_examples" in batch:  # PreferenceDataModule: TRL's metrics, global means
            self.preference_metrics.append({name: float(trainer.callback_metrics[name])
                                            for name in preference_metric_names(pl_module.preference)})
        if "step_tokens" in batch:  # ChatDataModule: the batch's global trained tokens, which its loss averages over
            self.global_tokens.append(float(trainer.callback_metrics["global_tokens"]))
        # Stands for a model's own randomness (dropout): resumes continue the same random stream.
        self.draws.append(float(torch.rand(1)))
        if trainer.global_step in self.weights_at_steps:
            save_state(pl_module.model, pl_module.device_mesh, trainer.global_rank, self.out_dir,
                       f"weights_step{trainer.global_step}")
        if trainer.global_step in self.local_weights_at_steps:
            torch.save(local_state(pl_module.model),
                       self.out_dir / f"local_rank{trainer.global_rank}_step{trainer.global_step}.pt")

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.local_weights_on_exception:  # runs before the strategy's own on_exception (the watchdog's)
            torch.save({"step": trainer.global_step, "error": type(exception).__name__,
                        "weights": local_state(pl_module.model)},
                       self.out_dir / f"local_rank{trainer.global_rank}_exception.pt")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_weights:
            save_state(pl_module.model, pl_module.device_mesh, trainer.global_rank, self.out_dir, "final")


def layout_of(value) -> dict:
    """What a tensor is, as a test compares it: a DTensor's placements (``repr``), mesh and local shape, or a
    plain tensor's shape (the first element of a tuple/list)."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if hasattr(value, "placements"):
        return {"type": "DTensor", "placements": [repr(pl) for pl in value.placements],
                "mesh_dims": list(value.device_mesh.mesh_dim_names or ()), "local_shape": list(value.to_local().shape),
                "shape": list(value.shape)}
    if isinstance(value, torch.Tensor):
        return {"type": "Tensor", "shape": list(value.shape)}
    return {"type": type(value).__name__}


class ActivationLayouts(L.Callback):
    """The layout of what some modules receive and return in the first training step (forward hooks,
    registered after the strategy parallelized the model, so they see what the TP hooks produced):
    ``logits`` is the model's output, what the loss receives; ``attention_norm``/``norm`` a block's
    first norm and the final norm (``Shard(1)`` DTensors under sequence parallelism, full plain tensors
    without it)."""

    WATCH: ClassVar[dict[str, str]] = {"logits": "", "attention_norm": "layers.0.attention_norm", "norm": "norm"}

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}
        self._handles: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        modules = {canonical_name(name): m for name, m in pl_module.model.named_modules()}
        for label, name in self.WATCH.items():
            if name in modules:
                def hook(_module, args, output, label=label):
                    if label not in self.seen:  # the first call (activation checkpointing recomputes)
                        self.seen[label] = {"input": layout_of(args) if args else None, "output": layout_of(output)}

                self._handles.append(modules[name].register_forward_hook(hook))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def data_parallel_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules each data-parallel backend wrapped: FSDP2 units, SimpleFSDP's gathering modules."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_2d.parallel.simple_fsdp import simple_fsdp_modules

    return {"fully_shard": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "simple_fsdp": len(simple_fsdp_modules(model))}


def placements(module: torch.nn.Module) -> dict[str, list]:
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "placements"):
            out[canonical_name(name)] = {
                "placements": [repr(pl) for pl in p.placements],
                "mesh_dims": list(p.device_mesh.mesh_dim_names or ()),
                "local_shape": list(p.to_local().shape),
                "shape": list(p.shape),
                "dtype": str(p.dtype),
            }
    return out


def linear_layouts(model: torch.nn.Module) -> dict[str, dict]:
    """Every ``nn.Linear`` (subclasses included) by canonical name: whether it is torchao's ``Float8Linear``, its
    class, and its weight's placements (``repr``) and local tensor type (``WeightWithDynamicFloat8CastTensor``
    under FSDP2's float8 all-gather)."""
    from torchao.float8.float8_linear import Float8Linear

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            weight = m.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            out[canonical_name(name)] = {
                "float8": isinstance(m, Float8Linear), "class": type(m).__name__,
                "placements": [repr(pl) for pl in weight.placements] if hasattr(weight, "placements") else None,
                "local_type": type(local).__name__,
            }
    return out


def count_packed_masks() -> dict[str, int]:
    """Counts the forwards in which transformers found packed documents in the positions (and so built a mask that
    keeps them apart): ``masking_utils.find_packed_sequence_indices`` returning their indices."""
    from transformers import masking_utils

    count = {"n": 0}
    original = masking_utils.find_packed_sequence_indices

    def counted(position_ids):
        found = original(position_ids)
        count["n"] += found is not None
        return found

    masking_utils.find_packed_sequence_indices = counted
    return count


def count_reduce_scatters() -> dict[str, int]:
    """Counts FSDP2's gradient reduce-scatters (it calls ``dist.reduce_scatter_single``) from now on."""
    import torch.distributed as dist

    counter = {"n": 0}
    original = dist.reduce_scatter_single

    def counting(*a, **k):
        counter["n"] += 1
        return original(*a, **k)

    dist.reduce_scatter_single = counting
    return counter


def fsdp_layout(model: torch.nn.Module, seq_len: int) -> dict:
    """The FSDP units, which parameters stay gathered after a forward, and the head's loss function."""
    from torch.distributed.fsdp import FSDPModule

    units = sorted(canonical_name(n) for n, m in model.named_modules() if isinstance(m, FSDPModule))
    with torch.no_grad():
        model(torch.zeros(1, seq_len, dtype=torch.long))
    # A resharded parameter is the FSDP shard (a DTensor on a mesh with a data-parallel dim);
    # a gathered one is the full tensor (plain, or a DTensor on the tensor-parallel mesh only).
    gathered = sorted(
        canonical_name(n)
        for n, p in model.named_parameters()
        if not any(d.startswith("data_parallel") for d in (getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names or ()))
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    # Each token's log-probability from the head's fused, (vocabulary-parallel) per-token path against log_softmax of
    # the logits, on the same seeded tokens on every rank.
    g = torch.Generator().manual_seed(11)
    vocab = model.output.weight.shape[0]
    tokens, labels = (torch.randint(0, vocab, (2, seq_len), generator=g) for _ in range(2))
    labels[0, :3] = -100
    with torch.no_grad():
        fused = model(tokens, labels=labels, per_token=True)
        logits = model(tokens)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        reference = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        reference = reference.masked_fill(labels == -100, 0.0)
    return {"fsdp_units": units, "gathered_after_forward": gathered,
            "head_loss_fn": model.output.linear_cross_entropy.__name__,
            "head_log_probs_fn": model.output.linear_log_probs.__name__,
            "log_probs_error": float((fused - reference).abs().max())}


def deferred_reductions(strategy) -> "dict | None":
    """The trained model's deferred tensor-parallel reductions (``parallel.grad_sync``): the bucketed all-reduces
    issued, the parameters hooked, and what is left pending after the run (``None``: not attached)."""
    parallelized = getattr(strategy, "parallelized", None)
    deferred = getattr(parallelized, "tensor_reductions", None)
    if deferred is None:
        return None
    names = {id(m): canonical_name(n) for n, m in parallelized.model.named_modules()}
    return {"reductions": deferred.reductions, "pending": deferred.pending,
            "deferred": sorted(f"{names.get(owner, '?')}.{name}" for owner, name in deferred.order)}


class BlockPositions(L.Callback):
    """Counts the training calls of the first block that received the attention mask (document masking: built once
    per forward, or per pipeline micro-batch, from ``position_ids`` and passed to every block as ``mask``)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer, pl_module) -> None:
        layers = getattr(getattr(pl_module, "model", None), "layers", None)
        if layers is None or "0" not in layers:
            return

        def seen(module, args, kwargs) -> None:
            if module.training and kwargs.get("mask") is not None:
                self.calls += 1

        layers["0"].register_forward_pre_hook(seen, with_kwargs=True)


class CollectiveCounter(L.Callback):
    """Counts the functional collectives (``_c10d_functional::`` ops: DTensor's, and so SimpleFSDP's gathers and
    reduce-scatters, also inside compiled graphs, bucketed or not) each rank issues in the forward and in the
    backward of one training step, by op name, from a CPU profile of that step."""

    BACKWARD = "lightning_2d_test.backward"

    def __init__(self, step: int) -> None:
        self.step, self.counts = step, {"forward": {}, "backward": {}}
        self._profile = self._backward = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self._profile is None:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU])
            self._profile.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._profile is not None:
            self._backward = torch.profiler.record_function(self.BACKWARD)
            self._backward.__enter__()

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._profile is None or self._backward is None:
            return
        self._backward.__exit__(None, None, None)
        self._profile.__exit__(None, None, None)
        events = self._profile.events()
        window = next(e.time_range for e in events if e.name == self.BACKWARD)
        for event in events:
            op = event.name.partition("_c10d_functional::")[2]
            if not op or event.name != f"_c10d_functional::{op}" or op == "wait_tensor" or op.startswith("_"):
                continue
            parent = event.cpu_parent  # the same call seen again below a dispatch mode (selective checkpointing's)
            while parent is not None and parent.name != event.name:
                parent = parent.cpu_parent
            if parent is not None:
                continue
            phase = "backward" if window.start <= event.time_range.start <= window.end else "forward"
            self.counts[phase][op] = self.counts[phase].get(op, 0) + 1
        self._profile = self._backward = None
        self.step = -1  # once


class InjectNaN(L.Callback):
    """At optimizer step ``step`` (from 1), on rank ``rank`` only: a NaN in this rank's local gradient shard
    (after the reduce-scatter, so no other rank sees it) or in its loss (before backward)."""

    def __init__(self, step: int, rank: int, where: str) -> None:
        self.step, self.rank, self.where = step, rank, where

    def _now(self, trainer) -> bool:
        return trainer.global_step + 1 == self.step and trainer.global_rank == self.rank

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.where == "loss" and self._now(trainer):
            loss.mul_(float("nan"))

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.where == "grad" and self._now(trainer):
            grad = next(p.grad for p in pl_module.model.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")


class Fail(L.Callback):
    """At optimizer step ``step`` (from 1), on rank ``rank``, after the forward: ``how`` = ``"sigkill"``,
    ``"sigstop"`` or ``"raise"``; ``"hang"``: before the step starts (as a stuck data loader or callback would), the
    rank sleeps, alive, its watchdog thread beating. The wall-clock time of the failure goes to ``failed_at.json`` first."""

    def __init__(self, step: int, rank: int, how: str, out_dir: Path) -> None:
        self.step, self.rank, self.how, self.out_dir = step, rank, how, out_dir

    def _now(self, trainer) -> bool:
        if trainer.global_step + 1 != self.step or trainer.global_rank != self.rank:
            return False
        (self.out_dir / "failed_at.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))
        return True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.how == "hang" and self._now(trainer):
            time.sleep(600)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.how == "hang" or not self._now(trainer):
            return
        if self.how == "raise":
            raise ValueError(f"injected failure in step {self.step}")
        os.kill(os.getpid(), {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}[self.how])


def strategy_timeouts(cfg: dict) -> dict:
    """``timeout``/``watchdog_timeout`` options from ``timeout_s``/``watchdog_timeout_s`` (None: off)."""
    from datetime import timedelta

    options = {}
    if "timeout_s" in cfg:
        options["timeout"] = timedelta(seconds=cfg["timeout_s"])
    if "watchdog_timeout_s" in cfg:
        seconds = cfg["watchdog_timeout_s"]
        options["watchdog_timeout"] = None if seconds is None else timedelta(seconds=seconds)
    return options


STRATEGY_OPTIONS = (
    "context_parallel_size",
    "activation_checkpointing",
    "selective_ac_option",
    "sequence_parallel",
    "loss_parallel",
    "compile",
    "reshard_after_forward",
    "param_dtype",
    "reduce_dtype",
    "reduce_every_micro_batch",
    "float8",
    "fsdp_float8_all_gather",
    "data_parallel_replicate_size",
    "non_finite",
    "pipeline_parallel_size",
    "pipeline_schedule",
    "pipeline_microbatches",
    "pipeline_stages_per_rank",
    "pipeline_layers_per_stage",
    "fsdp_backend",
    "expert_parallel_size",
    "experts_over_tensor_parallel",
)


def transformers_loss(directory: str, batch: dict) -> float:
    """The mean next-token cross-entropy of ``batch`` (labels already shifted, -100 ignored) under the Hugging Face
    model ``transformers`` itself loads from ``directory``: what the first step of a run started from those files
    must score."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    return float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100))


def tied_parameters(model: torch.nn.Module) -> list[dict]:
    """Each parameter the trained model holds under several names: the names, and its layout (a tie broken by the
    parallel steps would show two parameters, each under one name)."""
    from lightning_2d.parallel.ties import shared_parameters

    ties = []
    for group in shared_parameters(model):
        param = model.get_parameter(group[0])
        layout = [repr(p) for p in param.placements] if hasattr(param, "placements") else []
        ties.append({"names": [canonical_name(n) for n in group], "placements": layout})
    return ties


class Routing(L.Callback):
    """A mixture of experts' routing per step: each MoE layer's assignments per expert (this rank's tokens) and the
    logged auxiliary loss; with ``idle_experts`` the last that many experts of every layer get a bias of -10 before
    training (routing forced away from them: idle experts and ranks)."""

    def __init__(self, idle_experts: int) -> None:
        self.idle_experts, self.counts, self.aux = idle_experts, [], []
        #: Per step, the rows (token assignments) this rank's routed experts computed, over every layer: the expert
        #: FLOPs it spent (each row is one token through one expert's SwiGLU).
        self.expert_rows: list[int] = []
        self._rows = 0

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning_2d._compat import in_backward
        from lightning_2d.ops.moe import GroupedExperts

        if self.idle_experts:
            for layer in pl_module.model.moe_layers():
                layer.expert_bias[-self.idle_experts:] = -10.0

        def count(_module, args, _out) -> None:  # the arguments after the exchange's pre-hook: what it computes
            if not in_backward():  # not an activation checkpoint's recompute
                self._rows += int(args[0].shape[0])

        for module in pl_module.model.modules():
            if isinstance(module, GroupedExperts):
                module.register_forward_hook(count)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append({canonical_name(name): layer.last_stats.counts.tolist()
                            for name, layer in pl_module.model.named_modules()
                            if getattr(layer, "last_stats", None) is not None})
        aux = trainer.callback_metrics.get("train_aux_loss")
        self.aux.append(None if aux is None else float(aux))
        self.expert_rows.append(self._rows)
        self._rows = 0


class TeacherRecord(L.Callback):
    """A distillation run's teacher: each rank's own shards at train start and end (``local_state``: bits, no
    collective), and each step's logged means (``distill/…``)."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}
        self.metrics: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.before = local_state(pl_module.teacher)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_2d.integration.distillation import metric_names

        self.metrics.append({name: float(trainer.callback_metrics[name])
                             for name in metric_names(pl_module.distillation)})

    def on_train_end(self, trainer, pl_module) -> None:
        self.after = local_state(pl_module.teacher)

    def result(self, trainer, pl_module) -> dict:
        """What the tests assert of the teacher: bit for bit unchanged on this rank, sharded (its placements), never
        requiring or holding a gradient, in no optimizer."""
        teacher = pl_module.teacher
        held = {id(p) for p in teacher.parameters()}
        optimizer = trainer.optimizers[0]
        return {
            "distill_metrics": self.metrics,
            "teacher_unchanged": self.before.keys() == self.after.keys() and all(
                torch.equal(self.before[k], self.after[k]) for k in self.before),
            "teacher_parameters": len(self.before),
            "teacher_placements": placements(teacher.frozen()),
            "teacher_data_parallel_modules": data_parallel_modules(teacher.frozen()),
            "teacher_requires_grad": sum(p.requires_grad for p in teacher.parameters()),
            "teacher_grads": sum(p.grad is not None for p in teacher.parameters()),
            "teacher_in_optimizer": sum(id(p) in held for group in optimizer.param_groups for p in group["params"])
                                    + sum(id(p) in held for p in optimizer.state),
        }


class Bf16Rope(L.Callback):
    """Rounds the rotary table (``Transformer.rope``, fp32) to bf16 values before training, kept in fp32: FSDP2's
    ``MixedPrecisionPolicy`` casts every floating input of a unit to ``param_dtype`` (the table a block receives, too),
    SimpleFSDP casts none; with the values bf16 already, that cast changes nothing and the two backends' bf16-mixed
    runs compute the same products, so what differs between them is their gathers and reductions only."""

    def on_train_start(self, trainer, pl_module) -> None:
        rope = pl_module.model.rope
        with torch.no_grad():
            rope.copy_(rope.to(torch.bfloat16))


def fit(cfg: dict) -> None:
    out_dir = Path(cfg["out_dir"])
    # Started by Lightning's own launcher (no cluster environment): rank 0 is this process, the others its children.
    world = int(os.environ.get("WORLD_SIZE", cfg.get("lightning_launched_devices", 1)))
    L.seed_everything(cfg.get("seed", 1234), verbose=False)
    if "hf_config" in cfg:  # a Hugging Face decoder built from its config (bring your own model)
        from lightning_2d.hf import HFCausalLMModule

        if cfg.get("without_builtin_init"):  # as before #10: no init route for RMSNorm and rotary buffers
            import lightning_2d.models.registry as plans

            plans.known_init_hooks = lambda model: None

        module = HFCausalLMModule(
            cfg["hf_config"], init_from=cfg.get("init_from"), learning_rate=cfg.get("lr", 1e-3), warmup_steps=2,
            max_steps=cfg["steps"],
            init_seed=cfg.get("init_seed"), attn_implementation=cfg.get("attn_implementation", "sdpa"),
            lora=cfg.get("lora"), preference=cfg.get("preference"), teacher=cfg.get("teacher"),
            distillation=cfg.get("distillation"),
        )
        vocab_size = module.vocab_size
    else:
        module = LlamaLightningModule(
            None if cfg.get("init_from") else cfg.get("model", "debug"),
            init_from=cfg.get("init_from"),
            model_overrides=model_overrides(cfg),
            learning_rate=cfg.get("lr", 1e-3),
            warmup_steps=2,
            max_steps=cfg["steps"],
            init_seed=cfg.get("init_seed"),
            fused_loss=cfg.get("fused_loss", True),
            loss_chunk_size=cfg.get("loss_chunk_size", 1024),
            lora=cfg.get("lora"),
            preference=cfg.get("preference"),
            teacher=cfg.get("teacher"),
            distillation=cfg.get("distillation"),
        )
        vocab_size = module.model_args.vocab_size
    if cfg["strategy"] == "single":
        strategy, devices, dp = "auto", 1, 1
    else:
        options = {**{k: cfg[k] for k in STRATEGY_OPTIONS if k in cfg}, **strategy_timeouts(cfg)}
        strategy = ModelParallel2DStrategy(data_parallel_size=cfg["dp"], tensor_parallel_size=cfg["tp"], **options)
        devices, dp = world // cfg.get("num_nodes", 1), cfg.get("data_replicas", cfg["dp"])
    data = SyntheticTokens(cfg["global_batch"] * cfg["steps"], cfg["seq_len"], vocab_size,
                           even=cfg.get("even_labels", False), documents=cfg.get("documents", False),
                           prompts=cfg.get("prompts", 0))
    accumulate = cfg.get("accumulate", 1)
    datamodule = None
    if "preference_data" in cfg:  # preference tuning: PreferenceDataModule's packed pairs (its cache prepared by the test)
        from lightning_2d import PreferenceDataModule

        replicas = 1 if cfg["strategy"] == "single" else dp
        datamodule = PreferenceDataModule(**cfg["preference_data"], seq_len=cfg["seq_len"], val_fraction=0,
                                          batch_size=cfg["global_batch"] // replicas // accumulate, max_unprepared_mb=0)
        loader = None
    elif "chat" in cfg:  # instruction fine-tuning: ChatDataModule's packed conversations (its cache prepared by the test)
        from lightning_2d import ChatDataModule

        replicas = 1 if cfg["strategy"] == "single" else dp
        datamodule = ChatDataModule(**cfg["chat"], seq_len=cfg["seq_len"], val_fraction=0,
                                    batch_size=cfg["global_batch"] // replicas // accumulate, max_unprepared_mb=0)
        loader = None
    elif cfg["strategy"] == "single":
        # Lightning gives every parallel training loader a shuffling DistributedSampler (seeded
        # with the run's seed). The reference draws the same permutation with one replica, so
        # step i sees the union of the data-parallel ranks' step-i batches. With ``accumulate`` each step's rows
        # come in that many consecutive micro-batches: micro-batch m of step i holds row m of every data-parallel
        # rank's step-i batch (a pipeline's micro-batch m, at one row per rank and micro-batch).
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=cfg.get("seed", 1234))
        loader = DataLoader(data, batch_size=cfg["global_batch"] // accumulate, sampler=sampler)
    else:
        loader = DataLoader(data, batch_size=cfg["global_batch"] // dp // accumulate)
    val_loader = None
    if "val_samples" in cfg:  # validation through the model (under pipeline parallelism: the schedule's eval)
        val_data = SyntheticTokens(cfg["val_samples"], cfg["seq_len"], vocab_size, seed=1)
        val_loader = DataLoader(val_data, batch_size=cfg["global_batch"] // (1 if cfg["strategy"] == "single" else dp))
    # What only some tests read costs a multi-rank job collectives on 4 ranks sharing 2 cores (twice a step a
    # gradient norm with its all-reduces, a gather of every parameter at train start, forwards after the fit: ~20%
    # of a 2x2 parity fit's CPU): such a job records it only when asked (`grad_norms`, `initial_weights`,
    # `probe_forwards`), and what it did not record is absent from its output, so a test reading it fails loudly.
    # One process (the references, shared by many modules) records everything: cheap there.
    single = cfg["strategy"] == "single"
    grad_norms = cfg.get("grad_norms", single)
    probe_forwards = cfg.get("probe_forwards", single)
    recorder = Recorder(out_dir, cfg.get("save_weights", True), tuple(cfg.get("weights_at_steps", ())),
                        local_weights_at_steps=tuple(cfg.get("local_weights_at_steps", ())),
                        local_weights_on_exception=cfg.get("local_weights_on_exception", False), grad_norms=grad_norms,
                        initial_weights=cfg.get("initial_weights", single))
    callbacks = [recorder]
    pipelined = cfg.get("pipeline_parallel_size", 1) > 1
    # Hooks inside compiled blocks would be traced into (or break) their graphs: not under compile.
    activations = None
    if cfg["strategy"] == "2d" and "hf_config" not in cfg and not pipelined and not cfg.get("compile"):
        activations = ActivationLayouts()
        callbacks.append(activations)
    positions = BlockPositions()
    callbacks.append(positions)
    routing = None
    if "moe" in cfg.get("model", "debug"):
        routing = Routing(cfg.get("idle_experts", 0))
        callbacks.append(routing)
    collectives = None
    if "count_collectives" in cfg:  # the training step (from 0) whose collectives are counted
        collectives = CollectiveCounter(cfg["count_collectives"])
        callbacks.append(collectives)
    if cfg.get("bf16_rope"):
        callbacks.append(Bf16Rope())
    teacher_record = TeacherRecord() if cfg.get("teacher") else None
    if teacher_record is not None:
        callbacks.append(teacher_record)
    if "inject_nan" in cfg:
        callbacks.append(InjectNaN(**cfg["inject_nan"]))
    if "fail" in cfg:
        callbacks.append(Fail(**cfg["fail"], out_dir=out_dir))
    packed_masks = count_packed_masks() if "hf_config" in cfg and (cfg.get("documents") or "chat" in cfg) else None
    reduce_scatters = count_reduce_scatters()
    from torch._dynamo.utils import counters as dynamo_counters

    graphs_before = dynamo_counters["stats"]["unique_graphs"]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=cfg.get("num_nodes", 1),
        strategy=strategy,
        precision=cfg.get("precision", "32-true"),
        max_steps=cfg["steps"],
        gradient_clip_val=cfg.get("gradient_clip_val"),
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    if datamodule is not None:
        trainer.fit(module, datamodule=datamodule)
    else:
        trainer.fit(module, loader, val_loader)
    if cfg.get("save_checkpoint"):
        trainer.save_checkpoint(out_dir / "final_ckpt")  # a sharded (DCP) folder under the 2D strategy
    result = {
        "reduce_scatters": reduce_scatters["n"],
        "losses": recorder.losses,
        "batches": recorder.batches,
        "placements": placements(module.model),
        "blocks_given_masks": positions.calls,
        "tied_parameters": tied_parameters(module.model),
        "data_parallel_modules": data_parallel_modules(module.model),
        "deferred_reductions": deferred_reductions(trainer.strategy),
    }
    if grad_norms:
        result.update(grad_norms=recorder.grad_norms, stepped_grad_norms=recorder.stepped_grad_norms)
        if recorder.expert_grad_norms:
            result["expert_grad_norms"] = recorder.expert_grad_norms
    if routing is not None:
        result.update(router_counts=routing.counts, aux_losses=routing.aux, expert_rows=routing.expert_rows)
    buffers = persistent_buffers(module.model)
    if buffers:
        result["buffers"] = buffers
    if cfg.get("lora"):  # what the optimizer steps and keeps state for (the adapters only), what requires gradients
        names = {id(p): canonical_name(n) for n, p in module.model.named_parameters()}
        optimizer = trainer.optimizers[0]
        result["optimized"] = sorted(names[id(p)] for group in optimizer.param_groups for p in group["params"])
        result["optimizer_state"] = sorted(names[id(p)] for p in optimizer.state)
        result["requires_grad"] = sorted(canonical_name(n) for n, p in module.model.named_parameters() if p.requires_grad)
        result["nf4"] = sorted(canonical_name(n) for n, p in module.model.named_parameters() if is_nf4(p))
    if packed_masks is not None:
        result["packed_masks"] = packed_masks["n"]
    if datamodule is not None:  # the trained tokens each batch's loss was divided by (the optimizer step's)
        result["step_tokens"] = recorder.step_tokens
        result["trained_tokens"] = recorder.trained_tokens
        result["global_tokens"] = recorder.global_tokens
        result["preference_metrics"] = recorder.preference_metrics
        if cfg.get("preference"):  # what held the reference at the end: values read from the data, or a model
            result["reference_values_key"] = module._reference_precomputed
            result["frozen_models"] = len(module.frozen_models())
            result["frozen_data_parallel_modules"] = [data_parallel_modules(f.frozen()) for f in module.frozen_models()]
            # Under a pipeline: which blocks of each frozen model this rank holds, and what ran its stages.
            result["frozen_pipelines"] = [{
                "blocks": sorted(f.frozen().layers.keys(), key=int), "stage_indices": list(f.pipeline.stage_indices),
                "schedule_classes": sorted({type(s).__name__ for s in f.pipeline.schedules.values()}),
            } for f in module.frozen_models() if f.pipeline is not None]
            batch = datamodule.train_dataset[0] if datamodule.train_dataset is not None else {}
            result["batches_carry_reference_values"] = "reference_logps" in batch
    if collectives is not None:
        result["collectives"] = collectives.counts
    if teacher_record is not None:
        result.update(teacher_record.result(trainer, module))
    if val_loader is not None:
        result["val_loss"] = float(trainer.callback_metrics["val_loss"])
    if cfg.get("transformers_first_loss"):  # transformers' own loss of the init_from files on the first batch
        result["transformers_first_loss"] = transformers_loss(cfg["init_from"], next(iter(loader)))
    if activations is not None:
        result["activations"] = activations.seen
    if cfg["strategy"] == "2d" and "hf_config" not in cfg:  # which blocks activation checkpointing wrapped
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        result["checkpointed_blocks"] = [name for name, block in module.model.layers.items()
                                         if isinstance(block, CheckpointWrapper)]
        # Which blocks torch.compile wrapped, and what dynamo compiled during this fit (0 graphs: nothing ran
        # compiled, whatever the wrappers say; counted from the fit's start, so fits may share a process).
        from torch._dynamo.eval_frame import OptimizedModule
        from torch._dynamo.utils import counters

        result["compiled_blocks"] = [name for name, block in module.model.layers.items()
                                     if isinstance(block, OptimizedModule)]
        result["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
    pipeline = pipeline_of_run(module)
    if pipeline is not None:
        result["pipeline_split"] = pipeline.split
        result["blocks"] = sorted(module.model.layers.keys(), key=int)
        result["stage_indices"] = list(pipeline.stage_indices)
        result["sequence_shards"] = pipeline.sequence_shards  # the hidden states sent between stages: tp slices
        # What ran (a schedule silently replaced by another would still train equal to one device).
        result["schedule_classes"] = {("train" if key[3] else "eval"): type(schedule).__name__
                                      for key, schedule in pipeline.schedules.items()}
    if cfg.get("float8"):
        with sharded_parameters():  # SimpleFSDP: the stored weights, not gathered ones
            result["linears"] = linear_layouts(module.model)
    mesh = module.device_mesh
    context = cfg.get("context_parallel_size", 1) > 1
    # Not under compile: its no-grad forward would compile the blocks twice more (grad mode is in the guards).
    if (probe_forwards and cfg["strategy"] == "2d" and "hf_config" not in cfg and not pipelined and not context
            and not cfg.get("compile")):
        result.update(fsdp_layout(module.model, cfg["seq_len"]))
    if context:  # which attention cores exchange keys and values, and what FSDP shards over
        from lightning_2d.parallel.context import ContextParallelAttention

        result["context_parallel_attention"] = sorted(
            canonical_name(n) for n, m in module.model.named_modules()
            if isinstance(getattr(m, "attend", None), ContextParallelAttention))
        weight = next(p for p in module.model.parameters())
        result["fsdp_mesh"] = [list(weight.device_mesh.mesh_dim_names), list(weight.device_mesh.shape)]
        result["ring_vs_all_gather"] = exchange_disagreement(mesh["context_parallel"])
    if probe_forwards and "hf_config" in cfg:  # what a decoder layer receives: this rank's sequence slice under SP
        seen = []
        layer = module.model.model.layers[1]
        handle = layer.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(list(args[0].shape)), with_kwargs=True)
        with torch.no_grad():
            module.model(torch.zeros(1, cfg["seq_len"], dtype=torch.long))
        handle.remove()
        result["layer_input_shape"] = seen[0]
    sequence_parallel = cfg.get("sequence_parallel", True)
    if (probe_forwards and cfg["strategy"] == "2d" and cfg["tp"] != 1 and (sequence_parallel or "hf_config" in cfg)
            and not pipelined):
        # Under sequence parallelism an indivisible length must fail in the pre-hook, before any collective;
        # without it (recorded for the HF jobs) the same length must run (None).
        try:
            module.model(torch.zeros(1, 13, dtype=torch.long))
            result["bad_seq_len_error"] = None
        except ValueError as err:
            result["bad_seq_len_error"] = str(err)
        try:  # the same check for a keyword input (as Hugging Face models take `input_ids=`)
            keyword = "input_ids" if "hf_config" in cfg else "tokens"
            module.model(**{keyword: torch.zeros(1, 13, dtype=torch.long)})
            result["bad_seq_len_error_kw"] = None
        except ValueError as err:
            result["bad_seq_len_error_kw"] = str(err)
    if mesh is not None:
        result["dp_rank"] = mesh["data_parallel"].get_local_rank()
        result["tp_rank"] = mesh["tensor_parallel"].get_local_rank()
        result["mesh_shape"] = list(mesh.shape)
        result["mesh_dims"] = list(mesh.mesh_dim_names)
        result["replica_rank"] = mesh["data_parallel_replicate"].get_local_rank()
        from lightning_2d.parallel.dims import group_timeouts

        result["group_timeouts"] = {name: str(t) for name, t in group_timeouts(mesh).items()}
        result["shard_rank"] = mesh["data_parallel_shard"].get_local_rank()
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def text(cfg: dict) -> None:
    """TextDataModule under the 2D strategy: the batches of every rank and the tokens counted.

    (Resuming the data position is tested with the checkpoints, in test_checkpoints.py.)
    """
    from lightning_2d import TextDataModule
    from lightning_2d.integration.callbacks import TokenThroughputMonitor

    out_dir = Path(cfg["out_dir"])
    L.seed_everything(7, verbose=False)
    data = TextDataModule(cfg["corpus"], seq_len=cfg["seq_len"], batch_size=cfg["batch_size"],
                          cache_dir=cfg["cache_dir"], val_fraction=0.0)
    module = LlamaLightningModule("debug", warmup_steps=2, max_steps=6)
    recorder, monitor = Recorder(out_dir, save_weights=False), TokenThroughputMonitor(log_every_n_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
        strategy=ModelParallel2DStrategy(data_parallel_size=cfg["dp"], tensor_parallel_size=cfg["tp"]),
        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[recorder, monitor],
    )
    trainer.fit(module, datamodule=data)
    mesh = module.device_mesh
    result = {
        "batches": recorder.batches,
        "losses": recorder.losses,
        "tokens_per_step": monitor.last["tokens_per_step"],
        "tokens_per_sec": monitor.last.get("perf/tokens_per_sec"),
        "dp_rank": mesh["data_parallel"].get_local_rank(),
        "tp_rank": mesh["tensor_parallel"].get_local_rank(),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


class WriteObserver(L.Callback):
    """Makes a checkpoint write observable: each storage write (DCP's ``FileSystemWriter.write_data``, every
    rank's shard) first waits until training has started another batch (or ended), then writes. A write
    that runs in the background is released by the next step's ``on_train_batch_start``; a synchronous one
    blocks that very step, so it can only be released by the deadline (``timeout_s``). Each write records
    who released it and whether it ran on the main thread (``writes`` in ``rank{N}.json``)."""

    def __init__(self, timeout_s: float) -> None:
        import threading

        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        self.timeout_s, self.writes = timeout_s, []
        self.batches_started, self.train_ended = 0, False
        original = FileSystemWriter.write_data

        def observed_write(writer, plan, planner):
            started, seen = time.time(), self.batches_started
            deadline = time.monotonic() + timeout_s
            while self.batches_started == seen and not self.train_ended and time.monotonic() < deadline:
                time.sleep(0.01)
            released_by = ("next_batch" if self.batches_started != seen else "train_end" if self.train_ended
                           else "timeout")
            future = original(writer, plan, planner)
            future.wait()
            self.writes.append({"started": started, "ended": time.time(), "released_by": released_by,
                                "main_thread": threading.current_thread() is threading.main_thread()})
            return future

        FileSystemWriter.write_data = observed_write

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches_started += 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.train_ended = True


def prepare_files(actions: list[dict], rank: int, out_dir: Path, timeout_s: float = 120.0) -> None:
    """Rank 0 makes files from checkpoints an earlier run of the launch saved (before the launch they do not exist):
    a copy with a payload planted (``plant_meta``, ``plant_full``: tests/unit/test_safe_loading.py), a checkpoint
    folder whose ``last.ckpt`` links to a copy with flipped bits (``changed_last``). The other ranks wait for its
    ``prepared`` file (no process group exists before the run's fit)."""
    import shutil

    from tests.unit.test_checkpoint_digests import flip_exponent_bits
    from tests.unit.test_safe_loading import plant_full, plant_meta

    done = out_dir / "prepared"
    if rank == 0:
        for action in actions:
            if action["op"] == "plant_meta":
                plant_meta(Path(action["from"]), Path(action["to"]), Path(action["marker"]), action["redigested"])
            elif action["op"] == "plant_full":
                plant_full(Path(action["from"]), Path(action["to"]), Path(action["marker"]))
            elif action["op"] == "changed_last":
                source, folder = Path(action["from_dir"]), Path(action["to_dir"])
                folder.mkdir(parents=True)
                for name in action["keep"]:
                    shutil.copytree(source / name, folder / name)
                (folder / "last.ckpt").symlink_to(action["last"])
                flip_exponent_bits(folder / action["last"], action["fqn"], file_name=action["file"])
            else:
                raise ValueError(f"unknown prepare action {action}")
        done.write_text("ok")
        return
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not prepare {actions} within {timeout_s} s")
        time.sleep(0.05)


def try_loads(trainer: L.Trainer, refusals: list[list[str]]) -> dict[str, Any]:
    """Each ``[label, path, fn]``: the checkpoint loaded as ``Trainer.fit/validate/test/predict(ckpt_path=...)`` loads
    it (the strategy's ``load_checkpoint`` with the Trainer in that state), the refusal's message (``None``: loaded).
    Every rank raises the same refusal by itself, before any weight is read."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_2d.checkpoint import CheckpointError

    found: dict[str, Any] = {}
    was = trainer.state.fn
    for label, path, fn in refusals:
        trainer.state.fn = TrainerFn(fn)
        try:
            trainer.strategy.load_checkpoint(path)
            found[label] = None
        except CheckpointError as err:
            found[label] = f"{type(err).__name__}: {err}"
    trainer.state.fn = was
    return found


def train(cfg: dict) -> None:
    """One fit on TextDataModule with configurable checkpointing, resuming and a crash during a save."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_2d import TextDataModule

    out_dir = Path(cfg["out_dir"])
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if cfg.get("prepare"):
        prepare_files(cfg["prepare"], rank, out_dir)
    crash = cfg.get("crash")  # {"save": n, "rank": r}: rank r dies once its shard of the n-th save is written
    if crash:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original, calls = FileSystemWriter.write_data, {"n": 0}

        def write_then_maybe_die(self, plan, planner):
            future = original(self, plan, planner)
            calls["n"] += 1
            if calls["n"] == crash["save"] and rank == crash["rank"]:
                future.wait()  # this rank's shard is on disk; .metadata and meta.pt are not
                os.kill(os.getpid(), signal.SIGKILL)
            return future

        FileSystemWriter.write_data = write_then_maybe_die

    L.seed_everything(7, verbose=False)
    data = TextDataModule(cfg["corpus"], seq_len=cfg["seq_len"], batch_size=cfg["batch_size"],
                          cache_dir=cfg["cache_dir"], val_fraction=0.0)
    # The LR schedule always spans 6 steps, also in runs stopped earlier to be resumed.
    module = LlamaLightningModule(None if cfg.get("init_from") else cfg.get("model", "debug"), warmup_steps=2, max_steps=6,
                                  init_from=cfg.get("init_from"), lora=cfg.get("lora"), init_seed=cfg.get("init_seed"),
                                  model_overrides=model_overrides(cfg))
    recorder = Recorder(out_dir, save_weights=True, weights_at_steps=tuple(cfg.get("weights_at_steps", ())))
    callbacks: list = [recorder]
    observer = WriteObserver(cfg["observe_writes_timeout_s"]) if "observe_writes_timeout_s" in cfg else None
    if observer is not None:
        callbacks.append(observer)
    for spec in cfg.get("checkpoints", []):
        callbacks.append(ModelCheckpoint(**spec))
    strategy = ModelParallel2DStrategy(
        data_parallel_size=cfg["dp"], tensor_parallel_size=cfg["tp"],
        data_parallel_replicate_size=cfg.get("replicate", 1),
        **{k: cfg[k] for k in ("pipeline_parallel_size", "pipeline_schedule", "reduce_every_micro_batch",
                               "context_parallel_size", "fsdp_backend", "expert_parallel_size") if k in cfg},
        save_distributed_checkpoint=cfg.get("save_distributed", True),
        async_checkpoint=cfg.get("async_checkpoint", False),
        **strategy_timeouts(cfg),
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["max_steps"], logger=False,
        enable_checkpointing=bool(cfg.get("checkpoints")), enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    reduce_scatters = count_reduce_scatters()
    trainer.fit(module, datamodule=data, ckpt_path=cfg.get("resume"))
    if cfg.get("save_trained_state"):
        save_trained_state(module.model, trainer.optimizers[0], trainer.global_rank, out_dir)
    mesh = module.device_mesh
    result = {
        "reduce_scatters": reduce_scatters["n"],
        "losses": recorder.losses,
        "batches": recorder.batches,
        "draws": recorder.draws,
        "global_step": trainer.global_step,
        "dp_rank": mesh["data_parallel"].get_local_rank(),
        "batch_started_at": recorder.batch_started_at,
        "data_parallel_modules": data_parallel_modules(module.model),
    }
    buffers = persistent_buffers(module.model)
    if buffers:
        result["buffers"] = buffers
    if observer is not None:
        result["writes"] = observer.writes
    if cfg.get("refuse"):
        # A copy with changed bytes, loaded as fit(ckpt_path=...) loads (every rank checks its share of the
        # digests): refused on every rank, before any weight is read.
        from lightning_2d.checkpoint import CheckpointError

        try:
            trainer.strategy.load_checkpoint(cfg["refuse"])
            result["refused"] = None
        except CheckpointError as err:
            result["refused"] = str(err)
    if cfg.get("refusals"):
        result["refusals"] = try_loads(trainer, cfg["refusals"])
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def bench_checkpoint(cfg: dict) -> None:
    """Wall time of each training step with checkpoints saved every few steps (sync, async or none)."""
    import time

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_2d import TextDataModule

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.last is not None:  # from the previous step's start: includes its checkpoint save
                self.times.append(now - self.last)
            self.last = now

    out_dir, world = Path(cfg["out_dir"]), int(os.environ["WORLD_SIZE"])
    L.seed_everything(7, verbose=False)
    data = TextDataModule(None, seq_len=cfg["seq_len"], batch_size=cfg["batch_size"], val_fraction=0.0)
    data.prepare()  # built-in corpus is over max_unprepared_mb; the first rank tokenizes, the others wait on the lock
    module = LlamaLightningModule("debug", model_overrides=cfg["model_overrides"], warmup_steps=2)
    timer = StepTimer()
    callbacks: list = [timer]
    if cfg["mode"] != "none":
        callbacks.append(ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_train_steps=cfg["every"], save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=cfg["steps"] + 1, logger=False,
        strategy=ModelParallel2DStrategy(data_parallel_size=cfg["dp"], tensor_parallel_size=cfg["tp"],
                                         async_checkpoint=cfg["mode"] == "async"),
        enable_checkpointing=cfg["mode"] != "none", enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"step_times": timer.times}))


def load_recipe(name: str) -> Any:
    """``recipes/NAME.py`` as a module (its ``parse_args`` and ``train``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


def fabric_dpo(fabric: L.Fabric, cfg: dict, out_dir: Path) -> dict:
    """recipes/fabric_dpo.py's loop in the processes of a Fabric job already launched (``then_dpo``): a policy and its
    frozen reference set up side by side. Returns each step's loss, gradient norm and TRL metrics, both models'
    parameter placements after the first step, and at every step whether a reference parameter required or had a
    gradient, and the run's seconds; saves the final weights of both (``dpo_final``, ``dpo_reference``)."""
    recipe = load_recipe("fabric_dpo")
    args = recipe.parse_args([
        "--data", cfg["data"], "--cache-dir", cfg["cache_dir"], "--max-length", str(cfg["max_length"]),
        "--seq-len", str(cfg["seq_len"]), "--batch-size", str(cfg["batch_size"]), "--max-steps", str(cfg["steps"]),
        "--warmup-steps", "2", "--lr", str(cfg["lr"]), "--log-every", "1000",
    ])
    mesh = getattr(fabric.strategy, "device_mesh", None)
    record: dict[str, Any] = {"reference_requires_grad": [], "reference_has_grad": []}

    def on_step(step: int, policy, reference) -> None:
        params = list(reference.parameters())
        record["reference_requires_grad"].append(any(p.requires_grad for p in params))
        record["reference_has_grad"].append(any(p.grad is not None for p in params))
        if step == 1:  # sharded as they are between steps (FSDP's units resharded)
            record["placements"] = {"policy": placements(policy.module), "reference": placements(reference.module)}
        if step == args.max_steps:
            save_state(policy, mesh, fabric.global_rank, out_dir, "dpo_final")
            save_state(reference, mesh, fabric.global_rank, out_dir, "dpo_reference")

    start = time.perf_counter()
    history = recipe.train(fabric, args, on_step=on_step)
    return {**history, **record, "seconds": time.perf_counter() - start}  # what the DPO run adds to its job


def fabric_distill(fabric: L.Fabric, cfg: dict, out_dir: Path) -> dict:
    """recipes/fabric_distill.py's loop in the processes of a Fabric job already launched (``then_distill``): a
    student and a frozen teacher read from a Hugging Face folder, set up side by side. Returns each step's loss,
    gradient norm and logged means, the teacher's placements after the first step, whether its shards ended bit for
    bit as they were set up, and at every step whether a teacher parameter required or had a gradient; saves the
    final weights of both (``distill_final``, ``distill_teacher``)."""
    recipe = load_recipe("fabric_distill")
    args = recipe.parse_args([
        "--data", cfg["corpus"], "--cache-dir", cfg["cache_dir"], "--seq-len", str(cfg["seq_len"]),
        "--batch-size", str(cfg["batch_size"]), "--max-steps", str(cfg["steps"]), "--warmup-steps", "2",
        "--lr", "1e-3", "--teacher-init-from", cfg["teacher"], "--loss", "jsd", "--temperature", "2.0",
        "--alpha", "0.5", "--log-every", "1000",
    ])
    mesh = getattr(fabric.strategy, "device_mesh", None)
    record: dict[str, Any] = {"teacher_requires_grad": [], "teacher_has_grad": []}
    before: dict[str, torch.Tensor] = {}

    def on_step(step: int, student, teacher) -> None:
        params = list(teacher.parameters())
        record["teacher_requires_grad"].append(any(p.requires_grad for p in params))
        record["teacher_has_grad"].append(any(p.grad is not None for p in params))
        if step == 1:  # the first step ran the teacher; its shards are as set up (it is never written)
            before.update(local_state(teacher.module))
            record["teacher_placements"] = placements(teacher.module)
            record["student_placements"] = placements(student.module)
        if step == args.max_steps:
            after = local_state(teacher.module)
            record["teacher_unchanged"] = before.keys() == after.keys() and all(
                torch.equal(before[k], after[k]) for k in before)
            save_state(student, mesh, fabric.global_rank, out_dir, "distill_final")
            save_state(teacher, mesh, fabric.global_rank, out_dir, "distill_teacher")

    history = recipe.train(fabric, args, on_step=on_step)
    return {**history, **record}


def fabric_loop(cfg: dict) -> None:
    """recipes/fabric_pretrain.py's loop, under the 2D Fabric strategy or a plain single-device Fabric; with
    ``then_dpo``, recipes/fabric_dpo.py's after it in the same processes (``fabric_dpo``)."""
    from lightning_2d.fabric import ModelParallel2DStrategy as FabricStrategy

    recipe = load_recipe("fabric_pretrain")
    out_dir, world = Path(cfg["out_dir"]), int(os.environ["WORLD_SIZE"])
    argv = ["--data", cfg["corpus"], "--cache-dir", cfg["cache_dir"], "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch_size"]), "--accumulate", str(cfg.get("accumulate", 1)),
            "--max-steps", "6", "--warmup-steps", "2", "--lr", "1e-3", "--grad-clip", str(cfg["grad_clip"]),
            "--save-every", str(cfg.get("save_every", 0)), "--checkpoint-dir", cfg.get("checkpoint_dir", "ckpt")]
    if cfg.get("resume"):
        argv += ["--resume", cfg["resume"]]
    if cfg.get("lora_rank"):
        argv += ["--lora-rank", str(cfg["lora_rank"])]
    if cfg.get("model"):
        argv += ["--model", cfg["model"]]
    args = recipe.parse_args(argv)
    if cfg["strategy"] == "single":
        strategy = "auto"
    elif cfg.get("custom_parallelize_fn"):
        # Fabric's own hook, written by hand as a user would: the library's steps, full AC.
        from lightning_2d.models.llama.plan import llama_plan
        from lightning_2d.parallel import ParallelConfig, parallelize_model

        def parallelize_fn(model, mesh):
            config = ParallelConfig(activation_checkpointing="full").resolve_dtypes("32-true")
            parallelize_model(model, mesh, llama_plan(model.args, config), config)
            return model

        strategy = FabricStrategy(cfg["dp"], cfg["tp"], parallelize_fn=parallelize_fn)
    else:
        strategy = FabricStrategy(cfg["dp"], cfg["tp"], data_parallel_replicate_size=cfg.get("replicate", 1),
                                  pipeline_parallel_size=cfg.get("pp", 1),
                                  pipeline_schedule=cfg.get("pipeline_schedule", "1F1B"),
                                  fsdp_backend=cfg.get("fsdp_backend", "fully_shard"),
                                  expert_parallel_size=cfg.get("ep", 1))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()

    reduce_scatters = count_reduce_scatters()

    def on_step(step: int, model) -> None:
        if step == 6:
            save_state(model, getattr(fabric.strategy, "device_mesh", None), fabric.global_rank, out_dir, "final")

    trained: list[str] = []
    experts: dict[str, dict] = {}

    def on_step_and_record(step: int, model) -> None:
        if step == 1:  # what requires gradients once fabric.setup parallelized the model
            trained.extend(canonical_name(n) for n, p in model.named_parameters() if p.requires_grad)
            experts.update({n.removeprefix("_forward_module."): v for n, v in placements(model).items()
                            if ".experts." in n})  # the names under Fabric's wrapper
        on_step(step, model)

    history = recipe.train(fabric, args, on_step=on_step_and_record)
    result = {**history, "reduce_scatters": reduce_scatters["n"], "requires_grad": sorted(trained),
              "expert_placements": experts}
    if cfg.get("then_resume"):
        # In the same processes, a second run of the recipe resumes from a checkpoint the first one saved (a
        # synchronous fabric.save ends in a barrier: it is complete): its steps and final weights ("resumed_final").
        def on_resumed_step(step: int, model) -> None:
            if step == 6:
                save_state(model, getattr(fabric.strategy, "device_mesh", None), fabric.global_rank, out_dir,
                           "resumed_final")

        again = recipe.parse_args(argv + ["--save-every", "0", "--resume", cfg["then_resume"]])
        result["resumed"] = recipe.train(fabric, again, on_step=on_resumed_step)
    if cfg.get("then_dpo"):  # after everything the pretraining run recorded (its reduce-scatter count)
        result["dpo"] = fabric_dpo(fabric, cfg["then_dpo"], out_dir)
    if cfg.get("then_distill"):
        result["distill"] = fabric_distill(fabric, cfg["then_distill"], out_dir)
    if cfg.get("refuse"):
        # Checkpoints the test planted a payload in, loaded as fabric.load loads: each rank's refusal (None: loaded).
        from lightning_2d.checkpoint import CheckpointError

        result["refused"] = {}
        for label, path, weights_only in cfg["refuse"]:
            try:
                fabric.load(path, {}, weights_only=weights_only)
                result["refused"][label] = None
            except CheckpointError as err:
                result["refused"][label] = f"{type(err).__name__}: {err}"
    (out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


def fabric_hf(cfg: dict) -> None:
    """A Hugging Face decoder given as-is to ``fabric.setup`` (plan and init found by the strategy),
    trained by a hand-written loop with the batches, loss and optimizer of the Trainer's ``fit``."""
    from lightning_2d.fabric import ModelParallel2DStrategy as FabricStrategy
    from lightning_2d.hf import HFCausalLMModule
    from lightning_2d.parallel.loss import next_token_loss

    out_dir, world = Path(cfg["out_dir"]), int(os.environ["WORLD_SIZE"])
    strategy = FabricStrategy(cfg["dp"], cfg["tp"], init_seed=cfg["init_seed"], sequence_parallel=cfg["sequence_parallel"])
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    L.seed_everything(cfg["seed"], verbose=False)
    # Only for its config, optimizer and schedule: the model itself is the bare transformers module.
    helper = HFCausalLMModule(cfg["hf_config"], learning_rate=cfg.get("lr", 1e-3), warmup_steps=2, max_steps=cfg["steps"])
    hf_config = helper.hf_config  # a transformers LlamaConfig
    with fabric.init_module(empty_init=True):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model = fabric.setup(model)
    helper.model = model
    configured = helper.configure_optimizers()
    optimizer = fabric.setup_optimizers(configured["optimizer"])
    scheduler = configured["lr_scheduler"]["scheduler"]
    mesh = fabric.strategy.device_mesh
    dp, dp_rank = mesh["data_parallel"].size(), mesh["data_parallel"].get_local_rank()
    data = SyntheticTokens(cfg["global_batch"] * cfg["steps"], cfg["seq_len"], helper.vocab_size)
    # What Lightning's Trainer does under a parallel strategy: a shuffling sampler over the dp ranks.
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=True, seed=cfg["seed"])
    losses = []
    for batch in DataLoader(data, batch_size=cfg["global_batch"] // dp, sampler=sampler):
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        loss, global_mean, _ = next_token_loss(logits, batch["labels"], mesh)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(global_mean))
    result = {"losses": losses}
    (out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


def exchange_disagreement(cp_mesh) -> float:
    """The largest difference between the ring and the all-gather exchanges over this job's real context group:
    outputs and the gradients of this rank's queries, keys and values, for packed documents (the library uses
    the all-gather; the ring is the measured alternative, ``tests/benchmarks/bench_context.py --exchanges``)."""
    from lightning_2d.data.loading import document_positions
    from lightning_2d.parallel.context import EXCHANGES, ContextParallelAttention, local_indices

    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    generator = torch.Generator().manual_seed(0)  # the same whole sequence on every rank; each takes its slice
    batch, length = 2, 8 * cp
    q, k, v, grad = (torch.randn(batch, heads, length, 8, generator=generator) for heads in (4, 2, 2, 4))
    tokens = torch.zeros(batch, length, dtype=torch.long)
    tokens[:, [2, 5, length // 2]] = 1
    positions, mine = document_positions(tokens, eos_id=1), local_indices(length, cp, rank)
    results = []
    for exchange in EXCHANGES:
        held = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        core = ContextParallelAttention(cp_mesh.get_group(), cp, rank, exchange)
        out = core(*held, core.mask(positions[:, mine], q.dtype))
        out.backward(grad[:, :, mine])
        results.append([out.detach(), *(t.grad for t in held)])
    return max(float((a - b).abs().max()) for a, b in zip(*results))


def one_after_another(run_one: Callable[[dict], None], cfg: dict) -> None:
    """``run_one`` for each of ``cfg["runs"]`` in turn, in the same processes and process group (one launch shared
    by several jobs: ``Jobs.layouts``, ``Jobs.share``); each writes into its own folder. Lightning's environment
    deletes ``WORLD_SIZE`` at teardown: the launch's cluster variables are put back before each run."""
    cluster = {k: os.environ[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    for name, run in cfg["runs"].items():
        os.environ.update(cluster)
        out = Path(cfg["out_dir"]) / name
        out.mkdir(exist_ok=True)
        run_one({**run, "out_dir": str(out)})


def fits(cfg: dict) -> None:
    """Several ``fit`` runs one after the other in one launch (``one_after_another``)."""
    one_after_another(fit, cfg)


#: ``train`` options that make a run a launch of its own: a crash and the write observer patch DCP's writer for
#: the rest of the process; an asynchronous save may still be writing when the run ends.
ALONE = ("crash", "observe_writes_timeout_s", "async_checkpoint")


def trains(cfg: dict) -> None:
    """Several ``train`` runs one after the other in one launch (``one_after_another``): a run that resumes from
    a checkpoint an earlier run of the launch saved finds it complete (a synchronous save ends in a barrier)."""
    for name, run in cfg["runs"].items():
        alone = [key for key in ALONE if run.get(key)]
        if alone:
            raise ValueError(f"run {name!r} sets {alone}: launch it alone (see worker.ALONE)")
    one_after_another(train, cfg)


def fabric_crash(cfg: dict) -> None:
    """A rank of test_fabric_crash.py's jobs (``fabric_crash_worker.main``), forked as every other rank is."""
    from tests.distributed import fabric_crash_worker

    fabric_crash_worker.main(cfg)


def old_checkpoints(cfg: dict) -> None:
    """test_old_checkpoints.py's one process: ``tests/fixtures/make_checkpoints.py --resume OUT_DIR``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_checkpoints", REPO / "tests/fixtures/make_checkpoints.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.resume(Path(cfg["out_dir"]))


def script(cfg: dict) -> None:
    """This rank runs a documented script as ``python SCRIPT ARGS`` (``cfg["script"]``) or ``python -m MODULE ARGS``
    (``cfg["module"]``) would, in ``cfg["cwd"]``: as ``__main__``, with its ``sys.argv`` and ``sys.path[0]``, the
    loss probe applied when ``cfg["probe"]``. Launched with the cluster variables set, the script's Trainer or
    Fabric finds its processes already started (as under torchrun) and starts none: what the fork saves is
    each rank's interpreter start and imports, the script's own lines all run."""
    import runpy

    os.chdir(cfg["cwd"])
    if cfg.get("probe"):
        from tests.distributed import loss_probe

        loss_probe.install()
    if "module" in cfg:
        sys.argv = [cfg["module"], *cfg["args"]]
        sys.path.insert(0, cfg["cwd"])
        runpy.run_module(cfg["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [cfg["script"], *cfg["args"]]
        sys.path.insert(0, str(Path(cfg["script"]).resolve().parent))
        runpy.run_path(cfg["script"], run_name="__main__")


def expert_exchange(cfg: dict) -> None:
    """Expert parallelism's token exchange (``parallel.expert.ExpertExchange``, attached around a layer's experts)
    against the whole layer on one process.

    For each case (``cfg["cases"]``: ``ep``, the expert-parallel size, and ``idle``, whether the last expert-parallel
    rank's experts are biased out of every choice so that it receives no token), each rank routes its own tokens
    through an ``ops.moe.MoE`` holding only its ``E / ep`` experts, and compares with the whole layer run, in this
    process, on the tokens of its expert-parallel group: its outputs and input gradients, its experts' gradients, and
    the router's gradient summed over the group. Writes the worst differences to ``rank{N}.json``."""
    import copy

    import torch.distributed as dist

    from lightning_2d.ops.moe import GroupedExperts, MoE, MoEArgs
    from lightning_2d.parallel.expert import ExpertExchange

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dim, hidden, experts, top_k, tokens = 16, 24, 8, 2, 10
    results = {}
    for case in cfg["cases"]:
        ep = case["ep"]
        groups = [dist.new_group(list(range(start, start + ep))) for start in range(0, world, ep)]
        members = list(range(rank // ep * ep, rank // ep * ep + ep))
        torch.manual_seed(0)
        whole = MoE(dim, MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=hidden, load_balancing="bias"))
        with torch.no_grad():
            for param in whole.parameters():
                param.normal_(0.0, 0.3)
            if case["idle"]:  # the last expert-parallel rank's experts are never chosen
                whole.expert_bias[experts - experts // ep:] = -10.0
        inputs = [torch.randn(tokens, dim, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
        grads = [torch.randn(tokens, dim, generator=torch.Generator().manual_seed(200 + r)) for r in range(world)]
        layer = copy.deepcopy(whole)
        exchange = ExpertExchange(groups[rank // ep], experts)
        mine = slice(exchange.first_expert, exchange.first_expert + exchange.local_experts)
        layer.experts = GroupedExperts(dim, hidden, exchange.local_experts)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(layer.experts, name).copy_(getattr(whole.experts, name)[mine])
        exchange.attach(layer.experts)  # the tokens go to their experts' ranks around the experts' forward

        reference_in = torch.cat([inputs[r] for r in members]).requires_grad_(True)
        reference = whole(reference_in)
        reference.backward(torch.cat([grads[r] for r in members]))
        x = inputs[rank].clone().requires_grad_(True)
        out = layer(x)
        out.backward(grads[rank])
        counts = layer.last_stats.counts.clone()
        dist.all_reduce(counts, group=groups[rank // ep])
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad, group=groups[rank // ep])
        at = members.index(rank) * tokens
        error = lambda a, b: float((a - b).abs().max())  # noqa: E731
        results[f"ep{ep}{'_idle' if case['idle'] else ''}"] = {
            "output": error(out, reference[at:at + tokens]),
            "input_grad": error(x.grad, reference_in.grad[at:at + tokens]),
            "expert_grads": max(error(getattr(layer.experts, n).grad, getattr(whole.experts, n).grad[mine])
                                for n in ("w1", "w2", "w3")),
            "router_grad": error(router_grad, whole.router.weight.grad),
            "assignments": int(counts.sum()),
            "group_tokens": tokens * ep,
            "received": int(layer.experts.w1.grad.abs().sum() > 0),
            "output_scale": float(reference.abs().max()),
        }
    Path(cfg["out_dir"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


SCENARIOS = {
    "fit": fit,
    "script": script,
    "fits": fits,
    "trains": trains,
    "text": text,
    "train": train,
    "bench_checkpoint": bench_checkpoint,
    "fabric": fabric_loop,
    "fabric_hf": fabric_hf,
    "fabric_crash": fabric_crash,
    "old_checkpoints": old_checkpoints,
    "expert_exchange": expert_exchange,
}

if __name__ == "__main__":
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native abort (gloo at exit …) prints every thread's Python stack
    scenario, config_path = sys.argv[1], sys.argv[2]
    SCENARIOS[scenario](json.loads(Path(config_path).read_text()))
