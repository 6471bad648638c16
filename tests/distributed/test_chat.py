"""Instruction fine-tuning (``ChatDataModule``: conversations rendered with a ChatML template, the loss on the
assistant's tokens, packed as documents) under every parallelism equals one device.

Real jobs of 4 CPU processes on gloo, one launch per process count (``Jobs.share``), 6 fp32 AdamW steps of the
``debug`` Llama on 120 conversations about the standard library (the built-in corpus, byte-level ChatML
tokenizer), against the single-device ``Trainer`` on the same global batches: 2×2 with sequence parallelism;
context parallel 2 × tensor parallel 2 (each rank holds load-balanced slices of the packed windows, their
positions with them); pipeline 2 × data parallel 2 (1F1B; every stage receives the positions); and 2×2 with two
accumulated batches per step, whose loss is the mean over the step's trained tokens (``step_tokens``), as one device
computes it over the whole step (the gradient norms and final weights are compared: the logged losses are each
batch's).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

SEQ_LEN, CONVERSATIONS = 128, 120


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
    common = {"chat": chat, "seq_len": SEQ_LEN, "model_overrides": {"vocab_size": 264}}
    specs = {
        "reference": jobs.reference_job(**common),
        "sp": jobs.layout_job(2, 2, **common),
        "cp_tp": jobs.layout_job(1, 2, nprocs=4, context_parallel_size=2, **common),
        "pp_dp": jobs.layout_job(2, 1, nprocs=4, pipeline_parallel_size=2, pipeline_schedule="1F1B", **common),
        "accumulate": jobs.layout_job(2, 2, accumulate=2, grad_norms=True, **common),
    }
    # Named by layout (the default names would hold the data's paths).
    return {key: (f"chat_{key}", config, nprocs, nodes) for key, (_, config, nprocs, nodes) in specs.items()}


@pytest.fixture(scope="module")
def runs(jobs, chat) -> dict:
    specs = jobs_of(jobs, chat)
    jobs.share("chat", list(specs.values()))
    return {key: jobs.run(name, "fit", config, nprocs=nprocs) for key, (name, config, nprocs, _) in specs.items()}


@pytest.mark.parametrize("layout", ["sp", "cp_tp", "pp_dp"])
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


def test_under_context_parallelism_each_rank_attends_its_slices_of_the_packed_windows(runs):
    for rank in range(4):
        out = runs["cp_tp"].rank_output(rank)
        assert out["mesh_shape"][out["mesh_dims"].index("context_parallel")] == 2
        assert out["context_parallel_attention"] == [f"layers.{b}.attention" for b in range(4)]
        sizes = dict(zip(*out["fsdp_mesh"]))  # FSDP shards over the context ranks (data parallel is 1 here)
        assert sizes["data_shard_context_parallel"] == 2 and sizes["tensor_parallel"] == 2, sizes
        assert out["ring_vs_all_gather"] <= 1e-5


def test_accumulated_batches_weigh_every_trained_token_of_the_step_alike(runs):
    """Two batches per step with different numbers of trained tokens: divided by the step's count (summed over both
    batches and both replicas), the gradients are one device's on the whole step (norms and weights)."""
    reference, run = runs["reference"].rank_output(0), runs["accumulate"]
    for rank in range(4):
        out = run.rank_output(rank)
        assert len(out["trained_tokens"]) == 12 and out["step_tokens"][0::2] == out["step_tokens"][1::2]
        assert any(a != b for a, b in zip(out["trained_tokens"][0::2], out["trained_tokens"][1::2]))
        error = worst_relative_error(out["grad_norms"], reference["grad_norms"])
        print(f"accumulate rank {rank}: worst relative gradient-norm error {error:.2e}")
        assert error <= LOSS_RTOL, (out["grad_norms"], reference["grad_norms"])
    # The step's count is both replicas' trained tokens of both batches: the reference's one batch.
    replicas = {run.rank_output(r)["dp_rank"]: run.rank_output(r) for r in range(4)}
    for step in range(6):
        total = sum(replicas[d]["step_tokens"][2 * step] for d in (0, 1))
        assert total == reference["trained_tokens"][step] == reference["step_tokens"][step]
    final, ref_final = load_weights(run, "final"), load_weights(runs["reference"], "final")
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
