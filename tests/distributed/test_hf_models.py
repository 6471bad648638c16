"""Hugging Face decoders built on the meta device and trained at 2×2 equal single-device training."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.distributed.conftest import PARITY, load_weights

pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

#: Tiny Llama with grouped-query attention (4 query heads share 2 key/value heads).
LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False,
}
#: Qwen2: the same layout plus q/k/v biases (column-wise sharded with their weights).
QWEN2 = {**LLAMA, "model_type": "qwen2"}
#: Qwen3: a per-head RMSNorm of q and k (weights of head_dim, shared by every head), no biases; head_dim a field.
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 16}
#: Qwen3 with its options: a sliding window (8 of the 32 tokens) on layer 1 and q/k/v/o biases.
QWEN3_SLIDING = {**QWEN3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "attention_bias": True}

#: Each model trained on one device once (the reference of its variants).
CONFIGS = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3_sliding": QWEN3_SLIDING}

VARIANTS = {
    # name: (CONFIGS key, strategy options)
    "llama_sp_loss_parallel": ("llama", {"sequence_parallel": True, "loss_parallel": True}),
    "llama_no_sp": ("llama", {"sequence_parallel": False, "save_checkpoint": True}),
    "qwen2_sp_ac": ("qwen2", {"sequence_parallel": True, "activation_checkpointing": "full"}),
    # The per-head norms' weights are replicated over TP and their gradients summed over the TP ranks (each holds
    # half of the heads): were they not, the final q_norm/k_norm weights and the gradient norms would differ.
    "qwen3_sp": ("qwen3", {"sequence_parallel": True}),
    "qwen3_sliding_no_sp": ("qwen3_sliding", {"sequence_parallel": False}),
    # SimpleFSDP (fsdp_backend) on a Hugging Face decoder, with loss parallel and per-op selective checkpointing.
    "qwen3_simple_fsdp": ("qwen3", {"sequence_parallel": True, "loss_parallel": True, "fsdp_backend": "simple_fsdp",
                                    "activation_checkpointing": "selective", "selective_ac_option": "op"}),
}


#: What the variants record beyond a multi-rank job's default (worker.fit): the tests below read all of it.
RECORD = {"grad_norms": True, "initial_weights": True, "probe_forwards": True}


def reference(jobs, model):
    """``model`` trained on one device; every model's reference runs in one launch (one fit after another)."""
    runs = {name: {**PARITY, "strategy": "single", "hf_config": config} for name, config in CONFIGS.items()}
    result = jobs.run("hf_references", "fits", {"runs": runs}, nprocs=1)
    return replace(result, out_dir=result.out_dir / model)


def parallel(jobs, variant):
    """``variant`` trained at 2×2; every variant runs in one launch of 4 processes."""
    runs = {name: {**PARITY, "strategy": "2d", "dp": 2, "tp": 2, "num_nodes": 1, "data_replicas": 2,
                   "hf_config": CONFIGS[model], **options, **RECORD} for name, (model, options) in VARIANTS.items()}
    result = jobs.run("hf_variants", "fits", {"runs": runs}, nprocs=4)
    return replace(result, out_dir=result.out_dir / variant)


