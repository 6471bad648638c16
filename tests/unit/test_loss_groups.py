"""The loss is normalized over the data-parallel ranks of the mesh: the ranks holding different sequences (with
context parallelism, different tokens), not the tensor- or pipeline-parallel ranks that share them."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.loss import data_context_group
from lightning_2d.tools.planner.world import fake_world


@pytest.mark.parametrize("dims, members", [
    (ParallelDims(dp_replicate=1, dp_shard=2, tp=2), [1, 3]),                       # rank 1: tp rank 1 of replicas 0 and 1
    (ParallelDims(dp_replicate=2, dp_shard=2, tp=2), [1, 3, 5, 7]),  # HSDP: replicas × shards
    (ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2), [1, 3]),                 # pipeline rank 0's data-parallel ranks
    (ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1), [0, 1, 2, 3]),           # context ranks hold different tokens
])
def test_the_loss_group_is_the_data_parallel_one(dims, members):
    rank = 1
    with fake_world(dims.world_size, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        group = data_context_group(dims.build_mesh("cpu"))
        assert dist.get_process_group_ranks(group) == members
