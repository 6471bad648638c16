"""recipes/fabric_pretrain.py under the Fabric 2D strategy equals the single-device Fabric loop.

Real jobs (4 CPU processes, gloo) on a small real-text corpus, 6 fp32 AdamW steps, gradients
clipped to 0.5 (every step is clipped: the clipping uses the global norm of sharded gradients).
The 2×2 and the single-device jobs then run recipes/fabric_dpo.py in the same processes: DPO of the whole model
against a frozen copy set up beside it; and then recipes/fabric_distill.py: a 2-block student distilled from a wider,
deeper teacher read from a Hugging Face folder, set up frozen beside it.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_2d.data import stdlib_sources
from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 4
#: recipes/fabric_dpo.py's run after the pretraining loop in these jobs' processes (``then_dpo``: no launch of its
#: own): 4 steps of 4 windows of 128 positions, several of 96 built-in pairs packed in each.
THEN_DPO = ("fabric_single", "fabric_2x2")
DPO_STEPS, DPO_PAIRS = 4, 96
#: recipes/fabric_distill.py's run after the DPO one (``then_distill``): 4 steps, jsd at temperature 2 mixed half and
#: half with the next-token loss, from a transformers Llama teacher (4 layers of 256) saved in a folder.
DISTILL_STEPS = 4
TEACHER = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "rope_theta": 10000.0}


def teacher_folder(root) -> str:
    """A seeded transformers ``LlamaForCausalLM`` saved as a Hugging Face folder: the distillation's teacher."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEACHER)).save_pretrained(root / "teacher")
    return str(root / "teacher")


def dpo_pairs(root) -> dict:
    """recipes/fabric_dpo.py's data arguments: built-in pairs in a file, its cache prepared here once."""
    import json

    from lightning_2d import PreferenceDataModule
    from lightning_2d.data.preference.builtin import stdlib_preference_rows

    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in stdlib_preference_rows()[:DPO_PAIRS]))
    args = {"data": str(path), "cache_dir": str(root / "pairs_cache"), "max_length": 60, "seq_len": 128}
    PreferenceDataModule(args["data"], cache_dir=args["cache_dir"], max_length=args["max_length"],
                         seq_len=args["seq_len"]).prepare(num_workers=1)
    return {**args, "steps": DPO_STEPS, "lr": 1e-3}  # as the Trainer's preference jobs (test_preference.py)


