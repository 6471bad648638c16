"""Collectives per step: every all-gather, reduce-scatter and all-reduce one rank issues in one training step,
counted from a CPU profile of that step (``CollectiveCountCallback``).

Both FSDP backends are counted alike: FSDP2 calls the process group's ops (``c10d::_allgather_base_``,
``c10d::_reduce_scatter_base_``, ...), DTensor, SimpleFSDP and compiled graphs the functional ones
(``_c10d_functional::all_gather_into_tensor``, bucketed into fewer, larger ones under ``compile``). A collective
issued inside another (a functional op calling the process group's) counts once, as the outer one.

``counted_collectives`` profiles one step for the Trainer variants (``CollectiveCountCallback``) and the plain loop
alike; with ``by_issuer`` (the benchmark's ``--collectives``) it also wraps the Python entry points of the
collectives (``torch.distributed``'s and the functional ones DTensor calls) for that step and records each call's
kind, group, size and issuer, the code that called it (``classify_issuer``, from the call's stack).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L

from lightning_2d import _compat

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


#: ``issuer_table``'s issuer of the collectives the profile saw that no wrapped entry point did: the backward of
#: an autograd functional collective, a compiled graph's, or a function bound by ``from … import`` before the step.
UNSEEN = "no Python call seen (autograd backward, compiled graph)"

_HUMAN = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce", "other": "other"}
#: lightning_2d's functions that count the step's tokens over the data-parallel ranks (``parallel/loss.py``).
_TOKEN_COUNTS = ("normalize_by_global_tokens", "count_global_tokens", "count_step_tokens", "normalize_by_global_count",
                 "unit_scale", "global_means")
#: The innermost lightning_2d file on the stack → the issuer.
_OUR_FILES = {
    "parallel/guard.py": "non-finite guard (parallel/guard.py)",
    "parallel/grad_norm.py": "gradient clipping (parallel/grad_norm.py)",
    "parallel/grad_sync.py": "deferred tensor-parallel gradient sums (parallel/grad_sync.py)",
    "parallel/loss.py": "vocab-parallel loss statistics (parallel/loss.py)",
    "parallel/expert.py": "expert parallel dispatch (parallel/expert.py)",
    "parallel/context.py": "context parallel (parallel/context.py)",
    "parallel/pipeline.py": "pipeline (parallel/pipeline.py)",
    "integration/step_guard.py": "first-step loss check (integration/step_guard.py)",
}


def _path(filename: str) -> str:
    return filename.replace("\\", "/")


def _short(filename: str, function: str) -> str:
    """``parallel/loss.py:_normalized``, ``torch/distributed/fsdp/…:fn``, ``lightning/pytorch/…:fn``."""
    path = _path(filename)
    for marker, prefix in (("/lightning_2d/", ""), ("/torch/", "torch/"), ("/lightning/", "lightning/")):
        if marker in path:
            return f"{prefix}{path.rsplit(marker, 1)[1]}:{function}"
    return f"{path.rsplit('/', 1)[-1]}:{function}"


def classify_issuer(frames: Sequence[tuple[str, str]], kind: str, unit: Optional[str] = None) -> str:
    """A short label of the code that issued a collective of ``kind``, from the stack at the call.

    Args:
        frames: ``(filename, function)`` of each frame, outermost first (``traceback.extract_stack``'s order).
        kind: The collective's kind (``KINDS`` or ``"other"``).
        unit: The FSDP2 unit on the stack (``""``: the root), if known.

    FSDP2's own collectives come first (a unit's all-gather runs inside whatever called the unit), then
    lightning_2d's step-level ones (token counts, then by the innermost lightning_2d file: guard, gradient norm,
    loss statistics …), then DTensor's redistributes, and else the innermost frame of lightning_2d,
    torch.distributed or Lightning as ``file:function``.
    """
    paths = [(_path(f), fn) for f, fn in frames]
    human = _HUMAN.get(kind, kind)
    fsdp = [(f, fn) for f, fn in paths if "/torch/distributed/fsdp/" in f]
    if any(fn == "_get_grad_inner_tensor" for _, fn in fsdp):
        return "DTensor Partial→Replicate grad (FSDP2 _get_grad_inner_tensor)"
    if fsdp:
        return f"FSDP2 {human}" + (f" (unit {unit or 'root'})" if unit is not None else "")
    ours = [(f.rsplit("/lightning_2d/", 1)[1], fn) for f, fn in paths
            if "/lightning_2d/" in f and "/lightning_2d/tools/benchmark/collectives.py" not in f]
    if any(f == "parallel/simple_fsdp.py" for f, _ in ours):
        return f"SimpleFSDP {human}"
    counting = [fn for _, fn in ours if fn in _TOKEN_COUNTS]
    if counting:
        return f"global token count ({counting[0]})"
    if ours and ours[-1][0] in _OUR_FILES:
        return _OUR_FILES[ours[-1][0]]
    dtensor = [(f, fn) for f, fn in paths if "/torch/distributed/tensor/" in f]
    if dtensor:
        if any("/torch/distributed/tensor/parallel/" in f for f, _ in dtensor) or any(
                f == "parallel/tensor_parallel.py" for f, _ in ours):
            return "TP/SP layer (DTensor redistribute)"
        if any(fn == "backward" for _, fn in dtensor):
            return "DTensor redistribute in backward"
        callers = [(f, fn) for f, fn in paths if "/torch/distributed/tensor/" not in f and "/torch/" not in f]
        return "DTensor redistribute" + (f" ({_short(*callers[-1])})" if callers else "")
    for f, fn in reversed(paths):
        if any(m in f for m in ("/lightning_2d/", "/torch/distributed/", "/lightning/")) and \
                "/lightning_2d/tools/benchmark/collectives.py" not in f:
            return _short(f, fn)
    return f"unknown ({_short(*paths[-1])})" if paths else "unknown"


@dataclass
class CollectiveCall:
    """One collective called during the counted step: its kind, group, size and issuer."""

    kind: str
    issuer: str
    group: str
    elements: int
    bytes: int


def describe_group(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The process group a collective's arguments name: ``mesh dim name×size`` where known, ``size N`` else
    (``world×N`` when none is given, the default group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    for value in (*kwargs.values(), *args):
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], DeviceMesh):
            mesh, dim = value
            index = mesh.mesh_dim_names.index(dim) if isinstance(dim, str) and mesh.mesh_dim_names else dim
            name = mesh.mesh_dim_names[index] if mesh.mesh_dim_names else f"dim {index}"
            return f"{name}×{mesh.size(index)}"
        if isinstance(value, DeviceMesh):
            name = "×".join(value.mesh_dim_names or ("mesh",))
            return f"{name}×{value.size()}"
        if isinstance(value, dist.ProcessGroup):
            desc = getattr(value, "group_desc", "") or ""
            return f"{desc.removeprefix('mesh_') or 'group'}×{value.size()}"
    if not any(k == "group" for k in kwargs) and dist.is_initialized():
        return f"world×{dist.get_world_size()}"
    return "?"


def payload(args: Sequence[Any], kwargs: dict[str, Any], kind: str) -> tuple[int, int]:
    """Elements and bytes of a collective's input, what this rank contributes: an all-gather's shard (its smallest
    buffer), else the largest (a reduce-scatter's whole input; a list of tensors counts as one buffer, summed)."""
    import torch

    sizes = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            sizes.append((value.numel(), value.numel() * value.element_size()))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            sizes.append((sum(t.numel() for t in value), sum(t.numel() * t.element_size() for t in value)))
    if not sizes:
        return (0, 0)
    return min(sizes) if kind == "all_gather" else max(sizes)


#: What the name of a collective's entry point holds (``all_gather_single``, ``reduce_scatter_tensor``, …).
_COLLECTIVE_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "permute_tensor")


