"""Mixture-of-experts blocks in the Llama family (``ModelArgs.moe``) and the pure pieces of their training: which
blocks are sparse, parameter and FLOP counts, the layout-independent init of the stacked experts, the auxiliary loss
split over ranks, aux-loss-free balancing counted once per forward (not again in a checkpoint's recompute), and the
expert-parallel refusals before launch."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_2d.models.llama.model import PRESETS, ModelArgs, ModelArgsError, Transformer
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.ops.init import SeededInit
from lightning_2d.ops.feed_forward import SwiGLU
from lightning_2d.ops.moe import MoE, MoEArgs, RouterStats, auxiliary_loss, auxiliary_loss_terms
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_2d.parallel.dims import validate_parallel_dims


def test_which_blocks_are_mixtures_of_experts_follows_qwen3_moe():
    args = ModelArgs(dim=64, n_layers=6, n_heads=4, vocab_size=32, multiple_of=16,
                     moe={"num_experts": 4, "top_k": 2, "hidden_dim": 16}, moe_layer_step=2, dense_layers=[3])
    assert isinstance(args.moe, MoEArgs) and args.dense_layers == [3]
    assert args.moe_layers == (1, 5)  # (i + 1) % 2 == 0, block 3 kept dense
    model = Transformer(args)
    kinds = [type(model.layers[str(i)].feed_forward) for i in range(6)]
    assert kinds == [SwiGLU, MoE, SwiGLU, SwiGLU, SwiGLU, MoE]
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert ModelArgs(**asdict(args)) == args  # as checkpoints store them (plain data) and read them back
    with pytest.raises(ModelArgsError, match=r"moe: Invalid mixture-of-experts settings: top_k \(9\) cannot exceed"):
        ModelArgs(moe={"num_experts": 4, "top_k": 9, "hidden_dim": 16})
    with pytest.raises(ModelArgsError, match=r"dense_layers must be block indices in \[0, 2\), got \[5\]"):
        ModelArgs(n_layers=2, dense_layers=(5,))


def test_presets_count_all_and_active_parameters():
    mixtral = ModelArgs.from_name("mixtral-8x7b")
    assert round(mixtral.num_params() / 1e9, 1) == 46.7  # Mistral's published 46.7 B, 12.9 B active
    assert round(mixtral.num_params(active=True) / 1e9, 1) == 12.9
    debug = PRESETS["debug-moe"]
    assert debug.moe_layers == (1, 2, 3)
    model = Transformer(debug)
    assert sum(p.numel() for p in model.parameters()) == debug.num_params()
    moe = debug.moe
    assert debug.num_params() - debug.num_params(active=True) == 3 * 3 * 128 * 64 * (moe.num_experts - moe.top_k)
    # The FLOPs of a token are its active parameters' (torchtitan's convention for mixtures of experts).
    dense = ModelArgs.from_name("debug")
    assert debug.flops_per_token(32) - dense.flops_per_token(32) == 6 * (
        debug.num_params(exclude_embedding=True, active=True) - dense.num_params(exclude_embedding=True))


def test_stacked_experts_take_the_same_init_in_any_shard():
    """The seeded init draws a 3-D expert tensor by rows of its global shape: an expert-parallel rank's experts (a
    dim-0 slice) and a tensor-parallel rank's features (a dim-1 slice) get the whole tensor's values."""
    model = Transformer(PRESETS["debug-moe"])
    specs = model.param_init_specs()
    assert set(specs) == {n for n, _ in model.named_parameters()}
    model.init_weights(5)
    source = SeededInit(specs, 5)
    for name in ("layers.1.feed_forward.experts.w1", "layers.3.feed_forward.experts.w2"):
        whole = model.get_parameter(name)
        block = torch.empty(3, *whole.shape[1:])
        source.fill_block_(block, name, tuple(whole.shape), (4, 0, 0))
        assert torch.equal(block, whole[4:7])
        cut = torch.empty(whole.shape[0], whole.shape[1] // 2, whole.shape[2])
        source.fill_block_(cut, name, tuple(whole.shape), (0, whole.shape[1] // 2, 0))
        assert torch.equal(cut, whole[:, whole.shape[1] // 2:])
    assert specs["layers.1.feed_forward.experts.w2"].std < specs["layers.1.feed_forward.experts.w1"].std == 0.02


def test_the_auxiliary_loss_split_over_ranks_sums_to_the_whole_batchs_with_its_gradient():
    """Each rank's term (its scores against the counts of all ranks) sums to transformers' loss of the whole batch,
    and so do the router gradients; a mean of each rank's own loss does not."""
    torch.manual_seed(0)
    experts = 6
    logits = [torch.randn(10 + 3 * r, experts, requires_grad=True) for r in range(3)]

    def stats(chunk: torch.Tensor) -> RouterStats:
        scores = torch.softmax(chunk, -1)
        counts = torch.zeros(experts).scatter_add_(0, scores.topk(2).indices.flatten(), torch.ones(chunk.shape[0] * 2))
        return RouterStats(counts, scores.sum(0), chunk.shape[0])

    whole = auxiliary_loss([stats(torch.cat(logits))], experts, 2)
    grads = torch.autograd.grad(whole, logits)
    per_rank = [[stats(chunk)] for chunk in logits]
    summed = torch.stack([torch.cat([s[0].counts, s[0].score_sums.detach(), torch.tensor([float(s[0].tokens)])])
                          for s in per_rank]).sum(0)

    def all_reduce(t: torch.Tensor) -> None:  # what the data-parallel all-reduce gives every rank
        t.copy_(summed)

    terms = [auxiliary_loss_terms(s, experts, all_reduce) for s in per_rank]
    torch.testing.assert_close(sum(t for t, _ in terms), whole)
    for _, value in terms:
        torch.testing.assert_close(value, whole)
    term_grads = [torch.autograd.grad(t, chunk)[0] for (t, _), chunk in zip(terms, logits)]
    for got, want in zip(term_grads, grads):
        torch.testing.assert_close(got, want)
    own_mean = sum(auxiliary_loss(s, experts, 2) for s in per_rank) / 3
    assert abs(own_mean.item() - whole.item()) > 1e-3


