"""Deferred tensor-parallel gradient sums (``parallel.grad_sync``) on one gloo process: which gradients are deferred
(a ``Partial()`` one, not a ``Replicate()`` one), the FSDP2 reduce-scatter leaving them as they are, one bucketed
all-reduce per step completing them, accumulation over micro-batches, and the strategies' call points. The sums over
real tensor ranks, equal to one device's training, are checked by the 4-process jobs (tests/distributed/test_parity.py,
test_lora.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_2d.parallel.grad_sync import DeferredTensorReduction, defer_tensor_reductions


class _Block(nn.Module):
    """``scale`` is used on a sequence-sharded input (its gradient a partial sum, as a sequence-parallel norm's);
    ``bias`` on a replicated one (its gradient already whole)."""

    def __init__(self, mesh) -> None:
        from torch.distributed.tensor import Replicate, distribute_tensor

        super().__init__()
        self.mesh = mesh
        self.scale = nn.Parameter(distribute_tensor(torch.linspace(0.5, 1.5, 8), mesh, [Replicate()]))
        self.bias = nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Replicate()]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        sharded = DTensor.from_local(x, self.mesh, [Shard(0)], run_check=False)
        whole = DTensor.from_local(x.sum(0), self.mesh, [Replicate()], run_check=False)
        return (sharded * self.scale).sum() + (whole * self.bias).sum()


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    finally:
        dist.destroy_process_group()


def _sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(_Block(mesh["tensor_parallel"]))
    fully_shard(model[0], mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def test_a_partial_gradient_waits_for_finish_and_a_whole_one_does_not(one_rank):
    from torch.distributed.tensor import Partial

    model = _sharded_model(one_rank)
    deferred = defer_tensor_reductions(model, "fully_shard")
    assert deferred is not None and deferred.attached
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    for _ in range(2):  # two micro-batches accumulate before the step
        model(x).backward()
    block = model[0]
    # One deferred parameter (the partial sum), waiting; the whole one went through FSDP as before.
    assert [name for _, name in deferred.order] == ["scale"] and deferred.pending == 1
    assert not any(isinstance(p, Partial) for p in block.scale.grad.placements)
    assert deferred.reductions == 0
    deferred.finish()
    assert deferred.pending == 0 and deferred.reductions == 1  # one bucket: one process group, one dtype
    deferred.finish()  # idempotent within a step
    assert deferred.reductions == 1
    torch.testing.assert_close(block.scale.grad.full_tensor(), 2 * x.sum(0))
    torch.testing.assert_close(block.bias.grad.full_tensor(), 2 * x.sum(0))


def test_the_gathered_parameter_is_hooked_once_across_steps(one_rank):
    model = _sharded_model(one_rank)
    deferred = DeferredTensorReduction().attach(model)
    x = torch.ones(4, 8)
    for _ in range(3):
        model(x).backward()
        deferred.finish()
        model.zero_grad()
    assert len(deferred._hooked) == 2  # scale and bias, once each although gathered three times
    assert deferred.reductions == 3
    deferred.detach()
    assert not deferred.attached


def test_nothing_is_deferred_without_fsdp2_units_or_under_another_backend(one_rank):
    model = nn.Sequential(_Block(one_rank["tensor_parallel"]))
    assert defer_tensor_reductions(model, "fully_shard") is None
    assert defer_tensor_reductions(_sharded_model(one_rank), "simple_fsdp") is None


def test_the_strategies_complete_gradients_before_the_guard_and_clipping():
    """The Trainer's closure and Fabric's step call ``gradients_ready`` before the non-finite guard reads the
    gradients; the precision plugin calls it before clipping (a manual loop may clip before the step)."""
    from lightning_2d.integration.precision import FSDP2Precision
    from lightning_2d.integration.step_guard import StepGuard

    calls: list[str] = []
    guard = StepGuard("raise")
    guard.check = lambda optimizer, step, device: calls.append("guard") or True  # type: ignore[method-assign]
    args, kwargs = guard.guard_optimizer_step(object(), (), {"closure": lambda: calls.append("closure")}, 1,
                                              torch.device("cpu"), gradients_ready=lambda: calls.append("ready"))
    kwargs["closure"]()
    assert calls == ["closure", "ready", "guard"]
    calls.clear()
    guard.guard_optimizer_step(object(), (), {}, 1, torch.device("cpu"), gradients_ready=lambda: calls.append("ready"))
    assert calls == ["ready", "guard"]

    calls.clear()
    plugin = FSDP2Precision("32-true", gradients_ready=lambda: calls.append("ready"))
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    optimizer = torch.optim.SGD([p], lr=0.1)
    plugin.clip_grad_by_norm(optimizer, 1.0)
    plugin.clip_grad_by_value(optimizer, 0.1)
    assert calls == ["ready", "ready"]
    torch.testing.assert_close(p.grad, torch.full((3,), 0.1))
