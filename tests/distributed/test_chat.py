"""Instruction fine-tuning (``ChatDataModule``: conversations rendered with a ChatML template, the loss on the
assistant's tokens, packed as documents) under every parallelism equals one device.

Real jobs of 4 CPU processes on gloo, one launch per process count (``Jobs.share``), 6 fp32 AdamW steps of the
``debug`` Llama on 120 conversations about the standard library (the built-in corpus, byte-level ChatML
tokenizer), against the single-device ``Trainer`` on the same global batches: 2×2 with sequence parallelism and two
accumulated batches per step, whose loss is the mean over the step's trained tokens (``step_tokens``), as one device
computes it over the whole step; context parallel 2 × tensor parallel 2 (each rank holds load-balanced slices of the
packed windows, their positions with them); pipeline 2 × data parallel 2 (1F1B; every stage receives the
positions); and a transformers Qwen3 at 2×2, whose own mask builder keeps the conversations apart.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

SEQ_LEN, CONVERSATIONS, BLOCKS = 128, 120, 2
#: A tiny transformers Qwen3 for the byte-level ChatML vocabulary.
QWEN3 = {"model_type": "qwen3", "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict:
    """The data module's arguments, its cache prepared here once (every job finds it)."""
    from lightning_2d import ChatDataModule
    from lightning_2d.data.chat.builtin import stdlib_conversations

    folder = tmp_path_factory.mktemp("chat")
    rows = stdlib_conversations()[:CONVERSATIONS]
    (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"paths": str(folder / "chats.jsonl"), "tokenizer": "byte", "cache_dir": str(folder / "cache")}
    data = ChatDataModule(**args, seq_len=SEQ_LEN)
    data.prepare(num_workers=1)
    return args


def jobs_of(jobs, chat: dict) -> dict:
    # The debug Llama with the byte vocabulary and 2 of its 4 blocks (the pipeline's stages one each).
    common = {"chat": chat, "seq_len": SEQ_LEN, "model_overrides": {"vocab_size": 264, "n_layers": BLOCKS}}
    specs = {
        "reference": jobs.reference_job(**common),
        "cp_tp": jobs.layout_job(1, 2, nprocs=4, context_parallel_size=2, **common),
        "pp_dp": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2, pipeline_schedule="1F1B", **common),
        "accumulate": jobs.layout_job(2, 2, accumulate=2, grad_norms=True, **common),
        # A transformers Qwen3 (HFCausalLMModule): its own mask builder keeps the packed conversations apart.
        "hf_reference": jobs.reference_job(**common, hf_config=QWEN3),
        "hf_sp": jobs.layout_job(2, 2, **common, hf_config=QWEN3),
    }
    # Named by layout (the default names would hold the data's paths).
    return {key: (f"chat_{key}", config, nprocs, nodes) for key, (_, config, nprocs, nodes) in specs.items()}


@pytest.fixture(scope="module")
def runs(jobs, chat) -> dict:
    specs = jobs_of(jobs, chat)
    jobs.share("chat", list(specs.values()))
    return {key: jobs.run(name, "fit", config, nprocs=nprocs) for key, (name, config, nprocs, _) in specs.items()}


