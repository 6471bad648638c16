"""LoRA on the routed experts of a mixture of experts (``ops.lora.LoRAExperts``): per-expert adapters over the stacked
weights, computed by the experts' grouped matrix products, equal to a per-expert dense reference; the default targets
reach them; the peft and merged exports give our logits on transformers' Qwen3-MoE. Under expert parallelism and FSDP:
tests/distributed/test_lora.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_2d import LlamaLightningModule, LoRA
from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.models.lora_targets import HF_TO_LLAMA, LLAMA_TARGETS
from lightning_2d.ops.init import module_init_specs
from lightning_2d.ops.lora import (
    LoRAConfigError,
    LoRAExperts,
    adapters_disabled,
    add_lora,
    is_adapter_parameter,
    lora_of,
    targets_reach_experts,
)
from lightning_2d.ops.moe import GroupedExperts, uses_grouped_mm
from tests.unit.test_lora import _fit

DIM, HIDDEN, EXPERTS, RANK = 16, 12, 4, 3


def _experts(projections=("w1", "w2", "w3"), lora=LoRA(rank=RANK, alpha=6.0)) -> LoRAExperts:
    torch.manual_seed(0)
    base = GroupedExperts(DIM, HIDDEN, EXPERTS)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(std=0.3)
    adapted = LoRAExperts.from_experts(base, lora, projections)
    assert adapted.w1 is base.w1 and adapted.w2 is base.w2  # the experts' own weights
    with torch.no_grad():  # non-zero B: the adapters contribute
        for name, p in adapted.named_parameters():
            if is_adapter_parameter(name):
                p.normal_(std=0.3)
    return adapted


def _reference(experts: LoRAExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Expert by expert, each projection a dense LoRA: ``x (W_e + s·B_e A_e)ᵀ``."""
    def project(rows, which, e):
        weight = getattr(experts, which)[e]
        if which in experts.projections:
            a, b = getattr(experts, f"{which}_lora_a")[e], getattr(experts, f"{which}_lora_b")[e]
            weight = weight + experts.scale * b @ a
        return rows @ weight.t()

    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        outs.append(project(torch.nn.functional.silu(project(rows, "w1", e)) * project(rows, "w3", e), "w2", e))
    return torch.cat(outs)


