"""``fsdp_backend="simple_fsdp"``: SimpleFSDP trains as one device does, on FSDP2's parameter layout.

Real jobs: 4 CPU processes on gloo against the single-device reference (6 fp32 AdamW steps on the ``debug`` model,
gradients clipped), one shared launch per process count. Beyond the losses and weights, each layout's gradient norm
of every step is the reference's: AdamW's update barely changes when a gradient is off by a constant factor (only its
epsilon tells, on near-zero gradients), the norms show the factor itself, and the clipping makes them decide each
update's size. Each test asserts that SimpleFSDP ran: no FSDP2 unit anywhere, every parameter-holding module
gathering, and the parameters laid out as ``fully_shard`` lays them (compared with the FSDP2 job of the same layout in
the same launch). bf16-mixed at 2×2 trains as ``fully_shard`` does at the same precision.
"""

from __future__ import annotations

import pytest
import torch

from lightning_2d.parallel.schedules import SCHEDULES
from tests.distributed.conftest import SMALL, load_weights
from tests.distributed.test_options import BF16_MIXED, CLIP, FLOAT8_SINGLE
from tests.distributed.test_parity import LOSS_RTOL, RECORD, worst_relative_error

pytestmark = pytest.mark.distributed

SIMPLE = {"fsdp_backend": "simple_fsdp"}
#: (dp, tp, options, the reference's options): FSDP × TP with sequence parallelism, tensor parallelism alone (FSDP
#: over 1 rank), HSDP (2 replicas × 2 shards; its collectives counted in step 1), FSDP with full activation
#: checkpointing (counted too), context parallel × FSDP with packed documents, and FSDP × TP with gradient
#: accumulation. Every job clips its gradients and records their norms (below). All but FSDP × TP (whose placements
#: are test_parity.py's FSDP2 job's, 4 blocks) train 2 of the debug model's blocks (``SMALL``), as their references.
LAYOUTS = {
    "dp2xtp2": (2, 2, {"count_collectives": 1}, {}),
    "tp4": (1, 4, {**SMALL}, {**SMALL}),
    "hsdp2x2": (4, 1, {"data_parallel_replicate_size": 2, "count_collectives": 1, **SMALL}, {**SMALL}),
    "dp4_ac_full": (4, 1, {"activation_checkpointing": "full", "count_collectives": 1, **SMALL}, {**SMALL}),
    "dp4_ac_selective_op": (4, 1, {"activation_checkpointing": "selective", "selective_ac_option": "op",
                                   "count_collectives": 1, **SMALL}, {**SMALL}),
    "cp2xdp2_documents": (2, 1, {"context_parallel_size": 2, "documents": True, **SMALL},
                          {"documents": True, **SMALL}),
    "dp2xtp2_accumulate": (2, 2, {"even_labels": True, "accumulate": 2, **SMALL}, {"even_labels": True, **SMALL}),
}
#: The blocks of the 2-block jobs.
BLOCKS = SMALL["blocks"]
# Pipeline 2 × data 2 under every schedule: each stage's parameters gathered where used, each micro-batch's backward
# reducing (under the zero-bubble ones in the weight pass, torch's stage_backward_weight). DualPipeV needs 4
# micro-batches of a sequence: a global batch of 8 (its own reference).
LAYOUTS.update({
    f"pp2xdp2_{schedule}": (2, 1, {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, **batch}, batch)
    for schedule in SCHEDULES for batch in [{"global_batch": 8} if schedule == "DualPipeV" else {}]
})
#: Every layout and its reference clip the gradients (test_options.py's threshold: its clipped reference is the
#: plain layouts' too, cached when the whole suite runs), every layout records the norms.
LAYOUTS = {name: (dp, tp, {**extra, "gradient_clip_val": CLIP, "grad_norms": True}, {**ref, "gradient_clip_val": CLIP})
           for name, (dp, tp, extra, ref) in LAYOUTS.items()}
#: A NaN in rank 1's gradient shard at step 3 under non_finite="skip" (test_non_finite.py's FSDP2 job).
NAN_SKIP = {"non_finite": "skip", "weights_at_steps": [2, 3], "inject_nan": {"step": 3, "rank": 1, "where": "grad"},
            **SMALL}