def _entry_points() -> list[tuple[Any, str]]:
    """``(module, name)`` of every collective a Python caller can reach: ``torch.distributed``'s (and
    ``distributed_c10d``'s, the same functions) and the functional ones."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    points = []
    for module in (dist, c10d, _compat.functional_collectives()):
        for name in dir(module):
            if name.startswith("_") or not any(op in name for op in _COLLECTIVE_NAMES) or name.endswith(
                    ("_backward", "_setup_context")):
                continue
            fn = getattr(module, name, None)
            if callable(fn) and not isinstance(fn, type):
                points.append((module, name))
    return points


class _CallRecorder:
    """Wraps the collectives' entry points (``_entry_points``) while on; a call inside another wrapped one (a
    ``torch.distributed`` function a functional one calls) is recorded once, as the outer one."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()

    def _wrapped(self, name: str, fn: Any) -> Any:
        kind = collective_kind(f"c10d::{name}") or "other"
        recorder = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if getattr(recorder._local, "inside", False):
                return fn(*args, **kwargs)
            recorder._local.inside = True
            try:
                recorder.record(kind, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                recorder._local.inside = False

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def record(self, kind: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        frames, unit = [], None
        frame = sys._getframe(2)  # the caller of the wrapped entry point
        while frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_code.co_name))
            if unit is None and "/fsdp/" in _path(frame.f_code.co_filename):
                unit = _compat.fsdp_unit_of(frame.f_locals.get("self"))
            frame = frame.f_back
        frames.reverse()
        elements, nbytes = payload(args, kwargs, kind)
        self.calls.append(CollectiveCall(kind, classify_issuer(frames, kind, unit), describe_group(args, kwargs),
                                         elements, nbytes))

    def __enter__(self) -> _CallRecorder:
        for module, name in _entry_points():
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
        wrapped = {id(fn): self._wrapped(name, fn) for _, name, fn in self._saved}
        for module, name, fn in self._saved:  # one wrapper per function, shared by the modules that export it
            setattr(module, name, wrapped[id(fn)])
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()