def relative_error(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == PARITY["steps"]
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_decoder_built_on_meta_trains_as_on_one_device(jobs, variant):
    ref = reference(jobs, VARIANTS[variant][0])
    result = parallel(jobs, variant)
    ref_losses, ref_norms = ref.rank_output(0)["losses"], ref.rank_output(0)["grad_norms"]
    errors = [relative_error(result.rank_output(rank)["losses"], ref_losses) for rank in range(4)]
    norm_errors = [relative_error(result.rank_output(rank)["grad_norms"], ref_norms) for rank in range(4)]
    print(f"\n{variant}: worst relative loss error per rank {['%.1e' % e for e in errors]},"
          f" gradient norm {['%.1e' % e for e in norm_errors]}")
    backend = VARIANTS[variant][1].get("fsdp_backend", "fully_shard")
    for rank in range(4):
        assert errors[rank] <= 1e-5, (variant, rank)
        assert norm_errors[rank] <= 1e-5, (variant, rank)  # before clipping: every parameter's gradient counts
        wrapped = result.rank_output(rank)["data_parallel_modules"]
        assert wrapped[backend] > 0 and sum(wrapped.values()) == wrapped[backend], (variant, wrapped)  # which ran
    # The seeded init is layout-independent: the meta-built shards start from the reference's weights.
    start, ref_start = load_weights(result, "initial"), load_weights(ref, "initial")
    assert start.keys() == ref_start.keys()
    for name in ref_start:
        torch.testing.assert_close(start[name], ref_start[name], rtol=0, atol=0, msg=name)
    final, ref_final = load_weights(result, "final"), load_weights(ref, "final")
    moved = {}
    for name in ref_final:
        torch.testing.assert_close(final[name], ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
        moved[name] = float((ref_final[name] - ref_start[name]).abs().max())
    assert max(moved.values()) > 1e-3  # the weights did train
    if CONFIGS[VARIANTS[variant][0]]["model_type"] == "qwen3":  # and the per-head norms with them
        assert min(m for name, m in moved.items() if "_norm" in name and "self_attn" in name) > 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_decoder_layout_follows_the_sequence_parallel_option(jobs, variant):
    _, options = VARIANTS[variant]
    sp = options["sequence_parallel"]
    result = parallel(jobs, variant).rank_output(0)
    placements = result["placements"]
    attn = "model.layers.0.self_attn.q_proj.weight"
    assert placements[attn]["mesh_dims"] == ["data_parallel", "tensor_parallel"]
    assert placements[attn]["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    norm = placements["model.layers.0.input_layernorm.weight"]
    norm = [norm["mesh_dims"], norm["placements"]]
    if sp:  # the norms run on sequence slices: their weights are replicated DTensors over TP
        assert norm == [["data_parallel", "tensor_parallel"], ["Shard(dim=0)", "Replicate()"]]
        assert result["layer_input_shape"] == [1, PARITY["seq_len"] // 2, LLAMA["hidden_size"]]
        assert "not divisible by tensor_parallel_size (2)" in result["bad_seq_len_error"]
        assert "not divisible by tensor_parallel_size (2)" in result["bad_seq_len_error_kw"]
    else:
        assert norm == [["data_parallel"], ["Shard(dim=0)"]]
        assert result["layer_input_shape"] == [1, PARITY["seq_len"], LLAMA["hidden_size"]]
        assert result.get("bad_seq_len_error") is None
        # Recorded in this job too: a length of 13, indivisible by tp = 2, ran (SP off refuses nothing),
        # positional and keyword input alike.
        assert "bad_seq_len_error" in result and "bad_seq_len_error_kw" in result, sorted(result)
        assert (result["bad_seq_len_error"], result["bad_seq_len_error_kw"]) == (None, None)
    hf_config = CONFIGS[VARIANTS[variant][0]]
    if hf_config["model_type"] == "qwen2" or hf_config.get("attention_bias"):
        assert placements["model.layers.0.self_attn.q_proj.bias"]["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    if hf_config["model_type"] == "qwen3":  # with and without SP: replicated over TP, sharded by FSDP
        for norm in ("q_norm", "k_norm"):
            weight = placements[f"model.layers.1.self_attn.{norm}.weight"]
            assert weight["mesh_dims"] == ["data_parallel", "tensor_parallel"]
            assert (weight["placements"], weight["shape"]) == (["Shard(dim=0)", "Replicate()"], [16])


def test_a_bare_hf_model_given_to_fabric_setup_trains_as_on_one_device(jobs):
    """No plan, no hooks: the Fabric strategy recognizes the transformers model, applies the built-in
    plan with sequence parallelism and its seeded init; a hand-written loop matches the Trainer reference."""
    ref = reference(jobs, "llama").rank_output(0)["losses"]
    config = {**PARITY, "dp": 2, "tp": 2, "hf_config": LLAMA, "sequence_parallel": True}
    result = jobs.run("hf_fabric_llama_sp", "fabric_hf", config)
    for rank in range(4):
        assert relative_error(result.rank_output(rank)["losses"], ref) <= 1e-5, rank


def test_a_meta_built_model_left_uninitialized_stops_before_step_1_naming_each_tensor(jobs):
    """The corruption of issue #10 in real processes: without an init route for the RMSNorm weights and
    the rotary buffers, every rank's shards are checked after allocation and the run stops."""
    config = {**PARITY, "strategy": "2d", "dp": 2, "tp": 2, "data_replicas": 2, "hf_config": LLAMA,
              "without_builtin_init": True}
    # The launcher kills no rank (kill_on_failure=False): each one must find its own uninitialized shards and stop.
    result = jobs.run("hf_uninitialized", "fit", config, expect_ok=False, kill_on_failure=False)
    assert not result.ok and not result.timed_out
    log = result.logs[result.failed_rank()]
    assert "MaterializationError" in log
    assert "model.layers.0.input_layernorm.weight (parameter of LlamaRMSNorm): LlamaRMSNorm has no reset_parameters()" in log
    assert "model.rotary_emb.inv_freq (non-persistent buffer of LlamaRotaryEmbedding)" in log
    assert not list(result.out_dir.glob("rank*.json"))  # no rank trained
    assert result.returncodes == [1, 1, 1, 1], result.describe()  # each raised itself (not 75: ended by another)
    for rank in range(4):
        own = result.logs[rank]
        assert "MaterializationError" in own and "model.rotary_emb.inv_freq" in own, result.describe([rank])


def test_the_sharded_checkpoint_of_an_hf_module_exports_as_the_model_trained(jobs, tmp_path):
    """`lightning-2d export` on the DCP folder written at 2×2: the weights as they are (no renaming or
    RoPE permutation for a transformers model) and the config the module recorded."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from lightning_2d.hf import export_hf

    result = parallel(jobs, "llama_no_sp")
    export_hf(result.out_dir / "final_ckpt", tmp_path / "hf_out")
    exported = load_file(tmp_path / "hf_out" / "model.safetensors")
    trained = load_weights(result, "final")
    assert exported.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(exported[name], value), name
    config = AutoConfig.from_pretrained(tmp_path / "hf_out")
    assert (config.model_type, config.num_key_value_heads, config.tie_word_embeddings) == ("llama", 2, False)
