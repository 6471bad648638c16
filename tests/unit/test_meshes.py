"""``ParallelMeshes``: every named sub-mesh always exists (size 1 allowed), asked for by purpose; the root is what
Lightning sees as ``strategy.device_mesh``; meshes built elsewhere are read once (``as_meshes``). In the planner's
fake process group (no communication), as the rank named."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.meshes import EXPERT_TOKENS, ParallelMeshes, as_meshes
from lightning_2d.parallel.names import (
    CP_DIM,
    DP_CP_DIM,
    DP_DIM,
    DP_REPLICATE_DIM,
    DP_SHARD_CP_DIM,
    DP_SHARD_DIM,
    EP_DIM,
    EP_REPLICATE_DIM,
    EP_SHARD_DIM,
    MESH_DIMS,
    PP_DIM,
    TP_DIM,
)
from lightning_2d.tools.planner.world import fake_world

EVERY_NAME = (*MESH_DIMS, DP_DIM, DP_CP_DIM, DP_SHARD_CP_DIM, EP_REPLICATE_DIM, EP_SHARD_DIM, EP_DIM, EXPERT_TOKENS)


def members(mesh) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group())


def test_every_named_mesh_exists_at_every_layout_and_optional_is_none_at_size_one():
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2)  # no pipeline, no context, no replicas
    with fake_world(dims.world_size, rank=3):
        meshes = dims.build_mesh("cpu")
        assert isinstance(meshes, ParallelMeshes) and set(meshes.names) == set(EVERY_NAME)
        assert meshes.root.mesh_dim_names == MESH_DIMS and tuple(meshes.root.shape) == (1, 1, 2, 1, 2)
        sizes = {name: meshes.get(name).size() for name in EVERY_NAME}
        assert sizes == {PP_DIM: 1, DP_REPLICATE_DIM: 1, DP_SHARD_DIM: 2, CP_DIM: 1, TP_DIM: 2, DP_DIM: 2,
                         DP_CP_DIM: 2, DP_SHARD_CP_DIM: 2, EP_REPLICATE_DIM: 1, EP_SHARD_DIM: 2, EP_DIM: 1,
                         EXPERT_TOKENS: 2}
        assert {name: meshes.size(name) for name in EVERY_NAME} == sizes
        assert [n for n in EVERY_NAME if meshes.optional(n) is not None] == [DP_SHARD_DIM, TP_DIM, DP_DIM, DP_CP_DIM,
                                                                             DP_SHARD_CP_DIM, EP_SHARD_DIM,
                                                                             EXPERT_TOKENS]
        assert meshes.get(PP_DIM).get_local_rank() == 0 and members(meshes.get(CP_DIM)) == [3]
        # Rank 3 = (shard 1, tensor 1): its data-parallel group is the tensor rank 1 of both shards.
        assert members(meshes.get(DP_DIM)) == members(meshes.get(DP_CP_DIM)) == [1, 3]
        assert members(meshes[TP_DIM]) == [2, 3]
        # At context size 1 the context-flattened names reuse the meshes of the same ranks: no extra groups.
        assert meshes.get(DP_CP_DIM) is meshes.get(DP_DIM) and meshes.get(DP_SHARD_CP_DIM) is meshes.get(DP_SHARD_DIM)
        assert meshes.fsdp is meshes.get(DP_DIM) and meshes.fsdp.mesh_dim_names == (DP_DIM,)
        # Without expert parallelism the expert names are the meshes of the same ranks: no extra groups either.
        assert meshes.get(EP_SHARD_DIM) is meshes.get(DP_SHARD_CP_DIM) and meshes.expert_fsdp is meshes.fsdp
        assert meshes.get(EP_REPLICATE_DIM) is meshes.get(DP_REPLICATE_DIM) and members(meshes.get(EP_DIM)) == [3]
        assert meshes.get(EXPERT_TOKENS) is meshes.get(DP_CP_DIM)  # the tensor ranks hold the same tokens
        with pytest.raises(KeyError, match="no mesh dimension 'sequence_parallel'; the meshes are pipeline_parallel"):
            meshes.get("sequence_parallel")


@pytest.mark.parametrize("dims, rank, groups, fsdp", [
    # pipeline 2 × shard 2 × tensor 2, rank 5 = (pp 1, shard 0, tp 1)
    (ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2), 5,
     {PP_DIM: [1, 5], DP_DIM: [5, 7], DP_CP_DIM: [5, 7], TP_DIM: [4, 5]}, (DP_DIM,)),
    # context 2 × shard 2 × tensor 2, rank 5 = (shard 1, cp 0, tp 1): the loss over shards × context ranks
    (ParallelDims(dp_replicate=1, dp_shard=2, tp=2, cp=2), 5,
     {CP_DIM: [5, 7], DP_DIM: [1, 5], DP_CP_DIM: [1, 3, 5, 7], DP_SHARD_CP_DIM: [1, 3, 5, 7]}, (DP_SHARD_CP_DIM,)),
    # HSDP 2 × 2 × tensor 2, rank 6 = (replica 1, shard 1, tp 0): FSDP over (replicate, shard)
    (ParallelDims(dp_replicate=2, dp_shard=2, tp=2), 6,
     {DP_REPLICATE_DIM: [2, 6], DP_SHARD_DIM: [4, 6], DP_DIM: [0, 2, 4, 6], DP_CP_DIM: [0, 2, 4, 6]},
     (DP_REPLICATE_DIM, DP_SHARD_DIM)),
    # expert parallel 2 of shard 4, rank 1 = (shard 1): experts over [0, 1], each expert's FSDP over [1, 3]
    (ParallelDims(dp_replicate=1, dp_shard=4, tp=1, ep=2), 1,
     {EP_DIM: [0, 1], EP_SHARD_DIM: [1, 3], DP_DIM: [0, 1, 2, 3], EP_REPLICATE_DIM: [1]}, (DP_DIM,)),
    # experts over the tensor ranks: expert parallel 2 = shard 1 × tensor 2, rank 3 = (shard 1, tp 1): its group is
    # its tensor pair, each expert's FSDP over the shards [1, 3], the routing over every rank
    (ParallelDims(dp_replicate=1, dp_shard=2, tp=2, ep=2, ep_over_tp=True), 3,
     {EP_DIM: [2, 3], EP_SHARD_DIM: [1, 3], EXPERT_TOKENS: [0, 1, 2, 3], DP_CP_DIM: [1, 3], TP_DIM: [2, 3]},
     (DP_DIM,)),
    # expert parallel 4 = shard 2 × tensor 2 over 4 ranks, rank 2: every rank one group, each expert on one rank
    (ParallelDims(dp_replicate=1, dp_shard=2, tp=2, ep=4, ep_over_tp=True), 2,
     {EP_DIM: [0, 1, 2, 3], EP_SHARD_DIM: [2], EXPERT_TOKENS: [0, 1, 2, 3]}, (DP_DIM,)),
])
def test_each_named_mesh_holds_the_ranks_its_name_says(dims, rank, groups, fsdp):
    with fake_world(dims.world_size, rank):
        meshes = dims.build_mesh("cpu")
        assert {name: members(meshes.get(name)) for name in groups} == groups
        assert meshes.fsdp.mesh_dim_names == fsdp
        # The root, as user code gets it back (`strategy.device_mesh`), reads as the same meshes, without new groups.
        again = as_meshes(meshes.root)
        assert {name: members(again.get(name)) for name in EVERY_NAME} == {
            name: members(meshes.get(name)) for name in EVERY_NAME}
        assert again.fsdp.mesh_dim_names == fsdp and as_meshes(meshes) is meshes and as_meshes(None) is None


def test_code_written_for_lightnings_strategy_reads_the_root_by_lightnings_names():
    """``device_mesh["data_parallel"]`` (Lightning's sampler kwargs) and ``["tensor_parallel"]`` on the root."""
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    with fake_world(dims.world_size, rank=13), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: slicing a flattened dim off the root is deprecated
        meshes = dims.build_mesh("cpu")
        device_mesh = meshes.device_mesh
        assert device_mesh is meshes.root
        assert members(device_mesh["data_parallel"]) == members(meshes.get(DP_DIM)) == [9, 11, 13, 15]
        assert device_mesh["data_parallel"].get_local_rank() == 2  # replica 1, shard 0 of pipeline rank 1
        assert members(device_mesh["tensor_parallel"]) == [12, 13]


def test_lightnings_own_2d_mesh_is_read_as_no_pipeline_no_context():
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_2d.parallel.context import context_shard
    from lightning_2d.parallel.loss import data_context_group

    with fake_world(4, rank=2):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(DP_DIM, TP_DIM))
        meshes = as_meshes(mesh)
        assert meshes.optional(PP_DIM) is None and meshes.optional(CP_DIM) is None and meshes.size(CP_DIM) == 1
        assert members(meshes.get(DP_CP_DIM)) == members(meshes.fsdp) == [0, 2]
        assert dist.get_process_group_ranks(data_context_group(mesh)) == [0, 2]
        batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
        assert context_shard(batch, mesh) is batch
        bad = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match=r"dimensions \('dp',\) is neither one lightning_2d builds"):
            as_meshes(bad)


