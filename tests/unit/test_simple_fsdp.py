"""SimpleFSDP's wrapping, without communication: a fake process group of 4 ranks (real meshes and DTensors, no
collective run), on the meta device. What it trains to is tests/distributed/test_simple_fsdp.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_2d.parallel.schedules import SCHEDULES
from lightning_2d.parallel.simple_fsdp import (
    GatherPolicy,
    data_parallel,
    is_simple_fsdp,
    sharded_parameters,
    simple_fsdp_modules,
)
from lightning_2d.tools.planner.world import fake_world


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("rank", [0, 3])
def test_parameters_are_sharded_as_fully_shard_and_a_tie_stays_one_parameter(rank):
    with fake_world(4, rank), torch.device("meta"):
        model = Tied()
        data_parallel(model, _mesh((4,), ("fsdp",)))
        params = dict(model.named_parameters(remove_duplicate=False))
        assert params["head.weight"] is params["embed.weight"]  # still one parameter, sharded once
        weight = params["mid.weight"]
        assert tuple(weight.placements) == (torch.distributed.tensor.Shard(0),) and weight.shape == (6, 6)
        # torch.chunk's split of 6 rows over 4 ranks: 2, 2, 2, 0 (the last rank holds none, as under FSDP2).
        assert weight.to_local().shape == ((2, 6) if rank == 0 else (0, 6))
        assert sorted(type(m).__name__ for m in simple_fsdp_modules(model)) == [
            "SimpleFSDPEmbedding", "SimpleFSDPLinear", "SimpleFSDPLinear"]
        assert not is_simple_fsdp(model)  # holds no parameter of its own
        # Outside sharded_parameters() an attribute read gathers (a plain replicated tensor), inside it is the shard.
        with sharded_parameters():
            assert model.mid.weight is weight
        gathered = model.mid.weight
        assert not isinstance(gathered, nn.Parameter) and gathered.shape == (6, 6)


def test_each_module_keeps_its_own_mesh_and_policy_though_they_share_a_class():
    """torchtitan #2754: the generated class was cached with the first wrapping's mesh and precision, which later
    modules of the same class silently took. Here the class is shared, the policy is the instance's."""
    with fake_world(4, 0), torch.device("meta"):
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        data_parallel(first, _mesh((4,), ("a",)), param_dtype=torch.bfloat16)
        data_parallel(second, _mesh((2, 2), ("replicate", "shard")), reduce_dtype=torch.float32)
        assert type(first) is type(second)
        policies = [m._simple_fsdp_policy for m in (first, second)]
        assert isinstance(policies[0], GatherPolicy) and policies[0] is not policies[1]
        assert (policies[0].param_dtype, policies[1].param_dtype) == (torch.bfloat16, None)
        assert policies[1].dp_mesh.mesh_dim_names == ("replicate", "shard")
        with sharded_parameters():
            assert [repr(p) for p in second.weight.placements] == ["Replicate()", "Shard(dim=0)"]
            assert first.weight.to_local().shape == (1, 4) and second.weight.to_local().shape == (2, 4)
        assert first.weight.dtype == torch.bfloat16  # gathered in its compute dtype, stored in fp32
        assert second.weight.dtype == torch.float32  # its own policy: none


def test_wrapping_twice_changes_nothing():
    with fake_world(2, 1), torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
        mesh = _mesh((2,), ("fsdp",))
        data_parallel(model, mesh)
        with sharded_parameters():
            before = model[0].weight
        data_parallel(model, mesh)
        with sharded_parameters():
            assert model[0].weight is before


