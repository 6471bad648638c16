"""Distillation (``teacher=`` and ``distillation=``) under the parallelisms equals one device.

Real jobs of 4 CPU processes on gloo sharing one launch (``Jobs.share``), 6 fp32 AdamW steps of the ``debug`` Llama
cut to 2 blocks (dim 128) distilled from a deeper and wider teacher (``debug`` at dim 256 and 4 blocks, the same
vocabulary, its seeded init), against the single-device ``Trainer`` on the same global batches:

- 2×2 with sequence parallelism, the whole student, generalized JSD at temperature 2 mixed half and half with the
  next-token loss (the teacher tensor-parallel by its own plan, both heads' vocabulary rows on the same ranks), saving
  a checkpoint;
- context parallel 2 × data parallel 2 on packed documents whose first 3 targets are ignored (a chat's prompt),
  forward KL over every position of a document up to its last trained one (``tokens="all"``: the prompts too; the
  mask marked on whole rows, then cut with them: a rank's slice may hold a document's prompt alone);
- a LoRA student at 2×2 with two batches a step, reverse KL alone (``alpha=1``);
- ``HFCausalLMModule``: a Qwen3 student from a wider, deeper Llama teacher (transformers' models, each by its own
  family's plan) at 2×2 with sequence parallelism.

Each compares the losses, the logged divergence and next-token loss, the gradient norms and the final weights; and
asserts the teacher is sharded (FSDP over the data ranks, its head over the vocabulary on the tensor ranks), never
requires or gets a gradient, is in no optimizer and no checkpoint, and ends bit for bit as it started on every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import SMALL, load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

#: Deeper and wider than the student (2 blocks of dim 128): 4 blocks of dim 256, the same vocabulary.
TEACHER = {"model": "debug", "model_overrides": {"dim": 256, "n_layers": 4}}
JSD = {"loss": "jsd", "beta": 0.5, "temperature": 2.0, "alpha": 0.5, "chunk_size": 48}
FORWARD_KL_ALL = {"loss": "forward_kl", "alpha": 0.7, "tokens": "all"}
REVERSE_KL = {"loss": "reverse_kl", "alpha": 1.0}
LORA = {"rank": 4, "alpha": 8.0}
#: transformers' decoders: a Qwen3 student (2 layers of 64) and a Llama teacher (3 layers of 128), one vocabulary.
HF_STUDENT = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
HF_TEACHER = {"config": {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
                         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "max_position_embeddings": 128, "tie_word_embeddings": False}}


@pytest.fixture(scope="module")
def runs(jobs) -> dict:
    jsd = {**SMALL, "teacher": TEACHER, "distillation": JSD}
    packed = {**SMALL, "teacher": TEACHER, "distillation": FORWARD_KL_ALL, "documents": True, "prompts": 3}
    lora = {**SMALL, "teacher": TEACHER, "distillation": REVERSE_KL, "lora": LORA, "even_labels": True}
    hf = {"hf_config": HF_STUDENT, "teacher": HF_TEACHER, "distillation": {**JSD, "alpha": 0.6}}
    specs = {
        "reference": jobs.reference_job(**jsd),
        "sp_2x2": jobs.layout_job(2, 2, grad_norms=True, save_checkpoint=True, **jsd),
        "packed_reference": jobs.reference_job(**packed),
        "cp_dp": jobs.layout_job(2, 1, nprocs=4, context_parallel_size=2, grad_norms=True, **packed),
        "lora_reference": jobs.reference_job(**lora),
        "lora_2x2": jobs.layout_job(2, 2, accumulate=2, grad_norms=True, **lora),
        "hf_reference": jobs.reference_job(**hf),
        "hf_2x2": jobs.layout_job(2, 2, grad_norms=True, **hf),
    }
    specs = {key: (f"distillation_{key}", config, nprocs, nodes) for key, (_, config, nprocs, nodes) in specs.items()}
    jobs.share("distillation", list(specs.values()))
    return {key: jobs.run(name, "fit", config, nprocs=nprocs) for key, (name, config, nprocs, _) in specs.items()}


def check_against(run, reference, label: str, accumulated: bool = False) -> None:
    """``run``'s losses, logged means (each batch's, when a step is one batch), gradient norms and final weights
    against ``reference``'s; the teacher as the module docstring says."""
    ref = reference.rank_output(0)
    assert len(ref["losses"]) == 6 and len(ref["distill_metrics"]) == 6
    assert ref["teacher_unchanged"] and ref["teacher_parameters"] > 0
    for rank in range(4):
        out = run.rank_output(rank)
        errors = {"gradient norm": worst_relative_error(out["grad_norms"], ref["grad_norms"])}
        if accumulated:  # two batches a step, each logging its own mean: the step shows in its gradients
            assert len(out["losses"]) == len(out["distill_metrics"]) == 12
        else:
            errors["loss"] = worst_relative_error(out["losses"], ref["losses"])
            for name in ref["distill_metrics"][0]:
                errors[name] = worst_relative_error([m[name] for m in out["distill_metrics"]],
                                                    [m[name] for m in ref["distill_metrics"]])
        print(f"{label} rank {rank}: " + ", ".join(f"worst relative {k} error {v:.2e}" for k, v in errors.items()))
        assert max(errors.values()) <= LOSS_RTOL, (errors, out["losses"], ref["losses"])
        # The teacher: unchanged bit for bit on this rank, frozen, outside the optimizer, sharded by FSDP2.
        assert out["teacher_unchanged"] and out["teacher_parameters"] == ref["teacher_parameters"]
        assert out["teacher_requires_grad"] == out["teacher_grads"] == out["teacher_in_optimizer"] == 0
        assert out["teacher_data_parallel_modules"]["fully_shard"] > 0
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def test_distillation_at_2x2_with_sequence_parallelism_equals_one_device(runs):
    """Generalized JSD at temperature 2, half the next-token loss: the teacher (4 blocks of dim 256) sharded by its
    own plan over the same 2×2 mesh, its head's vocabulary rows on the tensor ranks where the student's are."""
    check_against(runs["sp_2x2"], runs["reference"], "2x2 SP")
    out = runs["sp_2x2"].rank_output(0)
    placements = out["teacher_placements"]
    head, student_head = placements["output.weight"], out["placements"]["output.weight"]
    # FSDP over the data ranks, the vocabulary over the tensor ranks: the student's rows, the teacher's width.
    assert head["mesh_dims"] == ["data_parallel", "tensor_parallel"] and head["placements"][1] == "Shard(dim=0)"
    assert head["placements"] == student_head["placements"], (head, student_head)
    assert head["shape"] == [256, 256] and head["local_shape"] == [64, 256] and student_head["local_shape"] == [64, 128]
    assert placements["layers.3.feed_forward.w1.weight"]["shape"][1] == 256  # the teacher's own shape, 4 blocks