def test_bias_balancing_counts_each_forward_once_under_activation_checkpointing():
    layer = MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, load_balancing="bias", bias_update_rate=0.1))
    torch.nn.init.normal_(layer.router.weight)
    for p in layer.experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # the recompute must not count again
    assert layer.tokens_per_expert.sum() == 2 * 5 * 2
    counts = layer.tokens_per_expert.clone()
    layer.update_bias(counts)
    below = counts < counts.mean()
    assert (layer.expert_bias[below] > layer.expert_bias[~below].max()).all()  # the starved experts move up
    assert abs(float(layer.expert_bias.sum())) < 1e-6 and not layer.tokens_per_expert.any()
    layer.eval()
    layer(x)
    assert not layer.tokens_per_expert.any()  # evaluation does not balance


@pytest.mark.parametrize("load_balancing", ["aux_loss", "bias"])
def test_one_load_balancing_object_is_the_training_contract_of_every_loop(load_balancing):
    """``LoadBalancing`` (what ``LlamaLightningModule`` and the Fabric recipe both use) on one process: the auxiliary
    loss of the last forward's routing over every MoE block, weighted, or nothing under bias balancing, whose bias
    it moves after the optimizer step instead."""
    from dataclasses import replace

    from lightning_2d.parallel.expert import LoadBalancing

    args = replace(PRESETS["debug-moe"], moe=replace(PRESETS["debug-moe"].moe, load_balancing=load_balancing))
    model = Transformer(args)
    model.init_weights(0)
    model(torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)))
    balancing = LoadBalancing(args.moe)
    assert balancing.uses_aux_loss == (load_balancing == "aux_loss")
    if load_balancing == "aux_loss":
        term, value = balancing.loss(model)
        expected = args.moe.aux_loss_coef * auxiliary_loss(model.router_stats(), args.moe.num_experts, args.moe.top_k)
        torch.testing.assert_close(term, expected)
        torch.testing.assert_close(value, expected.detach())
        assert term.requires_grad and balancing.after_optimizer_step(model) == 0
    else:
        assert balancing.loss(model) is None
        assert balancing.after_optimizer_step(model) == len(args.moe_layers) == 3
        assert all(layer.expert_bias.abs().sum() > 0 for layer in model.moe_layers())
    assert LoadBalancing(None).loss(model) is None and LoadBalancing(None).after_optimizer_step(model) == 0


