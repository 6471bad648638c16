"""The pipeline schedules' facts, in one table: what every reader of a ``pipeline_schedule`` asks.

``SCHEDULES`` maps each ``pipeline_schedule`` to its ``Schedule``: torch's class (training and forward-only),
the stages a rank holds and where (a loop or a V), whether it splits each backward into an input and a weight
pass (zero bubble) and how many micro-batches it needs. The options (``ParallelConfig``: checks, defaults,
placement), the runtime (``parallel/pipeline.py``) and the planner (``tools/planner/schedules.py``) read it;
``ScheduleName`` is the option's type, and a unit test checks that it names exactly the table's schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

#: The ``pipeline_schedule`` option's type: the names of ``SCHEDULES``, in its order (a test keeps them equal).
ScheduleName = Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule of ``torch.distributed.pipelining``, as the library runs it."""

    #: The ``pipeline_schedule`` value.
    name: str
    #: Its training class in ``torch.distributed.pipelining``.
    torch_class: str
    #: The stages each rank runs: ``"single"`` (one), ``"multi"`` (several, in a loop: stage ``s`` on rank
    #: ``s % pp``) or ``"v"`` (exactly two, in a V: rank ``r`` holds stages ``r`` and ``2·pp - 1 - r``).
    stages: Literal["single", "multi", "v"]
    #: Whether each backward is split into its input-gradient and weight-gradient halves (``I`` and ``W`` actions,
    #: torch's ``stage_backward_input``/``stage_backward_weight``) to fill the bubble.
    zero_bubble: bool = False
    #: The fewest micro-batches it runs: ``"pipeline_parallel_size"``, ``"stages"`` (all of them), or ``None``.
    min_microbatches: Optional[Literal["pipeline_parallel_size", "stages"]] = None

    @property
    def placement(self) -> Literal["loop", "v"]:
        """Where the stages go (``stages_of_rank``'s ``placement``)."""
        return "v" if self.stages == "v" else "loop"

    @property
    def default_stages_per_rank(self) -> int:
        """``pipeline_stages_per_rank=None``: 1 for a one-stage schedule, else 2."""
        return 1 if self.stages == "single" else 2

    @property
    def forward_only_class(self) -> str:
        """The class of a forward-only step (every order computes the same there, and fill-drain takes any
        micro-batch count): ``ScheduleGPipe`` for one stage per rank, ``ScheduleLoopedBFS`` for a loop,
        ``VForwardOnly`` (``parallel/pipeline.py``) for a V, whose torch classes' own ``eval`` fails in torch 2.13."""
        return {"single": "ScheduleGPipe", "multi": "ScheduleLoopedBFS", "v": "VForwardOnly"}[self.stages]


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("1F1B", "Schedule1F1B", "single", min_microbatches="pipeline_parallel_size"),
        Schedule("GPipe", "ScheduleGPipe", "single"),
        Schedule("Interleaved1F1B", "ScheduleInterleaved1F1B", "multi", min_microbatches="pipeline_parallel_size"),
        Schedule("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", "multi", zero_bubble=True),
        Schedule("ZBVZeroBubble", "ScheduleZBVZeroBubble", "v", zero_bubble=True),
        Schedule("DualPipeV", "ScheduleDualPipeV", "v", zero_bubble=True, min_microbatches="stages"),
    )
}


def schedule_of(name: str) -> Optional[Schedule]:
    """The ``Schedule`` named ``name``, or ``None`` for a name that is not one (the options' check reports it)."""
    return SCHEDULES.get(name)
