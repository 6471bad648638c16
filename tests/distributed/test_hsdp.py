"""HSDP: FSDP shards inside replica groups, gradients all-reduced across them — equal to single device.

Real jobs: 4 CPU processes on gloo, the parity setup of test_parity.py (6 fp32 AdamW steps on the
``debug`` model, uneven target tokens per sample) at (replicate, shard, tp) = (2, 2, 1) and (2, 1, 2).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

# (data_parallel_size = replicate × shard, tensor_parallel_size, replicate)
LAYOUTS = [(4, 1, 2), (2, 2, 2)]
IDS = ["2x2x1", "2x1x2"]


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    """The two HSDP layouts (and the reference, unless an earlier module ran it) in one launch per process count."""
    jobs.share("hsdp", [jobs.reference_job(), *(jobs.layout_job(dp, tp, **hsdp_options(replicate))
                                                for dp, tp, replicate in LAYOUTS)])


def hsdp_options(replicate: int) -> dict:
    """The HSDP option, and the initial weights recorded (read below; a multi-rank job records none by default)."""
    return {"data_parallel_replicate_size": replicate, "initial_weights": True}


def hsdp(jobs, dp: int, tp: int, replicate: int):
    return jobs.layout(dp, tp, **hsdp_options(replicate))


@pytest.mark.parametrize(("dp", "tp", "replicate"), LAYOUTS, ids=IDS)
def test_hsdp_losses_and_weights_match_single_device(jobs, dp, tp, replicate):
    reference, run = jobs.reference(), hsdp(jobs, dp, tp, replicate)
    ref_losses = reference.rank_output(0)["losses"]
    for rank in range(dp * tp):
        error = worst_relative_error(run.rank_output(rank)["losses"], ref_losses)
        print(f"HSDP (replicate={replicate}, shard={dp // replicate}, tp={tp}) rank {rank}: worst relative loss error {error:.3e}")
        assert error <= LOSS_RTOL
    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=f"final weight {name}")
    initial = load_weights(run, "initial")
    assert all(torch.equal(initial[n], w) for n, w in load_weights(reference, "initial").items())
    assert any(not torch.equal(initial[n], final[n]) for n in final)


@pytest.mark.parametrize(("dp", "tp", "replicate"), LAYOUTS, ids=IDS)
def test_hsdp_mesh_ranks_and_batches(jobs, dp, tp, replicate):
    """Rank r sits at (r // (shard·tp), (r // tp) % shard, r % tp); every data-parallel rank (replica ×
    shard) draws its own batches, the ranks of a tensor-parallel group the same ones."""
    shard = dp // replicate
    outputs = [hsdp(jobs, dp, tp, replicate).rank_output(r) for r in range(dp * tp)]
    for rank, out in enumerate(outputs):
        # Every dimension is in the mesh (ParallelMeshes): the pipeline and context ones of size 1 here.
        assert out["mesh_dims"] == ["pipeline_parallel", "data_parallel_replicate", "data_parallel_shard",
                                    "context_parallel", "tensor_parallel"]
        assert out["mesh_shape"] == [1, replicate, shard, 1, tp]
        assert (out["replica_rank"], out["shard_rank"], out["tp_rank"]) == (rank // (shard * tp), (rank // tp) % shard, rank % tp)
        assert out["dp_rank"] == out["replica_rank"] * shard + out["shard_rank"]  # the flattened data_parallel dim
    by_dp_rank: dict[int, list] = {}
    for out in outputs:
        by_dp_rank.setdefault(out["dp_rank"], []).append(out["batches"])
    assert sorted(by_dp_rank) == list(range(dp))
    assert all(all(b == group[0] for b in group) for group in by_dp_rank.values())
    firsts = [group[0] for group in by_dp_rank.values()]
    assert all(len({batches[step] for batches in firsts}) == dp for step in range(6))


@pytest.mark.parametrize(("dp", "tp", "replicate"), LAYOUTS, ids=IDS)
def test_hsdp_parameters_are_sharded_within_a_replica_and_replicated_across(jobs, dp, tp, replicate):
    shard = dp // replicate
    placements = hsdp(jobs, dp, tp, replicate).rank_output(0)["placements"]
    wq, norm, wo = (placements[n] for n in ("layers.0.attention.wq.weight", "norm.weight", "layers.0.attention.wo.weight"))
    dims = ["data_parallel_replicate", "data_parallel_shard", "tensor_parallel"]
    if tp == 1:
        # No tensor parallelism: the parameters live on the (replicate, shard) mesh.
        assert wq["mesh_dims"] == dims[:2] and wq["placements"] == ["Replicate()", "Shard(dim=0)"]
        assert wq["local_shape"] == [128 // shard, 128]
        assert norm["placements"] == ["Replicate()", "Shard(dim=0)"] and norm["local_shape"] == [128 // shard]
    else:
        assert wq["mesh_dims"] == dims
        assert wq["placements"][0] == "Replicate()" and wq["local_shape"] == [128 // (shard * tp), 128]
        assert wo["placements"] == ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"]
        assert wo["local_shape"] == [128 // shard, 128 // tp]
        assert norm["placements"] == ["Replicate()", "Shard(dim=0)", "Replicate()"]
