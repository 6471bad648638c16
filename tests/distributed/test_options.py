"""Strategy options keep single-device numerics: loss parallel, SP off, reshard policies, clipping,
bf16 precisions and compile."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import SMALL, load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

CLIP = 0.5
# loss_parallel applies to a model that returns logits: LlamaLightningModule(fused_loss=False).
# Each activation-checkpointing mode rides along in one of these jobs (shared launches): recomputation
# is exact in fp32, so the job must still equal the single-device run.
OPTIONS = {
    "loss-parallel": {"loss_parallel": True, "fused_loss": False, "reshard_after_forward": "never",
                      "activation_checkpointing": "full"},
    "no-sequence-parallel": {"sequence_parallel": False, "loss_parallel": True, "fused_loss": False,
                             "activation_checkpointing": "selective", "selective_ac_option": "op"},
    "no-sequence-parallel-reshard-always": {"sequence_parallel": False, "reshard_after_forward": "always",
                                            "activation_checkpointing": "selective", "selective_ac_option": 2},
    "unfused-loss-gathered-logits": {"fused_loss": False},
}
#: The option jobs whose reshard policy is checked: what stays gathered after a forward.
RESHARD = {"loss-parallel": "all", "no-sequence-parallel-reshard-always": "none"}
#: The precision jobs; bf16-mixed clipped with its gradient norms recorded, as test_simple_fsdp.py's SimpleFSDP run it
#: is compared with (the same job, launched once per session). ``bf16_rope`` (the rotary table rounded to bf16 values)
#: changes nothing here: FSDP2 casts the table a block receives to bf16 itself (worker.Bf16Rope).
BF16_MIXED = {"precision": "bf16-mixed", "gradient_clip_val": CLIP, "grad_norms": True, "bf16_rope": True, **SMALL}
PRECISIONS = {"bf16-mixed": BF16_MIXED, "bf16-true": {"precision": "bf16-true", **SMALL}}
#: The accumulation job whose gradient norms are compared with one device's on the double batch.
ACCUMULATED = {"even_labels": True, "accumulate": 2, "grad_norms": True, **SMALL}
#: Emulated float8 at 2x2 with the float8 all-gather, and the same conversion on one process (test_simple_fsdp's too).
FLOAT8 = {"float8": "emulate", "fsdp_float8_all_gather": True, "sequence_parallel": False, **SMALL}
FLOAT8_SINGLE = {"float8": "emulate", **SMALL}
#: The blocks of this module's jobs (``SMALL``) but the compiled ones'.
BLOCKS = SMALL["blocks"]


def clipped(name: str) -> dict:
    """The options of job ``name`` (``OPTIONS``, gradients clipped), with what its tests read beyond a multi-rank job's
    default (worker.fit): the gradient norms, and for a ``RESHARD`` job the forward after the fit. 2 blocks
    (``SMALL``), as the references they are compared with."""
    return {"gradient_clip_val": CLIP, **OPTIONS[name], "grad_norms": True, **SMALL,
            **({"probe_forwards": True} if name in RESHARD else {})}


#: The compiled jobs, FSDP2's and SimpleFSDP's (its collectives counted in step 1), in a launch of their own; with the
#: debug model's 4 blocks (one graph for all of them), against the 4-block reference and eager SimpleFSDP job.
COMPILED = {"compile": True}
SIMPLE_COMPILED = {"compile": True, "fsdp_backend": "simple_fsdp", "count_collectives": 1}
#: The accumulation job reduce-scattering after every micro-batch.
EVERY_MICRO_BATCH = {"even_labels": True, "accumulate": 2, "reduce_every_micro_batch": True, **SMALL}
#: Its eager counterpart: test_simple_fsdp.py's 2x2 job (the same options, so launched once per session), clipped and
#: recording its norms there (after the backward whose collectives are counted).
SIMPLE_EAGER = {"fsdp_backend": "simple_fsdp", "count_collectives": 1, "gradient_clip_val": CLIP, "grad_norms": True}


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    """This module's jobs in one launch per process count: one fit after another in the same processes
    (``Jobs.share``); the tests then read them as usual. The two compiled jobs share another (dynamo's graph
    counters are read per fit, but the compiled code of one job stays in its processes)."""
    jobs.share("compiled", [jobs.layout_job(2, 2, **COMPILED), jobs.layout_job(2, 2, **SIMPLE_COMPILED)])
    jobs.share("options", [
        jobs.reference_job(), jobs.reference_job(**SMALL), jobs.reference_job(gradient_clip_val=CLIP, **SMALL),
        jobs.reference_job(even_labels=True, **SMALL), jobs.layout_job(1, 1, **FLOAT8_SINGLE),
        *(jobs.layout_job(2, 2, **clipped(name)) for name in OPTIONS),
        *(jobs.layout_job(2, 2, **options) for options in PRECISIONS.values()),
        jobs.layout_job(2, 2, **ACCUMULATED),
        jobs.layout_job(2, 2, **EVERY_MICRO_BATCH),
        jobs.layout_job(2, 2, **FLOAT8),
        jobs.layout_job(2, 2, **SIMPLE_EAGER),  # test_simple_fsdp's too
    ])


def test_clipping_is_active_in_these_runs(jobs):
    out = jobs.reference(gradient_clip_val=CLIP, **SMALL).rank_output(0)
    # Every step's gradient norm exceeds the threshold, so every step is clipped to it.
    assert min(out["grad_norms"]) > 2 * CLIP
    assert out["stepped_grad_norms"] == pytest.approx([CLIP] * 6, rel=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_with_gradient_clipping_matches_single_device(jobs, name):
    """Gradient clipping needs the global norm over DTensors (on two meshes when SP is off)."""
    run = jobs.layout(2, 2, **clipped(name))
    reference = jobs.reference(gradient_clip_val=CLIP, **SMALL)
    ref_out = reference.rank_output(0)
    for rank in range(4):
        out = run.rank_output(rank)
        assert worst_relative_error(out["losses"], ref_out["losses"]) <= LOSS_RTOL
        assert out["grad_norms"] == pytest.approx(ref_out["grad_norms"], rel=1e-5)
        assert out["stepped_grad_norms"] == pytest.approx([CLIP] * 6, rel=1e-5)
    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    for name_, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name_], rtol=1e-5, atol=1e-5, msg=name_)


# What the options make of the activations (worker.ActivationLayouts, first training step, every rank): batch
# 4 / dp 2 = 2 sequences of 32 tokens, dim 128, vocabulary 256, tp 2.
SEQUENCE_SHARDED = {"type": "DTensor", "placements": ["Shard(dim=1)"], "mesh_dims": ["tensor_parallel"],
                    "local_shape": [2, 16, 128], "shape": [2, 32, 128]}
FULL_SEQUENCE = {"type": "Tensor", "shape": [2, 32, 128]}  # the same on both tensor-parallel ranks
VOCAB_SHARDED_LOGITS = {"type": "DTensor", "placements": ["Shard(dim=2)"], "mesh_dims": ["tensor_parallel"],
                        "local_shape": [2, 32, 128], "shape": [2, 32, 256]}
GATHERED_LOGITS = {"type": "Tensor", "shape": [2, 32, 256]}
FUSED_LOSS = {"type": "Tensor", "shape": []}  # the model returns the summed loss, not logits


LAYOUTS = {  # option job: (what the model returns, what the norms receive and return)
    "loss-parallel": (VOCAB_SHARDED_LOGITS, SEQUENCE_SHARDED),
    "no-sequence-parallel": (VOCAB_SHARDED_LOGITS, FULL_SEQUENCE),
    "no-sequence-parallel-reshard-always": (FUSED_LOSS, FULL_SEQUENCE),
    "unfused-loss-gathered-logits": (GATHERED_LOGITS, SEQUENCE_SHARDED),
}


@pytest.mark.parametrize(("name", "logits", "norms"), [(name, *LAYOUTS[name]) for name in LAYOUTS], ids=list(LAYOUTS))
def test_options_decide_the_placements_of_the_logits_and_the_norms(jobs, name, logits, norms):
    """The losses above are the same whether or not an option was applied; the layouts are not.
    loss_parallel: the logits reaching the loss are a DTensor sharded over the vocabulary on the
    tensor-parallel mesh (without it: gathered plain logits). sequence_parallel=False: the norms run on the
    whole sequence, plain tensors (with it: Shard(1) DTensors, half the sequence per rank)."""
    run = jobs.layout(2, 2, **clipped(name))  # the jobs above
    for rank in range(4):
        seen = run.rank_output(rank)["activations"]
        assert seen["logits"]["output"] == logits, (rank, seen["logits"])
        for norm in ("attention_norm", "norm"):
            assert seen[norm]["input"] == norms and seen[norm]["output"] == norms, (rank, norm, seen[norm])


@pytest.mark.parametrize(("name", "checkpointed"), [
    ("loss-parallel", ["0", "1"]),  # full: every block (of 2)
    ("no-sequence-parallel", ["0", "1"]),  # selective per op: every block, with a save policy
    ("no-sequence-parallel-reshard-always", ["1"]),  # selective 2: every 2nd block
])
def test_activation_checkpointing_modes_wrap_their_blocks_and_keep_single_device_numerics(jobs, name, checkpointed):
    """The option jobs above carry the three activation-checkpointing modes (their parity is asserted there)."""
    out = jobs.layout(2, 2, **clipped(name)).rank_output(0)
    assert out["checkpointed_blocks"] == checkpointed


@pytest.mark.parametrize(("name", "gathered"), list(RESHARD.items()))
def test_reshard_policy_decides_what_stays_gathered_after_forward(jobs, name, gathered):
    out = jobs.layout(2, 2, **clipped(name)).rank_output(0)  # the jobs above
    assert out["gathered_after_forward"] == (sorted(out["placements"]) if gathered == "all" else [])


@pytest.mark.parametrize(("precision", "shard_dtype"), [("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")])
def test_bf16_precisions(jobs, precision, shard_dtype):
    options = PRECISIONS[precision]
    out = jobs.layout(2, 2, **options).rank_output(0)
    # bf16 compute follows the fp32 run (clipped as the job is) within bf16 rounding over 6 steps.
    reference = jobs.reference(**{k: v for k, v in options.items() if k == "gradient_clip_val"}, **SMALL)
    assert worst_relative_error(out["losses"], reference.rank_output(0)["losses"]) <= 2e-3
    assert {p["dtype"] for p in out["placements"].values()} == {shard_dtype}


def test_compiled_blocks_match_single_device(jobs):
    compiled = jobs.layout(2, 2, **COMPILED)
    losses = compiled.rank_output(0)["losses"]
    # Inductor fuses and reorders fp32 reductions: equal up to a few ulps of accumulated rounding.
    assert worst_relative_error(losses, jobs.reference().rank_output(0)["losses"]) <= 1e-4
    # The losses would also match with compile a no-op: check that every block is torch.compile's wrapper
    # on every rank, and that dynamo did compile graphs in the process (none in an eager job).
    for rank in range(4):
        out = compiled.rank_output(rank)
        assert out["compiled_blocks"] == ["0", "1", "2", "3"], (rank, out["compiled_blocks"])
        # One graph for all 4 blocks: the first block's input (the embedding's output, still waiting on its
        # reduce-scatter under sequence parallelism) is made plain like the others' (compile.py:_plain_inputs).
        assert out["dynamo_unique_graphs"] == 1, (rank, out["dynamo_unique_graphs"])
    eager = jobs.layout(2, 2, **clipped("unfused-loss-gathered-logits")).rank_output(0)  # a job of the tests above
    assert eager["compiled_blocks"] == [] and eager["dynamo_unique_graphs"] == 0


def test_compiled_simple_fsdp_buckets_its_collectives_and_matches_single_device(jobs):
    """``fsdp_backend="simple_fsdp"`` with ``compile=True`` at 2x2: inductor buckets the gathers and reduce-scatters
    that SimpleFSDP leaves in the blocks' graphs (one per block and direction instead of one per parameter)."""
    out = jobs.layout(2, 2, **SIMPLE_COMPILED).rank_output(0)
    assert worst_relative_error(out["losses"], jobs.reference().rank_output(0)["losses"]) <= 1e-4
    for rank in range(4):
        assert jobs.layout(2, 2, **SIMPLE_COMPILED).rank_output(rank)["compiled_blocks"] == ["0", "1", "2", "3"]
    assert out["dynamo_unique_graphs"] == 1  # one graph for the 4 blocks (a fresh one: the classes are SimpleFSDP's)
    eager = jobs.layout(2, 2, **SIMPLE_EAGER).rank_output(0)["collectives"]
    compiled = out["collectives"]
    print(f"collectives of step 1 at 2x2 under SimpleFSDP: eager {eager}, compiled {compiled}")

    def count(counts: dict, prefix: str) -> int:  # bucketed ops are the "_out"/in-place variants
        return sum(n for op, n in counts.items() if op.startswith(prefix))

    # Eager: 39 weight gathers in forward (4 blocks x 9 parameters, embedding, final norm, head) and 9 sequence-
    # parallel activation gathers; backward reduce-scatters as many. Compiled, the blocks' weights arrive in
    # bucketed collectives (measured: 48 -> 24 all-gathers, 48 -> 24 reduce-scatters): fewer than the parameters.
    assert count(eager["forward"], "all_gather") == 39 + 9 and count(eager["backward"], "reduce_scatter") == 39 + 9
    assert count(compiled["forward"], "all_gather") <= (39 + 9) // 2 < 39
    assert count(compiled["backward"], "reduce_scatter") <= (39 + 9) // 2 < 39