@pytest.fixture(scope="module")
def fabric_jobs(jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("fabric")
    corpus = root / "corpus"
    corpus.mkdir()
    for path in stdlib_sources()[:6]:
        shutil.copy(path, corpus / path.name)
    base = {"corpus": str(corpus), "cache_dir": str(root / "cache"), "seq_len": 64, "grad_clip": 0.5}
    dpo = dpo_pairs(root)
    distill = {"corpus": str(corpus), "cache_dir": str(root / "cache"), "seq_len": 64, "steps": DISTILL_STEPS,
               "teacher": teacher_folder(root)}

    def run(name, dp=1, tp=1, strategy="2d", accumulate=1, **extra):
        config = {**base, "strategy": strategy, "dp": dp, "tp": tp, "accumulate": accumulate,
                  "batch_size": GLOBAL_BATCH // dp // accumulate, **extra}
        if name in THEN_DPO:
            config["then_dpo"] = {**dpo, "batch_size": GLOBAL_BATCH // dp}
            config["then_distill"] = {**distill, "batch_size": GLOBAL_BATCH // dp}
        return jobs.run(name, "fabric", config, nprocs=dp * tp * extra.get("pp", 1))

    return root, run


def relative_errors(a: list[float], b: list[float], steps: int = 6) -> float:
    assert len(a) == len(b) == steps
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_fabric_2x2_equals_the_single_device_loop_and_clips_to_the_global_norm(fabric_jobs):
    root, run = fabric_jobs
    single = run("fabric_single", strategy="single")
    sharded = run("fabric_2x2", dp=2, tp=2, save_every=3, checkpoint_dir=str(root / "ckpt"))
    ref = single.rank_output(0)
    assert min(ref["grad_norm"]) > 0.5  # clipping is active at every step
    for rank in range(4):
        out = sharded.rank_output(rank)
        loss_error, norm_error = relative_errors(out["loss"], ref["loss"]), relative_errors(out["grad_norm"], ref["grad_norm"])
        print(f"rank {rank}: worst relative loss error {loss_error:.2e}, clip-norm error {norm_error:.2e}")
        assert loss_error <= LOSS_RTOL and norm_error <= LOSS_RTOL
    ref_final, final = load_weights(single, "final"), load_weights(sharded, "final")
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def test_gradient_accumulation_equals_one_double_batch_and_syncs_once(fabric_jobs):
    root, run = fabric_jobs
    # Shared with the parity and resume tests: the same configuration (a name is one job, whichever test runs first).
    double = run("fabric_2x2", dp=2, tp=2, save_every=3, checkpoint_dir=str(root / "ckpt"))
    # Shared with the custom parallelize_fn test: the same job, parallelized by a hand-written hook.
    accumulated = run("fabric_2x2_acc2_custom_fn", dp=2, tp=2, accumulate=2, custom_parallelize_fn=True)
    assert relative_errors(accumulated.rank_output(0)["loss"], double.rank_output(0)["loss"]) <= LOSS_RTOL
    # no_backward_sync: the first micro-batch's backward reduce-scatters nothing.
    for rank in range(4):
        assert accumulated.rank_output(rank)["reduce_scatters"] == double.rank_output(rank)["reduce_scatters"] > 0


def test_save_then_load_at_another_layout_with_hsdp(fabric_jobs):
    """Saved at (dp, tp) = (2, 2), resumed under HSDP (replicate, shard, tp) = (2, 2, 1): steps 4-6 equal
    the single-device loop's."""
    from tests.unit.test_safe_loading import plant_meta

    root, run = fabric_jobs
    run("fabric_2x2", dp=2, tp=2, save_every=3, checkpoint_dir=str(root / "ckpt"))
    # The same run then loads a copy whose meta.pt holds a pickled os.system (its digest recorded again): refused
    # by fabric.load on every rank in one line, nothing built; and any checkpoint with weights_only=False.
    marker = root / "payload_ran"
    planted = plant_meta(root / "ckpt" / "step-000003", root / "planted" / "step-000003", marker)
    resumed = run("fabric_resume_hsdp_2x2x1", dp=4, tp=1, replicate=2, resume=str(root / "ckpt" / "step-000003"),
                  refuse=[["payload", str(planted), None], ["not_weights_only", str(root / "ckpt" / "step-000003"), False]])
    ref = run("fabric_single", strategy="single").rank_output(0)
    out = resumed.rank_output(0)
    assert len(out["loss"]) == 3  # steps 4-6 only
    assert max(abs(x - y) / y for x, y in zip(out["loss"], ref["loss"][3:])) <= LOSS_RTOL
    for rank in range(4):
        refused = resumed.rank_output(rank)["refused"]
        assert refused["payload"].startswith(f"UnsafeCheckpointError: {planted / 'meta.pt'} holds a pickled"
                                             " posix.system, which a weights-only load refuses"), refused
        assert "the file was not loaded" in refused["payload"] and "\n" not in refused["payload"]
        assert refused["not_weights_only"].startswith("CheckpointError: weights_only=False was passed"), refused
    assert not marker.exists()


def test_simple_fsdp_under_fabric_resumes_fully_shard_s_checkpoint_and_accumulates(fabric_jobs):
    """``fsdp_backend="simple_fsdp"``: FSDP2's (2, 2) checkpoint of step 3 loaded by ``fabric.load`` under SimpleFSDP,
    then 2 accumulated micro-steps per step (``no_backward_sync`` has no reduction to skip: each micro-batch
    reduces its gradients) and clipping: steps 4-6 equal the single-device loop's, and no FSDP2 unit reduced."""
    root, run = fabric_jobs
    run("fabric_2x2", dp=2, tp=2, save_every=3, checkpoint_dir=str(root / "ckpt"))
    resumed = run("fabric_simple_resume_acc2", dp=2, tp=2, accumulate=2, fsdp_backend="simple_fsdp",
                  resume=str(root / "ckpt" / "step-000003"))
    ref = run("fabric_single", strategy="single").rank_output(0)
    for rank in range(4):
        out = resumed.rank_output(rank)
        assert len(out["loss"]) == 3 and out["reduce_scatters"] == 0  # FSDP2's reduce-scatters: none ran
        assert max(abs(x - y) / y for x, y in zip(out["loss"], ref["loss"][3:])) <= LOSS_RTOL
        assert max(abs(x - y) / y for x, y in zip(out["grad_norm"], ref["grad_norm"][3:])) <= LOSS_RTOL


def test_a_custom_parallelize_fn_is_still_accepted(fabric_jobs):
    """Fabric's own hook, written by hand (the library's steps, full AC), in the accumulation test's job:
    two accumulated micro-steps per step still equal the single-device loop."""
    _, run = fabric_jobs
    custom = run("fabric_2x2_acc2_custom_fn", dp=2, tp=2, accumulate=2, custom_parallelize_fn=True)
    ref = run("fabric_single", strategy="single").rank_output(0)
    for rank in range(4):
        assert relative_errors(custom.rank_output(rank)["loss"], ref["loss"]) <= LOSS_RTOL


def test_fabric_pipeline_with_accumulation_equals_the_single_device_loop(fabric_jobs):
    """2 pipeline stages (GPipe) × 2 tensor-parallel ranks, 2 accumulated micro-steps per step and clipping
    to 0.5: the recipe's loop (``pipeline.train_step(..., grad_scale=1 / accumulate)`` in place of the model and ``fabric.backward``),
    equals the single-device loop."""
    _, run = fabric_jobs
    ref = run("fabric_single", strategy="single").rank_output(0)
    pipelined = run("fabric_pp2_tp2_gpipe_acc2", dp=1, tp=2, pp=2, pipeline_schedule="GPipe", accumulate=2)
    for rank in range(4):
        out = pipelined.rank_output(rank)
        loss_error, norm_error = relative_errors(out["loss"], ref["loss"]), relative_errors(out["grad_norm"], ref["grad_norm"])
        print(f"rank {rank}: worst relative loss error {loss_error:.2e}, clip-norm error {norm_error:.2e}")
        assert loss_error <= LOSS_RTOL and norm_error <= LOSS_RTOL
    final, ref_final = load_weights(pipelined, "final"), load_weights(run("fabric_single", strategy="single"), "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def lora_2x2(fabric_jobs):
    """The recipe's ``--lora-rank 4`` at 2×2, saving every 3 steps; then, in the same processes, a second run of it
    resuming from step 3 (``then_resume``)."""
    root, run = fabric_jobs
    ckpt = root / "lora_ckpt"
    return run("fabric_2x2_lora", dp=2, tp=2, lora_rank=4, save_every=3, checkpoint_dir=str(ckpt),
               then_resume=str(ckpt / "step-000003")), ckpt


def test_lora_under_fabric_equals_the_single_device_loop_and_leaves_the_base_bit_for_bit(fabric_jobs):
    """The Fabric recipe with ``--lora-rank 4``: adapters declared on the meta model (``model.lora``), added by
    ``fabric.setup`` (its converters), the optimizer over what requires gradients. At 2×2 (sequence parallel) the
    adapters train as on one device, the gradient norms (the adapters', clipped) agree, and every frozen weight ends
    as it started."""
    from lightning_2d.ops.lora import is_adapter_parameter

    _, run = fabric_jobs
    single = run("fabric_single_lora", strategy="single", lora_rank=4)
    sharded, _ = lora_2x2(fabric_jobs)
    ref = single.rank_output(0)
    assert ref["requires_grad"] and all(is_adapter_parameter(n) for n in ref["requires_grad"])
    for rank in range(4):
        out = sharded.rank_output(rank)
        assert out["requires_grad"] == ref["requires_grad"]
        error = relative_errors(out["loss"], ref["loss"])
        print(f"fabric lora rank {rank}: worst relative loss error {error:.2e}")
        assert error <= 1e-5 and out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    from lightning_2d import ModelArgs, Transformer

    initial = Transformer(ModelArgs.from_name("debug"))
    initial.init_weights(42)  # the recipe's seeded init (--seed 42)
    final, ref_final = load_weights(sharded, "final"), load_weights(single, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        if is_adapter_parameter(name):
            torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
        else:
            start = initial.get_parameter(name.removeprefix("_forward_module."))  # Fabric's wrapper
            assert torch.equal(weight, start) and torch.equal(ref_final[name], start), name


def test_lora_under_fabric_saves_only_its_adapters_and_resumes_them_exactly(fabric_jobs):
    """``fabric.save`` under LoRA, as the Trainer's checkpoints: the adapters (56: 4 blocks × 7 projections × A, B)
    and their AdamW state only, with their settings and base (the seeded init, the recipe's seed 42); ``fabric.load``
    of step 3 at the same layout, its base rebuilt from the seed, continues exactly: steps 4-6 and the final weights
    bit for bit."""
    from lightning_2d.checkpoint.dcp_metadata import read_dcp_metadata, stored_shapes
    from lightning_2d.checkpoint.subset import adapter_record
    from lightning_2d.ops.lora import is_adapter_parameter

    sharded, ckpt = lora_2x2(fabric_jobs)
    step3 = ckpt / "step-000003"
    stored = stored_shapes(step3, "model")
    assert len(stored) == 4 * 7 * 2 and all(is_adapter_parameter(n) for n in stored), sorted(stored)
    optimizer_items = [n for n in read_dcp_metadata(step3).state_dict_metadata if n.startswith("optimizer.state.")]
    assert optimizer_items and all(is_adapter_parameter(n.split(".", 2)[2].rpartition(".")[0]) for n in optimizer_items)
    assert adapter_record(step3) == {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": None, "rslora": False},
                                     "base": {"init_from": None, "init_seed": 42}}
    for rank in range(4):
        out = sharded.rank_output(rank)
        assert out["resumed"]["loss"] == out["loss"][3:]  # exact: no tolerance
        assert out["resumed"]["grad_norm"] == out["grad_norm"][3:]
    final, resumed = load_weights(sharded, "final"), load_weights(sharded, "resumed_final")
    assert resumed.keys() == final.keys()
    for name, weight in resumed.items():
        assert torch.equal(weight, final[name]), name


def test_a_mixture_of_experts_under_fabric_with_expert_parallelism_equals_the_single_device_loop(fabric_jobs):
    """debug-moe in the recipe's loop at expert parallel 2 × FSDP 2: the auxiliary loss over the global batch added to
    each rank's loss (the loop's moe_auxiliary_loss), the experts split over the expert-parallel ranks by
    fabric.setup; the losses, gradient norms and final weights are the single-device loop's."""
    root, run = fabric_jobs
    single = run("fabric_moe_single", strategy="single", model="debug-moe")
    parallel = run("fabric_moe_ep2", dp=4, model="debug-moe", ep=2)
    ref = single.rank_output(0)
    for rank in range(4):
        out = parallel.rank_output(rank)
        assert relative_errors(out["loss"], ref["loss"]) <= LOSS_RTOL, (rank, out["loss"], ref["loss"])
        assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        placed = out["expert_placements"]["layers.1.feed_forward.experts.w1"]
        assert placed["mesh_dims"] == ["expert_data_shard", "expert_parallel"] and placed["local_shape"][0] == 2
    final, expected = load_weights(parallel, "final"), load_weights(single, "final")
    for name, weight in expected.items():
        torch.testing.assert_close(final[name], weight, rtol=1e-5, atol=1e-5, msg=name)


def test_dpo_against_a_frozen_reference_set_up_beside_the_policy_equals_the_single_device_loop(fabric_jobs):
    """recipes/fabric_dpo.py: the policy and a frozen copy (every parameter ``requires_grad=False``) both given to
    ``fabric.setup``. At 2×2 (FSDP × TP, sequence parallel) the reference's parameters are DTensors placed as the
    policy's (every unit resharded between steps: its head too), never require or get a gradient, and end as they
    started (the seeded init, bit for bit); the DPO losses, TRL's metrics, gradient norms and the policy's final weights
    equal the single-device loop's."""
    from lightning_2d import ModelArgs, Transformer

    root, run = fabric_jobs
    single = run("fabric_single", strategy="single")
    sharded = run("fabric_2x2", dp=2, tp=2, save_every=3, checkpoint_dir=str(root / "ckpt"))
    ref = single.rank_output(0)["dpo"]
    assert len(ref["loss"]) == DPO_STEPS and ref["metrics"][-1]["rewards/margins"] > 0  # it trained
    for rank in range(4):
        out = sharded.rank_output(rank)["dpo"]
        placed = out["placements"]
        assert placed["reference"] and placed["reference"] == placed["policy"]
        # FSDP's row shards (strided under a tensor-parallel row split) over the data-parallel ranks
        assert all(p["mesh_dims"][0] == "data_parallel" and "Shard(dim=0" in p["placements"][0]
                   for p in placed["reference"].values())
        assert not any(out["reference_requires_grad"]) and not any(out["reference_has_grad"])
        loss_error = max(abs(x - y) / abs(y) for x, y in zip(out["loss"], ref["loss"], strict=True))
        norm_error = max(abs(x - y) / abs(y) for x, y in zip(out["grad_norm"], ref["grad_norm"], strict=True))
        print(f"fabric DPO rank {rank}: worst relative loss error {loss_error:.2e}, gradient norm {norm_error:.2e}"
              f" ({out['seconds']:.1f} s added to the 2x2 job, {ref['seconds']:.1f} s to the single-device one)")
        assert loss_error <= LOSS_RTOL and norm_error <= LOSS_RTOL
        for got, want in zip(out["metrics"], ref["metrics"], strict=True):
            for name, value in want.items():  # rewards: beta x a difference of sums of ~-400 (see test_preference)
                assert got[name] == pytest.approx(value, **({"rel": 1e-5} if name.startswith("logps/") else {"abs": 5e-5}))
    final, ref_final = load_weights(sharded, "dpo_final"), load_weights(single, "dpo_final")
    assert final.keys() == ref_final.keys()
    # AdamW divides each update by its gradient's running RMS: an element whose gradients are near zero moves by up to
    # the learning rate on rounding alone, and DPO's losses are differences of sums of ~-400 (the rewards' 5e-5 above).
    # Measured: one embedding element off by 4.0e-5 (summing the tensor ranks' partial norm gradients after
    # the data-parallel reduce-scatter, parallel.grad_sync, rounds differently), every other weight within 1e-5.
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=5e-5, msg=name)
    initial = Transformer(ModelArgs.from_name("debug", vocab_size=264))
    initial.init_weights(42)  # the recipe's seeded init (--seed 42), the policy's start
    for job in (sharded, single):
        reference = load_weights(job, "dpo_reference")
        assert len(reference) == len(dict(initial.named_parameters()))
        for name, weight in reference.items():
            assert torch.equal(weight, initial.get_parameter(name.removeprefix("_forward_module."))), name


def test_distillation_from_a_teacher_folder_set_up_beside_the_student_equals_the_single_device_loop(fabric_jobs):
    """recipes/fabric_distill.py: a 2-block student and a teacher read from a Hugging Face folder (4 layers of 256),
    frozen, both given to ``fabric.setup``. At 2×2 the teacher is sharded by its own plan (FSDP over the data ranks,
    its head's vocabulary rows on the tensor ranks where the student's are), never requires or gets a gradient, ends
    bit for bit as set up, and holds the folder's weights; the mixed loss, the logged divergence and next-token loss,
    the gradient norms and the student's final weights equal the single-device loop's."""
    from safetensors.torch import load_file

    root, run = fabric_jobs
    single = run("fabric_single", strategy="single")
    sharded = run("fabric_2x2", dp=2, tp=2, save_every=3, checkpoint_dir=str(root / "ckpt"))
    ref = single.rank_output(0)["distill"]
    assert len(ref["loss"]) == DISTILL_STEPS and ref["teacher_unchanged"]
    assert ref["metrics"][-1]["distill/jsd"] < ref["metrics"][0]["distill/jsd"]  # it learns from the teacher
    for rank in range(4):
        out = sharded.rank_output(rank)["distill"]
        head, student_head = out["teacher_placements"]["output.weight"], out["student_placements"]["output.weight"]
        assert head["mesh_dims"] == ["data_parallel", "tensor_parallel"] and head["placements"][1] == "Shard(dim=0)"
        assert head["placements"] == student_head["placements"] and head["local_shape"] == [64, 256], head
        assert all(p["mesh_dims"][0] == "data_parallel" for p in out["teacher_placements"].values())
        assert not any(out["teacher_requires_grad"]) and not any(out["teacher_has_grad"])
        assert out["teacher_unchanged"]
        errors = {"loss": relative_errors(out["loss"], ref["loss"], DISTILL_STEPS),
                  "gradient norm": relative_errors(out["grad_norm"], ref["grad_norm"], DISTILL_STEPS)}
        for name in ref["metrics"][0]:
            errors[name] = relative_errors([m[name] for m in out["metrics"]], [m[name] for m in ref["metrics"]],
                                           DISTILL_STEPS)
        print(f"fabric distillation rank {rank}: " + ", ".join(f"worst relative {k} error {v:.2e}"
                                                               for k, v in errors.items()))
        assert max(errors.values()) <= LOSS_RTOL, errors
    final, ref_final = load_weights(sharded, "distill_final"), load_weights(single, "distill_final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
    # The folder's weights, on both (names free of the rotary permutation: the embedding, a down projection, a norm).
    saved = load_file(root / "teacher" / "model.safetensors")
    for job in (sharded, single):
        teacher = {name.removeprefix("_forward_module."): w for name, w in load_weights(job, "distill_teacher").items()}
        assert teacher["layers.3.feed_forward.w1.weight"].shape == (512, 256)
        for ours, theirs in [("tok_embeddings.weight", "model.embed_tokens.weight"),
                             ("layers.2.feed_forward.w2.weight", "model.layers.2.mlp.down_proj.weight"),
                             ("layers.1.attention_norm.weight", "model.layers.1.input_layernorm.weight"),
                             ("output.weight", "lm_head.weight")]:
            assert torch.equal(teacher[ours], saved[theirs]), ours
