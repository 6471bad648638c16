"""Preference tuning (``preference=``: DPO on ``PreferenceDataModule``'s packed pairs) under the parallelisms equals
one device.

Real jobs of 4 CPU processes on gloo sharing one launch (``Jobs.share``), 6 fp32 AdamW steps of the ``debug`` Llama
(2 blocks) on pairs about the standard library (the built-in data: a docstring's answer chosen, an evasive one
rejected; byte-level ChatML), several pairs packed in each window, against the single-device ``Trainer`` on the
same global batches:

- LoRA, the reference the base with its adapters off: 2×2 with sequence parallelism and two accumulated batches per
  step (the loss the mean over the step's pairs), and context parallel 2 × tensor parallel 2 (each pair's sequences
  cut over the context ranks, their log-probabilities summed across them);
- the whole model, the reference a frozen copy parallelized beside it (FSDP × TP at 2×2);
- QLoRA (adapters on NF4 bases, the reference those bases with the adapters off) at FSDP 4 against the
  single-device QLoRA run;
- KTO on the same pairs unpaired (each answer desirable, each evasive one undesirable), each example packed with its
  KL sequence, LoRA with its adapters off as the reference, at 2×2 with sequence parallelism: its KL estimate a mean
  over both replicas' windows;
- pipeline 2 × data 2: LoRA (1F1B, GPipe with the reference precomputed), the whole model against a frozen copy split
  into the same stages (1F1B; Interleaved1F1B and ZBVZeroBubble at 4 blocks, against their own single-device run),
  KTO (1F1B).

Each compares the losses, TRL's reward metrics (KTO's with its KL estimate), the gradient norms where recorded and
the final weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_2d.ops.lora import is_adapter_parameter
from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

SEQ_LEN, PAIRS = 128, 96
DPO = {"loss_type": "sigmoid", "beta": 0.1}
LORA = {"rank": 4, "alpha": 8.0}
#: KTO's windows: an example (at most 60 tokens) and its KL sequence take up to 118 positions, two examples a window.
KTO_SEQ_LEN, KTO_PAIRS = 256, 48
#: The desirable examples weigh more: their completions' rise under other prompts too makes the KL estimate positive
#: from the second step (the reference point matters), where equal weights leave it clamped at 0 in most steps.
KTO = {"loss_type": "kto", "beta": 0.1, "desirable_weight": 3.0, "undesirable_weight": 0.5}
#: QLoRA's model: each projection whole NF4 scaler groups (16,384 elements) in each of 4 row shards (256 × 256 and
#: 768 × 256 weights), as tests/distributed/test_lora.py's.
QLORA_MODEL = {"vocab_size": 264, "n_layers": 2, "dim": 256, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 256}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """The data module's arguments, its cache prepared here once (every job finds it)."""
    from lightning_2d import PreferenceDataModule
    from lightning_2d.data.preference.builtin import stdlib_preference_rows

    folder = tmp_path_factory.mktemp("pairs")
    rows = stdlib_preference_rows()[:PAIRS]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"paths": str(folder / "pairs.jsonl"), "tokenizer": "byte", "cache_dir": str(folder / "cache"),
            "max_length": 60}  # each sequence at most 60 tokens: a pair fits a window of 128 positions
    PreferenceDataModule(**args, seq_len=SEQ_LEN).prepare(num_workers=1)
    return args


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict:
    """The unpaired data module's arguments: the built-in pairs unpaired, its cache prepared here once."""
    from lightning_2d import PreferenceDataModule
    from lightning_2d.data.preference import stdlib_preference_rows, unpaired_rows

    folder = tmp_path_factory.mktemp("examples")
    rows = unpaired_rows(stdlib_preference_rows()[:KTO_PAIRS])
    (folder / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"paths": str(folder / "examples.jsonl"), "tokenizer": "byte", "cache_dir": str(folder / "cache"),
            "format": "unpaired", "max_length": 60}
    data = PreferenceDataModule(**args, seq_len=KTO_SEQ_LEN, val_fraction=0)
    data.prepare(num_workers=1)
    data.setup("fit")
    assert data.packing.alone <= 2 and data.packing.examples == 2 * KTO_PAIRS  # KL sequences in (almost) every window
    return args


