"""The strategies' options, each written once: ``ParallelConfig``'s fields (the parallel layout) and
``StrategyOptions``' (the plan, the seed, checkpoints, the process group and the watchdog).

The Trainer and Fabric strategies' constructors list every option as a parameter, its default read from the
field (``compile: bool = ParallelConfig.compile``), so that IDEs and type checkers see the real signature;
tests/unit/test_options.py checks that each parameter agrees with its field. From the fields come the
constructors' docstring (``takes_options``; what LightningCLI/jsonargparse shows for ``--help``), the split of
a call's arguments into the two dataclasses (``split_options``), and the README's "Strategy options" table
(``lightning_2d.tools.options_table``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_2d.parallel.config import LAYOUT_CHECKS, ParallelConfig, ParallelPlan, raise_if_problems
from lightning_2d.parallel.options import Option, args_section, documented, markdown, option, options_of
from lightning_2d.parallel.watchdog import DEFAULT_WATCHDOG_TIMEOUT

#: Backends ``torch.distributed`` ships; a ``"cpu:gloo,cuda:nccl"`` style mapping is accepted too.
PROCESS_GROUP_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")
#: The shortest ``watchdog_timeout`` accepted.
MIN_WATCHDOG_TIMEOUT_S = 5
PROCESS_GROUP_CHECKS = "lightning_2d.integration.options.process_group_problems"

Init = TypeVar("Init", bound=Callable[..., None])


@documented
@dataclass
class StrategyOptions:
    """The strategies' options that are not the parallel layout's (those are ``ParallelConfig``'s).

    Each field's docstring is the option's documentation everywhere, as for ``ParallelConfig``.
    """

    plan: Optional[ParallelPlan] = option(None, checks=(LAYOUT_CHECKS,), shown="from the module")
    """Module names to parallelize (a ``ParallelPlan``), for a model that does not provide
    ``parallel_plan(config)``; ``None``: the LightningModule's (or the model's) plan."""
    init_seed: Optional[int] = None
    """Seed of the layout-independent initialization of a meta-device model; ``None``: the
    model's/LightningModule's ``init_seed`` attribute if it has one, else the run's seed (``seed_everything``)
    broadcast from rank 0."""
    save_distributed_checkpoint: bool = True
    """Save one shard per rank (``True``: DCP, resumable at any layout) or a single full file assembled on
    rank 0."""
    async_checkpoint: bool = False
    """Write sharded checkpoints in a background thread after copying them to CPU memory, so training
    continues during the write."""
    process_group_backend: Optional[str] = option(None, checks=(PROCESS_GROUP_CHECKS,))
    """``"nccl"``, ``"gloo"`` (or a mapping such as ``"cpu:gloo,cuda:nccl"``); ``None``: the device's
    default."""
    timeout: Optional[timedelta] = option(default_pg_timeout, checks=(PROCESS_GROUP_CHECKS,))
    """How long a rank waits in a collective for a stalled peer before it fails: a ``datetime.timedelta`` set
    on every process group the strategy creates (the mesh's data- and tensor-parallel groups included)."""
    watchdog_timeout: Optional[timedelta] = option(DEFAULT_WATCHDOG_TIMEOUT, checks=(PROCESS_GROUP_CHECKS,))
    """The failure watchdog's bound (``lightning_2d.parallel.watchdog``): a rank whose process died ends the
    job within seconds; one silent (stopped, dead on another host) or stuck (alive, not starting the step the
    others started) for this long is named, every rank exiting with code 75; an exception on one rank ends the
    others within seconds. The shorter of this and ``timeout`` bounds the job (+ a few seconds): ``timeout`` is
    never extended. ``None`` turns the watchdog off."""

    def __post_init__(self) -> None:
        # A typo fails at construction, with every problem listed.
        raise_if_problems(process_group_problems(self.process_group_backend, self.timeout, self.watchdog_timeout))


def process_group_problems(backend: Any, timeout: Any, watchdog_timeout: Any = None) -> list[str]:
    """Problems with ``process_group_backend``/``timeout``/``watchdog_timeout``, found at construction
    instead of at spawn."""
    problems = []
    if backend is not None:
        parts = [p.split(":")[-1] for p in backend.split(",")] if isinstance(backend, str) else [backend]
        if not isinstance(backend, str) or any(p not in PROCESS_GROUP_BACKENDS for p in parts):
            problems.append(
                f"process_group_backend={backend!r} is not a torch.distributed backend; use one of"
                f" {', '.join(repr(b) for b in PROCESS_GROUP_BACKENDS)} (or 'cpu:gloo,cuda:nccl'), or None for the"
                " device's default"
            )
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


#: The strategies' parameters in their positional order (that of 0.1.0, which ``--print_config`` shows too):
#: every field of ``ParallelConfig`` and ``StrategyOptions`` once; a new option is placed here by hand, and as a
#: parameter at the same place in both strategies' ``__init__`` (``ModelParallel2DBase``'s and Fabric's).
PARAMETER_ORDER = (
    "data_parallel_size", "tensor_parallel_size", "data_parallel_replicate_size",
    "pipeline_parallel_size", "pipeline_schedule", "pipeline_microbatches", "pipeline_stages_per_rank",
    "pipeline_layers_per_stage",
    "sequence_parallel", "loss_parallel", "activation_checkpointing", "selective_ac_option", "compile",
    "param_dtype", "reduce_dtype", "reshard_after_forward", "reduce_every_micro_batch",
    "float8", "float8_recipe", "fsdp_float8_all_gather", "async_tensor_parallel",
    "plan", "init_seed", "save_distributed_checkpoint", "async_checkpoint", "non_finite",
    "process_group_backend", "timeout", "watchdog_timeout",
    "context_parallel_size",  # last: a new option must not shift the positions of the others
)


def strategy_options() -> list[Option]:
    """Every option of the strategies, in ``PARAMETER_ORDER``."""
    declared = {opt.name: opt for cls in (ParallelConfig, StrategyOptions) for opt in options_of(cls)}
    missing, unknown = sorted(set(declared) - set(PARAMETER_ORDER)), sorted(set(PARAMETER_ORDER) - set(declared))
    if missing or unknown or len(PARAMETER_ORDER) != len(set(PARAMETER_ORDER)):
        raise TypeError(
            f"PARAMETER_ORDER in {__name__} must list every option of ParallelConfig and StrategyOptions once:"
            f" missing {missing}, not an option {unknown}"
        )
    return [declared[name] for name in PARAMETER_ORDER]


OPTIONS: tuple[Option, ...] = tuple(strategy_options())


def takes_options(intro: str, extra: Sequence[Option] = ()) -> Callable[[Init], Init]:
    """Decorate a strategy's ``__init__``, written with every option as a parameter: its docstring becomes
    ``intro`` and an ``Args:`` section with each option's field docstring, then ``extra``'s (a strategy's own
    arguments: Fabric's ``parallelize_fn``), which is what ``help()`` and jsonargparse's ``--help`` show.

    The signature is the function's own (no ``__signature__``), so IDEs and type checkers see the same one as
    ``inspect`` and jsonargparse; tests/unit/test_options.py checks that it agrees with the fields.
    """

    def document(init: Init) -> Init:
        init.__doc__ = f"{intro}\n\n{args_section([*OPTIONS, *extra])}\n"
        return init

    return document


def option_values(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The options among a constructor's arguments (its ``locals()``), by name, in ``PARAMETER_ORDER``."""
    return {name: arguments[name] for name in PARAMETER_ORDER if name in arguments}


def split_options(arguments: Mapping[str, Any]) -> tuple[ParallelConfig, StrategyOptions]:
    """A strategy constructor's arguments (its ``locals()``) as its two option dataclasses; each validates its
    values."""
    given = option_values(arguments)
    # StrategyOptions first: its process-group problems are reported before the layout's, as since 0.1.0.
    strategy = StrategyOptions(**{f.name: given[f.name] for f in fields(StrategyOptions) if f.name in given})
    parallel = ParallelConfig(**{f.name: given[f.name] for f in fields(ParallelConfig) if f.name in given})
    return parallel, strategy


def options_table() -> str:
    """The README's "Strategy options" table (markdown): name, default as shown, meaning."""
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{o.name}` | {o.shown_default} | {markdown(o.doc)} |" for o in OPTIONS]
    return "\n".join(rows) + "\n"
