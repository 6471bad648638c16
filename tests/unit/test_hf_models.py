"""Hugging Face decoders: the built-in plan, its refusals, layout-independent init, ``init_from``, and the
sequence-parallel overlay of ``ParallelPlan``.

One process. Where a plan must be applied to a real module tree, a fake 4-rank world (the planner's
``fake_world``) stands in for the processes; the training parity of these models at 2×2 is in
``tests/distributed/test_hf_models.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_2d.hf import HFCausalLMModule, HFDecoderInit, SafetensorsWeights, check_hf_decoder, hf_decoder_plan  # noqa: E402
from lightning_2d.models.registry import known_init_hooks, known_plan  # noqa: E402
from lightning_2d.parallel import ParallelConfig, ParallelConfigError, ParallelPlan, validate_parallel_dims  # noqa: E402
from lightning_2d.parallel.materialize import MaterializationError, materialize_model  # noqa: E402
from lightning_2d.parallel.styles import SequenceShardInput, is_sequence_parallel_style  # noqa: E402

CPU = torch.device("cpu")
LLAMA = {
    "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
}


def meta_model(**overrides):
    from lightning_2d.hf import load_hf_config

    config = load_hf_config({**LLAMA, **overrides})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


# ---- the plan -------------------------------------------------------------------------------------
def test_the_plan_has_sequence_parallel_styles_only_when_the_option_is_on():
    config = meta_model().config
    sp = hf_decoder_plan(config, ParallelConfig(sequence_parallel=True))
    plain = hf_decoder_plan(config, ParallelConfig(sequence_parallel=False))
    only_sp = set(sp.tensor_parallel) - set(plain.tensor_parallel)
    assert only_sp == {
        "model.layers.0", "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm",
        "model.layers.*.self_attn", "model.layers.*.mlp", "model.norm",
    }
    assert isinstance(sp.tensor_parallel["model.layers.0"], SequenceShardInput)
    assert sp.has_sequence_parallel and not plain.has_sequence_parallel
    assert sp.tp_divides == {"num_attention_heads": 4, "num_key_value_heads": 2}
    assert (sp.blocks, sp.module, sp.input_units, sp.output_unit) == (
        "model.layers", "model", ("model.embed_tokens",), ("model.norm", "lm_head"))
    assert known_plan(meta_model(), ParallelConfig()).module == ""  # a bare model given to Fabric


#: Qwen3's own fields: head_dim is a field of its own (its default, 128, is not hidden_size / heads).
QWEN3 = {"model_type": "qwen3", "head_dim": 8}


def family(model_type: str) -> dict:
    return QWEN3 if model_type == "qwen3" else {"model_type": model_type}


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_plan_applies_to_every_named_module_of_the_family(model_type, sequence_parallel):
    """In a fake 2×2 world: every plan entry resolves to a module (torch only warns on a typo), the
    projections become DTensors over both mesh dims, and nothing is left on the meta device unplanned."""
    from torch.distributed.tensor import Replicate, Shard

    from lightning_2d.parallel import ParallelDims, parallelize_model
    from lightning_2d.tools.planner import fake_world

    model = meta_model(**family(model_type))
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, sequence_parallel=sequence_parallel)
    config = config.resolve_dtypes("32-true")
    plan = hf_decoder_plan(model.config, config, module="")
    validate_parallel_dims(config, world_size=4, devices_per_node=4, plan=plan, seq_len=64)  # SP off: no SP style
    with fake_world(4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = ParallelDims(1, 2, 2).build_mesh("cpu")
        parallelize_model(model, mesh, plan, config)
        q = model.model.layers[1].self_attn.q_proj.weight
        assert q.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
        assert q.to_local().shape == (32 // 4, 32)  # rows: 2 of 4 heads (TP), then half of those (FSDP)
        if model_type == "qwen2":
            assert model.model.layers[0].self_attn.k_proj.bias.to_local().shape == (16 // 4,)
        if model_type == "qwen3":
            # Each rank normalizes its own heads with the one weight all heads share: replicated over TP (its
            # gradient then summed over the TP ranks), sharded by FSDP over data parallelism; with or without SP.
            for norm in ("q_norm", "k_norm"):
                weight = model.model.layers[1].self_attn.get_submodule(norm).weight
                assert weight.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
                assert weight.placements == (Shard(0), Replicate()), repr(weight.placements)
                assert weight.shape == (8,) and weight.to_local().shape == (8 // 2,)
        else:
            assert not hasattr(model.model.layers[1].self_attn, "q_norm")
    # torch only warns about a plan key that matches no module; we also warn if SP would do nothing.
    problems = [str(w.message) for w in caught if "could not be resolved" in str(w.message) or "no effect" in str(w.message)]
    assert problems == []


def test_qwen3s_per_head_norms_are_planned_with_and_without_sequence_parallelism():
    """The norms run on the projections' local heads (dim 2 of ``(batch, seq, heads, head_dim)``), the same under
    both settings; not a sequence-parallel style (so refused by no validation with SP off). Llama has none."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from lightning_2d.parallel.styles import HeadShardedNorm

    config = meta_model(**QWEN3).config
    for sp in (True, False):
        styles = hf_decoder_plan(config, ParallelConfig(sequence_parallel=sp)).tensor_parallel_styles(sp)
        for norm in ("q_norm", "k_norm"):
            style = styles[f"model.layers.*.self_attn.{norm}"]
            assert isinstance(style, HeadShardedNorm) and style.use_local_output
            assert repr(style.sequence_sharding) == "(Shard(dim=2),)"
            assert not is_sequence_parallel_style(style)
    assert not is_sequence_parallel_style(SequenceParallel(sequence_dim=2))  # torch's own, along another dim
    assert "model.layers.*.self_attn.q_norm" not in hf_decoder_plan(meta_model().config, ParallelConfig()).tensor_parallel


