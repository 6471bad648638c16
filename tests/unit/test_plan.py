"""The tensor-parallel plan is data: its structure can be checked without a process group."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from lightning_2d import LlamaLightningModule, ModelArgs, ParallelConfig, ParallelPlan, Transformer
from lightning_2d.models.llama.plan import llama_tensor_parallel_plan
from lightning_2d.parallel.activation_checkpoint import uses_randomness
from lightning_2d.parallel.modules import get_named_submodules, get_submodule_container
from lightning_2d.parallel.styles import VocabParallelHead


def test_sequence_parallel_plan_matches_the_reference_layouts():
    plan = llama_tensor_parallel_plan(sequence_parallel=True)
    emb = plan["tok_embeddings"]
    assert isinstance(emb, RowwiseParallel)
    assert emb.input_layouts == (Replicate(),) and emb.output_layouts == (Shard(1),)
    assert isinstance(plan["norm"], SequenceParallel)
    out = plan["output"]
    assert isinstance(out, ColwiseParallel) and out.input_layouts == (Shard(1),) and out.output_layouts == (Replicate(),)
    for name in ("attention_norm", "ffn_norm"):
        assert isinstance(plan[f"layers.*.{name}"], SequenceParallel)
    attn = plan["layers.*.attention"]
    assert isinstance(attn, PrepareModuleInput)
    assert attn.input_layouts == (Shard(1), None) and attn.desired_input_layouts == (Replicate(), None)
    ffn = plan["layers.*.feed_forward"]
    assert ffn.input_layouts == (Shard(1),) and ffn.desired_input_layouts == (Replicate(),)
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert type(plan[f"layers.*.{name}"]) is ColwiseParallel
    for name in ("attention.wo", "feed_forward.w2"):
        style = plan[f"layers.*.{name}"]
        assert isinstance(style, RowwiseParallel) and style.output_layouts == (Shard(1),)
    assert len(plan) == 14


def test_plain_tensor_parallel_plan_keeps_norms_local():
    plan = llama_tensor_parallel_plan(sequence_parallel=False)
    assert not any(isinstance(style, (SequenceParallel, PrepareModuleInput)) for style in plan.values())
    assert plan["tok_embeddings"].output_layouts == (Replicate(),)
    assert plan["layers.*.attention.wo"].output_layouts == (Replicate(),)
    assert plan["output"].input_layouts == (Replicate(),)


def test_loss_parallel_leaves_logits_sharded_over_the_vocabulary():
    out = llama_tensor_parallel_plan(loss_parallel=True)["output"]
    assert out.output_layouts == (Shard(-1),) and out.use_local_output is False


def test_module_plan_carries_divisibility_constraints():
    module = LlamaLightningModule("llama3-8b")
    plan = module.parallel_plan(ParallelConfig())
    assert plan.module == "model" and plan.blocks == "layers"
    assert plan.tp_divides == {"n_heads": 32, "n_kv_heads": 8}
    assert "layers.*.attention.wq" in plan.tensor_parallel
    # torchtitan's FSDP units; no dropout, so activation checkpointing need not replay the RNG.
    assert plan.input_units == ("tok_embeddings",) and plan.output_unit == ("norm", "output")
    assert plan.blocks_use_randomness is False


def test_the_head_style_also_carries_the_fused_loss():
    out = llama_tensor_parallel_plan()["output"]
    assert isinstance(out, VocabParallelHead)  # a ColwiseParallel that lets the 0-dim fused loss through


def test_plan_names_that_do_not_exist_are_clear_errors():
    model = Transformer(ModelArgs.from_name("debug", n_layers=1))
    with pytest.raises(ValueError, match=r"ParallelPlan.output_unit names 'head', but Transformer has no such"
                       r" submodule \(its children: tok_embeddings, layers, norm, output\)"):
        get_named_submodules(model, ("norm", "head"), "output_unit")
    with pytest.raises(ValueError, match=r"ParallelPlan.blocks names 'blocks'.*Set ParallelPlan\(blocks=...\)"):
        get_submodule_container(model, "blocks")
    with pytest.raises(ValueError, match="ParallelPlan.blocks='norm' is a RMSNorm; it must name an nn.ModuleDict"):
        get_submodule_container(model, "norm")


def test_randomness_decides_whether_checkpointing_replays_the_rng():
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    assert uses_randomness(block, ParallelPlan())
    assert not uses_randomness(torch.nn.Sequential(torch.nn.Dropout(0.0)), ParallelPlan())
    assert not uses_randomness(block, ParallelPlan(blocks_use_randomness=False))  # the plan decides


def test_the_hooks_protocol_lists_what_the_strategies_look_up():
    from lightning_2d.parallel.hooks import OWNER_HOOKS, STEP_HOOKS, ModelInitHooks, ParallelHooks, defined_hooks
    from lightning_2d.parallel.parallelize import STEPS

    assert tuple(STEPS) == STEP_HOOKS  # every replaceable step is a documented hook, in order
    assert set(OWNER_HOOKS) <= {n for n in dir(ParallelHooks) if not n.startswith("_")}
    assert defined_hooks(LlamaLightningModule("debug")) == ["parallel_plan", "weights_source"]

    class OwnFSDP(torch.nn.Module):
        def apply_fully_shard(self, model, dp_mesh, plan, config) -> None: ...

    assert defined_hooks(OwnFSDP()) == ["apply_fully_shard"]
    assert isinstance(Transformer(ModelArgs.from_name("debug")), ModelInitHooks)


def test_parallel_dims_build_the_named_mesh_with_a_flattened_data_parallel_dim(monkeypatch):
    import torch.distributed as dist

    from lightning_2d.parallel.dims import MESH_DIMS, ParallelDims, fsdp_mesh_of

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from lightning_2d.tools.launch import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1)
        meshes = dims.build_mesh("cpu")
        mesh = meshes.root  # what the strategies give Lightning as `device_mesh`: every dimension, size 1 allowed
        assert mesh.mesh_dim_names == MESH_DIMS == (
            "pipeline_parallel", "data_parallel_replicate", "data_parallel_shard", "context_parallel",
            "tensor_parallel")
        assert mesh["data_parallel"].mesh_dim_names == ("data_parallel",)  # Lightning's name still works
        assert mesh["tensor_parallel"].mesh_dim_names == ("tensor_parallel",)
        assert fsdp_mesh_of(mesh).mesh_dim_names == ("data_parallel",)  # plain FSDP: the flattened dim
        assert fsdp_mesh_of(meshes) is meshes.fsdp and meshes.get("data_parallel").mesh_dim_names == ("data_parallel",)
        assert (dims.dp, dims.world_size, dims.hsdp) == (1, 1, False)
        assert ParallelDims(dp_replicate=2, dp_shard=4, tp=8).as_dict() == {
            "data_parallel_replicate": 2, "data_parallel_shard": 4, "tensor_parallel": 8}
    finally:
        dist.destroy_process_group()