def assert_two_micro_batches_equal_the_double_batch(out: dict, ref: dict) -> dict:
    """A rank's output under ``accumulate_grad_batches=2`` against one device's on the double batch: the mean of each
    pair of micro-batch losses is the step's loss, and the clipped-to norms are equal. Returns ``out``."""
    micro = out["losses"]
    assert len(micro) == 12  # two micro-batches per optimizer step
    pairs = [(a + b) / 2 for a, b in zip(micro[::2], micro[1::2])]
    assert worst_relative_error(pairs, ref["losses"]) <= LOSS_RTOL
    assert out["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    return out


def test_trainer_gradient_accumulation_equals_one_double_batch_and_reduces_once_per_step(jobs):
    """accumulate_grad_batches=2: FSDP2 skips the first micro-batch's reduce-scatter (Lightning's own
    block_backward_sync only knows DDP). Every target counts (even labels), so the mean of the two
    micro-batch means is the double batch's mean."""
    double = jobs.reference(even_labels=True, **SMALL)  # one device, the whole global batch per step
    accumulated = jobs.layout(2, 2, **ACCUMULATED)
    every = jobs.layout(2, 2, **EVERY_MICRO_BATCH)
    for rank in range(4):
        out = assert_two_micro_batches_equal_the_double_batch(accumulated.rank_output(rank), double.rank_output(0))
        micro = out["losses"]
        # One reduce-scatter per FSDP unit (embedding, the blocks, [norm, output]) and step, as without
        # accumulation: the first micro-batch's backward reduces nothing.
        units = 1 + BLOCKS + 1
        assert out["reduce_scatters"] == units * 6
        # The memory-saving option reduce-scatters after each micro-batch: twice as often.
        assert every.rank_output(rank)["reduce_scatters"] == 2 * units * 6
        assert worst_relative_error(every.rank_output(rank)["losses"][1::2], micro[1::2]) <= LOSS_RTOL
    ref_final, final = load_weights(double, "final"), load_weights(accumulated, "final")
    every_final = load_weights(every, "final")
    for name, weight in final.items():
        # Against one device the micro-batch sums round differently, and AdamW's normalized update
        # (lr 1e-3 per step) turns that into up to ~1.1e-5 on an element whose gradient is near zero.
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=3e-5, msg=name)
        # The two reduction schedules sum the same micro-batch gradients.
        torch.testing.assert_close(every_final[name], weight, rtol=1e-5, atol=1e-5, msg=name)


