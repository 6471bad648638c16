"""The strategies' options, each written once: ``ParallelConfig``'s fields (the parallel layout) and
``StrategyOptions``' (the plan, the seed, checkpoints, the process group and the watchdog).

Each field holds the option's name, type, default, docstring and place among the strategies' parameters
(``option(position=)``). From the fields come the strategies' constructors (``takes_options`` generates each
``__init__``: its signature, with the fields' annotations and defaults in the positional order of 0.1.0, and its
docstring, which is what ``inspect``, LightningCLI/jsonargparse and ``help()`` read), the split of a call's
arguments into the two dataclasses (``split_options``), the docs' "Strategy options" table and the constructors'
declarations for static type checkers and IDEs (``init_stub``: the generated ``if TYPE_CHECKING:`` block in each
strategy class), both written by ``lightning_2d.tools.options_table``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Callable, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_2d.parallel.checks import check, checks_reading, run_checks
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan, raise_if_problems
from lightning_2d.models import hf_decoders  # noqa: F401 - registers the Hugging Face decoders' checks
from lightning_2d.parallel.dims import validate_parallel_dims  # noqa: F401 - registers the layout (and LoRA's) checks
from lightning_2d.parallel.options import Option, args_section, documented, markdown, option, options_of
from lightning_2d.parallel.watchdog import DEFAULT_WATCHDOG_TIMEOUT

#: Backends ``torch.distributed`` ships; a ``"cpu:gloo,cuda:nccl"`` style mapping is accepted too.
PROCESS_GROUP_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")
#: The shortest ``watchdog_timeout`` accepted.
MIN_WATCHDOG_TIMEOUT_S = 5


@documented
@dataclass
class StrategyOptions:
    """The strategies' options that are not the parallel layout's (those are ``ParallelConfig``'s).

    Each field's docstring is the option's documentation everywhere, as for ``ParallelConfig``.
    """

    plan: Optional[ParallelPlan] = option(None, position=21, shown="from the module")
    """Module names to parallelize (a ``ParallelPlan``), for a model that does not provide
    ``parallel_plan(config)``; ``None``: the LightningModule's (or the model's) plan."""
    init_seed: Optional[int] = option(None, position=22)
    """Seed of the layout-independent initialization of a meta-device model; ``None``: the
    model's/LightningModule's ``init_seed`` attribute if it has one, else the run's seed (``seed_everything``)
    broadcast from rank 0."""
    save_distributed_checkpoint: bool = option(True, position=23)
    """Save one shard per rank (``True``: DCP, resumable at any layout) or a single full file assembled on
    rank 0."""
    async_checkpoint: bool = option(False, position=24)
    """Write sharded checkpoints in a background thread after copying them to CPU memory, so training
    continues during the write."""
    process_group_backend: Optional[str] = option(None, position=26)
    """``"nccl"``, ``"gloo"`` (or a mapping such as ``"cpu:gloo,cuda:nccl"``); ``None``: the device's
    default."""
    timeout: Optional[timedelta] = option(default_pg_timeout, position=27)
    """How long a rank waits in a collective for a stalled peer before it fails: a ``datetime.timedelta`` set
    on every process group the strategy creates (the mesh's data- and tensor-parallel groups included)."""
    watchdog_timeout: Optional[timedelta] = option(DEFAULT_WATCHDOG_TIMEOUT, position=28)
    """The failure watchdog's bound (``lightning_2d.parallel.watchdog``): a rank whose process died ends the
    job within seconds; one silent (stopped, dead on another host) or stuck (alive, not starting the step the
    others started) for this long is named, every rank exiting with code 75; an exception on one rank ends the
    others within seconds. The shorter of this and ``timeout`` bounds the job (+ a few seconds): ``timeout`` is
    never extended. ``None`` turns the watchdog off."""

    def __post_init__(self) -> None:
        # A typo fails at construction, with every problem listed.
        raise_if_problems(run_checks(vars(self)))


@check
def process_group_backend_option(process_group_backend: Any) -> list[str]:
    """``process_group_backend`` is a ``torch.distributed`` backend (found at construction instead of at spawn)."""
    backend = process_group_backend
    if backend is None:
        return []
    parts = [p.split(":")[-1] for p in backend.split(",")] if isinstance(backend, str) else [backend]
    if not isinstance(backend, str) or any(p not in PROCESS_GROUP_BACKENDS for p in parts):
        return [
            f"process_group_backend={backend!r} is not a torch.distributed backend; use one of"
            f" {', '.join(repr(b) for b in PROCESS_GROUP_BACKENDS)} (or 'cpu:gloo,cuda:nccl'), or None for the"
            " device's default"
        ]
    return []


@check
def timeout_options(timeout: Any, watchdog_timeout: Any) -> list[str]:
    """``timeout``/``watchdog_timeout`` are ``timedelta``s (a number has no unit), in range."""
    problems = []
    if timeout is not None and not isinstance(timeout, timedelta):
        problems.append(
            f"timeout={timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=10)), not"
            f" {type(timeout).__name__}: a plain number has no unit"
        )
    elif timeout is not None and timeout.total_seconds() <= 0:
        problems.append(f"timeout={timeout!r} must be positive")
    if watchdog_timeout is not None and not isinstance(watchdog_timeout, timedelta):
        problems.append(
            f"watchdog_timeout={watchdog_timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=2)) or"
            f" None (no watchdog), not {type(watchdog_timeout).__name__}"
        )
    elif watchdog_timeout is not None and watchdog_timeout.total_seconds() < MIN_WATCHDOG_TIMEOUT_S:
        problems.append(
            f"watchdog_timeout={watchdog_timeout!r} is under {MIN_WATCHDOG_TIMEOUT_S} s: heartbeats go every"
            " tenth of it, and a shorter bound would declare a rank stalled during an ordinary pause (GC, a busy"
            " host); use at least timedelta(seconds=10), or None to turn the watchdog off"
        )
    return problems


def strategy_options(classes: Sequence[type] = ()) -> list[Option]:
    """Every option of the strategies (the fields of ``classes``: ``ParallelConfig`` and ``StrategyOptions``), in
    their ``position`` order, which must number them ``0, 1, …`` once each; each with the registered checks that
    read it."""
    declared = [opt for cls in (classes or (ParallelConfig, StrategyOptions)) for opt in options_of(cls)]
    unplaced = sorted(o.name for o in declared if o.position is None)
    positions = sorted(o.position for o in declared if o.position is not None)
    if unplaced or positions != list(range(len(declared))):
        taken = {p for p in positions if positions.count(p) > 1}
        raise TypeError(
            "every strategy option needs its own place in the strategies' signature, option(position=N) numbering"
            f" them 0 … {len(declared) - 1}: without a position {unplaced}, positions taken twice {sorted(taken)}"
            f" (a new option takes position {len(declared) - 1 if unplaced else len(declared)})"
        )
    ordered = sorted(declared, key=lambda o: o.position)  # type: ignore[arg-type, return-value]
    return [replace(o, checks=checks_reading(o.name)) for o in ordered]


OPTIONS: tuple[Option, ...] = tuple(strategy_options())
#: The strategies' parameters in their positional order (that of 0.1.0, which ``--print_config`` shows too).
PARAMETER_ORDER: tuple[str, ...] = tuple(o.name for o in OPTIONS)


def takes_options(intro: str, extra: Sequence[Option] = ()) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Generate a strategy's ``__init__`` from the options' fields: decorate the constructor's body
    ``body(self, options, **extra)``, which receives every option's value by name (``options``, in
    ``PARAMETER_ORDER``) and ``extra``'s arguments (a strategy's own: Fabric's ``parallelize_fn``).

    The ``__init__`` made is a real function, as ``dataclasses`` makes one: every option a parameter in
    ``PARAMETER_ORDER`` (the positional order of 0.1.0) with its field's annotation and default, then ``extra``
    keyword-only; its docstring is ``intro`` and an ``Args:`` section with each option's field docstring. So
    ``inspect.signature`` (and through it LightningCLI/jsonargparse: ``--help``, ``--print_config``, recipes),
    ``help()`` and Python's own argument errors all see the options as parameters, written nowhere else.
    Static type checkers and IDEs, which do not run it, read the ``__init__`` declared in the class's
    ``if TYPE_CHECKING:`` block instead: ``init_stub``'s text, generated from the same fields
    (tests/unit/test_options.py checks both).
    """

    def generate(body: Callable[..., None]) -> Callable[..., None]:
        params = [inspect.Parameter(o.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=o.default,
                                    annotation=o.annotation) for o in OPTIONS]
        params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                                     annotation=o.annotation) for o in extra]
        signature = ", ".join(["self", *(f"{p.name}=_defaults[{i}]" for i, p in enumerate(params[:len(OPTIONS)]))])
        if extra:
            signature += ", *, " + ", ".join(f"{o.name}=_defaults[{len(OPTIONS) + i}]" for i, o in enumerate(extra))
        given = ", ".join(f"{o.name!r}: {o.name}" for o in OPTIONS)
        forwarded = "".join(f", {o.name}={o.name}" for o in extra)
        source = f"def __init__({signature}) -> None:\n    _body(self, {{{given}}}{forwarded})\n"
        namespace: dict[str, Any] = {"_body": body, "_defaults": [p.default for p in params]}
        exec(compile(source, f"<{body.__qualname__} generated by takes_options>", "exec"), namespace)  # noqa: S102
        init = namespace["__init__"]
        # Named as the method it becomes (Python's argument errors say ``ModelParallel2DBase.__init__()``).
        init.__qualname__, init.__module__ = f"{body.__qualname__.rpartition('.')[0]}.__init__", body.__module__
        init.__annotations__ = {**{p.name: p.annotation for p in params}, "return": None}
        init.__doc__ = f"{intro}\n\n{args_section([*OPTIONS, *extra])}\n"
        return init

    return generate


def option_values(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The options among a constructor's arguments, by name, in ``PARAMETER_ORDER``."""
    return {name: arguments[name] for name in PARAMETER_ORDER if name in arguments}