def test_a_qwen3_config_loads_with_its_fields_and_sliding_windows():
    """Qwen3's sliding-window layers (``use_sliding_window`` + ``max_window_layers`` → ``layer_types``) are built,
    masked and run as on one device by the plan (trained at 2×2 in tests/distributed/test_hf_models.py)."""
    module = HFCausalLMModule({**LLAMA, **QWEN3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    config = module.hf_config
    assert (config.head_dim, config.attention_bias, config.layer_types) == (8, False, ["full_attention", "sliding_attention"])
    model = module.build_model()
    assert model.model.layers[1].self_attn.sliding_window == 8 and model.model.layers[0].self_attn.sliding_window is None


def test_a_tied_decoder_declares_its_tie_and_an_untied_one_none():
    """Tied embeddings (Llama 3.2, Qwen2.5 small, SmolLM): one weight in the embedding and lm_head, declared so that
    a pipeline is refused before any process starts; parallelize_model keeps the tie (tests/unit/test_ties.py)."""
    tied = meta_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert hf_decoder_plan(tied.config, ParallelConfig()).tied_weights == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert hf_decoder_plan(meta_model().config, ParallelConfig()).tied_weights == ()
    HFCausalLMModule({**LLAMA, "tie_word_embeddings": True})  # accepted at construction


def test_models_the_plan_would_shard_wrongly_are_refused_with_the_reason():
    with pytest.raises(ValueError,
                       match=r"model_type 'gpt2' is not one of .*llama, mistral, qwen2, qwen3, qwen3_moe, mixtral\)"):
        hf_decoder_plan(transformers.GPT2Config(), ParallelConfig())
    # A per-head norm is planned for Qwen3 only: on a Llama it is a parameter the plan does not know.
    model = meta_model()
    with torch.device("meta"):
        model.model.layers[0].self_attn.q_norm = nn.LayerNorm(8)
    with pytest.raises(ValueError, match=r"outside the Llama layout.*model\.layers\.0\.self_attn\.q_norm\.weight"):
        check_hf_decoder(model)
    # On a Qwen3, its RMSNorm weights are known, but a norm with a bias is not (the plan shards weights only).
    qwen3 = meta_model(**QWEN3)
    check_hf_decoder(qwen3)
    with torch.device("meta"):
        qwen3.model.layers[1].self_attn.k_norm = nn.LayerNorm(8)
    with pytest.raises(ValueError, match=r"outside the Llama layout.*\(model\.layers\.1\.self_attn\.k_norm\.bias\)"):
        check_hf_decoder(qwen3)


# ---- the sequence-parallel overlay of any plan ---------------------------------------------------
def test_a_plan_with_sequence_parallel_styles_is_refused_when_the_option_is_off():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    assert is_sequence_parallel_style(SequenceParallel())
    assert is_sequence_parallel_style(RowwiseParallel(output_layouts=Shard(1)))
    assert is_sequence_parallel_style(PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
    assert not is_sequence_parallel_style(RowwiseParallel())
    assert not is_sequence_parallel_style(ColwiseParallel(output_layouts=Shard(-1)))

    mixed = ParallelPlan(tensor_parallel={"fc": ColwiseParallel(), "norm": SequenceParallel()})
    with pytest.raises(ParallelConfigError, match=r"sequence_parallel=False, but .* \(norm\).*ParallelPlan\(sequence_parallel="):
        validate_parallel_dims(ParallelConfig(tensor_parallel_size=2, sequence_parallel=False), world_size=2,
                               devices_per_node=2, plan=mixed)
    overlay = ParallelPlan(
        tensor_parallel={"fc": ColwiseParallel(), "out": RowwiseParallel()},
        sequence_parallel={"out": RowwiseParallel(output_layouts=Shard(1)), "norm": SequenceParallel()},
    )
    assert list(overlay.tensor_parallel_styles(True)) == ["fc", "out", "norm"]
    assert overlay.tensor_parallel_styles(True)["out"].output_layouts == (Shard(1),)
    assert overlay.tensor_parallel_styles(False)["out"].output_layouts == (Replicate(),)
    # A plan without a sequence-parallel form: an odd sequence length is no problem for it.
    plain = ParallelPlan(tensor_parallel={"fc": ColwiseParallel()})
    validate_parallel_dims(ParallelConfig(tensor_parallel_size=2), world_size=2, devices_per_node=2, plan=plain, seq_len=7)
    with pytest.raises(ParallelConfigError, match=r"sequence length \(7\)"):
        validate_parallel_dims(ParallelConfig(tensor_parallel_size=2), world_size=2, devices_per_node=2, plan=overlay, seq_len=7)


def test_sequence_parallel_on_a_plan_without_its_styles_warns_that_it_does_nothing():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_2d.parallel import ParallelDims, parallelize_model
    from lightning_2d.tools.planner import fake_world

    class MLPs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))

    model = MLPs()
    plan = ParallelPlan(tensor_parallel={"layers.*.0": ColwiseParallel(), "layers.*.2": RowwiseParallel()}, module="")
    config = ParallelConfig(tensor_parallel_size=2).resolve_dtypes("32-true")
    with fake_world(2), pytest.warns(UserWarning, match="sequence_parallel=True has no effect on MLPs"):
        parallelize_model(model, ParallelDims(1, 1, 2).build_mesh("cpu"), plan, config)


# ---- materialization ------------------------------------------------------------------------------
def test_a_meta_built_hf_model_without_init_hooks_names_every_tensor_left_empty():
    """The corruption of issue #10: RMSNorm has no reset_parameters(), the rotary inv_freq is a
    non-persistent buffer. Now an error naming each, instead of a NaN loss or silent garbage."""
    with pytest.raises(MaterializationError) as err:
        materialize_model(meta_model(), CPU, seed=0)
    message = str(err.value)
    assert "model.layers.0.input_layernorm.weight (parameter of LlamaRMSNorm): LlamaRMSNorm has no reset_parameters()" in message
    assert "model.rotary_emb.inv_freq (non-persistent buffer of LlamaRotaryEmbedding)" in message

    class SpecsOnly:  # a user's param_init_specs, but nothing for the buffers
        def __init__(self, model):
            self.specs = HFDecoderInit(model).param_init_specs()

        def param_init_specs(self):
            return self.specs

    model = meta_model()
    with pytest.raises(MaterializationError, match=r"1 tensor|2 tensor") as err:
        materialize_model(model, CPU, seed=0, init_hooks=[SpecsOnly(model)])
    assert "inv_freq" in str(err.value) and "input_layernorm" not in str(err.value)


def test_the_built_in_init_fills_everything_and_recomputes_the_rotary_tables():
    model = meta_model()
    materialize_model(model, CPU, seed=3, init_hooks=[known_init_hooks(model)])
    reference = transformers.AutoModelForCausalLM.from_config(model.config)  # built on CPU by transformers
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    std = float(model.model.layers[0].mlp.up_proj.weight.detach().std())
    assert 0.015 < std < 0.025  # N(0, initializer_range=0.02), as transformers' own init
    again = meta_model()
    materialize_model(again, CPU, seed=3, init_hooks=[HFDecoderInit(again)])
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name  # seeded: the same values every time (and at every layout)


def test_init_from_reads_a_saved_model_and_refuses_one_that_does_not_match(tmp_path):
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(meta_model().config, attn_implementation="sdpa")
    original.save_pretrained(tmp_path)
    module = HFCausalLMModule(init_from=str(tmp_path))
    module.configure_model()
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(module(tokens), original(tokens).logits, rtol=1e-6, atol=1e-6)
    # A rank's block: rows 8..16 and columns 16..32 of a (32, 32) projection.
    name = "model.layers.1.self_attn.o_proj.weight"
    block = torch.empty(8, 16)
    SafetensorsWeights(tmp_path).fill_block_(block, name, (32, 32), (8, 16))
    assert torch.equal(block, original.state_dict()[name][8:16, 16:32])
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight: missing"):
        wrong = HFCausalLMModule(init_from=str(tmp_path), config_overrides={"num_hidden_layers": 3})
        wrong.configure_model()
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: stored \(128, 32\), the model's is \(256, 32\)"):
        HFCausalLMModule(init_from=str(tmp_path), config_overrides={"vocab_size": 256}).configure_model()


def test_flops_per_token_counts_the_projections_and_attention():
    module = HFCausalLMModule(LLAMA)
    per_layer = 32 * 8 * (2 * 4 + 2 * 2) + 3 * 32 * 64  # q, k, v, o (GQA) + SwiGLU
    assert module.flops_per_token(16) == 6 * (2 * per_layer + 128 * 32) + 12 * 2 * 4 * 8 * 16


def test_a_trained_hf_module_exports_to_a_directory_transformers_loads(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_2d.hf import export_hf

    module = HFCausalLMModule(LLAMA, warmup_steps=1, max_steps=2, init_seed=5)
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=2))
    trainer.save_checkpoint(tmp_path / "hf.ckpt")
    with pytest.raises(ValueError, match=r"records its own config; --model/--model-overrides apply to LlamaLightningModule"):
        export_hf(tmp_path / "hf.ckpt", tmp_path / "refused", model="debug")
    assert not (tmp_path / "refused").exists()
    export_hf(tmp_path / "hf.ckpt", tmp_path / "hf_out", dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out")
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.num_key_value_heads == 2
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens[:, :-1]).logits, module(tokens[:, :-1]), rtol=0, atol=0)


def test_float8_converts_the_projections_and_keeps_the_head_in_high_precision():
    pytest.importorskip("torchao")
    from lightning_2d.parallel import ParallelDims, parallelize_model
    from lightning_2d.tools.planner import fake_world

    model = meta_model()
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, sequence_parallel=False,
                            float8="emulate").resolve_dtypes("32-true")
    with fake_world(4):
        parallelize_model(model, ParallelDims(1, 2, 2).build_mesh("cpu"), hf_decoder_plan(model.config, config, module=""), config)
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.model.layers[0].self_attn.q_proj, Float8Linear)
    assert isinstance(model.model.layers[1].mlp.down_proj, Float8Linear)
    assert not isinstance(model.lm_head, Float8Linear)  # the plan's output unit stays in high precision
