"""Expert parallelism's token exchange (``lightning_2d.parallel.expert``) on 4 CPU processes over gloo, in one
launch: expert-parallel groups of 2 (two groups, as EP 2 × DP 2) and of 4, each also with one rank whose experts
receive no token. Each rank's ``MoE`` holds only its experts and must compute what the whole layer computes on one
process for the tokens of its group: outputs, input gradients, its experts' gradients, the router's gradient (summed
over the group); dropless (every assignment computed)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

CASES = [{"ep": 2, "idle": False}, {"ep": 2, "idle": True}, {"ep": 4, "idle": False}, {"ep": 4, "idle": True}]
TOLERANCE = 1e-5  # fp32; the exchange changes no arithmetic, only where the grouped product runs


@pytest.fixture(scope="module")
def exchange(jobs):
    return jobs.run("expert_exchange", "expert_exchange", {"cases": CASES}, nprocs=4)


@pytest.mark.parametrize("case", ["ep2", "ep2_idle", "ep4", "ep4_idle"])
def test_experts_split_over_ranks_compute_the_whole_layer(exchange, case):
    for rank in range(4):
        out = exchange.rank_output(rank)[case]
        print(f"{case} rank {rank}: {out}")
        for what in ("output", "input_grad", "expert_grads", "router_grad"):
            assert out[what] <= TOLERANCE * max(1.0, out["output_scale"]), (case, rank, what, out)
        assert out["assignments"] == out["group_tokens"] * 2  # dropless: tokens × top_k
    ep = int(case[2])
    last = [ep - 1 + start for start in range(0, 4, ep)]  # each group's last rank
    for rank in range(4):  # an idle rank's experts got no token, so no gradient; every other rank's did
        expected = 0 if case.endswith("idle") and rank in last else 1
        assert exchange.rank_output(rank)[case]["received"] == expected, (case, rank)