#: Emulated float8 at 2x2 (the float8 TP styles, each weight cast after its gather), against the same conversion on
#: one process (test_options.py's job, cached when the whole suite runs).
FLOAT8 = {"float8": "emulate", "sequence_parallel": False, **SMALL}
#: FSDP2 at 2x2, as test_parity records it (the same job, so launched once per session): the placements to match.
FSDP2 = (2, 2, RECORD)
#: bf16-mixed at 2x2, clipped, gradient norms recorded, the rotary table rounded to bf16 values, 2 blocks; sequence
#: parallelism off: the norms then see whole sequences on every tensor rank, and no gradient is a partial sum over the
#: tensor ranks, which FSDP2 sums in fp32 after its reduce-scatter (``parallel.grad_sync``) and SimpleFSDP in bf16
#: before it (DTensor's redistribute of the bf16 gradient). With sequence parallelism the two drift apart by that
#: alone (measured: losses 2.9e-5, gradient norms 1.9e-5 over 6 steps), which would hide what the test looks for.
BF16 = {**BF16_MIXED, "sequence_parallel": False}


def run_of(jobs, name):
    dp, tp, extra, _ = LAYOUTS[name]
    return jobs.layout(dp, tp, nprocs=4, **SIMPLE, **extra)


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    references = {tuple(sorted(ref.items())) for *_, ref in LAYOUTS.values()}
    jobs.share("simple_fsdp", [
        *(jobs.reference_job(**dict(ref)) for ref in sorted(references)),
        *(jobs.layout_job(dp, tp, nprocs=4, **SIMPLE, **extra) for dp, tp, extra, _ in LAYOUTS.values()),
        jobs.layout_job(FSDP2[0], FSDP2[1], **FSDP2[2]),
        jobs.layout_job(1, 1, **FLOAT8_SINGLE), jobs.layout_job(2, 2, **SIMPLE, **FLOAT8),
        jobs.layout_job(2, 2, **SIMPLE, **NAN_SKIP),
        jobs.layout_job(2, 2, **BF16), jobs.layout_job(2, 2, **SIMPLE, **BF16),
    ])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_simple_fsdp_losses_and_weights_match_single_device(jobs, name):
    *_, ref_options = LAYOUTS[name]
    reference, run = jobs.reference(**ref_options), run_of(jobs, name)
    ref_out = reference.rank_output(0)
    ref_losses, ref_norms = ref_out["losses"], ref_out["grad_norms"]
    assert min(ref_norms) > CLIP  # every step clipped: the norm decides the update's size
    accumulate = LAYOUTS[name][2].get("accumulate", 1)
    for rank in range(4):
        out = run.rank_output(rank)
        losses = out["losses"]
        if name.endswith("accumulate"):  # each step's two micro-batch means average to the double batch's
            losses = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
        error = worst_relative_error(losses, ref_losses)
        # Under pipeline parallelism the norm over every stage's gradients.
        norm_error = worst_relative_error(out["grad_norms"], ref_norms)
        print(f"simple_fsdp {name} rank {rank}: worst relative loss error {error:.3e}, gradient norm {norm_error:.3e}")
        assert error <= LOSS_RTOL, (losses, ref_losses)
        assert norm_error <= LOSS_RTOL, (out["grad_norms"], ref_norms)
        if not name.startswith("pp"):  # (a pipeline's step zeroes the gradients it used)
            stepped = out["stepped_grad_norms"][accumulate - 1::accumulate]  # after the micro-batch that stepped
            assert stepped == pytest.approx([CLIP] * 6, rel=1e-5)  # clipped on every rank
        # SimpleFSDP ran, not FSDP2: no unit, and every module holding parameters gathers them.
        assert out["data_parallel_modules"]["fully_shard"] == 0
        assert out["data_parallel_modules"]["simple_fsdp"] > 0
    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    assert final.keys() == ref_final.keys()
    # Two micro-batches sum their gradients in another order than the double batch: the losses and norms agree to
    # 1e-7, but AdamW's normalized update of an element whose gradient is near zero amplifies that (measured
    # 1.06e-5 on one element of 1.2e-3 after 6 steps; FSDP2's accumulation job is not compared on weights at all).
    atol = 5e-5 if name.endswith("accumulate") else 1e-5
    for weight_name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[weight_name], rtol=1e-5, atol=atol, msg=weight_name)