def issuer_table(calls: Iterable[CollectiveCall], counts: Optional[dict[str, int]] = None) -> list[dict[str, Any]]:
    """``calls`` by issuer, kind and group: ``{"issuer", "kind", "group", "count", "elements", "bytes"}`` rows, the
    most frequent first; where the profile's ``counts`` hold more of a kind than were called, the rest is one row
    of ``UNSEEN`` (its size unknown: ``None``)."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    seen = dict.fromkeys((*KINDS, "other"), 0)
    for call in calls:
        row = rows.setdefault((call.issuer, call.kind, call.group), {
            "issuer": call.issuer, "kind": call.kind, "group": call.group, "count": 0, "elements": 0, "bytes": 0})
        row["count"] += 1
        row["elements"] += call.elements
        row["bytes"] += call.bytes
        seen[call.kind] = seen.get(call.kind, 0) + 1
    table = sorted(rows.values(), key=lambda r: (-r["count"], r["issuer"], r["kind"], r["group"]))
    for kind, counted in (counts or {}).items():
        if counted > seen.get(kind, 0):
            table.append({"issuer": UNSEEN, "kind": kind, "group": "?", "count": counted - seen.get(kind, 0),
                          "elements": None, "bytes": None})
    return table


@dataclass
class StepCollectives:
    """What ``counted_collectives`` found: ``counts`` by kind, and with ``by_issuer`` the ``issuers`` table
    (``issuer_table``); both ``None`` until the step ends."""

    counts: Optional[dict[str, int]] = None
    issuers: Optional[list[dict[str, Any]]] = None
    calls: list[CollectiveCall] = field(default_factory=list)


@contextmanager
def counted_collectives(by_issuer: bool = False) -> Iterator[StepCollectives]:
    """Profile the code inside (one training step) and count its collectives (``count_collectives``); with
    ``by_issuer`` also record each call's issuer (``_CallRecorder``, ``issuer_table``). The Trainer variants enter
    it from a callback (``CollectiveCountCallback``), the plain loop around one iteration."""
    from torch.profiler import ProfilerActivity, profile

    result = StepCollectives()
    with ExitStack() as stack:
        prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU]))
        recorder = stack.enter_context(_CallRecorder()) if by_issuer else None
        yield result
    result.counts = count_collectives(prof.events())
    if recorder is not None:
        result.calls = recorder.calls
        result.issuers = issuer_table(recorder.calls, result.counts)


class CollectiveCountCallback(L.Callback):
    """Counts the collectives of training step ``step`` (from 0: a warm-up step, whose time the benchmark drops) on
    this rank (``counted_collectives``) and keeps its ``counts`` and, with ``by_issuer``, its ``issuers``; ``None``
    until then."""

    def __init__(self, step: int, by_issuer: bool = False) -> None:
        self.step = step
        self.by_issuer = by_issuer
        self.counts: Optional[dict[str, int]] = None
        self.issuers: Optional[list[dict[str, Any]]] = None
        self._stack: Optional[ExitStack] = None
        self._result: Optional[StepCollectives] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step and self._stack is None and self.counts is None:
            self._stack = ExitStack()
            self._result = self._stack.enter_context(counted_collectives(self.by_issuer))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._stack is None or self._result is None:
            return
        self._stack.close()
        self.counts, self.issuers = self._result.counts, self._result.issuers
        self._stack = self._result = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._stack is not None:  # the entry points unwrapped and the profiler stopped for what runs next
            self._stack.close()
            self._stack = self._result = None
