"""Collectives per step: every all-gather, reduce-scatter and all-reduce one rank issues in one training step,
counted from a CPU profile of that step (``CollectiveCountCallback``).

Both FSDP backends are counted alike: FSDP2 calls the process group's ops (``c10d::_allgather_base_``,
``c10d::_reduce_scatter_base_``, ...), DTensor, SimpleFSDP and compiled graphs the functional ones
(``_c10d_functional::all_gather_into_tensor``, bucketed into fewer, larger ones under ``compile``). A collective
issued inside another (a functional op calling the process group's) counts once, as the outer one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import lightning as L

#: The kinds counted, in the report's order.
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_NAMESPACES = ("c10d::", "_c10d_functional::")


def collective_kind(name: str) -> Optional[str]:
    """The kind of the profiler event ``name`` (``KINDS``, or ``"other"`` for another collective: a broadcast, an
    all-to-all), ``None`` for anything that is not a collective (a wait, a barrier's bookkeeping, a compute op)."""
    namespace = next((ns for ns in _NAMESPACES if name.startswith(ns)), None)
    if namespace is None:
        return None
    op = name[len(namespace):]
    if op.startswith("wait") or op in ("barrier", "monitored_barrier_"):
        return None
    if namespace == "_c10d_functional::" and op.startswith("_"):  # its bookkeeping (``_wrap_tensor_autograd``)
        return None
    compact = op.replace("_", "")
    if "reducescatter" in compact:
        return "reduce_scatter"
    if "allgather" in compact:
        return "all_gather"
    if "allreduce" in compact:
        return "all_reduce"
    return "other"


def count_collectives(events: Iterable[Any]) -> dict[str, int]:
    """Collectives by kind among profiler ``events`` (each with ``name`` and ``cpu_parent``): an event inside
    another collective is not counted again."""
    counts = dict.fromkeys((*KINDS, "other"), 0)
    for event in events:
        kind = collective_kind(event.name)
        if kind is None:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = collective_kind(parent.name) is not None, parent.cpu_parent
        if not nested:
            counts[kind] += 1
    return counts


class CollectiveCountCallback(L.Callback):
    """Profiles training step ``step`` (from 0: a warm-up step, whose time the benchmark drops) on this rank and
    keeps its ``counts`` (``count_collectives``); ``None`` until then."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.counts: Optional[dict[str, int]] = None
        self._profile: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step and self._profile is None and self.counts is None:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU])
            self._profile.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        self.counts = count_collectives(self._profile.events())
        self._profile = None