def test_emulated_float8_at_2x2_equals_float8_on_one_device(jobs):
    """torchao's float8 (emulated on CPU: the same e4m3/e5m2 rounding) through the float8 TP styles and
    FSDP2's float8 all-gather, against the same conversion on one process: tensorwise scales are
    amaxes of the *full* tensors, so the layout changes only the fp32 summation order."""
    single = jobs.layout(1, 1, **FLOAT8_SINGLE).rank_output(0)
    sharded = jobs.layout(2, 2, **FLOAT8).rank_output(0)
    fp32 = jobs.reference(**SMALL).rank_output(0)["losses"]
    error = worst_relative_error(sharded["losses"], single["losses"])
    print(f"float8 (emulated) (2, 2) vs (1, 1): worst relative loss error {error:.2e};"
          f" vs fp32 {worst_relative_error(single['losses'], fp32):.2e}")
    assert error <= 1e-4
    # float8 really ran: its rounding moves the losses away from fp32's (yet not far).
    assert 1e-6 < worst_relative_error(single["losses"], fp32) <= 1e-2


#: The debug model's block projections, each with the (data_parallel, tensor_parallel) placements of the Llama plan
#: at 2×2 (as in test_parity.py::test_plan_structure_at_2x2): column-wise ones FSDP-sharded over a TP dim-0 shard.
BLOCK_PROJECTIONS = {
    **{name: ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
       for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")},
    **{name: ["Shard(dim=0)", "Shard(dim=1)"] for name in ("attention.wo", "feed_forward.w2")},  # row-wise
}


def test_float8_converted_the_block_projections_and_kept_their_placements(jobs):
    """What the float8 job above ran (its losses alone would pass with the conversion skipped, within 1e-2 of
    fp32): every block projection is torchao's ``Float8Linear`` on every rank, its weight laid out as the plan
    says and, under ``fsdp_float8_all_gather``, wrapped for the float8 all-gather; the head stays a plain
    ``VocabProjection`` (high precision), column-wise. At (1, 1) the same modules are converted, unwrapped (one
    data-parallel rank: nothing to all-gather)."""
    run = jobs.layout(2, 2, **FLOAT8)
    expected = {f"layers.{i}.{name}" for i in range(BLOCKS) for name in BLOCK_PROJECTIONS}
    for rank in range(4):
        linears = run.rank_output(rank)["linears"]
        assert {name for name, m in linears.items() if m["float8"]} == expected, rank
        assert linears.keys() == expected | {"output"}, rank
        for name in expected:
            got = linears[name]
            assert got["class"] == "Float8Linear", (rank, name, got)
            assert got["placements"] == BLOCK_PROJECTIONS[name.split(".", 2)[2]], (rank, name, got)
            assert got["local_type"] == "WeightWithDynamicFloat8CastTensor", (rank, name, got)
        head = linears["output"]
        assert not head["float8"] and "VocabProjection" in head["class"], (rank, head)
        assert head["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"] and head["local_type"] == "Tensor"
    single = jobs.layout(1, 1, **FLOAT8_SINGLE).rank_output(0)["linears"]
    assert {name for name, m in single.items() if m["float8"]} == expected
    assert {single[name]["local_type"] for name in expected} == {"Tensor"}
