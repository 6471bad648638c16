"""A NaN on one rank is caught on every rank before it reaches a weight: stopped, or skipped everywhere."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.conftest import PARITY, load_weights

pytestmark = pytest.mark.distributed

LAYOUT = {**PARITY, "strategy": "2d", "dp": 2, "tp": 2, "data_replicas": 2}


def test_a_nan_gradient_on_one_rank_is_skipped_on_every_rank(jobs):
    """Rank 1's local gradient shard, after the reduce-scatter (no other rank sees it), gets a NaN at
    step 3. Under non_finite='skip' every rank drops the step: the weights after step 3 are bit-equal
    to those after step 2, the run goes on and ends finite."""
    config = {**LAYOUT, "non_finite": "skip", "weights_at_steps": [2, 3], "timeout_s": 45,
              "inject_nan": {"step": 3, "rank": 1, "where": "grad"}}
    result = jobs.run("nan_grad_skip", "fit", config)
    before, after = load_weights(result, "weights_step2"), load_weights(result, "weights_step3")
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    final = load_weights(result, "final")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert any(not torch.equal(final[n], before[n]) for n in before)  # steps 4-6 trained
    reference = jobs.reference().rank_output(0)["losses"]
    for rank in range(4):
        losses = result.rank_output(rank)["losses"]
        assert all(math.isfinite(x) for x in losses)
        assert max(abs(a - b) / abs(b) for a, b in zip(losses[:3], reference[:3])) <= 1e-5  # up to step 3
    assert "Step 3 skipped on every rank (non-finite gradients on rank(s) [1])" in result.logs[0]


def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_update(jobs):
    """Rank 1's loss is NaN at step 3 (non_finite='raise', the default). The launcher kills no rank
    (``kill_on_failure=False``): every rank must stop by itself, with the error naming the step and rank 1,
    and its own shards of the weights as they were after step 2 (each rank writes them, no collective)."""
    config = {**LAYOUT, "inject_nan": {"step": 3, "rank": 1, "where": "loss"},
              "local_weights_at_steps": [2], "local_weights_on_exception": True}
    result = jobs.run("nan_loss_raise", "fit", config, expect_ok=False, kill_on_failure=False)
    assert not result.ok and not result.timed_out
    log = result.logs[result.failed_rank()]
    assert "NonFiniteStepError: Step 3 stopped before the update (non-finite loss on rank(s) [1]" in log
    assert "no weight was changed" in log
    # Each rank raised the error itself (exit 1), none was ended by another rank's failure (75) or killed.
    assert result.returncodes == [1, 1, 1, 1], result.describe()
    for rank in range(4):
        own = result.logs[rank]
        assert "NonFiniteStepError: Step 3 stopped before the update (non-finite loss on rank(s) [1]" in own, rank
        assert "every rank checked, no weight was changed." in own, result.describe([rank])
        stopped = torch.load(result.out_dir / f"local_rank{rank}_exception.pt")
        after_step_2 = torch.load(result.out_dir / f"local_rank{rank}_step2.pt")
        assert (stopped["step"], stopped["error"]) == (2, "NonFiniteStepError")
        assert stopped["weights"].keys() == after_step_2.keys() and after_step_2
        for name, value in after_step_2.items():
            assert torch.equal(stopped["weights"][name], value), (rank, name)  # bit-equal: no update ran


def test_the_timeout_reaches_every_process_group_of_the_mesh(jobs):
    """init_device_mesh gives its groups the backend's default (30 minutes for gloo): a rank stuck in a
    tensor- or data-parallel collective waited that long whatever `timeout` said. Now every group has it."""
    config = {**LAYOUT, "non_finite": "skip", "weights_at_steps": [2, 3], "timeout_s": 45,
              "inject_nan": {"step": 3, "rank": 1, "where": "grad"}}
    result = jobs.run("nan_grad_skip", "fit", config)  # the same launch as above
    for rank in range(4):
        timeouts = result.rank_output(rank)["group_timeouts"]
        # Every named mesh (the root's size-1 pipeline and context dimensions, the flattened ones, the expert meshes,
        # which always exist: aliases at expert parallel size 1) has it.
        assert timeouts == dict.fromkeys(
            ["pipeline_parallel", "data_parallel_replicate", "data_parallel_shard", "context_parallel",
             "tensor_parallel", "data_parallel", "data_context_parallel", "data_shard_context_parallel",
             "expert_parallel", "expert_data_replicate", "expert_data_shard", "expert_tokens"], "0:00:45"
        ), (rank, timeouts)