@pytest.fixture(scope="module")
def runs(jobs, pairs, examples) -> dict:
    common = {"preference_data": pairs, "seq_len": SEQ_LEN, "model_overrides": {"vocab_size": 264, "n_layers": 2},
              "preference": DPO}
    lora = {**common, "lora": LORA}
    kto = {**lora, "preference_data": examples, "seq_len": KTO_SEQ_LEN, "preference": KTO}
    qlora = {**common, "model_overrides": QLORA_MODEL, "lora": {**LORA, "quantize_base": "nf4"}}
    four_blocks = {**common, "model_overrides": {"vocab_size": 264, "n_layers": 4}}  # 4 stages of one block
    specs = {
        "reference": jobs.reference_job(**lora),
        "sp_accumulate": jobs.layout_job(2, 2, accumulate=2, grad_norms=True, **lora),
        "cp_tp": jobs.layout_job(1, 2, nprocs=4, context_parallel_size=2, **lora),
        "copy_reference": jobs.reference_job(**common),
        "copy_2x2": jobs.layout_job(2, 2, grad_norms=True, **common),
        # the other FSDP backends and layouts: SimpleFSDP with activation checkpointing (the frozen copy gathered by
        # it too), and HSDP (2 replicas × 2 shards) with LoRA
        "simple_fsdp_copy": jobs.layout_job(2, 2, fsdp_backend="simple_fsdp", activation_checkpointing="full",
                                            grad_norms=True, **common),
        "hsdp_lora": jobs.layout_job(4, 1, data_parallel_replicate_size=2, grad_norms=True, **lora),
        # pipeline 2 × data 2: the pairs' losses in the last stage, the reference the stages with adapters off
        "pp_dp": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2, pipeline_schedule="1F1B",
                                 grad_norms=True, **lora),
        "pp_precomputed": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2, pipeline_schedule="GPipe",
                                          **{**lora, "preference": {**DPO, "precompute_reference": True}}),
        # precompute_reference: the frozen copy's values computed once at data 2 × context 2, then released
        "precomputed": jobs.layout_job(2, 1, nprocs=4, context_parallel_size=2, grad_norms=True,
                                       **{**common, "preference": {**DPO, "precompute_reference": True}}),
        "kto_reference": jobs.reference_job(**kto),
        "kto_2x2": jobs.layout_job(2, 2, grad_norms=True, **kto),
        # QLoRA: FSDP shards the NF4 bases over 4 ranks and gathers them for the reference's forward too
        "qlora_reference": jobs.reference_job(**qlora),
        "qlora_fsdp4": jobs.layout_job(4, 1, grad_norms=True, **qlora),
        # pipeline 2 × data 2, the whole model against its frozen copy cut into the same stages on the same ranks
        # (its own forward-only pipeline): 1F1B at 2 blocks; two stages a rank at 4 blocks, in a loop (Interleaved1F1B)
        # and in a V with each backward split in two (ZBVZeroBubble); KTO, its KL estimate by a forward-only pass
        "pp_copy": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2, pipeline_schedule="1F1B",
                                   grad_norms=True, **common),
        "copy_reference_4_blocks": jobs.reference_job(**four_blocks),
        "pp_copy_interleaved": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2,
                                               pipeline_schedule="Interleaved1F1B", grad_norms=True, **four_blocks),
        "pp_copy_zero_bubble": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2,
                                               pipeline_schedule="ZBVZeroBubble", grad_norms=True, **four_blocks),
        "pp_kto": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2, pipeline_schedule="1F1B", grad_norms=True,
                                  **kto),
    }
    specs = {key: (f"preference_{key}", config, nprocs, nodes) for key, (_, config, nprocs, nodes) in specs.items()}
    jobs.share("preference", list(specs.values()))
    return {key: jobs.run(name, "fit", config, nprocs=nprocs) for key, (name, config, nprocs, _) in specs.items()}


def check_against(run, reference, accumulated: bool = False, grad_norms: bool = False, label: str = "",
                  margin: bool = True) -> None:
    """``run``'s losses and TRL's metrics (each batch's, when a step is one batch), gradient norms (when recorded) and
    final weights against ``reference``'s; ``margin``: the reference's last reward margin is positive."""
    ref = reference.rank_output(0)
    assert len(ref["losses"]) == 6 and len(ref["preference_metrics"]) == 6
    if margin:
        assert ref["preference_metrics"][-1]["rewards/margins"] > 0  # trained: the chosen gained on the rejected
    for rank in range(4):
        out = run.rank_output(rank)
        errors = {}
        if accumulated:  # two batches a step, each logging its own mean: the step shows in its gradients
            assert len(out["losses"]) == 12
        else:
            errors["loss"] = worst_relative_error(out["losses"], ref["losses"])
            for got, want in zip(out["preference_metrics"], ref["preference_metrics"], strict=True):
                for name, value in want.items():
                    # A reward is β × the small difference of two sums of ~-400 (the logps of 60 tokens each) summed
                    # in another order (over context ranks, vocabulary shards): a few fp32 ulps of the sums, up to
                    # ~3e-4 × β measured (1.1e-5 at CP 2 × TP 2); a wrong sum or reference is off by the reward.
                    tolerance = {"rel": 1e-5} if name.startswith("logps/") else {"abs": 5e-5}
                    assert got[name] == pytest.approx(value, **tolerance), (name, got[name], value)
        if grad_norms:
            errors["gradient norm"] = worst_relative_error(out["grad_norms"], ref["grad_norms"])
        print(f"{label} rank {rank}: " + ", ".join(f"worst relative {k} error {v:.2e}" for k, v in errors.items()))
        assert max(errors.values()) <= LOSS_RTOL, (out["losses"], ref["losses"], out.get("grad_norms"))
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def test_dpo_with_lora_at_2x2_with_accumulation_equals_one_device(runs):
    """Two batches a step: the loss divided by the step's pairs (``step_pairs``, both replicas and batches), so the
    gradients and weights are one device's on the whole step."""
    check_against(runs["sp_accumulate"], runs["reference"], accumulated=True, grad_norms=True,
                  label="2x2 SP, accumulate 2")


