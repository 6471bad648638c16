"""2D training equals single-device training: losses, initial and final weights, batches, layouts.

Real jobs: 4 CPU processes on gloo against a plain single-device ``Trainer``; 6 fp32 AdamW steps
on the ``debug`` model with uneven numbers of target tokens per sample.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights

pytestmark = pytest.mark.distributed

LAYOUTS = [(2, 2), (4, 1), (1, 4)]
LOSS_RTOL = 1e-5
#: What the layouts' jobs record beyond a multi-rank job's default (worker.fit): the tests below read both.
RECORD = {"initial_weights": True, "probe_forwards": True}


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    """The reference and the three layouts in one launch per process count (``Jobs.share``)."""
    jobs.share("parity", [jobs.reference_job(), *(jobs.layout_job(dp, tp, **RECORD) for dp, tp in LAYOUTS)])


def worst_relative_error(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference) == 6
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@pytest.mark.parametrize(("dp", "tp"), LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_losses_and_weights_match_single_device(jobs, dp, tp):
    reference, run = jobs.reference(), jobs.layout(dp, tp, **RECORD)
    ref_losses = reference.rank_output(0)["losses"]
    for rank in range(dp * tp):
        losses = run.rank_output(rank)["losses"]
        error = worst_relative_error(losses, ref_losses)
        print(f"(dp={dp}, tp={tp}) rank {rank}: worst relative loss error {error:.3e}")
        assert error <= LOSS_RTOL, (losses, ref_losses)

    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=f"final weight {name}")
    # Training moved the weights: the comparison above is not between two untouched inits.
    initial = load_weights(run, "initial")
    assert any(not torch.equal(initial[n], final[n]) for n in final)


@pytest.mark.parametrize(("dp", "tp"), LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_initial_weights_are_layout_independent(jobs, dp, tp):
    ref_initial = load_weights(jobs.reference(), "initial")
    initial = load_weights(jobs.layout(dp, tp, **RECORD), "initial")
    assert initial.keys() == ref_initial.keys()
    for name, weight in initial.items():
        assert torch.equal(weight, ref_initial[name]), f"initial {name} differs at (dp={dp}, tp={tp})"


@pytest.mark.parametrize(("dp", "tp"), LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_tensor_parallel_group_shares_batches_data_parallel_ranks_differ(jobs, dp, tp):
    run = jobs.layout(dp, tp, **RECORD)
    outputs = [run.rank_output(r) for r in range(dp * tp)]
    by_dp_rank: dict[int, list[list[str]]] = {}
    for out in outputs:
        by_dp_rank.setdefault(out["dp_rank"], []).append(out["batches"])
    assert sorted(by_dp_rank) == list(range(dp))
    for group in by_dp_rank.values():
        assert len(group) == tp and all(batches == group[0] for batches in group)
        assert len(group[0]) == 6
    firsts = [group[0] for group in by_dp_rank.values()]
    for step in range(6):
        hashes = [batches[step] for batches in firsts]
        assert len(set(hashes)) == dp, f"data-parallel ranks drew overlapping batches at step {step}"


def test_two_simulated_nodes_auto_sizes_put_tensor_parallel_inside_a_node(jobs):
    run = jobs.layout("auto", "auto", nprocs=4, num_nodes=2, save_weights=False)  # no weights read here
    outputs = [run.rank_output(r) for r in range(4)]
    # (pipeline, data_parallel_replicate, data_parallel_shard, context, tensor_parallel): plain FSDP has one replica.
    assert all(out["mesh_shape"] == [1, 1, 2, 1, 2] for out in outputs)
    # Ranks 0, 1 are node 0 and ranks 2, 3 node 1: each node is one tensor-parallel group.
    assert [(o["dp_rank"], o["tp_rank"]) for o in outputs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert worst_relative_error(outputs[0]["losses"], jobs.reference().rank_output(0)["losses"]) <= LOSS_RTOL


def test_plan_structure_at_2x2(jobs):
    """Which parameters are DTensors with which placements on which mesh dims (Llama plan + FSDP2)."""
    placements = jobs.layout(2, 2, **RECORD).rank_output(0)["placements"]
    strided = ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]  # FSDP shard of a TP dim-0 shard
    expected = {
        "tok_embeddings.weight": (strided, [256 // 4, 128]),  # vocabulary-sharded embedding
        "output.weight": (strided, [256 // 4, 128]),  # column-wise: vocabulary-sharded logits
        "norm.weight": (["Shard(dim=0)", "Replicate()"], [64]),  # sequence-parallel norm: replicated over TP
    }
    for i in range(4):
        for name in ("attention.wq", "feed_forward.w1", "feed_forward.w3"):
            rows = 128 if "attention" in name else 352
            expected[f"layers.{i}.{name}.weight"] = (strided, [rows // 4, 128])
        for name in ("attention.wk", "attention.wv"):
            expected[f"layers.{i}.{name}.weight"] = (strided, [64 // 4, 128])  # 4 kv heads of 16
        expected[f"layers.{i}.attention.wo.weight"] = (["Shard(dim=0)", "Shard(dim=1)"], [64, 64])
        expected[f"layers.{i}.feed_forward.w2.weight"] = (["Shard(dim=0)", "Shard(dim=1)"], [64, 176])
        for name in ("attention_norm", "ffn_norm"):
            expected[f"layers.{i}.{name}.weight"] = (["Shard(dim=0)", "Replicate()"], [64])
    assert placements.keys() == expected.keys()
    for name, (want_placements, want_local) in expected.items():
        got = placements[name]
        assert got["mesh_dims"] == ["data_parallel", "tensor_parallel"], name
        assert got["placements"] == want_placements, name
        assert got["local_shape"] == want_local, name


@pytest.mark.parametrize(("dp", "tp"), LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_fsdp_units_and_what_stays_gathered_after_forward(jobs, dp, tp):
    """torchtitan's units: the embedding, each block, [norm, output] together, and an empty root. Under
    the default policy only the output unit and the last block (what backward needs first) stay gathered."""
    out = jobs.layout(dp, tp, **RECORD).rank_output(0)
    assert out["fsdp_units"] == ["", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output", "tok_embeddings"]
    last_block = sorted(name for name in out["placements"] if name.startswith("layers.3."))
    assert len(last_block) == 9  # its 7 projections and 2 norms
    assert out["gathered_after_forward"] == sorted([*last_block, "norm.weight", "output.weight"])
    # The fused loss runs vocabulary-parallel on the output's shards when tensor parallel.
    assert out["head_loss_fn"] == ("vocab_parallel_linear_cross_entropy" if tp > 1 else "linear_cross_entropy")
    # So do each token's log-probabilities (preference tuning's), equal to log_softmax of the gathered logits.
    assert out["head_log_probs_fn"] == ("vocab_parallel_linear_log_probs" if tp > 1 else "linear_log_probs")
    assert out["log_probs_error"] <= 1e-5


def test_indivisible_sequence_is_refused_before_any_collective(jobs):
    out = jobs.layout(1, 4, **RECORD).rank_output(0)
    for key in ("bad_seq_len_error", "bad_seq_len_error_kw"):  # positional and keyword input
        message = out[key]
        assert message is not None and "Input sequence length 13 is not divisible by tensor_parallel_size (4)" in message


@pytest.mark.parametrize(("dp", "tp"), LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_tensor_parallel_gradient_sums_run_once_per_step_in_one_bucket(jobs, dp, tp):
    """The sequence-parallel norms' partial gradients (DTensor ``Partial()`` over the tensor ranks) are not
    all-reduced one by one: they wait for the step's end and go in one bucketed all-reduce (``parallel.grad_sync``),
    one per optimizer step, none left pending; the losses and weights above equal one device's with it."""
    deferred = jobs.layout(dp, tp, **RECORD).rank_output(0)["deferred_reductions"]
    if tp == 1:  # nothing is replicated over tensor ranks: nothing deferred, nothing reduced
        assert deferred["deferred"] == [] and deferred["reductions"] == 0
        return
    norms = ["norm.weight"] + [f"layers.{i}.{n}.weight" for i in range(4) for n in ("attention_norm", "ffn_norm")]
    assert deferred["deferred"] == sorted(norms)
    assert deferred["reductions"] == 6 and deferred["pending"] == 0