@pytest.mark.parametrize("projections", [("w1", "w2", "w3"), ("w3",)])
def test_adapted_experts_forward_and_backward_equal_a_per_expert_dense_reference(projections):
    """The grouped path (one grouped product for A, one for B, per projection) and the loop both equal the per-expert
    merged weights, outputs and every adapter's gradient; an expert with no token included (zero gradients)."""
    experts = _experts(projections)
    x = torch.randn(11, DIM, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([4, 0, 5, 2])
    grad_out = torch.randn(11, DIM, generator=torch.Generator().manual_seed(2))
    adapters = [n for n, _ in experts.named_parameters() if is_adapter_parameter(n)]
    assert adapters == [f"{w}_lora_{ab}" for w in projections for ab in "ab"]

    def run(fn):
        experts.zero_grad()
        out = fn()
        out.backward(grad_out)
        return out.detach(), {n: experts.get_parameter(n).grad.clone() for n in adapters}

    assert uses_grouped_mm(x)
    grouped, looped, reference = run(lambda: experts(x, counts)), run(lambda: experts._loop(x, counts)), run(
        lambda: _reference(experts, x, counts))
    # Two kernels agree up to accumulation order (fp32 over reductions of at most DIM + RANK terms).
    for out, grads in (grouped, looped):
        torch.testing.assert_close(out, reference[0], rtol=1e-5, atol=1e-5)
        for name in adapters:
            torch.testing.assert_close(grads[name], reference[1][name], rtol=1e-5, atol=1e-5, msg=name)
    for name in adapters:
        assert not grouped[1][name][1].any() and grouped[1][name][0].any(), name  # expert 1 got no token
    # The merged stacked weights compute the same, and so does the float64 loop (no grouped_mm).
    merged = GroupedExperts(DIM, HIDDEN, EXPERTS)
    with torch.no_grad():
        for which in ("w1", "w2", "w3"):
            getattr(merged, which).copy_(experts.merged_weight(which))
        torch.testing.assert_close(merged(x, counts), reference[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(experts.double()(x.double(), counts), reference[0].double(), rtol=1e-5, atol=1e-5)


def test_zero_b_starts_as_the_base_and_adapters_off_computes_the_base():
    experts = _experts()
    x, counts = torch.randn(9, DIM), torch.tensor([2, 3, 0, 4])
    base = GroupedExperts(DIM, HIDDEN, EXPERTS)
    with torch.no_grad():
        for which in ("w1", "w2", "w3"):
            getattr(base, which).copy_(getattr(experts, which))
        with adapters_disabled(experts):
            assert torch.equal(experts(x, counts), base(x, counts))
        assert not torch.allclose(experts(x, counts), base(x, counts))
        for which in experts.projections:
            getattr(experts, f"{which}_lora_b").zero_()
        assert torch.equal(experts(x, counts), base(x, counts))


def test_the_default_targets_adapt_the_routed_experts_and_the_model_starts_as_its_base():
    """debug-moe: the routed experts' three projections in every sparse block beside the dense adapters (the shared
    experts' Linears included), A drawn as peft's (Kaiming-uniform over its input features) and B zero, so the adapted
    model computes the base's logits; only adapters require gradients."""
    args = PRESETS["debug-moe"]
    base = Transformer(args)
    base.init_weights(7)
    model = Transformer(args)
    adapted = add_lora(model, LoRA(rank=4, alpha=8), LLAMA_TARGETS, HF_TO_LLAMA)
    model.init_weights(7)
    sparse = list(args.moe_layers)
    assert {f"layers.{i}.feed_forward.experts.{w}" for i in sparse for w in ("w1", "w2", "w3")} <= set(adapted)
    assert {f"layers.{i}.feed_forward.shared_experts.{w}" for i in sparse for w in ("w1", "w2", "w3")} <= set(adapted)
    experts = model.layers[str(sparse[0])].feed_forward.experts
    assert isinstance(experts, LoRAExperts) and lora_of(model) == LoRA(rank=4, alpha=8)
    a, b = experts.w2_lora_a, experts.w2_lora_b
    assert a.shape == (args.moe.num_experts, 4, args.moe.hidden_dim) and b.shape == (args.moe.num_experts, args.dim, 4)
    bound = args.moe.hidden_dim ** -0.5
    assert 0.9 * bound < a.abs().max() <= bound and not b.any()
    spec = module_init_specs(model)[f"layers.{sparse[0]}.feed_forward.experts.w1_lora_a"]
    assert spec.bound == pytest.approx(args.dim ** -0.5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n in model.state_dict() if is_adapter_parameter(n)]
    assert f"layers.{sparse[0]}.feed_forward.experts.w3_lora_b" in trainable
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))
    # Targets by name: experts.w1 alone, gate_proj (its Hugging Face name) for every gate projection.
    only = add_lora(Transformer(args), LoRA(targets=["experts.w1"]), LLAMA_TARGETS, HF_TO_LLAMA)
    assert only == [f"layers.{i}.feed_forward.experts.w1" for i in sparse]
    assert targets_reach_experts(None) and targets_reach_experts(("gate_proj",), HF_TO_LLAMA)
    assert targets_reach_experts(("layers.1.feed_forward.experts.w2",))
    assert not targets_reach_experts(("wq", "shared_experts.w1", "feed_forward.w2"), HF_TO_LLAMA)
    with pytest.raises(LoRAConfigError, match=r"match no linear layer .* and the routed experts' w1, w2, w3"):
        add_lora(Transformer(args), LoRA(targets=["w4"]), LLAMA_TARGETS, HF_TO_LLAMA)


def test_the_module_optimizes_the_experts_adapters_and_leaves_the_base_experts_bit_for_bit():
    import lightning as L
    from torch.utils.data import DataLoader

    module = LlamaLightningModule("debug-moe", lora={"rank": 2, "alpha": 4.0}, max_steps=2, init_seed=0,
                                  learning_rate=1e-2, warmup_steps=1)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in module.model.named_parameters() if is_adapter_parameter(n)}
    assert optimized == adapters
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    tokens = torch.randint(0, module.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([{"input_ids": t[:-1], "labels": t[1:]} for t in tokens], batch_size=4))
    for name, param in module.model.named_parameters():
        if is_adapter_parameter(name):
            assert not torch.equal(param, before[name]), name
        else:
            assert torch.equal(param, before[name]), name


def test_what_lora_on_experts_cannot_run_with_is_refused_before_launch():
    from lightning_2d.models.registry import known_plan, validation_inputs_of
    from lightning_2d.parallel.config import ParallelConfig
    from lightning_2d.parallel.dims import validate_parallel_dims

    with pytest.raises(LoRAConfigError, match=r"QLoRA\) on the routed experts: their weights are stacked 3-D"):
        LlamaLightningModule("debug-moe", lora={"rank": 4, "quantize_base": "nf4"})
    LlamaLightningModule("debug-moe", lora={"rank": 4, "quantize_base": "nf4", "targets": ["wq"]})
    # The experts split by tensor parallelism or by expert take their adapters (tests/distributed/test_lora.py).
    for tp, ep in ((2, 1), (2, 2), (1, 2)):
        config = ParallelConfig(data_parallel_size=4 // tp, tensor_parallel_size=tp, expert_parallel_size=ep)
        with torch.device("meta"):
            moe = Transformer(PRESETS["debug-moe"])
        add_lora(moe, LoRA(rank=4), LLAMA_TARGETS)
        validate_parallel_dims(config, world_size=4, devices_per_node=4, plan=known_plan(moe, config),
                               **validation_inputs_of(moe))
    from lightning_2d.hf import HFCausalLMModule

    mixtral = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
               "num_experts_per_tok": 2}
    with pytest.raises(LoRAConfigError, match=r"LoRA on transformers' own mixture of experts \(HFCausalLMModule, or a"
                                              r" transformers model given to Fabric\) is not supported: its fused"):
        HFCausalLMModule(mixtral, lora={"rank": 4})


