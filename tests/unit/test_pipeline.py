"""Pipeline parallelism without processes: the split, the stage modules, the plan per stage, the mesh
sizes and the loss check. Real schedules run in tests/distributed/test_pipeline.py."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_2d.integration.module import LlamaLightningModule
from lightning_2d.models.llama.model import PRESETS, ModelArgs, Transformer
from lightning_2d.models.llama.pipeline import LLAMA_PIPELINE_STAGES, PipelineStageModule, block_costs_of
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.parallel.config import PIPELINE_SCHEDULES, ZERO_BUBBLE_SCHEDULES, ParallelConfig, ParallelConfigError
from lightning_2d.parallel.dims import PP_DIM, ParallelDims, validate_parallel_dims
from lightning_2d.parallel.pipeline import (
    Pipeline,
    VForwardOnly,
    balanced_split,
    pipeline_split,
    rank_of_stage,
    schedule_class,
    stage_plan,
    stages_of_rank,
)


def brute_force_best(costs: list[float], stages: int, last_extra: float, first_extra: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        stage_costs = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage_costs[0] += first_extra
        stage_costs[-1] += last_extra
        best = min(best, max(stage_costs))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_minimizes_the_most_expensive_stage(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    stages = int(torch.randint(1, n + 1, (1,), generator=g))
    costs = (torch.rand(n, generator=g) * 10 + 1).tolist()
    last, first = float(torch.rand(1, generator=g) * 15), float(torch.rand(1, generator=g) * 3)
    sizes = balanced_split(costs, stages, last_extra=last, first_extra=first)
    assert len(sizes) == stages and sum(sizes) == n and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    stage_costs = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    stage_costs[0] += first
    stage_costs[-1] += last
    assert max(stage_costs) == pytest.approx(brute_force_best(costs, stages, last, first))


def test_equal_blocks_split_evenly_and_a_heavy_head_lightens_the_last_stage():
    assert balanced_split([1.0] * 8, 4) == [2, 2, 2, 2]
    assert balanced_split([1.0] * 8, 2, last_extra=2.0) == [5, 3]
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4 stages"):
        balanced_split([1.0] * 3, 4)


def test_llama3_405b_splits_into_8_stages_with_a_lighter_last_one():
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_name("llama3-405b"))
    config = ParallelConfig(pipeline_parallel_size=8)
    sizes = [len(stage) for stage in pipeline_split(model, config, LLAMA_PIPELINE_STAGES)]
    assert sum(sizes) == 126 and len(sizes) == 8
    # The output head (16384 × 128256 ≈ 0.65 of a block) goes with the last stage: it gets fewer blocks.
    assert sizes[-1] < max(sizes) and max(sizes) - min(sizes) <= 1
    blocks, head, _ = block_costs_of(model, list(model.layers.keys()))
    assert 0.5 < head / blocks[0] < 0.8


def test_given_block_counts_are_used_and_must_add_up():
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    split = pipeline_split(model, ParallelConfig(pipeline_parallel_size=2, pipeline_layers_per_stage=[3, 1]), LLAMA_PIPELINE_STAGES)
    assert split == [["0", "1", "2"], ["3"]]
    with pytest.raises(ParallelConfigError, match=r"adds up to 5 blocks but the model has 4"):
        pipeline_split(
            model, ParallelConfig(pipeline_parallel_size=2, pipeline_layers_per_stage=[4, 1]), LLAMA_PIPELINE_STAGES
        )


def test_stages_are_placed_in_a_loop_over_the_pipeline_ranks():
    assert stages_of_rank(0, 2, 1) == [0] and stages_of_rank(1, 2, 1) == [1]
    assert stages_of_rank(1, 4, 2) == [1, 5]  # Interleaved1F1B: rank r holds stages r, r + pp, …
    assert ParallelConfig(pipeline_parallel_size=4, pipeline_schedule="Interleaved1F1B").num_pipeline_stages == 8


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_v_schedules_place_two_stages_per_rank_in_a_v(pp):
    """Rank r holds stages r and 2·pp - 1 - r (torch's generate_stage_to_rank_mapping(style="v")): rank 0 the
    first and the last; the two middle stages share the last rank."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    config = ParallelConfig(pipeline_parallel_size=pp, pipeline_schedule="ZBVZeroBubble", pipeline_microbatches=2 * pp)
    assert (config.stages_per_rank, config.num_pipeline_stages, config.pipeline_placement) == (2, 2 * pp, "v")
    torch_map = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
    for rank in range(pp):
        stages = stages_of_rank(rank, pp, 2, config.pipeline_placement)
        assert stages == [rank, 2 * pp - 1 - rank]
        assert [torch_map[s] for s in stages] == [rank, rank] == [rank_of_stage(s, pp, "v") for s in stages]
    loop = generate_stage_to_rank_mapping(pp, 2 * pp)
    assert all(rank_of_stage(s, pp) == loop[s] for s in range(2 * pp))
    izb = ParallelConfig(pipeline_parallel_size=pp, pipeline_schedule="InterleavedZeroBubble")
    assert (izb.stages_per_rank, izb.pipeline_placement) == (2, "loop")
    with pytest.raises(ValueError, match="the V placement holds 2 stages per rank"):
        stages_of_rank(0, pp, 3, "v")


def test_each_schedule_runs_its_own_torch_class():
    """Training runs the named schedule's class (a silent substitute would pass the parity tests); forward-only
    steps run a fill-drain order placed as the training one."""
    from torch.distributed import pipelining

    expected = {"1F1B": pipelining.Schedule1F1B, "GPipe": pipelining.ScheduleGPipe,
                "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
                "InterleavedZeroBubble": pipelining.ScheduleInterleavedZeroBubble,
                "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble, "DualPipeV": pipelining.ScheduleDualPipeV}
    assert set(expected) == set(PIPELINE_SCHEDULES)
    for name, cls in expected.items():
        assert schedule_class(name, train=True) is cls
    assert [schedule_class(n, train=False) for n in ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")] == [
        pipelining.ScheduleGPipe, pipelining.ScheduleLoopedBFS, VForwardOnly, VForwardOnly]


def test_zero_bubble_schedules_keep_the_units_gathered_under_the_default_policy():
    """Their input pass collects the weights to differentiate from the stage's parameters: a unit resharded after
    forward would show sharded parameters and lose its weight gradients (measured on gloo)."""
    for name in ZERO_BUBBLE_SCHEDULES:
        config = ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=name, pipeline_microbatches=4)
        assert config.reshard_policy == "never"
        assert replace(config, reshard_after_forward="never").reshard_policy == "never"
    assert ParallelConfig(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B").reshard_policy == "default"
    assert ParallelConfig(pipeline_schedule="ZBVZeroBubble").reshard_policy == "default"  # no pipeline


@pytest.mark.parametrize(("options", "message"), [
    ({"pipeline_schedule": "ZBVZeroBubble", "pipeline_stages_per_rank": 3},
     r"pipeline_schedule='ZBVZeroBubble' places exactly 2 stages on each rank, in a V .* pipeline_stages_per_rank=3;"
     r" use 2"),
    ({"pipeline_schedule": "DualPipeV", "pipeline_stages_per_rank": 1}, r"exactly 2 stages on each rank"),
    ({"pipeline_schedule": "DualPipeV", "pipeline_microbatches": 3},
     r"'DualPipeV' needs at least as many micro-batches as stages \(4: 2 × pipeline_parallel_size 2\), got 3"),
    ({"pipeline_schedule": "InterleavedZeroBubble", "pipeline_microbatches": 5},
     r"5 micro-batches make 2 rounds, which must divide them; use a multiple of 2, or at most 2 \(e\.g\. 4\)"),
    ({"pipeline_schedule": "InterleavedZeroBubble", "pipeline_stages_per_rank": 1},
     r"interleaves several stages per rank, but pipeline_stages_per_rank=1"),
    ({"pipeline_schedule": "ZBVZeroBubble", "compile": True},
     r"'ZBVZeroBubble' splits each backward .* not support for compiled modules .* use compile=False"),
    ({"pipeline_schedule": "InterleavedZeroBubble", "activation_checkpointing": "selective"},
     r"per-op selective activation checkpointing refuses .* use activation_checkpointing='full'"),
    ({"pipeline_schedule": "DualPipeV", "reduce_every_micro_batch": True},
     r"'DualPipeV' with reduce_every_micro_batch=True: each micro-batch's input pass would end in FSDP's"),
    ({"pipeline_schedule": "ZBVZeroBubble", "reshard_after_forward": "always"},
     r"reshard_after_forward='always': .* weight gradients would never be computed; use reshard_after_forward="),
])
def test_zero_bubble_combinations_torch_cannot_run_are_refused_with_the_reason(options, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelConfig(pipeline_parallel_size=2, **options)


def test_zero_bubble_combinations_that_run_are_accepted():
    for options in ({"pipeline_schedule": "ZBVZeroBubble", "pipeline_microbatches": 1},
                    {"pipeline_schedule": "InterleavedZeroBubble", "pipeline_microbatches": 3},
                    {"pipeline_schedule": "DualPipeV", "pipeline_microbatches": 4, "activation_checkpointing": "full"},
                    {"pipeline_schedule": "ZBVZeroBubble", "activation_checkpointing": "selective",
                     "selective_ac_option": 2}):
        ParallelConfig(pipeline_parallel_size=2, **options)
    # Without a pipeline the schedule is not used: nothing to refuse.
    ParallelConfig(pipeline_schedule="DualPipeV", compile=True, reduce_every_micro_batch=True)


def test_stage_modules_chained_compute_the_model_s_loss():
    """The first stage embeds, the last normalizes and computes the fused loss: together, the model."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["debug"])
    model.init_weights(3)
    tokens = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    labels[0, :3] = -100
    expected = model(tokens, labels=labels)
    first = PipelineStageModule(model, ["0", "1"], first=True, last=False)
    last = PipelineStageModule(model, ["2", "3"], first=False, last=True)
    for stage in (first, last):
        stage.seq_len = 16
    torch.testing.assert_close(last(first(tokens), labels=labels), expected, rtol=0, atol=0)
    # The stages reference the model's modules (no copies): the model's parameters are the stages'.
    assert first.layers["0"] is model.layers["0"] and last.output is model.output
    assert first.output is None and last.tok_embeddings is None


def test_each_stage_s_plan_names_only_what_it_holds():
    config = ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    plan = llama_plan(PRESETS["debug"], config, module="model")
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    first = stage_plan(PipelineStageModule(model, ["0", "1"], True, False), plan)
    last = stage_plan(PipelineStageModule(model, ["2", "3"], False, True), plan)
    assert "tok_embeddings" in first.tensor_parallel and "output" not in first.tensor_parallel
    assert "norm" not in first.tensor_parallel and "layers.*.attention.wq" in first.tensor_parallel
    assert "tok_embeddings" not in last.tensor_parallel and {"norm", "output"} <= set(last.tensor_parallel)
    assert (first.input_units, first.output_unit) == (("tok_embeddings",), ())
    assert (last.input_units, last.output_unit) == ((), ("norm", "output"))
    assert first.module == "" and plan.supports_pipeline and plan.num_blocks == 4


def test_the_pipeline_dimension_is_outermost_and_in_the_layout_only_with_a_pipeline():
    """The mesh has every dimension (size 1 allowed: ``ParallelMeshes``); the layout (``as_dict``: what checkpoints
    and the planner record) names the pipeline only when there is one."""
    dims = ParallelDims(dp_replicate=1, dp_shard=8, tp=8, pp=8)
    assert dims.world_size == 512 and dims.mesh_dims[0] == PP_DIM and dims.mesh_shape == (8, 1, 8, 1, 8)
    assert ParallelDims(1, 2, 2).mesh_shape == (1, 1, 2, 1, 2) and ParallelDims(1, 2, 2).mesh_dims == dims.mesh_dims
    assert PP_DIM not in ParallelDims(1, 2, 2).as_dict() and ParallelDims(1, 2, 2).as_dict().keys() == {
        "data_parallel_replicate", "data_parallel_shard", "tensor_parallel"}
    assert list(dims.as_dict())[0] == PP_DIM
    # 64 nodes × 8 GPUs with pipeline 8: tensor parallel within the node, data parallel over the rest.
    config = ParallelConfig(pipeline_parallel_size=8)
    resolved = validate_parallel_dims(config, world_size=512, devices_per_node=8, num_nodes=64)
    assert (resolved.pp, resolved.dp, resolved.tp) == (8, 8, 8)


def attached_to_a_pipeline(module: LlamaLightningModule, pipeline: Pipeline) -> None:
    """``module`` as the strategy runs it under pipeline parallelism: its trainer's strategy holds the
    ``Parallelized`` result (the model, its pipeline) that ``parallelize_model`` returned."""
    from types import SimpleNamespace

    from lightning_2d.parallel.parallelize import Parallelized

    parallelized = Parallelized(module.model, meshes=None, pipeline=pipeline)  # type: ignore[arg-type]
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(pipeline=parallelized.pipeline, meshes=None))


def test_a_loss_with_a_graph_is_refused_under_a_pipeline_and_fabric_backward_too():
    """``pipeline.train_step`` ran the backward: a term added outside the pipeline (a loss that still has a graph)
    would get no gradient, so the LightningModule's ``backward`` refuses it; Fabric's ``backward`` is refused."""
    from lightning_2d.integration.precision import FabricFSDP2Precision

    module = LlamaLightningModule("debug")
    module.model = nn.Linear(2, 2)
    assert module.pipeline is None  # no strategy, no pipeline
    marker = Pipeline.__new__(Pipeline)
    attached_to_a_pipeline(module, marker)
    assert module.pipeline is marker  # read from the strategy, not looked up by model
    module.backward(torch.tensor(2.0))  # the pipeline's loss: nothing to do
    with pytest.raises(RuntimeError, match="a term was added outside the pipeline and would get no gradient"):
        module.backward(torch.tensor(2.0, requires_grad=True) * 1)
    plugin = FabricFSDP2Precision("32-true", pipeline=lambda: marker)  # the strategy's `pipeline`, asked when needed
    with pytest.raises(RuntimeError, match=r"fabric.backward under pipeline parallelism: .*train_step"):
        plugin.backward(torch.tensor(2.0), module.model)


def test_under_a_pipeline_gradients_are_zeroed_after_the_step_not_between_step_and_backward():
    """Lightning calls ``optimizer_zero_grad`` after ``training_step`` (which computed the gradients under a
    pipeline): the module zeroes them right after each optimizer step instead."""
    module = LlamaLightningModule("debug")
    module.model = nn.Linear(2, 1)
    opt = torch.optim.SGD(module.model.parameters(), lr=0.0)
    for p in module.model.parameters():
        p.grad = torch.ones_like(p)
    module.optimizer_zero_grad(0, 0, opt)  # without a pipeline: Lightning's zeroing
    assert all(p.grad is None for p in module.model.parameters())
    attached_to_a_pipeline(module, Pipeline.__new__(Pipeline))
    for p in module.model.parameters():
        p.grad = torch.ones_like(p)
    module.optimizer_zero_grad(0, 0, opt)  # a pipeline's gradients survive it
    assert all(p.grad is not None for p in module.model.parameters())
    module.optimizer_step(0, 0, opt, None)
    assert all(p.grad is None for p in module.model.parameters())  # zeroed after the update


def test_an_older_torch_is_refused_for_a_pipeline_only(monkeypatch):
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.12.1"))
    with pytest.raises(ParallelConfigError, match=r"pipeline_parallel_size=2 needs torch >= 2\.13 .*found 2\.12\.1"):
        ParallelConfig(pipeline_parallel_size=2)
    ParallelConfig(tensor_parallel_size=2)  # no pipeline: no requirement


@pytest.mark.parametrize("rank", [0, 1], ids=["first_and_last_stage", "middle_stages"])
def test_calling_a_pipelined_model_is_refused_naming_the_pipeline_step(rank):
    """After ``parallelize_model`` splits it (a fake world of 2 pipeline ranks, no process), the model holds only this
    rank's blocks: calling it, with positional or keyword inputs, raises at once (the forward pre-hook), naming
    what to call instead, rather than computing a wrong or partial forward."""
    from lightning_2d.tools.planner.world import fake_world

    config = ParallelConfig(pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble").resolve_dtypes("32-true")
    args = PRESETS["debug"]
    with fake_world(2, rank):
        from lightning_2d.parallel.parallelize import parallelize_model

        mesh = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2).build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(args)
        parallelize_model(model, mesh, llama_plan(args, config), config)
        assert sorted(model.layers.keys()) == (["0", "3"] if rank == 0 else ["1", "2"])  # pruned to its V stages
        tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
        refused = r"Transformer is split into pipeline stages \(pipeline_parallel_size > 1\).*pipeline\.train_step\("
        with pytest.raises(RuntimeError, match=refused):
            model(tokens)
        with pytest.raises(RuntimeError, match=refused):
            model(tokens=tokens, labels=tokens)
        del model, mesh


def test_parallelize_model_returns_the_pipeline_and_the_deprecated_pipeline_of_still_finds_it():
    """``parallelize_model`` hands its pipeline back (``Parallelized``: no registry); 0.1.0's public
    ``lightning_2d.parallel.pipeline_of(model)`` still answers, warning, until 0.3; the pipelined model refuses a
    call, naming the strategy's ``pipeline``."""
    from lightning_2d.parallel import Parallelized, parallelize_model, pipeline_of
    from lightning_2d.tools.planner import fake_world

    config = ParallelConfig(data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=2,
                            pipeline_schedule="1F1B").resolve_dtypes("32-true")
    with fake_world(2, rank=1):
        meshes = ParallelDims(1, 1, 1, pp=2).build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(PRESETS["debug"])
        result = parallelize_model(model, meshes, llama_plan(PRESETS["debug"], config), config)
        assert isinstance(result, Parallelized) and result.model is model and result.meshes is meshes
        assert isinstance(result.pipeline, Pipeline) and result.pipeline.stage_indices == [1]
        assert result.pipeline.meshes is meshes and result.pipeline.has_last and not result.pipeline.has_first
        with pytest.warns(DeprecationWarning, match=r"pipeline_of\(model\) is deprecated .* strategy's `pipeline`"):
            assert pipeline_of(model) is result.pipeline
        with pytest.raises(RuntimeError, match=r"split into pipeline stages .*fabric\.strategy\.pipeline"):
            model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
        with torch.device("meta"):
            plain = Transformer(PRESETS["debug"])
        alone = parallelize_model(plain, ParallelDims(1, 1, 2).build_mesh("cpu"), llama_plan(PRESETS["debug"], config),
                                  replace(config, pipeline_parallel_size=1))
        assert alone.pipeline is None
        with pytest.warns(DeprecationWarning):
            assert pipeline_of(plain) is None