@pytest.mark.parametrize(("options", "message"), [
    ({"reshard_after_forward": "always"},
     r"reshard_after_forward='always' and activation_checkpointing='none': SimpleFSDP has no hook"),
    ({"reshard_after_forward": "never", "activation_checkpointing": "full"},
     r"reshard_after_forward='never' and activation_checkpointing='full': the recomputation"),
    ({"float8": "emulate", "fsdp_float8_all_gather": True},
     r"float8='emulate' and fsdp_float8_all_gather=True: the float8 all-gather is FSDP2's"),
])
def test_what_simple_fsdp_cannot_run_with_is_refused_with_the_reason(options, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelConfig(fsdp_backend="simple_fsdp", **options)
    ParallelConfig(**options)  # the same options under FSDP2 are fine


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_pipeline_schedule_and_float8_without_its_all_gather_are_accepted(schedule):
    """Pipeline stages are wrapped like any module (tests/distributed/test_simple_fsdp.py runs each schedule at
    pipeline 2 × data 2 against one device); float8 casts the gathered weight (runs there too)."""
    ParallelConfig(fsdp_backend="simple_fsdp", pipeline_parallel_size=2, pipeline_schedule=schedule,
                   pipeline_stages_per_rank=SCHEDULES[schedule].default_stages_per_rank)
    ParallelConfig(fsdp_backend="simple_fsdp", float8="emulate")


def test_an_unknown_backend_is_named():
    with pytest.raises(ParallelConfigError, match=r"fsdp_backend='fsdp1' is not a backend; choose one of"
                                                  r" 'fully_shard', 'simple_fsdp'"):
        ParallelConfig(fsdp_backend="fsdp1")


# ---- the backend object (#43: "the FSDP backend is an object") -----------------------------------------------------
def test_the_backends_table_is_the_options_values():
    """A backend is one module plus a row of ``BACKENDS``; the option lists the same names (config.py cannot import
    the backends, which import it)."""
    from typing import get_args, get_type_hints

    from lightning_2d.parallel.config import FSDP_BACKENDS
    from lightning_2d.parallel.fsdp_backend import BACKENDS, FSDPBackend, fsdp_backend

    assert tuple(BACKENDS) == FSDP_BACKENDS == get_args(get_type_hints(ParallelConfig)["fsdp_backend"])
    for name, backend in BACKENDS.items():
        assert isinstance(backend, FSDPBackend) and backend.name == name and fsdp_backend(name) is backend


def test_each_backend_applies_itself_with_the_owners_step_and_says_how_state_is_read():
    """SimpleFSDP's state access reads the stored shard (an attribute read gathers otherwise); FSDP2's needs nothing.
    ``apply`` runs the owner's replacement of the backend's step (``apply_simple_fsdp``) over the FSDP mesh."""
    from lightning_2d.parallel.config import ParallelPlan
    from lightning_2d.parallel.dims import ParallelDims
    from lightning_2d.parallel.fsdp_backend import BACKENDS

    simple, fully_shard = BACKENDS["simple_fsdp"], BACKENDS["fully_shard"]
    config = ParallelConfig(fsdp_backend="simple_fsdp")
    with fake_world(4, 0), torch.device("meta"):
        meshes = ParallelDims(dp_replicate=1, dp_shard=4, tp=1).build_mesh("cpu")
        calls = []
        model = nn.Sequential(nn.Linear(6, 6))
        simple.apply(model, meshes, ParallelPlan(), config, step=lambda *args: calls.append(args))
        assert calls == [(model, meshes.fsdp, ParallelPlan(), config)] and not simple_fsdp_modules(model)
        simple.apply(model, meshes, ParallelPlan(), config)  # the library's step
        stored = dict(model.named_parameters())["0.weight"]
        with simple.state_access():
            assert model[0].weight is stored
        with fully_shard.state_access():
            assert model[0].weight is not stored  # FSDP2's access changes nothing of SimpleFSDP's reads
        with simple.gradient_sync(model, enabled=False):  # nothing to defer: every micro-batch reduces
            pass


def test_only_simple_fsdp_brings_its_own_inductor_options():
    from lightning_2d.parallel.fsdp_backend import BACKENDS
    from lightning_2d.parallel.simple_fsdp import SIMPLE_FSDP_INDUCTOR_OPTIONS

    assert BACKENDS["fully_shard"].inductor_options() is None
    assert BACKENDS["simple_fsdp"].inductor_options() == SIMPLE_FSDP_INDUCTOR_OPTIONS  # no NCCL: no overlap scheduler
