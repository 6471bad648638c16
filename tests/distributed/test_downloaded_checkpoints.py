"""The checkpoints people download, as files: each family's directory written by ``transformers`` itself (a config
and ``save_pretrained``, nothing downloaded), loaded with ``init_from`` at (dp, tp) = (2, 2) with sequence
parallelism, trained 6 fp32 AdamW steps, and exported back.

- Llama 3.2-style: tied embeddings, Llama 3.1's rotary scaling (an original length of 16 at sequence 32, so the
  scaling matters), through the Hugging Face path (``HFCausalLMModule``) and through our own Llama.
- Llama 3.1-style: untied, the same rotary scaling, through our own Llama (``LlamaLightningModule``): imported,
  trained, exported.
- Qwen2.5-style: tied, q/k/v biases. SmolLM-style: tied, the plain Llama layout. Qwen3-style: per-head q/k
  norms (their weights perturbed away from 1 before saving, so a wrong load or an unsummed gradient shows).
- Qwen3-MoE-style and Mixtral-style mixtures of experts, through our own Llama: imported from transformers'
  per-expert files, the experts tensor-parallel (Qwen3-MoE) or expert-parallel × tensor-parallel (Mixtral), and
  exported back to the per-expert layout transformers reads; the same two through the Hugging Face path
  (``HFCausalLMModule``: transformers' fused experts read from the per-expert files, each sparse block whole on every
  tensor-parallel rank).

For each: the first step's loss equals ``transformers``' own loss of the same files on the same batch (the weights
really are loaded and sharded right), the 6 steps equal the same module on one device, and the trained checkpoint
exported with ``lightning-2d export`` loads in ``transformers`` with the logits of the trained weights, keeping the
tie (one tensor in the file). All 2×2 runs share one launch, all one-device runs another.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import PARITY, load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {  # name: (model_type, config fields, through our own Llama)
    "llama32_hf": ("llama", {"tie_word_embeddings": True, "rope_parameters": {**LLAMA31_ROPE, "factor": 32.0}}, False),
    "llama32_native": ("llama", {"tie_word_embeddings": True, "rope_parameters": {**LLAMA31_ROPE, "factor": 32.0}}, True),
    "llama31_native": ("llama", {"tie_word_embeddings": False, "rope_parameters": LLAMA31_ROPE}, True),
    "qwen25": ("qwen2", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, False),
    "smollm": ("llama", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, False),
    "qwen3": ("qwen3", {"tie_word_embeddings": False, "head_dim": 16,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, False),
    # Mixtures of experts through our own Llama: Qwen3-MoE (per-head q/k norms, a head size other than
    # hidden / heads, a dense block 0) with its experts split by features over the tensor-parallel ranks, and
    # Mixtral under expert parallel 2 × tensor parallel 2 (whole experts on each tensor-parallel rank).
    "qwen3_moe_native": ("qwen3_moe", {"tie_word_embeddings": False, "head_dim": 32, "num_experts": 8,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0],
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, True),
    "mixtral_native": ("mixtral", {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, True),
    # The same two through transformers' own model (HFCausalLMModule): its fused experts read from the per-expert files,
    # each sparse block whole on both tensor-parallel ranks, exported back per expert.
    "qwen3_moe_hf": ("qwen3_moe", {"tie_word_embeddings": False, "head_dim": 32, "num_experts": 8,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0],
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, False),
    "mixtral_hf": ("mixtral", {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, False),
}
#: Options of a family's 2×2 run beyond the common ones.
PARALLEL_OPTIONS = {"mixtral_native": {"expert_parallel_size": 2}}


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """Each family's Hugging Face directory, as ``save_pretrained`` writes it (random weights, seeded)."""
    root, out = tmp_path_factory.mktemp("downloaded"), {}
    for name, (model_type, fields, _) in FAMILIES.items():
        config = transformers.AutoConfig.for_model(model_type, **SMALL, **fields)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        with torch.no_grad():  # norms and biases away from their init (1, 0), so a wrong load shows
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _run(name: str, directory, single: bool) -> dict:
    native = FAMILIES[name][2]
    run = {**PARITY, "init_from": str(directory), "sequence_parallel": True, "save_checkpoint": not single}
    if not native:
        run["hf_config"] = None  # the Hugging Face path, its config read from init_from
    if single:
        return {**run, "strategy": "single", "transformers_first_loss": True}
    return {**run, "strategy": "2d", "dp": 2, "tp": 2, "num_nodes": 1, "data_replicas": 2,
            **PARALLEL_OPTIONS.get(name, {})}


#: A tied Llama 3.2-style checkpoint under context 2 × tensor 2 (sequence parallel), in the same launch.
CONTEXT_RUN = "llama32_native_cp2"