def split_options(arguments: Mapping[str, Any]) -> tuple[ParallelConfig, StrategyOptions]:
    """A strategy constructor's arguments (its options, by name) as its two option dataclasses; each validates its
    values."""
    given = option_values(arguments)
    # StrategyOptions first: its process-group problems are reported before the layout's, as since 0.1.0.
    strategy = StrategyOptions(**{f.name: given[f.name] for f in fields(StrategyOptions) if f.name in given})
    parallel = ParallelConfig(**{f.name: given[f.name] for f in fields(ParallelConfig) if f.name in given})
    return parallel, strategy


def options_table() -> str:
    """The "Strategy options" table of docs/strategy.md (markdown): name, default as shown, meaning."""
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{o.name}` | {o.shown_default} | {markdown(o.doc)} |" for o in OPTIONS]
    return "\n".join(rows) + "\n"


def annotation_source(name: str) -> str:
    """An option's annotation as written on its field (``Size``, ``Optional[timedelta]``), double-quoted literals."""
    for cls in (ParallelConfig, StrategyOptions):
        for f in fields(cls):
            if f.name == name:
                # The modules use ``from __future__ import annotations``: ``f.type`` is the source text.
                text = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
                return text.replace("'", '"')
    raise KeyError(name)


def default_source(value: Any) -> str:
    """A default as a stub writes it: a literal's own text, else ``...`` (e.g. a ``timedelta``)."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "..."


def init_stub(extra: Sequence[tuple[Option, str]] = (), indent: str = " " * 8) -> str:
    """The ``__init__`` declaration type checkers and IDEs read (the one ``takes_options`` generates at run time
    never is): every option in ``PARAMETER_ORDER`` with its field's annotation and default, then ``extra`` (an
    ``Option`` and its annotation's source text) keyword-only."""
    lines = ["def __init__(", "    self,"]
    lines += [f"    {o.name}: {annotation_source(o.name)} = {default_source(o.default)}," for o in OPTIONS]
    if extra:
        lines.append("    *,")
        lines += [f"    {o.name}: {text} = {default_source(o.default)}," for o, text in extra]
    lines.append(") -> None: ...")
    return "".join(f"{indent}{line}\n" for line in lines)
