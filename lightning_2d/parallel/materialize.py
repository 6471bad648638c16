"""Materialize a meta-device model after parallelization, with layout-independent values."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch
from torch import nn

from lightning_2d._compat import compute_local_shape_and_global_offset
from lightning_2d.errors import Lightning2DError, Lightning2DWarning
from lightning_2d.ops.init import SeededInit, module_init_specs
from lightning_2d.ops.weights import weight_format
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.parallel.ties import retie, shared_parameters


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """The tensor this rank holds of ``param`` and where it sits in the full parameter.

    For a plain tensor: itself at offset ``None`` (the whole). For a DTensor: its local shard
    and the global offset of that shard (the same computation Distributed Checkpoint uses).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, None
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(shape):  # pragma: no cover - a layout we do not know how to address
        raise NotImplementedError(
            f"Cannot address the local shard of a DTensor with placements {param.placements}: local shape"
            f" {tuple(local.shape)} differs from the computed {tuple(shape)}"
        )
    return local, tuple(offset)


class WeightSource(Protocol):
    """Where a materialized parameter's values come from, block by block."""

    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: tuple[int, ...], offset: Optional[tuple[int, ...]]
    ) -> None: ...


class MaterializationError(Lightning2DError, RuntimeError):
    """A meta-device model left tensors without values after materialization; names each and the fix."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _named_tensors(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Qualified name → ("parameter" | "buffer", tensor), each tensor once."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        out[name] = ("parameter", param)
    for name, buf in model.named_buffers():
        out[name] = ("buffer", buf)
    return out


def _poison_(tensor: torch.Tensor) -> bool:
    """Fill freshly allocated memory with a value no initializer produces; ``False`` if the dtype has none."""
    local = _local(tensor)
    if not weight_format(local).has_sentinel:
        return False  # no value of the format can be a sentinel (NF4's 4-bit codes): materialize_model tracks its fill
    if local.is_floating_point() or local.is_complex():
        local.fill_(float("nan"))
    elif local.dtype != torch.bool:
        local.fill_(torch.iinfo(local.dtype).min)
    else:
        return False
    return True


def _still_poisoned(tensor: torch.Tensor) -> bool:
    local = _local(tensor)
    if local.numel() == 0:
        return False
    if local.is_floating_point() or local.is_complex():
        return bool(torch.isnan(local).any())  # no initializer yields NaN: any is a hole
    return bool((local == torch.iinfo(local.dtype).min).all())


@torch.no_grad()
def materialize_model(
    model: nn.Module,
    device: torch.device,
    seed: int,
    weights: Optional[WeightSource] = None,
    init_hooks: Sequence[object] = (),
) -> None:
    """Allocate ``model``'s meta tensors on ``device`` and fill each rank's blocks; never leave one unfilled.

    ``weights`` supplies the values (e.g. ``lightning_2d.checkpoint.hf.HFWeights`` reads them from a Hugging
    Face directory). Without it, a model that describes its initialization (``param_init_specs()``
    → ``{name: InitSpec}``, as ``lightning_2d.models.llama.model.Transformer`` does) gets its seeded init, the
    same at every ``(dp, tp)`` layout and on a single device. Other models fall back to their
    modules' ``reset_parameters()`` methods (Lightning's behaviour), whose values depend on the
    layout; a warning says so. Then the model's ``init_buffers(device)``, if defined, fills (or
    recomputes) its buffers. Tensors that were not on the meta device keep their values.

    Every newly allocated tensor is first filled with a sentinel (NaN; the minimum for integers);
    a tensor that still holds it after these routes was initialized by none of them, and
    ``MaterializationError`` names each such tensor and how to fix it — before any training step,
    instead of a NaN loss or plausible-looking garbage.

    ``param_init_specs``/``init_buffers`` are looked up on ``model``, then on each of ``init_hooks``
    (the LightningModule that owns a model class it cannot change, e.g. a Hugging Face model; the
    built-in hooks of a known architecture), with names relative to ``model``.
    """
    if not has_meta_tensors(model):
        return
    before = _named_tensors(model)
    was_meta = {name for name, (_, t) in before.items() if t.is_meta}
    # `to_empty` must run on the root (FSDP2 re-registers its sharded parameters there) and gives every
    # tensor new storage: keep the values of those that were real.
    kept = {name: weight_format(t).snapshot(_local(t)) for name, (_, t) in before.items() if name not in was_meta}
    ties = shared_parameters(model)
    model.to_empty(device=device)
    retie(model, ties)  # `to_empty` gives each module its own new parameter: a tie would come out as two
    tensors = _named_tensors(model)
    for name, value in kept.items():
        weight_format(tensors[name][1]).restore_(_local(tensors[name][1]), value)
    checkable = {name for name in was_meta if _poison_(tensors[name][1])}
    # Weights of a format without a sentinel (QLoRA's NF4 bases): each must be filled below, and is checked off when
    # it is.
    unfilled = {name for name in was_meta if not weight_format(tensors[name][1]).has_sentinel}

    # Parameters their module initializes itself (adapters added to a model whose init, or checkpoint, has none).
    self_init = SeededInit({canonical_name(n): spec for n, spec in module_init_specs(model).items()}, seed)
    specs_fn = _init_hook(model, init_hooks, "param_init_specs")
    if weights is not None or callable(specs_fn):
        source = weights if weights is not None else SeededInit(specs_fn(), seed)
        for fqn, param in model.named_parameters():
            if fqn not in was_meta or canonical_name(fqn) in self_init.specs:
                continue
            local, offset = local_block(param)
            name, shape = canonical_name(fqn), tuple(param.shape)
            weight_format(local).fill_(local, lambda out, at: source.fill_block_(out, name, shape, at), shape, offset,
                                       device)
            unfilled.discard(fqn)
        route = "param_init_specs()" if weights is None else "the weights source"
    else:
        warnings.warn(
            f"{type(model).__name__} has no `param_init_specs()`; initializing it with each module's"
            " `reset_parameters()`, whose values depend on the parallel layout. Define `param_init_specs()`"
            " for seed-reproducible weights across layouts.",
            Lightning2DWarning,
            stacklevel=2,
        )
        for module in model.modules():
            own = [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
            reset = getattr(module, "reset_parameters", None)
            if own and callable(reset):
                reset()
        route = "reset_parameters()"
    # Their values: from the weights source where it has them (``covers``: a LoRA adapter folder), else their init.
    covers = getattr(weights, "covers", None)
    for fqn, param in model.named_parameters():
        name = canonical_name(fqn)
        if fqn in was_meta and name in self_init.specs:
            local, offset = local_block(param)
            source = weights if callable(covers) and covers(name) else self_init
            source.fill_block_(local, name, tuple(param.shape), offset)
    init_buffers = _init_hook(model, init_hooks, "init_buffers")
    if callable(init_buffers):
        init_buffers(device)

    tensors = _named_tensors(model)
    left = sorted({name for name in checkable if name in tensors and _still_poisoned(tensors[name][1])} | unfilled)
    if left:
        raise MaterializationError(_uninitialized_message(model, left, tensors, route))


def _init_hook(model: nn.Module, init_hooks: Sequence[object], name: str) -> Optional[Callable[..., Any]]:
    """``model.<name>``, else the first of ``init_hooks`` that defines it."""
    for owner in (model, *init_hooks):
        fn = getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def _uninitialized_message(model: nn.Module, names: list[str], tensors: dict[str, tuple[str, torch.Tensor]], route: str) -> str:
    persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
    lines = []
    for name in names:
        kind, _ = tensors[name]
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name) if owner_name else model
        detail = kind if kind == "parameter" else ("buffer" if name in persistent else "non-persistent buffer")
        if kind == "parameter" and route == "reset_parameters()":
            how = f"{type(owner).__name__} has no reset_parameters()"
        elif kind == "parameter":
            how = f"not filled by {route}"
        else:
            how = "no init route fills it (buffers are filled by the model's init_buffers(device))"
        lines.append(f"{canonical_name(name)} ({detail} of {type(owner).__name__}): {how}")
    return (
        f"{len(names)} tensor(s) of {type(model).__name__} built on the meta device were left without values"
        " after materialization (training on them would start from uninitialized memory):\n  - "
        + "\n  - ".join(lines)
        + f"\nFix: describe the parameters' initialization in `{type(model).__name__}.param_init_specs()`"
        " (layout-independent values) or give their modules a `reset_parameters()`; compute buffers in"
        f" `{type(model).__name__}.init_buffers(self, device)`, which the strategy calls after allocating;"
        " or build the model on a real device instead of the meta device."
    )