def test_dpo_with_lora_under_context_and_tensor_parallelism_equals_one_device(runs):
    """Each pair's two sequences cut over 2 context ranks, their log-probabilities summed across them, the head's
    vocabulary over 2 tensor ranks."""
    for rank in range(4):
        out = runs["cp_tp"].rank_output(rank)
        assert out["mesh_shape"][out["mesh_dims"].index("context_parallel")] == 2
    check_against(runs["cp_tp"], runs["reference"], label="CP 2 x TP 2")


def test_dpo_of_the_whole_model_against_a_frozen_copy_equals_one_device(runs):
    """No adapters: the reference is a frozen copy of the initial model, sharded beside it by the same plan."""
    check_against(runs["copy_2x2"], runs["copy_reference"], grad_norms=True, label="2x2 frozen copy")
    assert runs["copy_2x2"].rank_output(0)["frozen_models"] == 1


def test_dpo_under_simple_fsdp_with_checkpointing_and_under_hsdp_equals_one_device(runs):
    """SimpleFSDP gathers the trained model and its frozen copy (blocks checkpointed), HSDP shards LoRA's base over 2
    ranks and replicates it twice."""
    out = runs["simple_fsdp_copy"].rank_output(0)
    assert out["frozen_models"] == 1 and out["checkpointed_blocks"] == ["0", "1"]
    for modules in (out["data_parallel_modules"], *out["frozen_data_parallel_modules"]):  # both by SimpleFSDP
        assert modules["simple_fsdp"] > 0 and modules["fully_shard"] == 0, modules
    assert runs["copy_2x2"].rank_output(0)["frozen_data_parallel_modules"][0]["fully_shard"] > 0
    check_against(runs["simple_fsdp_copy"], runs["copy_reference"], grad_norms=True, label="2x2 SimpleFSDP + AC copy")
    out = runs["hsdp_lora"].rank_output(0)
    assert out["mesh_shape"][out["mesh_dims"].index("data_parallel_replicate")] == 2
    check_against(runs["hsdp_lora"], runs["reference"], grad_norms=True, label="HSDP 2x2 LoRA")


def test_dpo_under_pipeline_parallelism_equals_one_device(runs):
    """Pipeline 2 × data 2: each micro-batch's pairs scored in the last stage (a pair's two sequences are in one
    window, so in one micro-batch), the reference a forward-only run of the stages with the adapters off each step
    (1F1B), or precomputed once by such runs over every window (GPipe)."""
    for key, label in (("pp_dp", "PP 2 x DP 2 1F1B"), ("pp_precomputed", "PP 2 x DP 2 precomputed")):
        out = runs[key].rank_output(0)
        assert out["mesh_shape"][out["mesh_dims"].index("pipeline_parallel")] == 2
        check_against(runs[key], runs["reference"], grad_norms=key == "pp_dp", label=label)
    assert runs["pp_precomputed"].rank_output(0)["batches_carry_reference_values"]
    assert not runs["pp_dp"].rank_output(0)["batches_carry_reference_values"]


def test_a_precomputed_reference_trains_as_the_live_copy_and_is_released(runs):
    """``precompute_reference=True`` at data 2 × context 2: each rank scores its share of the windows (each
    sequence's halves on two context ranks), the values are summed over the four ranks and saved in the data cache;
    the copy is released and the steps read the values from their batches: the live copy's training on one device."""
    keys = set()
    for rank in range(4):
        out = runs["precomputed"].rank_output(rank)
        assert out["frozen_models"] == 0 and out["batches_carry_reference_values"]
        keys.add(out["reference_values_key"])
    assert len(keys) == 1 and None not in keys
    check_against(runs["precomputed"], runs["copy_reference"], grad_norms=True, label="DP 2 x CP 2 precomputed")