def _validate(plan_args: ModelArgs, world: int = 4, **options) -> None:
    config = ParallelConfig(**options)
    validate_parallel_dims(config, world_size=world, devices_per_node=world, plan=llama_plan(plan_args, config))


def test_expert_parallelism_is_refused_where_it_cannot_split_the_experts():
    moe = PRESETS["debug-moe"]
    _validate(moe, data_parallel_size=4, tensor_parallel_size=1, expert_parallel_size=4)  # accepted
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size \(4\) must divide the data-shard × context"
                                                  r" ranks \(2 = data_parallel_size 2 / data_parallel_replicate_size 1 × context_parallel_size 1\).*use one of 1"
                                                  r" or 2"):
        _validate(moe, data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size \(3\) must divide the model's 8 experts"):
        _validate(moe, world=6, data_parallel_size=6, tensor_parallel_size=1, expert_parallel_size=3)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size=2 but the model has no mixture-of-experts"):
        _validate(PRESETS["debug"], data_parallel_size=4, tensor_parallel_size=1, expert_parallel_size=2)
    ParallelConfig(expert_parallel_size=2, fsdp_backend="simple_fsdp")  # SimpleFSDP shards the experts too
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size must be a positive integer, got 0"):
        ParallelConfig(expert_parallel_size=0)


def test_the_auxiliary_loss_is_accepted_under_pipeline_parallelism():
    """The stages add it inside the schedule (``parallel.expert.PipelineAuxiliaryLoss``, installed from the plan's
    ``aux_loss_coef`` by ``parallelize_pipeline``): the module's plan and a Transformer's given to Fabric carry it."""
    from lightning_2d import LlamaLightningModule
    from lightning_2d.models.registry import known_plan

    config = ParallelConfig(pipeline_parallel_size=2)
    plan = LlamaLightningModule("debug-moe").parallel_plan(config)
    validate_parallel_dims(config, world_size=2, devices_per_node=2, plan=plan)
    assert (plan.num_experts, plan.aux_loss_coef) == (8, 0.01)
    with torch.device("meta"):
        model = Transformer(PRESETS["debug-moe"])
    validate_parallel_dims(config, world_size=2, devices_per_node=2, plan=known_plan(model, config))
    assert known_plan(model, config).aux_loss_coef == 0.01
    module = LlamaLightningModule("debug-moe", model_overrides={"moe": {**asdict(PRESETS["debug-moe"].moe),
                                                                          "load_balancing": "bias"}})
    assert module.parallel_plan(config).aux_loss_coef is None  # no term for the stages to add


transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
FAMILIES = {
    "qwen3": {"head_dim": 32},
    "qwen3_moe": {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "mlp_only_layers": [0], "norm_topk_prob": False},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def _saved(tmp_path, model_type: str, fused: bool = False):
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **FAMILIES[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms away from 1, so an unpermuted q/k norm weight shows
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    directory = tmp_path / (model_type + ("_fused" if fused else ""))
    model.save_pretrained(directory)
    if fused:  # transformers 5's in-memory names and stacked experts, as some checkpoints ship them
        from safetensors.torch import save_file

        (directory / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors",
                  metadata={"format": "pt"})
    return model, directory


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen3"])
def test_a_hugging_face_moe_config_is_read_in_one_place_the_same_from_a_file_or_transformers(tmp_path, model_type):
    """``MoEArgs.from_hf_config`` reads a transformers config and the ``config.json`` it writes alike (transformers 5
    writes ``num_local_experts``; a released Qwen3-MoE file says ``num_experts``), and so the Hugging Face plan's
    sparse blocks, our import's and ``HFCausalLMModule``'s FLOPs agree."""
    import json

    from lightning_2d.checkpoint.hf import model_args_from_hf
    from lightning_2d.models.hf_decoders import hf_moe_layers
    from lightning_2d.ops.moe import MoEArgs

    config = transformers.AutoConfig.for_model(model_type, **SMALL, **FAMILIES[model_type],
                                               output_router_logits=True, router_aux_loss_coef=0.02)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    released = {("num_experts" if k == "num_local_experts" and model_type == "qwen3_moe" else k): v
                for k, v in written.items()}
    read = [MoEArgs.from_hf_config(c) for c in (config, written, released)]
    assert read[0] == read[1] == read[2]
    if model_type == "qwen3":
        assert read[0] is None and hf_moe_layers(config) == ()
        return
    experts = 8 if model_type == "qwen3_moe" else 4
    hidden = 32 if model_type == "qwen3_moe" else 96
    assert read[0] == MoEArgs(num_experts=experts, top_k=2, hidden_dim=hidden, aux_loss_coef=0.02,
                              norm_topk_prob=model_type == "mixtral", load_balancing="aux_loss")
    args = model_args_from_hf(tmp_path)
    assert args.moe == read[0] and args.moe_layers == hf_moe_layers(config) == ((1, 2) if model_type == "qwen3_moe"
                                                                                else (0, 1, 2))
    assert MoEArgs.hf_block_rule(config) == MoEArgs.hf_block_rule(written) == (
        (1, [0]) if model_type == "qwen3_moe" else (1, []))


@pytest.mark.parametrize("model_type,fused", [("qwen3", False), ("qwen3_moe", False), ("qwen3_moe", True),
                                              ("mixtral", True)])
def test_a_hugging_face_directory_loads_into_our_model_with_transformers_logits(tmp_path, model_type, fused):
    from lightning_2d.checkpoint.hf import HFWeights, hf_config, model_args_from_hf

    model, directory = _saved(tmp_path, model_type, fused)
    args = model_args_from_hf(directory)
    assert args.qk_norm == model_type.startswith("qwen3") and args.head_dim == FAMILIES[model_type].get("head_dim", 16)
    if model_type != "qwen3":
        assert args.moe is not None and args.moe.load_balancing == "none"  # output_router_logits false: no aux loss
        assert args.moe_layers == ((1, 2) if model_type == "qwen3_moe" else (0, 1, 2))
        assert args.moe.norm_topk_prob == (model_type == "mixtral")
    ours = Transformer(args)
    ours.load_blocks(HFWeights(directory, args))
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), model(tokens).logits, rtol=1e-5, atol=1e-5)
    written = tmp_path / "written"
    written.mkdir()
    import json

    (written / "config.json").write_text(json.dumps(hf_config(args, torch.float32)))
    assert model_args_from_hf(written) == args  # what export writes reads back as the same model
    assert transformers.AutoConfig.from_pretrained(written).model_type == model_type


def test_export_refuses_what_the_hugging_face_families_cannot_hold():
    from lightning_2d.checkpoint.hf.layout import hf_export_problems, hf_model_type

    debug = PRESETS["debug-moe"]  # a shared expert, a dense block 0 without q/k norms
    assert hf_model_type(debug) == "mixtral"
    problems = hf_export_problems(debug)
    assert any("num_shared_experts=1: mixtral has no shared experts" in p for p in problems)
    assert any("dense blocks [0]: every Mixtral block is a mixture of experts" in p for p in problems)
    biased = ModelArgs.from_name("qwen3-30b-a3b", moe={**asdict(PRESETS["qwen3-30b-a3b"].moe), "load_balancing": "bias"})
    assert hf_model_type(biased) == "qwen3_moe"
    assert hf_export_problems(biased) == [
        "load_balancing='bias': the experts' balancing bias routes tokens and qwen3_moe has no place for it"]
    assert hf_export_problems(PRESETS["qwen3-30b-a3b"]) == hf_export_problems(PRESETS["mixtral-8x7b"]) == []


def test_qwen3_30b_a3b_counts_its_published_parameters():
    args = PRESETS["qwen3-30b-a3b"]
    # Qwen's model card: 30.5 B in total, 3.3 B activated (3.35 B with both the embedding and the head).
    assert round(args.num_params() / 1e9, 1) == 30.5 and 3.3e9 <= args.num_params(active=True) < 3.4e9
    with torch.device("meta"):
        model = Transformer(replace(args, n_layers=2))
    assert sum(p.numel() for p in model.parameters()) == replace(args, n_layers=2).num_params()


@pytest.mark.parametrize("model_type,fused", [("qwen3_moe", False), ("mixtral", False), ("mixtral", True)])
def test_the_hugging_face_path_reads_its_fused_experts_from_either_layout_and_exports_per_expert(tmp_path, model_type,
                                                                                                 fused):
    """HFCausalLMModule: transformers' own model, its experts fused in memory, filled from per-expert files (what
    save_pretrained writes) or fused ones; the logits are transformers'. The export writes them back per expert."""
    from lightning_2d.checkpoint.hf.layout import transformers_to_files
    from lightning_2d.hf import HFCausalLMModule

    model, directory = _saved(tmp_path, model_type, fused)
    module = HFCausalLMModule(init_from=str(directory), attn_implementation="eager")
    module.configure_model()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(module(tokens), model(tokens).logits, rtol=1e-5, atol=1e-5)
    from safetensors.torch import load_file

    files: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        files.update(transformers_to_files(name, tensor, model_type))
    if not fused:  # exactly what save_pretrained wrote
        written = load_file(directory / "model.safetensors")
        assert files.keys() == written.keys()
        for name, tensor in written.items():
            assert torch.equal(files[name], tensor), name


def test_the_hugging_face_path_refuses_what_it_would_silently_drop(tmp_path):
    from lightning_2d.hf import HFCausalLMModule

    _, directory = _saved(tmp_path, "mixtral")
    with pytest.raises(ValueError, match=r"output_router_logits=True.*LlamaLightningModule\(init_from=...\)"):
        HFCausalLMModule(init_from=str(directory), config_overrides={"output_router_logits": True})
    module = HFCausalLMModule(init_from=str(directory))
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=1, expert_parallel_size=2)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size=2 with HFCausalLMModule.*LlamaLightningModule"):
        validate_parallel_dims(config, world_size=2, devices_per_node=2, plan=module.parallel_plan(config),
                               **module.validation_inputs())
    plan = module.parallel_plan(ParallelConfig(tensor_parallel_size=2))
    from lightning_2d.parallel.styles import WholeOnEachRank

    assert [k for k, v in plan.tensor_parallel.items() if isinstance(v, WholeOnEachRank)] == [
        f"model.layers.{i}.mlp" for i in range(3)]
    assert not any(k.endswith("gate_proj") for k in plan.tensor_parallel)  # Mixtral has no dense MLP


