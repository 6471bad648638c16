"""LoRA's pure logic: the settings, adapting a model's projections in place, the adapters' seeded init, what the
modules optimize. Under the parallelisms: tests/distributed/test_lora.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from lightning_2d import LlamaLightningModule, LoRA
from lightning_2d.models.lora_targets import HF_TARGETS, HF_TO_LLAMA, LLAMA_TARGETS
from lightning_2d.models.llama.model import ModelArgs, Transformer
from lightning_2d.ops.init import SeededInit, WithOwnInit, module_init_specs
from lightning_2d.ops.lora import (
    LoRAConfigError,
    LoRALinear,
    adapters_disabled,
    add_lora,
    is_adapter_parameter,
    quantize_lora_bases,
)
from lightning_2d.ops.nf4 import dequantize, fill_nf4_, is_nf4, nf4_equal, nf4_state, to_nf4_weight

ARGS = ModelArgs.from_name("debug")


def lora_model(lora: LoRA, seed: int = 7) -> Transformer:
    model = Transformer(ARGS)
    add_lora(model, lora, LLAMA_TARGETS, HF_TO_LLAMA)
    model.init_weights(seed)
    return model


#: Every projection a whole number of NF4 scaler groups (16,384 elements) in up to 4 row shards.
QLORA_ARGS = ModelArgs.from_name("debug", dim=256, n_heads=4, n_kv_heads=4, multiple_of=256)


def qlora_model(lora: LoRA, seed: int = 7) -> Transformer:
    model = Transformer(QLORA_ARGS)
    add_lora(model, lora, LLAMA_TARGETS, HF_TO_LLAMA)
    model.init_weights(seed)
    quantize_lora_bases(model)
    return model


def test_settings_scale_and_round_trip_as_plain_data():
    assert LoRA(rank=8, alpha=16).scale == 2.0
    assert LoRA(rank=16, alpha=8, rslora=True).scale == pytest.approx(8 / 4)
    lora = LoRA.of({"rank": 4, "alpha": 8.0, "targets": ["q_proj"], "dropout": 0.1})
    assert lora.targets == ("q_proj",) and LoRA.of(lora.to_dict()) == lora and LoRA.of(lora) is lora
    assert LoRA.of(None) is None
    with pytest.raises(LoRAConfigError, match=r"alpha must be a positive number, got -1.*dropout must be in \[0, 1\)"):
        LoRA(alpha=-1, dropout=1.5)
    with pytest.raises(LoRAConfigError, match=r"targets must be a non-empty list"):
        LoRA(targets=[])


def test_adapting_keeps_the_base_names_freezes_them_and_starts_as_the_base():
    base = Transformer(ARGS)
    base.init_weights(7)
    model = lora_model(LoRA(rank=4, alpha=8))
    adapted = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == ARGS.n_layers * 7
    # The base parameters keep their names and (seeded) values: init_from, plans and checkpoints read them as before.
    for name, weight in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], weight), name
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n in model.state_dict() if is_adapter_parameter(n)] and len(trainable) == 2 * len(adapted)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))  # B starts at zero


def test_an_adapted_layer_computes_its_merged_weight():
    base = nn.Linear(12, 10, bias=False)
    linear = LoRALinear.from_linear(base, LoRA(rank=3, alpha=6))
    assert linear.weight is base.weight and linear.bias is None  # the layer's own parameters
    with torch.no_grad():
        linear.lora_b.weight.normal_()
    x = torch.randn(5, 12)
    torch.testing.assert_close(linear(x), x @ linear.merged_weight().T)
    assert linear.scale == 2.0 and isinstance(linear.lora_dropout, nn.Identity)
    assert isinstance(LoRALinear.from_linear(nn.Linear(4, 4), LoRA(dropout=0.1)).lora_dropout, nn.Dropout)


def test_targets_by_our_names_hugging_face_names_or_dotted_suffixes():
    def adapted(targets):
        model = Transformer(ARGS)
        return add_lora(model, LoRA(targets=targets), LLAMA_TARGETS, HF_TO_LLAMA)

    assert adapted(["q_proj", "v_proj"]) == adapted(["wq", "wv"])
    assert adapted(["attention.wq"]) == [f"layers.{i}.attention.wq" for i in range(ARGS.n_layers)]
    assert adapted(["layers.1.feed_forward.w2"]) == ["layers.1.feed_forward.w2"]
    assert set(HF_TO_LLAMA) == set(HF_TARGETS) and set(HF_TO_LLAMA.values()) == set(LLAMA_TARGETS)
    model = Transformer(ARGS)
    add_lora(model, LoRA(), LLAMA_TARGETS)
    with pytest.raises(LoRAConfigError, match="already has LoRA adapters"):
        add_lora(model, LoRA(), LLAMA_TARGETS)


def test_the_adapters_seeded_init_is_pefts_and_the_same_block_by_block():
    model = lora_model(LoRA(rank=8))
    a = model.layers["2"].feed_forward.w2.lora_a.weight  # (rank, in_features)
    bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=√5), as nn.Linear and peft
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and abs(float(a.mean())) < 0.1 * bound
    assert not model.layers["2"].feed_forward.w2.lora_b.weight.any()
    # A rank holding rows 3..8 and columns 100..200 draws exactly those values (any layout, the same weights).
    specs = module_init_specs(model)
    name = "layers.2.feed_forward.w2.lora_a.weight"
    block = torch.empty(5, 100)
    SeededInit(specs, 7).fill_block_(block, name, tuple(a.shape), (3, 100))
    assert torch.equal(block, a[3:8, 100:200])
    # From a checkpoint without adapters (init_from): the adapters from their own init, the rest from it.
    source = WithOwnInit(SeededInit(model.param_init_specs(), 7), specs, 7)
    again = lora_model(LoRA(rank=8), seed=0)
    again.load_blocks(source)
    for (n, x), y in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(x, y), n


def test_the_module_optimizes_the_adapters_only_and_keeps_its_settings_as_plain_data():
    module = LlamaLightningModule("debug", lora={"rank": 2, "targets": ["wq"]}, max_steps=4, init_seed=0)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in module.model.named_parameters() if is_adapter_parameter(n)}
    assert optimized == adapters and len(adapters) == 2 * ARGS.n_layers
    assert module.hparams["lora"] == {"rank": 2, "alpha": 16.0, "dropout": 0.0, "targets": ["wq"], "rslora": False}
    assert LlamaLightningModule("debug").lora is None


def saved_qwen3(folder, **sizes):
    """A small random transformers Qwen3 (vocabulary 64, 4 heads, untied head) saved to ``folder``; returned."""
    transformers = pytest.importorskip("transformers")
    config = {"model_type": "qwen3", "vocab_size": 64, "num_attention_heads": 4, "tie_word_embeddings": False, **sizes}
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    original.save_pretrained(folder)
    return original


def test_a_hugging_face_decoder_takes_adapters_on_its_own_projections_over_its_init_from_weights(tmp_path):
    from lightning_2d.hf import HFCausalLMModule

    original = saved_qwen3(tmp_path, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
                           head_dim=8)
    module = HFCausalLMModule(init_from=str(tmp_path), lora={"rank": 4, "targets": ["q_proj", "w2"]}, init_seed=1)
    module.configure_model()
    adapted = sorted(n for n, m in module.model.named_modules() if isinstance(m, LoRALinear))
    assert adapted == [f"model.layers.{i}.{p}" for i in range(2) for p in ("mlp.down_proj", "self_attn.q_proj")]
    assert all(is_adapter_parameter(n) == p.requires_grad for n, p in module.model.named_parameters())
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():  # the base read from the files, the adapters starting at zero: the saved model's logits
        torch.testing.assert_close(module(tokens), original(tokens).logits, rtol=1e-6, atol=1e-6)


def test_a_hugging_face_decoder_with_nf4_bases_computes_with_its_files_weights_quantized(tmp_path):
    """QLoRA on a Hugging Face decoder's own projections, from ``init_from``: each base is the NF4 of the file's
    weight (quantized whole), and the logits are those of the saved model with those weights dequantized."""
    from lightning_2d.hf import HFCausalLMModule

    original = saved_qwen3(tmp_path, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_key_value_heads=4,
                           head_dim=64)
    module = HFCausalLMModule(init_from=str(tmp_path), lora={"rank": 4, "quantize_base": "nf4"}, init_seed=1)
    module.configure_model()
    quantized = {n for n, p in module.model.named_parameters() if is_nf4(p)}
    assert quantized == {f"model.layers.0.{p}.weight" for p in
                         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    with torch.no_grad():
        for name in quantized:
            original.get_parameter(name).copy_(dequantize(to_nf4_weight(original.get_parameter(name))))
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(module(tokens), original(tokens).logits, rtol=1e-5, atol=1e-5)


def _fit(module, tmp_path, steps: int = 3):
    """A few single-device steps on random tokens, then a checkpoint: the adapters only."""
    import lightning as L
    from torch.utils.data import DataLoader

    tokens = torch.randint(0, module.vocab_size, (4 * steps, 17), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(batches, batch_size=4))
    path = tmp_path / "lora.ckpt"
    trainer.save_checkpoint(path)
    return path


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_lora_checkpoint_exports_for_peft_and_merged_with_our_logits(tmp_path, family):
    """Fine-tuned on an init_from folder: the peft folder on transformers' base and the merged folder alone give our
    model's logits (Llama: B's rows permuted to transformers' rotary layout, as the base's)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file
    from lightning_2d.hf import HFCausalLMModule, export_hf

    config = {"model_type": family, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "tie_word_embeddings": False, "max_position_embeddings": 64}
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).save_pretrained(base_dir)
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}
    if family == "llama":
        module = LlamaLightningModule(init_from=str(base_dir), lora=lora, learning_rate=1e-2, warmup_steps=1,
                                      max_steps=3, fused_loss=False)
    else:
        module = HFCausalLMModule(init_from=str(base_dir), lora=lora, learning_rate=1e-2, warmup_steps=1, max_steps=3)
    checkpoint = _fit(module, tmp_path)
    saved = load_checkpoint_file(checkpoint)["state_dict"]
    assert saved and all(is_adapter_parameter(k) for k in saved)
    module.eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = _logits(module, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    assert (ours - _logits(base, tokens)).abs().max() > 1e-3  # the adapters trained

    folder = export_hf(checkpoint, tmp_path / "peft", log=lambda line: None)
    written = json.loads((folder / "adapter_config.json").read_text())
    assert {k: written[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0,
        "base_model_name_or_path": str(base_dir.resolve())}
    assert written["target_modules"] == ["down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    assert not (folder / "model.safetensors").exists()
    adapted = peft.PeftModel.from_pretrained(base, folder)
    torch.testing.assert_close(_logits(adapted, tokens), ours, rtol=1e-5, atol=1e-5)
    # lora_init_from: the peft folder back into a new run's adapters (on the same base) gives the same model.
    cls = type(module)
    again = cls(init_from=str(base_dir), lora=lora, lora_init_from=str(folder), **(
        {"fused_loss": False} if family == "llama" else {}))
    again.configure_model()
    again.eval()
    torch.testing.assert_close(_logits(again, tokens), ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"does not fit this model's adapters:\n  - its r is 4, this model's lora"
                                         r" gives 8"):
        cls(init_from=str(base_dir), lora={**lora, "rank": 8}, lora_init_from=str(folder))
    with pytest.raises(ValueError, match=r"lora_init_from=.* needs the base its adapters were trained on: set"
                                         r" init_from"):
        cls(**({"model": "debug"} if family == "llama" else {"config": config}), lora=lora,
            lora_init_from=str(folder))

    merged = export_hf(checkpoint, tmp_path / "merged", merge_lora=True, log=lambda line: None)
    assert not (merged / "adapter_config.json").exists()
    alone = transformers.AutoModelForCausalLM.from_pretrained(merged)
    torch.testing.assert_close(_logits(alone, tokens), ours, rtol=1e-5, atol=1e-5)


def test_a_single_device_run_resumes_its_adapters_only_checkpoint_and_refuses_another_base(tmp_path):
    """Lightning's own loader (no 2D strategy) reads an adapters-only checkpoint: the base is rebuilt from the seed,
    the adapters and their AdamW state restored; a module on another seed is refused before anything is loaded."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_2d.checkpoint.errors import CheckpointError

    lora = {"rank": 2, "targets": ["wq", "w2"]}
    first = LlamaLightningModule("debug", lora=lora, init_seed=3, max_steps=4, warmup_steps=1)
    checkpoint = _fit(first, tmp_path, steps=2)
    tokens = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]

    def resume(module):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, DataLoader(batches, batch_size=4), ckpt_path=checkpoint)
        return trainer

    again = LlamaLightningModule("debug", lora=lora, init_seed=3, max_steps=4, warmup_steps=1)
    trainer = resume(again)
    assert trainer.global_step == 3
    optimizer_state = trainer.optimizers[0].state
    assert optimizer_state and all(int(s["step"]) == 3 for s in optimizer_state.values())  # restored, then one step
    with pytest.raises(CheckpointError, match=r"trained on the base initialized from seed 3; this run's base is from"
                                              r" seed 4: set init_seed=3"):
        resume(LlamaLightningModule("debug", lora=lora, init_seed=4, max_steps=4, warmup_steps=1))


@pytest.mark.parametrize("quantize_base", [None, "nf4"])
def test_an_adapted_block_compiles_as_one_graph_with_the_eager_gradients(quantize_base):
    """The adapters add nothing dynamo cannot trace: a block with adapters on all seven projections compiles with
    ``fullgraph=True`` (a graph break would raise) and gives eager's output and adapter gradients (``aot_eager``: the
    traced forward and backward without inductor's code generation, which the compiled 2×2 job exercises), and with
    its adapters switched off (a preference loss's reference, ``adapters_disabled``) the base's. With NF4 bases
    (QLoRA) too, adapters on: torchao's dequantizing linear traces as well."""
    if quantize_base:
        model = qlora_model(LoRA(rank=4, alpha=8, quantize_base=quantize_base))
        assert is_nf4(model.layers["1"].attention.wq.weight)
    else:
        model = lora_model(LoRA(rank=4, alpha=8))
    block = model.layers["1"]
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("lora_b.weight"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    x = torch.randn(2, 16, model.args.dim, requires_grad=True)
    rope = model.rope[:16]

    def run(fn):
        block.zero_grad()
        out = fn(x, rope)
        out.square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in block.named_parameters() if p.requires_grad}

    eager_out, eager_grads = run(block)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled_out, compiled_grads = run(compiled)
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys() and len(eager_grads) == 14
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if quantize_base:  # (compile=True is refused with NF4 bases under the strategies: qlora_compile)
        return
    # A preference loss's reference under LoRA: the same compiled block, its adapters off, without grad (its own
    # graph: the flag is in the guards), then on again (a graph of the flag off reused would give the base's output).
    with torch.no_grad():
        with adapters_disabled(block):
            base_eager, base_compiled = block(x, rope), compiled(x, rope)
        adapted_compiled = compiled(x, rope)
    torch.testing.assert_close(base_compiled, base_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adapted_compiled, eager_out, rtol=1e-5, atol=1e-5)
    assert (base_eager - eager_out).abs().max() > 1e-3  # the adapters change the block


# ---- QLoRA: NF4 bases ---------------------------------------------------------------------------------------------
def test_nf4_rows_filled_from_the_whole_weight_are_the_one_device_bits():
    """A rank's rows are cut from the whole weight's quantization (``fill_nf4_``), not quantized alone: the scalers'
    mean is the whole tensor's, so quantizing each shard by itself gives other values."""
    weight = torch.randn(512, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    whole = to_nf4_weight(weight)
    with torch.device("meta"):
        meta = to_nf4_weight(torch.empty(512, 256))  # as the strategy holds it before materialization
    rows = []
    for shard in torch.chunk(meta, 4, dim=0):
        local = torch.empty_like(shard, device="cpu")
        fill_nf4_(local, weight, row_offset=len(rows) * 128)
        rows.append(dequantize(local))
    assert torch.equal(torch.cat(rows), dequantize(whole))
    alone = torch.cat([dequantize(to_nf4_weight(part)) for part in torch.chunk(weight, 4, dim=0)])
    assert not torch.equal(alone, dequantize(whole))
    assert (dequantize(whole) - weight).abs().max() < 0.2 * weight.abs().max()  # 4-bit codes of the same weight


def test_qlora_layers_compute_with_their_nf4_bases_and_only_the_adapters_move():
    lora = LoRA(rank=4, alpha=8, quantize_base="nf4")
    model = qlora_model(lora)
    wq = model.layers["0"].attention.wq
    assert is_nf4(wq.weight) and not wq.weight.requires_grad
    assert not is_nf4(model.output.weight) and not is_nf4(model.layers["0"].attention_norm.weight)
    # The same model with the dequantized bases as plain weights computes the same logits.
    plain = lora_model_like(model)
    tokens = torch.randint(0, QLORA_ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        wq.lora_b.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(wq.merged_weight(), dequantize(wq.weight) + wq.lora_b.weight @ wq.lora_a.weight * 2.0)
    bases = {n: nf4_state(p) for n, p in model.named_parameters() if is_nf4(p)}
    assert len(bases) == 4 * 7
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    params = dict(model.named_parameters())
    assert all(nf4_equal(params[n], state) for n, state in bases.items())
    assert all(p.grad is None for n, p in params.items() if not is_adapter_parameter(n))


def lora_model_like(model: Transformer) -> Transformer:
    """A plain-LoRA copy of a QLoRA ``model``: the same adapters, its NF4 bases dequantized."""
    copy = Transformer(model.args)
    add_lora(copy, LoRA(rank=4, alpha=8), LLAMA_TARGETS, HF_TO_LLAMA)
    copy.load_state_dict({n: dequantize(p) if is_nf4(p) else p for n, p in model.state_dict().items()})
    return copy


def test_weights_that_do_not_split_into_whole_nf4_groups_are_refused_with_their_sizes():
    model = Transformer(ARGS)  # dim 128: a 128 × 128 projection is one scaler group
    add_lora(model, LoRA(quantize_base="nf4", targets=["wq", "w1"]), LLAMA_TARGETS, HF_TO_LLAMA)
    with pytest.raises(LoRAConfigError) as refused:
        quantize_lora_bases(model, shards=4)
    assert str(refused.value) == (
        "lora.quantize_base='nf4' cannot store these weights in NF4: layers.*.attention.wq.weight (128 × 128) does not"
        " split into 4 row shards of whole NF4 scaler groups (16,384 elements): each shard would hold 4,096;"
        " layers.*.feed_forward.w1.weight (352 × 128 = 45,056 elements) is not a whole number of NF4 scaler groups of"
        " 16,384 (64 × 256) elements. Leave them out of lora.targets, train with quantize_base=None, or use a"
        " data-parallel size whose shards hold whole groups of 16,384 elements")
    assert not any(is_nf4(p) for p in model.parameters())  # refused before any weight was replaced
    model = Transformer(ARGS)
    add_lora(model, LoRA(quantize_base="nf4", targets=["wq"]), LLAMA_TARGETS, HF_TO_LLAMA)
    assert len(quantize_lora_bases(model, shards=1)) == ARGS.n_layers  # one device: a whole group suffices


def test_qlora_without_torchao_says_how_to_install_it(monkeypatch):
    from lightning_2d.ops import nf4
    from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
    from lightning_2d.parallel.dims import validate_parallel_dims

    monkeypatch.setattr(nf4, "torchao_version", lambda: None)
    with pytest.raises(ParallelConfigError) as refused:  # the registered check qlora_weights, at tp=1
        validate_parallel_dims(ParallelConfig(), world_size=1, devices_per_node=1, lora=LoRA(quantize_base="nf4"))
    (problem,) = refused.value.problems
    assert problem == ("lora.quantize_base='nf4' (QLoRA) needs torchao>=0.18, which is not installed; install it with"
                       ' `pip install "lightning-2d[qlora]"` (or `pip install "torchao>=0.18"`)')
    with pytest.raises(ImportError, match=r"lightning-2d\[qlora\]"):
        qlora_model(LoRA(quantize_base="nf4"))


def test_qlora_settings_are_recorded_only_when_set():
    assert "quantize_base" not in LoRA(rank=2).to_dict()  # adapters saved before QLoRA existed compare equal
    assert LoRA.of(LoRA(rank=2, quantize_base="nf4").to_dict()) == LoRA(rank=2, quantize_base="nf4")


def test_a_model_given_with_its_adapters_is_checked_by_what_its_modules_show():
    """Fabric meets a model adapted by its owner, or one declaring its adapters (``model.lora``, as the recipe does):
    the checks read its adapters' settings and experts from its modules (``validation_inputs_of``), as they read a
    module's ``lora=``; the adapters' converter refuses nothing itself."""
    from lightning_2d.models.llama.model import PRESETS
    from lightning_2d.models.registry import validation_inputs_of, known_plan
    from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
    from lightning_2d.parallel.converters import ModelConverters
    from lightning_2d.parallel.dims import validate_parallel_dims

    with torch.device("meta"):
        moe, dense = Transformer(PRESETS["debug-moe"]), Transformer(ARGS)
    ModelConverters.of(known_plan(moe, ParallelConfig()), {"lora": LoRA(rank=4)}).convert(moe, None)  # adapted
    dense.lora = LoRA(rank=4, quantize_base="nf4")  # declared
    assert validation_inputs_of(moe) == {"owner": "Transformer", "lora": LoRA(rank=4), "experts": True,
                                    "supports_document_mask": False}
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    validate_parallel_dims(config, world_size=4, devices_per_node=4, plan=known_plan(moe, config),
                           **validation_inputs_of(moe))  # its routed experts' adapters too (#46)
    with pytest.raises(ParallelConfigError, match=r"QLoRA\) with tensor_parallel_size=2: NF4 weights"):
        validate_parallel_dims(config, world_size=4, devices_per_node=4, plan=known_plan(dense, config),
                               **validation_inputs_of(dense))
    with torch.device("meta"):
        quantized_moe = Transformer(PRESETS["debug-moe"])
    quantized_moe.lora = LoRA(rank=4, quantize_base="nf4")  # declared: NF4 bases of the routed experts, refused
    mixed = ParallelConfig(data_parallel_size=4, tensor_parallel_size=1, float8="emulate")
    with pytest.raises(ParallelConfigError) as both:  # problems of two kinds: one ParallelConfigError listing both
        validate_parallel_dims(mixed, world_size=4, devices_per_node=4, **validation_inputs_of(quantized_moe))
    assert [p.split(" ")[0] for p in both.value.problems] == ["float8='emulate'", "lora.quantize_base='nf4'"]


def test_a_weights_storage_format_says_how_it_is_filled_kept_counted_and_checked():
    """``ops.weights.weight_format``: what materialization, FSDP2, the finite check and the planner ask of a weight
    instead of its type. NF4 (a DTensor's local shard too): no sentinel, gathered in parts, not finite-checked, its
    bytes; a plain tensor the opposite, its dtype's bytes."""
    from lightning_2d.ops.nf4 import NF4Format, nf4_bytes
    from lightning_2d.ops.weights import PLAIN, weight_format

    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    nf4 = to_nf4_weight(weight)
    assert isinstance(weight_format(nf4), NF4Format) and weight_format(weight) is PLAIN
    assert (weight_format(nf4).has_sentinel, weight_format(nf4).gathers_as_one, weight_format(nf4).checks_finite) == (
        False, False, False)
    assert PLAIN.has_sentinel and PLAIN.gathers_as_one and PLAIN.checks_finite
    assert weight_format(nf4).nbytes(nf4.numel(), nf4.dtype) == nf4_bytes(256 * 128, torch.float32)
    assert PLAIN.gathered_bytes(10, torch.float32, torch.bfloat16) == 20 and PLAIN.nbytes(10, torch.float32) == 40
    kept = weight_format(nf4).snapshot(nf4)  # the inner tensors, not a re-quantized clone
    copy = to_nf4_weight(torch.zeros_like(weight))
    weight_format(copy).restore_(copy, kept)
    assert nf4_equal(copy, kept)


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_under_tensor_parallelism_the_adapters_compute_on_local_tensors(tmp_path, style):
    """``WithAdapters`` tells an adapted layer its local gradients' placements, and its forward then computes the
    adapters' products on local tensors (no DTensor dispatch, the ``lora_a``/``lora_b`` modules never called): the
    same output and gradients as the DTensor expression (one gloo rank; the sums over real ranks are
    tests/distributed/test_lora.py's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_2d.parallel.lora import WithAdapters

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        results = []
        for local in (True, False):
            torch.manual_seed(0)
            layer = LoRALinear.from_linear(nn.Linear(8, 6, bias=False), LoRA(rank=2, alpha=4.0))
            nn.init.normal_(layer.lora_b.weight)
            base = ColwiseParallel() if style == "colwise" else RowwiseParallel()
            parallelize_module(layer, mesh, WithAdapters(base))
            assert layer.local_adapter_grads is not None
            if not local:
                layer.local_adapter_grads = None
            calls = []
            layer.lora_a.register_forward_hook(lambda *args: calls.append("lora_a"))
            x = torch.randn(3, 8, requires_grad=True)
            layer(x).sum().backward()
            assert calls == ([] if local else ["lora_a"])
            grads = [layer.lora_a.weight.grad, layer.lora_b.weight.grad]
            results.append([x.grad, *(g.to_local() if hasattr(g, "to_local") else g for g in grads)])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)
    finally:
        dist.destroy_process_group()