def test_the_group_timeouts_cover_every_named_mesh():
    from lightning_2d.parallel.dims import group_timeouts

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2)
    with fake_world(dims.world_size):
        assert set(group_timeouts(dims.build_mesh("cpu"))) == set(EVERY_NAME)


# ---- the public boundary: a root or a mesh of another layout never drops a dimension the config asks for -------
def _moe_model_and_plan(config):
    from lightning_2d.models.llama.model import PRESETS, Transformer
    from lightning_2d.models.llama.plan import llama_plan

    args = PRESETS["debug-moe"]
    with torch.device("meta"):
        model = Transformer(args)
    return model, llama_plan(args, config, module="")


def _expert_mesh_dims(model) -> tuple[str, ...]:
    return model.layers["1"].feed_forward.experts.w1.device_mesh.mesh_dim_names


EP2 = dict(data_parallel_size=4, tensor_parallel_size=1, expert_parallel_size=2)


@pytest.mark.parametrize("given", ["root_of_the_built_meshes", "a_root_built_by_hand"])
def test_parallelize_model_given_a_root_applies_the_expert_parallelism_the_config_asks_for(given):
    """The bug class of wave 4 at the abstraction: ``parallelize_model(model, root, plan, config)`` with
    ``expert_parallel_size=2`` once read the root as meshes without expert parallelism (its size is not in the root's
    shape) and trained the experts as plain FSDP. Fabric's ``parallelize_fn`` receives the root
    (``strategy.device_mesh``) and a user's function passes it on, as the worker's custom function does."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_2d.parallel import ParallelConfig, parallelize_model

    config = ParallelConfig(**EP2).resolve_dtypes("32-true")
    dims = ParallelDims(dp_replicate=1, dp_shard=4, tp=1, ep=2)
    with fake_world(4, rank=1):
        meshes = dims.build_mesh("cpu")
        root = meshes.root if given == "root_of_the_built_meshes" else init_device_mesh(
            "cpu", dims.mesh_shape, mesh_dim_names=MESH_DIMS)
        model, plan = _moe_model_and_plan(config)
        result = parallelize_model(model, root, plan, config)
        assert result.meshes.size("expert_parallel") == 2
        assert _expert_mesh_dims(model) == ("expert_data_shard", "expert_parallel")
        assert model.layers["1"].feed_forward.experts.w1.to_local().shape[0] == 2  # 8 experts / EP 2 / FSDP 2


def test_the_root_a_strategy_hands_its_parallelize_fn_reads_as_the_strategys_meshes():
    """Fabric's ``parallelize_fn(module, device_mesh)`` gets the strategy's root. Passed on with options of expert
    parallel 2, it splits the experts over the strategy's own expert meshes (no second group); passed on with options
    that say nothing of experts (expert parallel 1, the default), it is refused naming both sizes: never the strategy's
    expert parallelism silently dropped."""
    from lightning_2d.parallel import ParallelConfig, parallelize_model

    with fake_world(4, rank=2):
        meshes = ParallelDims(dp_replicate=1, dp_shard=4, tp=1, ep=2).build_mesh("cpu")
        config = ParallelConfig(activation_checkpointing="full", **EP2).resolve_dtypes("32-true")
        model, plan = _moe_model_and_plan(config)
        assert parallelize_model(model, meshes.root, plan, config).meshes is meshes
        assert _expert_mesh_dims(model) == ("expert_data_shard", "expert_parallel")
        unaware = ParallelConfig(activation_checkpointing="full").resolve_dtypes("32-true")
        model, plan = _moe_model_and_plan(unaware)
        with pytest.raises(ValueError, match=r"expert_parallel_size=1 but the mesh's expert_parallel has 2 rank"):
            parallelize_model(model, meshes.root, plan, unaware)


def test_a_mesh_without_the_dimension_the_config_asks_for_is_refused_at_the_boundary():
    """Meshes of another layout (built without expert parallelism, Lightning's 2D mesh) and a config asking for
    ``expert_parallel_size=2``: refused, naming both, before anything is parallelized."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_2d.parallel import ParallelConfig, parallelize_model

    config = ParallelConfig(**EP2).resolve_dtypes("32-true")
    with fake_world(4, rank=0):
        plain = ParallelDims(dp_replicate=1, dp_shard=4, tp=1).build_mesh("cpu")
        lightnings = init_device_mesh("cpu", (4, 1), mesh_dim_names=(DP_DIM, TP_DIM))
        for mesh in (plain, plain.root, lightnings):
            model, plan = _moe_model_and_plan(config)
            with pytest.raises(ValueError, match=r"expert_parallel_size=2 but the mesh's expert_parallel has 1 rank"):
                parallelize_model(model, mesh, plan, config)
            assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
