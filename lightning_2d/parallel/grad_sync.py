"""Tensor-parallel gradient reductions deferred to the end of the step: one bucketed all-reduce per group and dtype.

A parameter replicated over the tensor-parallel ranks — a norm weight under sequence parallelism, a LoRA factor beside
a column- or row-wise base, a router — gets a gradient that is a partial sum on each rank (each rank saw only its
sequence slice, or its features). DTensor marks it ``Partial()``, and FSDP2 all-reduces it over the tensor ranks, one
collective per parameter, before its reduce-scatter (``FSDPParam._get_grad_inner_tensor``): 9 all-reduces per step
for the ``debug`` model's norms at ``(2, 2)``, one per adapter factor more under LoRA. The sum over tensor ranks is
linear: it commutes with FSDP's reduce-scatter over the data ranks and with accumulation over micro-batches, so it can
wait until the step's last backward and run once over every such gradient, on the reduce-scattered shards (1/dp of
the bytes) — Megatron-LM's ``_allreduce_layernorm_grads``. ``DeferredTensorReduction`` does that:

- ``attach(model)`` adds a forward pre-hook to each FSDP2 unit, after FSDP's own (which swapped the gathered
  parameters in): once per gathered parameter replicated over some mesh dimension, a gradient hook is registered that
  relabels a ``Partial("sum")`` gradient ``Replicate()`` without communicating, and notes its parameter as pending.
  FSDP2 then finds the placement it expects and reduce-scatters the partial sums as they are. A gradient that arrives
  ``Replicate()`` (a norm without sequence parallelism) is left alone and never reduced again.
- ``finish()``: after the step's last backward, before anything reads a gradient (the non-finite guard, clipping,
  ``on_before_optimizer_step``, the optimizer): the pending parameters' local gradient shards, flattened per process
  group and dtype, one all-reduce each, copied back. Idempotent within a step; the strategies call it from the
  optimizer step's closure and from gradient clipping (``integration.strategy_base``, ``integration.precision``).

Until ``finish()`` those gradients hold this rank's partial sums: what reads gradients between a backward and the
optimizer step (a Lightning ``on_after_backward`` hook, a Fabric loop reading ``p.grad`` before ``optimizer.step()``)
sees them unreduced; ``on_before_optimizer_step`` and ``fabric.clip_gradients`` see them reduced.

The gathered parameter of an FSDP2 unit is created at its first all-gather and reused for the run
(``FSDPParam.init_unsharded_param``), so its hook stays; the unit's pre-hook re-checks its parameters at every forward
(a set lookup each) in case one was replaced. Other FSDP backends (SimpleFSDP gathers through DTensor redistributes,
whose backward already reduces) are not attached; nothing is deferred there.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _owned(unit: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """``(module, name)`` of each parameter ``unit`` manages: its modules', not a nested unit's."""
    from torch.distributed.fsdp import FSDPModule

    stack = [unit]
    while stack:
        module = stack.pop()
        for name, _ in module.named_parameters(recurse=False):
            yield module, name
        stack.extend(child for child in module.children() if not isinstance(child, FSDPModule))


def _replicated_dtensor(param: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and param.requires_grad and any(p.is_replicate() for p in param.placements)


class DeferredTensorReduction:
    """The pending partial-sum gradients of one trained model and the bucketed all-reduce that completes them."""

    def __init__(self) -> None:
        self._hooked: dict[int, "weakref.ref[torch.Tensor]"] = {}  # by id: a tensor's ``==`` is element-wise
        self._order: dict[tuple[int, str], int] = {}  # hook order (forward's): the same on every rank of a group
        self._deferred: set[tuple[int, str]] = set()
        #: ``(module, name)`` → (the gathered parameter, the process groups its gradient is partial over).
        self._pending: dict[tuple[int, str], tuple[nn.Module, str, Any, tuple[Any, ...]]] = {}
        self._handles: list[Any] = []
        self.reductions = 0  # bucketed all-reduces issued so far (for tests and the benchmark)

    # ---- attach ---------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> "DeferredTensorReduction":
        """Defer the tensor-parallel reductions of ``model``'s FSDP2 units (none: nothing to do)."""
        for unit in _fsdp_units(model):
            self._handles.append(unit.register_forward_pre_hook(self._hook_gathered(unit)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _hook_gathered(self, unit: nn.Module) -> Any:
        owned = list(_owned(unit))

        @torch.compiler.disable
        def pre_forward(module: nn.Module, args: Any) -> None:
            for owner, name in owned:
                param = getattr(owner, name, None)
                known = self._hooked.get(id(param))
                if param is None or (known is not None and known() is param) or not _replicated_dtensor(param):
                    continue
                key = (id(owner), name)
                self._order.setdefault(key, len(self._order))
                param.register_hook(self._relabel_hook(owner, name, key, param))
                self._hooked[id(param)] = weakref.ref(param)

        return pre_forward

    def _relabel_hook(self, owner: nn.Module, name: str, key: tuple[int, str], param: torch.Tensor) -> Any:
        gathered = weakref.ref(param)

        def relabel(grad: torch.Tensor) -> torch.Tensor:
            from torch.distributed.tensor import DTensor, Replicate

            if not isinstance(grad, DTensor):
                return grad
            dims = tuple(i for i, p in enumerate(grad.placements)
                         if p.is_partial() and getattr(p, "reduce_op", "sum") == "sum")
            if not dims:
                return grad
            mesh = grad.device_mesh
            placements = tuple(Replicate() if i in dims else p for i, p in enumerate(grad.placements))
            with torch.no_grad():
                relabeled = DTensor.from_local(grad.to_local(), mesh, placements, run_check=False,
                                               shape=grad.shape, stride=grad.stride())
            self._pending[key] = (owner, name, gathered, tuple(mesh.get_group(i) for i in dims))
            self._deferred.add(key)
            return relabeled

        return relabel

    # ---- finish ---------------------------------------------------------------------------------
    @property
    def order(self) -> list[tuple[int, str]]:
        """``(id(module), name)`` of every parameter whose gradient was deferred at least once, in the order the
        buckets hold them."""
        return sorted(self._deferred, key=self._order.__getitem__)

    @property
    def pending(self) -> int:
        """Parameters whose gradients wait for ``finish()``."""
        return len(self._pending)

    @torch.no_grad()
    def finish(self) -> None:
        """Sum the pending gradients over their tensor ranks: one all-reduce per process group and dtype."""
        if not self._pending:
            return
        import torch.distributed as dist

        buckets: dict[tuple[Any, torch.dtype, torch.device], list[torch.Tensor]] = {}
        for key in sorted(self._pending, key=self._order.__getitem__):
            owner, name, gathered, groups = self._pending[key]
            param = getattr(owner, name, None)
            if param is not None and param is gathered():
                raise RuntimeError(
                    f"DeferredTensorReduction.finish: {type(owner).__name__}.{name} is still gathered after backward,"
                    " so its reduced gradient cannot be found; finish() runs after the step's last backward"
                )
            grad = None if param is None else param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            for group in groups:
                buckets.setdefault((group, local.dtype, local.device), []).append(local)
        self._pending.clear()
        for (group, _, _), tensors in buckets.items():
            flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
            dist.all_reduce(flat, group=group)
            self.reductions += 1
            if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
                continue
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def defer_tensor_reductions(model: nn.Module, fsdp_backend: Optional[str]) -> Optional[DeferredTensorReduction]:
    """A ``DeferredTensorReduction`` attached to ``model``'s FSDP2 units, or ``None`` where there are none (another
    backend, no FSDP)."""
    if fsdp_backend not in (None, "fully_shard") or not _fsdp_units(model):
        return None
    return DeferredTensorReduction().attach(model)