def test_the_teacher_is_in_no_checkpoint(runs):
    """The checkpoint saved after the 2×2 run holds the student's weights and optimizer state only."""
    from lightning_2d.checkpoint.dcp_metadata import read_dcp_metadata, stored_shapes

    folder = runs["sp_2x2"].out_dir / "final_ckpt"
    weights = {name.removeprefix("model."): shape for name, shape in stored_shapes(folder, "state_dict").items()}
    student = load_weights(runs["sp_2x2"], "final")
    # The teacher's names are the student's (both models' own), its shapes (dim 256) and blocks 2-3 are not.
    assert weights.keys() == student.keys(), sorted(weights.keys() ^ student.keys())[:4]
    assert all(list(weights[name]) == list(student[name].shape) for name in student)
    assert not any("teacher" in key for key in read_dcp_metadata(folder).state_dict_metadata)


def test_distillation_under_context_parallelism_on_packed_documents_equals_one_device(runs):
    """Forward KL over every position of each document up to its last trained one, 2 context × 2 data ranks: both
    models see this rank's slices and each document's positions, the counts are global."""
    out = runs["cp_dp"].rank_output(0)
    assert out["mesh_shape"][out["mesh_dims"].index("context_parallel")] == 2
    check_against(runs["cp_dp"], runs["packed_reference"], "CP 2 x DP 2 packed")


def test_distillation_of_a_lora_student_with_accumulation_equals_one_device(runs):
    """Reverse KL alone into the adapters of a LoRA student, two batches a step: only the adapters train, the
    teacher is untouched."""
    check_against(runs["lora_2x2"], runs["lora_reference"], "LoRA 2x2, accumulate 2", accumulated=True)
    out = runs["lora_2x2"].rank_output(0)
    assert out["optimized"] and all("lora" in name for name in out["optimized"])


def test_a_hugging_face_student_distils_from_a_teacher_of_another_family_at_2x2(runs):
    """transformers' Qwen3 from a Llama teacher: each parallelized by its own family's plan, the ``lm_head`` of both
    computing the loss in its call (sequence parallelism enters at the first layer, the head gathers the sequence)."""
    pytest.importorskip("transformers")
    check_against(runs["hf_2x2"], runs["hf_reference"], "HF 2x2 SP")
    head = runs["hf_2x2"].rank_output(0)["teacher_placements"]["lm_head.weight"]
    assert head["shape"] == [256, 128] and head["local_shape"] == [64, 128]