@pytest.mark.parametrize("layout", ["cp_tp", "pp_dp"])
def test_packed_fine_tuning_equals_one_device(runs, layout):
    reference, run = runs["reference"].rank_output(0), runs[layout]
    assert len(reference["losses"]) == 6 and all(t > 0 for t in reference["trained_tokens"])
    for rank in range(4):
        out = run.rank_output(rank)
        if layout != "pp_dp" or "0" in out.get("blocks", ["0"]):  # a pipeline's first stage holds block 0
            assert out["blocks_given_masks"] >= len(out["losses"])  # each step's blocks got the documents' mask
        error = worst_relative_error(out["losses"], reference["losses"])
        print(f"{layout} rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], reference["losses"])
    final, ref_final = load_weights(run, "final"), load_weights(runs["reference"], "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_hugging_face_decoder_fine_tunes_packed_conversations_as_on_one_device(runs):
    """transformers builds the packed-documents mask from the restarting positions (counted: the forwards whose
    batch packs more than one conversation in a row), at 2×2 with sequence parallelism as on one device."""
    reference, run = runs["hf_reference"].rank_output(0), runs["hf_sp"]
    assert reference["packed_masks"] >= 1 and len(reference["losses"]) == 6
    assert sum(run.rank_output(rank)["packed_masks"] for rank in range(4)) >= 2  # tensor-parallel pairs alike
    for rank in range(4):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], reference["losses"])
        print(f"hf rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], reference["losses"])
    final, ref_final = load_weights(run, "final"), load_weights(runs["hf_reference"], "final")
    for name, weight in final.items():
        # As in test_options.py: AdamW's normalized update (lr 1e-3 per step) turns the ranks' other summation order
        # into up to ~1.1e-5 on an element whose gradient is near zero (measured once: 1 of q_proj's 4,096 elements,
        # 1.09e-5 off after moving 1.0e-3); a wrongly sharded weight would be off by its whole update.
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=3e-5, msg=name)


def test_under_context_parallelism_each_rank_attends_its_slices_of_the_packed_windows(runs):
    for rank in range(4):
        out = runs["cp_tp"].rank_output(rank)
        assert out["mesh_shape"][out["mesh_dims"].index("context_parallel")] == 2
        assert out["context_parallel_attention"] == [f"layers.{b}.attention" for b in range(BLOCKS)]
        sizes = dict(zip(*out["fsdp_mesh"]))  # FSDP shards over the context ranks (data parallel is 1 here)
        assert sizes["data_shard_context_parallel"] == 2 and sizes["tensor_parallel"] == 2, sizes
        assert out["ring_vs_all_gather"] <= 1e-5


def test_at_2x2_with_sequence_parallelism_and_accumulation_every_trained_token_of_the_step_weighs_alike(runs):
    """2×2 with sequence parallelism, two batches per step with different numbers of trained tokens: divided by the
    step's count (summed over both batches and both replicas), the losses, gradients and weights are one device's on
    the whole step. Each batch logs its own mean: weighted by its trained tokens, the two give the step's."""
    reference, run = runs["reference"].rank_output(0), runs["accumulate"]
    for rank in range(4):
        out = run.rank_output(rank)
        assert out["blocks_given_masks"] >= len(out["losses"])  # each batch's blocks got the documents' mask
        assert len(out["trained_tokens"]) == 12 and out["step_tokens"][0::2] == out["step_tokens"][1::2]
        assert any(a != b for a, b in zip(out["global_tokens"][0::2], out["global_tokens"][1::2]))
        losses, tokens = out["losses"], out["global_tokens"]
        step_losses = [(losses[i] * tokens[i] + losses[i + 1] * tokens[i + 1]) / (tokens[i] + tokens[i + 1])
                       for i in range(0, 12, 2)]
        errors = [worst_relative_error(step_losses, reference["losses"]),
                  worst_relative_error(out["grad_norms"], reference["grad_norms"])]
        print(f"2x2 SP, accumulate 2, rank {rank}: worst relative loss error {errors[0]:.2e},"
              f" gradient norm {errors[1]:.2e}")
        assert max(errors) <= LOSS_RTOL, (step_losses, reference["losses"], out["grad_norms"], reference["grad_norms"])
    # The step's count is both replicas' trained tokens of both batches: the reference's one batch.
    replicas = {run.rank_output(r)["dp_rank"]: run.rank_output(r) for r in range(4)}
    for step in range(6):
        total = sum(replicas[d]["step_tokens"][2 * step] for d in (0, 1))
        assert total == reference["trained_tokens"][step] == reference["step_tokens"][step]
    final, ref_final = load_weights(run, "final"), load_weights(runs["reference"], "final")
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
