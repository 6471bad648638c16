"""Pipeline parallelism (a third mesh dimension) equals single-device training.

Real jobs: 4 CPU processes on gloo, 2 pipeline stages × 2 data-parallel ranks (1F1B) and 4 stages
interleaved on 2 pipeline ranks × 2 tensor-parallel ranks (Interleaved1F1B, gradients clipped to the
norm over every stage), 6 fp32 AdamW steps of the ``debug`` model against the single-device
``Trainer`` (the same reference the 2D layouts are held to), then validation through the pipeline.
GPipe runs in the Fabric test and in ``test_checkpoints.py`` (checkpoints across pipeline layouts). The
zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) run one 2-rank job each (pipeline 2,
2 stages per rank, 4 micro-batches) against the same reference, and record the torch class that ran; the V ones
also at pipeline 2 × data 2 (FSDP sharding each stage) and pipeline 2 × tensor 2 (sequence parallel).
Every job of this module runs in one launch per process count (``Jobs.share``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_2d.models.llama.model import PRESETS, Transformer
from tests.distributed.conftest import PARITY, Jobs, load_weights
from tests.distributed.test_options import CLIP, assert_two_micro_batches_equal_the_double_batch
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

VAL_SAMPLES = 10  # 5 per data-parallel rank: batches of 2, 2 and a last one of 1 (one micro-batch)
LAYOUTS = {
    "pp2xdp2-1F1B": ({"dp": 2, "tp": 1, "pipeline_parallel_size": 2, "pipeline_schedule": "1F1B",
                      "val_samples": VAL_SAMPLES}, {}),
    "pp2xtp2-Interleaved1F1B-clip": ({"dp": 1, "tp": 2, "pipeline_parallel_size": 2,
                                      "pipeline_schedule": "Interleaved1F1B", "gradient_clip_val": CLIP,
                                      "val_samples": VAL_SAMPLES}, {"gradient_clip_val": CLIP}),
}


#: The zero-bubble schedules: one 2-rank job each (pipeline 2 × 2 stages per rank, 4 micro-batches of one
#: sequence: DualPipeV needs as many micro-batches as stages), the torch class each must have run.
ZERO_BUBBLE = {
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", [[0, 2], [1, 3]]),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "VForwardOnly", [[0, 3], [1, 2]]),
    "DualPipeV": ("ScheduleDualPipeV", "VForwardOnly", [[0, 3], [1, 2]]),
}
LAYOUTS.update({
    f"pp2-{schedule}": ({"dp": 1, "tp": 1, "pipeline_parallel_size": 2, "pipeline_schedule": schedule,
                         "val_samples": VAL_SAMPLES}, {})
    for schedule in ZERO_BUBBLE
})
#: The V schedules with each stage FSDP-sharded over 2 data-parallel ranks, and tensor/sequence parallel over 2.
#: DualPipeV needs m >= 2·pp = 4 micro-batches of at least one sequence: at dp 2 that is a global batch of 8 (its
#: own reference); ZBVZeroBubble runs m = 2 there (fewer than the 2·pp − 1 its order is built for).
ZERO_BUBBLE_ND = {
    f"pp2x{axis}2-{schedule}": ({"dp": 2 if axis == "dp" else 1, "tp": 2 if axis == "tp" else 1,
                                 "pipeline_parallel_size": 2, "pipeline_schedule": schedule, "val_samples": VAL_SAMPLES,
                                 **batch}, batch)
    for axis in ("dp", "tp") for schedule in ("ZBVZeroBubble", "DualPipeV")
    for batch in [{"global_batch": 8} if (axis, schedule) == ("dp", "DualPipeV") else {}]
}
LAYOUTS.update(ZERO_BUBBLE_ND)
ACCUMULATION = {"pipeline_parallel_size": 2, "pipeline_schedule": "GPipe", "even_labels": True, "accumulate": 2,
                "grad_norms": True}
#: What every ``LAYOUTS`` job records beyond a multi-rank job's default (worker.fit): the tests below read both.
RECORD = {"grad_norms": True, "initial_weights": True}


def layout_jobs(name):
    """``(layout_job, reference_job)`` tuples of ``LAYOUTS[name]`` (``Jobs.layout_job``/``reference_job``)."""
    options, reference_options = LAYOUTS[name]
    options = {**options, **RECORD}
    dp, tp = options.pop("dp"), options.pop("tp")
    nprocs = dp * tp * options["pipeline_parallel_size"]
    return Jobs.layout_job(dp, tp, nprocs=nprocs, **options), Jobs.reference_job(**reference_options)


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    """This module's jobs in one launch per process count (4, 2 and the references' 1), one fit after another in
    the same processes (``Jobs.share``); the tests then read each as if launched alone."""
    jobs.share("pipeline", [
        *(job for name in LAYOUTS for job in layout_jobs(name)),
        Jobs.reference_job(even_labels=True), Jobs.layout_job(2, 1, nprocs=4, **ACCUMULATION),
    ])


def run_layout(jobs, name):
    options, reference_options = {**LAYOUTS[name][0], **RECORD}, LAYOUTS[name][1]
    dp, tp = options.pop("dp"), options.pop("tp")
    nprocs = dp * tp * options["pipeline_parallel_size"]
    return jobs.layout(dp, tp, nprocs=nprocs, **options), jobs.reference(**reference_options)


def ranks_of(run):
    return range(len(run.returncodes))


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipelined_training_equals_single_device(jobs, name):
    run, reference = run_layout(jobs, name)
    ref = reference.rank_output(0)
    for rank in ranks_of(run):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], ref["losses"])
        norm_error = worst_relative_error(out["grad_norms"], ref["grad_norms"])
        print(f"{name} rank {rank}: worst relative loss error {error:.2e}, gradient-norm error {norm_error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
        # The norm over every stage's gradients (each rank holds one stage's): clipping clips to it.
        assert norm_error <= LOSS_RTOL, (out["grad_norms"], ref["grad_norms"])
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()  # the stages together hold the whole model, under its names
    for weight_name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[weight_name], rtol=1e-5, atol=1e-5, msg=weight_name)
    initial = load_weights(run, "initial")
    assert any(not torch.equal(initial[n], final[n]) for n in final)


def test_fsdp_reduces_once_per_step_after_the_last_micro_batch(jobs):
    """By default the stage's FSDP units reduce-scatter once, after the last micro-batch: 3 units per rank
    (the embedding or [norm, output], and 2 blocks) × 6 steps, not × the 2 micro-batches."""
    run, _ = run_layout(jobs, "pp2xdp2-1F1B")
    assert [run.rank_output(r)["reduce_scatters"] for r in range(4)] == [3 * 6] * 4


def test_gradient_clipping_was_active(jobs):
    _, reference = run_layout(jobs, "pp2xtp2-Interleaved1F1B-clip")
    assert min(reference.rank_output(0)["grad_norms"]) > CLIP  # every step clipped: the check above meant it


@pytest.mark.parametrize(("name", "split", "blocks"), [
    ("pp2xdp2-1F1B", [2, 2], (["0", "1"], ["2", "3"])),
    # 4 stages of one block, stage s on pipeline rank s % 2: pipeline rank 0 holds blocks 0 and 2.
    ("pp2xtp2-Interleaved1F1B-clip", [1, 1, 1, 1], (["0", "2"], ["1", "3"])),
])
def test_each_pipeline_rank_holds_its_stages_blocks(jobs, name, split, blocks):
    run, _ = run_layout(jobs, name)
    outputs = [run.rank_output(r) for r in range(4)]
    assert outputs[0]["pipeline_split"] == split  # the debug model's 4 blocks, balanced
    assert outputs[0]["mesh_dims"][0] == "pipeline_parallel" and outputs[0]["mesh_shape"][0] == 2
    # Ranks 0-1 are pipeline rank 0, ranks 2-3 pipeline rank 1 (pipeline outermost); each holds only its blocks.
    assert [o["blocks"] for o in outputs] == [blocks[0], blocks[0], blocks[1], blocks[1]]
    embedding = {o["placements"].get("tok_embeddings.weight") is not None for o in outputs[:2]}
    head = {o["placements"].get("output.weight") is not None for o in outputs[2:]}
    assert embedding == {True} and head == {True}
    assert all("output.weight" not in o["placements"] for o in outputs[:2])


@pytest.mark.parametrize("name", LAYOUTS)
def test_validation_runs_through_the_pipeline(jobs, name):
    """The validation loss of the final weights, through the schedule's forward-only pass (a last, smaller
    batch included), equals the single-device loss of the reference run's final weights on the same samples."""
    from tests.distributed.worker import SyntheticTokens

    run, reference = run_layout(jobs, name)
    args = PRESETS["debug"]
    model = Transformer(args)
    model.load_state_dict(load_weights(reference, "final"), strict=False)
    model.init_buffers()
    data = SyntheticTokens(VAL_SAMPLES, PARITY["seq_len"], args.vocab_size, seed=1)
    batch = [data[i] for i in range(VAL_SAMPLES)]
    tokens = torch.stack([b["input_ids"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    with torch.no_grad():
        expected = float(model(tokens, labels=labels) / (labels != -100).sum())
    for rank in ranks_of(run):
        value = run.rank_output(rank)["val_loss"]
        print(f"rank {rank}: validation loss {value:.6f}, single device {expected:.6f}")
        assert value == pytest.approx(expected, rel=LOSS_RTOL)


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_zero_bubble_schedules_ran_with_their_placement(jobs, schedule):
    """The parity above is the named schedule's: each rank built torch's class for training (and the forward-only
    order of its placement for validation), and holds the stages of its placement (a V: rank 0 the first and
    the last)."""
    train_class, eval_class, stages = ZERO_BUBBLE[schedule]
    run, _ = run_layout(jobs, f"pp2-{schedule}")
    outputs = [run.rank_output(r) for r in range(2)]
    assert [o["schedule_classes"] for o in outputs] == [{"train": train_class, "eval": eval_class}] * 2
    assert [o["stage_indices"] for o in outputs] == stages
    assert outputs[0]["pipeline_split"] == [1, 1, 1, 1]
    embedding = [o["placements"].get("tok_embeddings.weight") is not None for o in outputs]
    head = [o["placements"].get("output.weight") is not None for o in outputs]
    assert embedding == [True, False] and head == ([False, True] if schedule == "InterleavedZeroBubble" else [True, False])


@pytest.mark.parametrize("name", ZERO_BUBBLE_ND)
def test_v_schedules_ran_sharded_over_data_or_tensor_parallel_ranks(jobs, name):
    """The parity above is the named V schedule's over a sharded stage: each of the 4 ranks built torch's class,
    holds the stages of a V (pipeline rank 0, ranks 0-1: stages 0 and 3), and its blocks' weights are sharded over
    the other axis (FSDP over the 2 data-parallel ranks, or the Llama plan's column-/row-wise tensor parallelism
    with sequence parallelism: the norms replicated over tensor-parallel ranks)."""
    schedule = name.split("-", 1)[1]
    train_class, eval_class, stages = ZERO_BUBBLE[schedule]
    run, _ = run_layout(jobs, name)
    outputs = [run.rank_output(r) for r in range(4)]
    assert [o["schedule_classes"] for o in outputs] == [{"train": train_class, "eval": eval_class}] * 4
    assert [o["stage_indices"] for o in outputs] == [stages[0], stages[0], stages[1], stages[1]]
    assert outputs[0]["pipeline_split"] == [1, 1, 1, 1]
    assert [o["blocks"] for o in outputs] == [["0", "3"]] * 2 + [["1", "2"]] * 2
    # A V: pipeline rank 0 holds the first stage (embedding) and the last (head).
    assert [("tok_embeddings.weight" in o["placements"], "output.weight" in o["placements"]) for o in outputs] == (
        [(True, True)] * 2 + [(False, False)] * 2)
    data_parallel = name.startswith("pp2xdp2")
    assert [o["sequence_shards"] for o in outputs] == [1 if data_parallel else 2] * 4
    for out in outputs:
        block = int(out["blocks"][0])
        wq, wo = (out["placements"][f"layers.{block}.attention.{w}.weight"] for w in ("wq", "wo"))
        norm = out["placements"][f"layers.{block}.attention_norm.weight"]
        if data_parallel:  # FSDP: every weight's rows split over the 2 data-parallel ranks, no tensor parallelism
            assert wq["mesh_dims"] == wo["mesh_dims"] == norm["mesh_dims"] == ["data_parallel"], (wq, wo, norm)
            assert wq["placements"] == wo["placements"] == norm["placements"] == ["Shard(dim=0)"], (wq, wo, norm)
            assert (wq["local_shape"], wo["local_shape"], norm["local_shape"]) == ([64, 128], [64, 128], [64])
        else:  # column-/row-wise tensor parallel, FSDP over one data-parallel rank (no split there)
            assert wq["mesh_dims"] == ["data_parallel", "tensor_parallel"], wq
            assert wq["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"] and wq["local_shape"] == [64, 128]
            assert wo["placements"] == ["Shard(dim=0)", "Shard(dim=1)"] and wo["local_shape"] == [128, 64], wo
            assert norm["placements"] == ["Shard(dim=0)", "Replicate()"] and norm["local_shape"] == [128], norm


def test_trainer_accumulation_under_a_pipeline_equals_one_double_batch(jobs):
    """accumulate_grad_batches=2 under 2 pipeline stages (GPipe: one sequence per rank and micro-step) × 2 data-parallel
    ranks, as the 2D accumulation test in
    test_options.py: the LightningModule steps the pipeline with ``grad_scale = 1/2`` and zeroes the gradients
    after each optimizer step (Lightning's own zero_grad, after the window's first ``training_step``, would drop
    the gradients that step computed; never zeroing would carry them into the next step)."""
    double = jobs.reference(even_labels=True)  # one device, the whole global batch per step (shared job)
    accumulated = jobs.layout(2, 1, nprocs=4, **ACCUMULATION)
    for rank in range(4):
        assert_two_micro_batches_equal_the_double_batch(accumulated.rank_output(rank), double.rank_output(0))
    final, ref_final = load_weights(accumulated, "final"), load_weights(double, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        # As in test_options.py: micro-batch sums round differently, AdamW's normalized update amplifies it.
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=3e-5, msg=name)
