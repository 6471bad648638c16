"""Tied embeddings (one weight for the token embedding and the output head: Llama 3.2 1B/3B, Qwen2.5 small, SmolLM)
trained at (dp, tp) = (2, 2) with sequence parallelism equal single-device training, in our Llama and in a Hugging
Face decoder; both runs share one launch. How the tie is kept through the parallel steps is unit-tested in
tests/unit/test_ties.py."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import PARITY, load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

TIED_LLAMA = {"model_overrides": {"tie_word_embeddings": True}}
TIED_HF = {"hf_config": {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True,
}}
RUNS = {  # name: (extra options, the tied names)
    "llama": (TIED_LLAMA, ["tok_embeddings.weight", "output.weight"]),
    "hf": (TIED_HF, ["model.embed_tokens.weight", "lm_head.weight"]),
}


@pytest.fixture(scope="module")
def tied_runs(jobs):
    return jobs.layouts("tied_embeddings", {name: (2, 2, {**extra, "sequence_parallel": True, "save_checkpoint": True})
                                            for name, (extra, _) in RUNS.items()}, nprocs=4)


@pytest.mark.parametrize("name", list(RUNS))
def test_tied_embeddings_train_at_2x2_as_on_one_device(jobs, tied_runs, name):
    extra, names = RUNS[name]
    reference = jobs.run(f"tied_reference_{name}", "fit", {**PARITY, "strategy": "single", **extra}, nprocs=1)
    ref = reference.rank_output(0)
    assert ref["tied_parameters"][0]["names"] == names  # the reference is tied too
    for rank in range(4):
        out = tied_runs[name].rank_output(rank)
        error = worst_relative_error(out["losses"], ref["losses"])
        print(f"tied {name} rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
        # Still one parameter under both names after TP and FSDP, sharded over the vocabulary by both.
        assert out["tied_parameters"] == [{"names": names, "placements": ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]}]
    final, ref_final = load_weights(tied_runs[name], "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()
    for weight_name, weight in ref_final.items():
        torch.testing.assert_close(final[weight_name], weight, rtol=1e-5, atol=1e-5, msg=weight_name)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_trained_tied_checkpoint_exports_one_tensor_with_the_trained_logits(tied_runs, name, tmp_path):
    """`lightning-2d export` of the DCP folder written at 2×2: one tensor for the tied weight in the file,
    tie_word_embeddings in config.json, and transformers' logits equal to those of the trained weights."""
    import transformers
    from safetensors import safe_open

    from lightning_2d.hf import export_hf

    run = tied_runs[name]
    export_hf(run.out_dir / "final_ckpt", tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    trained = load_weights(run, "final")
    tokens = torch.randint(0, hf.config.vocab_size, (2, PARITY["seq_len"]), generator=torch.Generator().manual_seed(0))
    if name == "llama":  # our Transformer with the trained weights (the tie restored by the model itself)
        from lightning_2d import ModelArgs, Transformer

        model = Transformer(ModelArgs.from_name("debug", tie_word_embeddings=True))
        model.load_state_dict({**trained, "output.weight": trained["tok_embeddings.weight"]})
        expected = model(tokens)
    else:
        reference = transformers.AutoModelForCausalLM.from_config(hf.config, attn_implementation="sdpa")
        reference.load_state_dict({**trained, "lm_head.weight": trained["model.embed_tokens.weight"]})
        expected = reference.eval()(tokens).logits
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected.detach(), rtol=1e-5, atol=1e-5)