def test_a_float32_sparse_block_compiles_around_its_eager_experts():
    """float32: ``grouped_mm`` has no compiled path (its meta kernel takes bf16 only), so a compiled sparse block calls
    its experts eagerly (``ops.moe._eager_call``): one break point, which dynamo records twice (in the block's frame and
    in the MoE layer's it resumes in), the rest traced around it; the block's output and every gradient equal eager's.
    (The strategy's compiled bf16 fit, no break, is ``tests/distributed/test_compiled_fits.py``.)"""
    from torch._dynamo.utils import counters

    from lightning_2d.models.llama.model import Transformer

    args = ModelArgs.from_name("debug-moe", n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(3)
    block, x = model.layers["1"], torch.randn(2, 32, args.dim, requires_grad=True)
    freqs = model.rope[:32]

    def run(module):
        out = module(x, freqs)
        grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
        return out, grads

    eager_out, eager_grads = run(block)
    torch._dynamo.reset()
    counters.clear()
    compiled_out, compiled_grads = run(torch.compile(block, backend="aot_eager"))
    breaks = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    assert breaks == {"Skip calling `torch.compiler.disable()`d function": 2}, breaks
    assert counters["stats"]["unique_graphs"] >= 2  # traced before and after the experts' eager call
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-6, atol=1e-6)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