def test_kto_with_lora_at_2x2_with_sequence_parallelism_equals_one_device(runs):
    """Unpaired examples with their KL sequences, the estimate a mean over every replica's windows (TRL gathers it
    across processes): the losses, the KL and reward metrics, gradient norms and weights are one device's."""
    ref = runs["kto_reference"].rank_output(0)
    assert set(ref["preference_metrics"][0]) == {"rewards/chosen", "rewards/rejected", "rewards/margins",
                                                 "logps/chosen", "logps/rejected", "kl"}
    kl = [m["kl"] for m in ref["preference_metrics"]]
    assert kl[0] == 0.0 and min(kl[2:]) > 0.01, kl  # trained (the adapters start as the reference), KL above 0
    check_against(runs["kto_2x2"], runs["kto_reference"], grad_norms=True, label="KTO 2x2 SP", margin=False)


#: The forward-only schedule of each placement (``Schedule.forward_only_class``): what runs a frozen model's stages.
FORWARD_ONLY = {"1F1B": "ScheduleGPipe", "Interleaved1F1B": "ScheduleLoopedBFS", "ZBVZeroBubble": "VForwardOnly"}


def test_dpo_against_a_frozen_copy_split_beside_the_pipeline_stages_equals_one_device(runs):
    """Pipeline 2 × data 2, the whole model trained against its frozen copy: each rank holds the frozen twins of its
    own blocks (the copy cut into the trained model's stages, FSDP-sharded as they are) and the reference is a
    forward-only run of the copy's stages; the trained stages run no forward-only step. Every schedule family: one
    stage a rank (1F1B), two in a loop (Interleaved1F1B) and in a V with the backward split into its input and weight
    passes (ZBVZeroBubble, the last stage's per-token head differentiated twice), each equal to one device."""
    for key, reference, blocks, schedule in (("pp_copy", "copy_reference", 2, "1F1B"),
                                             ("pp_copy_interleaved", "copy_reference_4_blocks", 4, "Interleaved1F1B"),
                                             ("pp_copy_zero_bubble", "copy_reference_4_blocks", 4, "ZBVZeroBubble")):
        held = []
        for rank in range(4):
            out = runs[key].rank_output(rank)
            (frozen,) = out["frozen_pipelines"]
            assert frozen["blocks"] == out["blocks"] and frozen["stage_indices"] == out["stage_indices"], (key, rank)
            assert frozen["schedule_classes"] == [FORWARD_ONLY[schedule]], (key, frozen)
            assert set(out["schedule_classes"]) == {"train"}  # the trained stages ran the training schedule only
            assert out["frozen_data_parallel_modules"][0]["fully_shard"] > 0
            held.append(out["blocks"])
        assert set().union(*held) == {str(b) for b in range(blocks)}  # each pipeline rank holds half of the copy
        assert all(len(b) == blocks // 2 for b in held)
        check_against(runs[key], runs[reference], grad_norms=True, label=f"PP 2 x DP 2 {schedule} frozen copy")


def test_kto_under_pipeline_parallelism_equals_one_device(runs):
    """Pipeline 2 × data 2 with LoRA: the KL estimate from forward-only runs of the stages (the trained model's and,
    adapters off, the reference's) before the schedule, over both replicas' KL sequences; each micro-batch's examples
    scored in the last stage against it. The losses, the KL and reward metrics, gradient norms and weights are one
    device's."""
    out = runs["pp_kto"].rank_output(0)
    assert out["schedule_classes"] == {"train": "Schedule1F1B", "eval": "ScheduleGPipe"}
    check_against(runs["pp_kto"], runs["kto_reference"], grad_norms=True, label="KTO PP 2 x DP 2", margin=False)


def test_dpo_with_qlora_equals_one_device_its_nf4_bases_the_reference(runs):
    """QLoRA: adapters on NF4 bases, no copy: the reference is the bases with the adapters off. Its first step's
    rewards are exactly 0 (the adapters' B starts at zero, so the model is its reference, NF4 bases included); at FSDP
    4 (the NF4 codes sharded over 4 ranks, gathered for both forwards) the run is the single device's, and the bases'
    bits are untouched."""
    reference, run = runs["qlora_reference"], runs["qlora_fsdp4"]
    ref = reference.rank_output(0)
    assert len(ref["nf4"]) == 2 * 7 and ref["frozen_models"] == 0  # both blocks' seven projections in NF4
    first = ref["preference_metrics"][0]
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0, first
    for rank in range(4):
        out = run.rank_output(rank)
        assert out["mesh_shape"][out["mesh_dims"].index("data_parallel_shard")] == 4
        assert out["nf4"] == ref["nf4"] and out["frozen_models"] == 0
        assert out["optimized"] == out["requires_grad"] and all(is_adapter_parameter(n) for n in out["optimized"])
    check_against(run, reference, grad_norms=True, label="QLoRA FSDP 4")
    initial, final = load_weights(reference, "initial"), load_weights(run, "final")
    for name in ref["nf4"]:  # the single device's NF4 values, untouched by training at FSDP 4
        assert torch.equal(final[name], initial[name]), name
