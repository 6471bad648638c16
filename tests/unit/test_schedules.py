"""The pipeline schedules' facts live in one table (``lightning_2d.parallel.schedules.SCHEDULES``): the option's
type names exactly its schedules, and what the options, the runtime and the planner derive agrees with it."""

from __future__ import annotations

import typing

import pytest

from lightning_2d.parallel.config import PIPELINE_SCHEDULES, ZERO_BUBBLE_SCHEDULES, ParallelConfig
from lightning_2d.parallel.schedules import SCHEDULES, ScheduleName


def test_the_option_s_type_names_the_table_s_schedules():
    assert typing.get_args(ScheduleName) == tuple(SCHEDULES)
    assert typing.get_type_hints(ParallelConfig)["pipeline_schedule"] is ScheduleName
    assert PIPELINE_SCHEDULES == {name: s.stages for name, s in SCHEDULES.items()}
    assert ZERO_BUBBLE_SCHEDULES == ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_schedule_s_facts_reach_the_options_and_the_torch_class(name):
    from torch.distributed import pipelining

    facts = SCHEDULES[name]
    assert getattr(pipelining, facts.torch_class).__name__ == facts.torch_class
    config = ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=name, pipeline_microbatches=4)
    assert config.pipeline_placement == ("v" if facts.stages == "v" else "loop")
    assert config.stages_per_rank == (1 if facts.stages == "single" else 2)
    assert config.zero_bubble == facts.zero_bubble
    with pytest.raises(ValueError, match=r"pipeline_schedule='x' is not a schedule; choose one of '1F1B', 'GPipe'"):
        ParallelConfig(pipeline_schedule="x")