@pytest.fixture(scope="module")
def runs(jobs, directories):
    parallel_runs = {n: _run(n, d, False) for n, d in directories.items()}
    parallel_runs[CONTEXT_RUN] = {**parallel_runs["llama32_native"], "dp": 1, "data_replicas": 1,
                                  "context_parallel_size": 2, "save_checkpoint": False}
    parallel = jobs.run("downloaded_2x2", "fits", {"runs": parallel_runs}, nprocs=4)
    single = jobs.run("downloaded_single", "fits", {"runs": {n: _run(n, d, True) for n, d in directories.items()}},
                      nprocs=1)
    from dataclasses import replace

    out = {n: (replace(parallel, out_dir=parallel.out_dir / n), replace(single, out_dir=single.out_dir / n))
           for n in directories}
    out[CONTEXT_RUN] = (replace(parallel, out_dir=parallel.out_dir / CONTEXT_RUN), out["llama32_native"][1])
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_downloaded_checkpoint_loads_trains_at_2x2_and_exports_as_transformers_reads_it(runs, directories, name,
                                                                                          tmp_path):
    from safetensors import safe_open

    from lightning_2d.hf import export_hf

    parallel, single = runs[name]
    ref = single.rank_output(0)
    # The first step scores the loaded weights: transformers' own loss of the same files on the same batch.
    first = [parallel.rank_output(rank)["losses"][0] for rank in range(4)]
    error = max(abs(loss - ref["transformers_first_loss"]) / ref["transformers_first_loss"] for loss in first)
    print(f"{name}: first loss vs transformers' {error:.2e}", end="; ")
    assert error <= LOSS_RTOL, (first, ref["transformers_first_loss"])
    # 6 steps at 2×2 equal the same module on one device.
    for rank in range(4):
        steps = worst_relative_error(parallel.rank_output(rank)["losses"], ref["losses"])
        assert steps <= LOSS_RTOL, (rank, parallel.rank_output(rank)["losses"], ref["losses"])
    print(f"6 steps vs one device {steps:.2e}")
    # The weights, within 1e-4 of the one-device run's (they moved by ~4e-3): AdamW divides each gradient by its own
    # size, so a parameter whose gradient is only rounding (the key bias: softmax ignores a shift all keys share)
    # moves by up to lr per step in a direction the summation order decides, on one device as at 2×2 (measured
    # 3.8e-5 for Qwen's k_proj bias, 5.5e-5 for one of Mixtral's 4,096 o_proj elements on the Hugging Face path,
    # 1.2e-5 elsewhere; a wrongly sharded weight would be off by its whole update).
    trained, ref_trained = load_weights(parallel, "final"), load_weights(single, "final")
    for weight_name, weight in ref_trained.items():
        torch.testing.assert_close(trained[weight_name], weight, rtol=0, atol=1e-4,
                                   msg=lambda message, weight_name=weight_name: f"{weight_name}: {message}")
    tied = FAMILIES[name][1]["tie_word_embeddings"]
    if tied:  # still one parameter under both names after TP and FSDP, sharded over the vocabulary by both
        names = ["tok_embeddings.weight", "output.weight"] if FAMILIES[name][2] else ["model.embed_tokens.weight",
                                                                                      "lm_head.weight"]
        for rank in range(4):
            assert parallel.rank_output(rank)["tied_parameters"] == [
                {"names": names, "placements": ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]}], rank
    # Exported from the sharded checkpoint: transformers' logits equal those of the trained weights.
    export_hf(parallel.out_dir / "final_ckpt", tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in set(f.keys())) == (not tied)  # tied: one tensor
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    original = transformers.AutoConfig.from_pretrained(directories[name])
    for field in ("tie_word_embeddings", "rope_parameters", "model_type"):
        assert getattr(exported.config, field) == getattr(original, field), field
    tokens = torch.randint(0, SMALL["vocab_size"], (2, PARITY["seq_len"]), generator=torch.Generator().manual_seed(1))
    if FAMILIES[name][2]:  # our Llama with the trained weights
        from lightning_2d import LlamaLightningModule

        module = LlamaLightningModule(init_from=str(directories[name]))
        module.configure_model()
        module.model.load_state_dict(trained, strict=False)  # a tied head is the embedding's weight
        expected = module.model(tokens)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directories[name], dtype=torch.float32).eval()
        model.load_state_dict(trained, strict=not tied)
        expected = model(tokens).logits
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, expected.detach(), rtol=1e-5, atol=1e-5)


def test_a_tied_checkpoint_trains_under_context_parallelism_as_on_one_device(runs):
    """Context 2 × tensor 2 on the Llama 3.2-style directory: the tie and the sequence split together."""
    parallel, single = runs[CONTEXT_RUN]
    ref = single.rank_output(0)
    for rank in range(4):
        out = parallel.rank_output(rank)
        assert worst_relative_error(out["losses"], ref["losses"]) <= LOSS_RTOL, (rank, out["losses"], ref["losses"])
        assert out["tied_parameters"][0]["names"] == ["tok_embeddings.weight", "output.weight"]
        assert out["mesh_dims"].count("context_parallel") == 1
    trained, ref_trained = load_weights(parallel, "final"), load_weights(single, "final")
    for weight_name, weight in ref_trained.items():
        torch.testing.assert_close(trained[weight_name], weight, rtol=0, atol=5e-5, msg=weight_name)