def test_simple_fsdp_lays_the_parameters_out_as_fully_shard(jobs):
    """Same placements, meshes, local shapes and dtypes as FSDP2 on every rank (``_StridedShard`` where tensor
    parallelism shards dim 0 too): what makes their checkpoints interchangeable."""
    simple, fsdp2 = run_of(jobs, "dp2xtp2"), jobs.layout(FSDP2[0], FSDP2[1], **FSDP2[2])
    for rank in range(4):
        ours, theirs = simple.rank_output(rank), fsdp2.rank_output(rank)
        assert ours["placements"] == theirs["placements"], rank
        assert theirs["data_parallel_modules"]["simple_fsdp"] == 0 and theirs["data_parallel_modules"]["fully_shard"]
    assert any("_StridedShard" in p["placements"][0] for p in ours["placements"].values())
    hsdp = run_of(jobs, "hsdp2x2").rank_output(0)["placements"]
    assert {tuple(p["placements"]) for p in hsdp.values()} == {("Replicate()", "Shard(dim=0)")}


def test_without_checkpointing_the_gathered_weights_live_to_backward_and_with_it_are_gathered_again(jobs):
    """Step 1's collectives without tensor parallelism (every functional all-gather is a weight's): under HSDP
    without activation checkpointing each weight is gathered once, in forward, and autograd keeps it for backward
    (FSDP2 would gather the blocks again); at dp 4 with full checkpointing each block's recomputation gathers its
    weights again, so only the activations outlive the forward. Both reduce-scatter every gradient once, in
    backward; HSDP also all-reduces each across its 2 replicas."""
    plain = run_of(jobs, "hsdp2x2").rank_output(0)["collectives"]
    checkpointed = run_of(jobs, "dp4_ac_full").rank_output(0)["collectives"]
    print(f"collectives of step 1: {plain} under HSDP without checkpointing, {checkpointed} at dp 4 with it")
    gathers = plain["forward"]["all_gather_into_tensor"]
    # The debug model's blocks (2 here) hold 9 parameters each; the embedding, final norm and head 3 more (untied).
    assert gathers == BLOCKS * 9 + 3 and plain["backward"].get("all_gather_into_tensor", 0) == 0
    assert plain["backward"]["reduce_scatter_tensor"] == plain["backward"]["all_reduce"] == gathers
    assert checkpointed["forward"]["all_gather_into_tensor"] == gathers
    assert checkpointed["backward"]["all_gather_into_tensor"] == BLOCKS * 9  # the blocks', recomputed
    assert checkpointed["backward"]["reduce_scatter_tensor"] == gathers
    # Per-op selective checkpointing saves the matmul and attention outputs, not the gathers: recomputed as well.
    selective = run_of(jobs, "dp4_ac_selective_op").rank_output(0)["collectives"]
    print(f"collectives of step 1 at dp 4 with per-op selective checkpointing: {selective}")
    assert selective["forward"]["all_gather_into_tensor"] == gathers
    assert selective["backward"]["all_gather_into_tensor"] == BLOCKS * 9
    assert selective["backward"]["reduce_scatter_tensor"] == gathers


def test_pipeline_stages_are_gathered_by_simple_fsdp_and_run_the_schedule_asked(jobs):
    """The pipeline jobs above ran SimpleFSDP on each rank's stages (no FSDP2 unit, which ``PipelineStage`` would
    have driven), under the torch schedule named (every one torch has), each rank holding only its stages' blocks."""
    for name, schedule in ((f"pp2xdp2_{s.name}", s.torch_class) for s in SCHEDULES.values()):
        run = run_of(jobs, name)
        outputs = [run.rank_output(rank) for rank in range(4)]
        for out in outputs:
            assert out["data_parallel_modules"]["fully_shard"] == 0 and out["data_parallel_modules"]["simple_fsdp"]
            assert out["schedule_classes"]["train"] == schedule
        assert outputs[0]["blocks"] != outputs[2]["blocks"]  # pipeline ranks 0 and 1 hold different blocks
        assert {p["placements"][0] for p in outputs[0]["placements"].values()} == {"Shard(dim=0)"}


