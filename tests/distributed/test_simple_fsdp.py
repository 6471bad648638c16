"""``fsdp_backend="simple_fsdp"``: SimpleFSDP trains as one device does, on FSDP2's parameter layout.

Real jobs: 4 CPU processes on gloo against the single-device reference (6 fp32 AdamW steps on the ``debug`` model),
one shared launch per process count. Beyond the losses and weights, each test asserts that SimpleFSDP ran: no FSDP2
unit anywhere, every parameter-holding module gathering, and the parameters laid out as ``fully_shard`` lays them
(compared with the FSDP2 job of the same layout in the same launch).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

SIMPLE = {"fsdp_backend": "simple_fsdp"}
#: (dp, tp, options): FSDP × TP with sequence parallelism, FSDP alone, and HSDP (2 replicas × 2 shards).
LAYOUTS = {
    "dp2xtp2": (2, 2, {}),
    "dp4": (4, 1, {}),
    "hsdp2x2": (4, 1, {"data_parallel_replicate_size": 2}),
}


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    jobs.share("simple_fsdp", [
        jobs.reference_job(),
        *(jobs.layout_job(dp, tp, **SIMPLE, **extra) for dp, tp, extra in LAYOUTS.values()),
        jobs.layout_job(2, 2),  # FSDP2 at the same layout: the placements to match
    ])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_simple_fsdp_losses_and_weights_match_single_device(jobs, name):
    dp, tp, extra = LAYOUTS[name]
    reference, run = jobs.reference(), jobs.layout(dp, tp, **SIMPLE, **extra)
    ref_losses = reference.rank_output(0)["losses"]
    for rank in range(4):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], ref_losses)
        print(f"simple_fsdp {name} rank {rank}: worst relative loss error {error:.3e}")
        assert error <= LOSS_RTOL, (out["losses"], ref_losses)
        # SimpleFSDP ran, not FSDP2: no unit, and every module holding parameters gathers them.
        assert out["data_parallel_modules"]["fully_shard"] == 0
        assert out["data_parallel_modules"]["simple_fsdp"] > 0
    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    assert final.keys() == ref_final.keys()
    for weight_name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[weight_name], rtol=1e-5, atol=1e-5, msg=weight_name)


def test_simple_fsdp_lays_the_parameters_out_as_fully_shard(jobs):
    """Same placements, meshes, local shapes and dtypes as FSDP2 on every rank (``_StridedShard`` where tensor
    parallelism shards dim 0 too): what makes their checkpoints interchangeable."""
    simple, fsdp2 = jobs.layout(2, 2, **SIMPLE), jobs.layout(2, 2)
    for rank in range(4):
        ours, theirs = simple.rank_output(rank), fsdp2.rank_output(rank)
        assert ours["placements"] == theirs["placements"], rank
        assert theirs["data_parallel_modules"]["simple_fsdp"] == 0 and theirs["data_parallel_modules"]["fully_shard"]
    assert any("_StridedShard" in p["placements"][0] for p in ours["placements"].values())
    hsdp = jobs.layout(4, 1, **SIMPLE, data_parallel_replicate_size=2).rank_output(0)["placements"]
    assert {tuple(p["placements"]) for p in hsdp.values()} == {("Replicate()", "Shard(dim=0)")}