transformers = pytest.importorskip("transformers")




@pytest.mark.parametrize("model_type,targets", [("qwen3_moe", None), ("mixtral", None),
                                                ("qwen3_moe", ["q_proj", "up_proj"])])
def test_experts_adapters_export_for_peft_and_merged_with_our_logits(tmp_path, model_type, targets):
    """Fine-tuned on transformers' Qwen3-MoE (or Mixtral) miniature read by our Llama: the peft folder (LoRA on the
    fused expert parameters, peft's target_parameters) on transformers' base, loaded by ``PeftModel.from_pretrained``,
    and the merged folder alone give our model's logits. Every projection adapted (the default), or the experts' up
    projection alone (``gate_up_proj``'s gate rows then take a zero ``B``, one wrapper, rank ``r``)."""
    peft = pytest.importorskip("peft")
    from lightning_2d.hf import export_hf

    family = {"qwen3_moe": {"head_dim": 8, "num_experts": 4, "moe_intermediate_size": 16, "mlp_only_layers": []},
              "mixtral": {"num_local_experts": 4}}[model_type]
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=64, **family)
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base_dir)
    lora = {"rank": 4, "alpha": 8.0, "targets": targets}
    module = LlamaLightningModule(init_from=str(base_dir), lora=lora, learning_rate=1e-2, warmup_steps=1, max_steps=3,
                                  fused_loss=False)
    checkpoint = _fit(module, tmp_path)
    module.eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = module(tokens)
        experts = module.model.layers["1"].feed_forward.experts
        assert isinstance(experts, LoRAExperts) and experts.w3_lora_b.any()
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        base_logits = base(tokens).logits
        assert (ours - base_logits).abs().max() > 1e-3  # the adapters trained

    folder = export_hf(checkpoint, tmp_path / "peft", log=lambda line: None)
    written = json.loads((folder / "adapter_config.json").read_text())
    adapted = peft.PeftModel.from_pretrained(base, folder)
    wrapper = adapted.base_model.model.model.layers[1].mlp.experts
    if targets is None:  # peft's LoRA on both fused parameters
        assert written["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        assert written["target_parameters"] == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                                for p in ("down_proj", "gate_up_proj")]
        assert written["rank_pattern"] == {"gate_up_proj": 8} and written["alpha_pattern"] == {"gate_up_proj": 16.0}
        assert (wrapper.parameter_name, wrapper.base_layer.parameter_name) == ("down_proj", "gate_up_proj")
        assert wrapper.lora_A["default"].weight.shape == (4 * 4, experts.w2.shape[2])  # (E·r, F)
        assert wrapper.base_layer.lora_A["default"].weight.shape == (4 * 8, 32)  # (E·2r, D): w1's and w3's
    else:
        assert written["target_modules"] == ["q_proj"] and "rank_pattern" not in written
        assert written["target_parameters"] == [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)]
        assert wrapper.parameter_name == "gate_up_proj" and wrapper.lora_A["default"].weight.shape == (4 * 4, 32)
    with torch.no_grad():
        theirs = adapted(tokens).logits
        with adapted.disable_adapter():
            assert torch.equal(adapted(tokens).logits, base_logits)
        for layer in module.model.layers.values():  # what the experts' adapters alone change
            for which in layer.feed_forward.experts.projections:
                getattr(layer.feed_forward.experts, f"{which}_lora_b").zero_()
        assert (module(tokens) - ours).abs().max() > 1e-4
    error = float((theirs - ours).abs().max())
    print(f"{model_type} (targets {targets}): peft's logits vs ours, max abs difference {error:.2e}")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # lora_init_from: the peft folder back into a new run's experts' adapters gives the same model; a fused B that
    # is not block-diagonal (an adapter of the whole gate_up_proj) is refused.
    again = LlamaLightningModule(init_from=str(base_dir), lora=lora, lora_init_from=str(folder), fused_loss=False)
    again.configure_model()
    again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), ours, rtol=1e-5, atol=1e-5)
    if targets is None:
        from safetensors.torch import load_file, save_file

        stored = load_file(folder / "adapter_model.safetensors")
        key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
        stored[key][0, -1] = 1.0  # a gate row, an up-projection rank column
        save_file(stored, folder / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=r"experts.base_layer.lora_B.weight: not block-diagonal over w1\+w3"):
            LlamaLightningModule(init_from=str(base_dir), lora=lora, lora_init_from=str(folder)).configure_model()

    merged = export_hf(checkpoint, tmp_path / "merged", merge_lora=True, log=lambda line: None)
    alone = transformers.AutoModelForCausalLM.from_pretrained(merged)
    with torch.no_grad():
        torch.testing.assert_close(alone(tokens).logits, ours, rtol=1e-5, atol=1e-5)