def test_emulated_float8_at_2x2_equals_float8_on_one_device(jobs):
    """torchao's float8 under SimpleFSDP: the block projections are ``Float8Linear``s (wrapped to gather), their
    stored weights laid out as under FSDP2 (plain shards: the float8 cast follows the gather), and the losses those
    of the same conversion on one process."""
    from tests.distributed.test_options import BLOCK_PROJECTIONS

    single = jobs.layout(1, 1, **FLOAT8_SINGLE).rank_output(0)
    run = jobs.layout(2, 2, **SIMPLE, **FLOAT8)
    expected = {f"layers.{i}.{name}" for i in range(BLOCKS) for name in BLOCK_PROJECTIONS}
    for rank in range(4):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], single["losses"])
        print(f"simple_fsdp float8 (emulated) 2x2 rank {rank}: worst relative loss error {error:.2e} vs (1, 1)")
        assert error <= 1e-4
        linears = out["linears"]
        assert {n for n, m in linears.items() if m["float8"]} == expected, rank
        for n in expected:
            assert linears[n]["class"] == "SimpleFSDPFloat8Linear", (rank, n, linears[n])
            assert linears[n]["placements"] == BLOCK_PROJECTIONS[n.split(".", 2)[2]], (rank, n, linears[n])
            assert linears[n]["local_type"] == "Tensor", (rank, n, linears[n])
        assert out["data_parallel_modules"]["fully_shard"] == 0


def test_a_nan_gradient_on_one_rank_is_skipped_on_every_rank(jobs):
    """The non-finite guard under SimpleFSDP: rank 1's gradient shard gets a NaN after the reduction at step 3; with
    ``non_finite="skip"`` every rank drops that step (its weights bit-equal to step 2's) and trains on."""
    run = jobs.layout(2, 2, **SIMPLE, **NAN_SKIP)
    before, after = load_weights(run, "weights_step2"), load_weights(run, "weights_step3")
    assert before and all(torch.equal(after[name], value) for name, value in before.items())
    final = load_weights(run, "final")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert any(not torch.equal(final[n], before[n]) for n in before)  # steps 4-6 trained
    assert "Step 3 skipped on every rank (non-finite gradients on rank(s) [1])" in run.logs[0]
    assert run.rank_output(0)["data_parallel_modules"]["simple_fsdp"] > 0


def test_bf16_mixed_trains_as_fully_shard_does(jobs):
    """bf16-mixed at 2x2 (sequence parallelism off: ``BF16``), gradients clipped: SimpleFSDP casts each fp32 shard to bf16 before its gather and reduces
    the gradients in fp32, as FSDP2's ``MixedPrecisionPolicy`` does, so both compute the same bf16 products and the
    same fp32 sums: the same losses, gradient norms and final weights, held to the fp32 tolerance (1e-5; measured:
    equal bit for bit, a sum of two ranks' gradients and its halving being exact in any order). A bf16 rounding that
    FSDP2 does not make shows at once: gathering in fp32 moves the first loss by 2.6e-4 and the norms by up to 1.4e-3,
    reducing in bf16 the norms by up to 5.7e-5 and the weights by 1.3e-3.

    Both runs' rotary tables hold bf16 values (``bf16_rope``): FSDP2 casts every floating input of a block to bf16,
    the fp32 table included, where SimpleFSDP casts none; with the table as it is, the runs differ by that alone
    (losses by up to 7e-5, norms 2.4e-5 over 6 steps), enough to hide a bf16 reduction."""
    simple, fsdp2 = jobs.layout(2, 2, **SIMPLE, **BF16), jobs.layout(2, 2, **BF16)
    fp32 = jobs.reference(gradient_clip_val=CLIP, **SMALL).rank_output(0)["losses"]
    for rank in range(4):
        ours, theirs = simple.rank_output(rank), fsdp2.rank_output(rank)
        assert ours["placements"] == theirs["placements"]  # fp32 shards, laid out alike
        assert {p["dtype"] for p in ours["placements"].values()} == {"torch.float32"}
        assert ours["data_parallel_modules"]["fully_shard"] == 0 and ours["data_parallel_modules"]["simple_fsdp"]
        error = worst_relative_error(ours["losses"], theirs["losses"])
        norm_error = worst_relative_error(ours["grad_norms"], theirs["grad_norms"])
        print(f"simple_fsdp bf16-mixed 2x2 rank {rank}: worst relative loss error {error:.3e}, gradient norm "
              f"{norm_error:.3e} vs fully_shard")
        assert error <= LOSS_RTOL, (ours["losses"], theirs["losses"])
        assert norm_error <= LOSS_RTOL, (ours["grad_norms"], theirs["grad_norms"])
        assert ours["stepped_grad_norms"] == pytest.approx([CLIP] * 6, rel=1e-5)  # clipped
        # And bf16: not the fp32 run's losses, but within bf16's rounding of them.
        assert 1e-5 < worst_relative_error(ours["losses"], fp32) <= 2e-3
    final, expected = load_weights(simple, "final"), load_weights(fsdp2, "final")
    assert final.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(final[name], weight, rtol=1e-5, atol=1e-5, msg=name)
