"""The gradient norm in one collective (``parallel.grad_norm``): on a simulated world of 4 ranks (the fake process
group: collectives return at once, their results this rank's own input), the one all-reduce each rank issues and the
value it contributes, each local shard weighted by how many ranks hold it. The global values against one device's
are the 4-process jobs' (tests/distributed: ``grad_norms`` under clipping, at every layout)."""

from __future__ import annotations

import pytest
import torch

from lightning_2d.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_2d.tools.planner.world import fake_world


def _counted_all_reduces(monkeypatch) -> list[torch.Tensor]:
    import torch.distributed as dist

    seen: list[torch.Tensor] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        seen.append(tensor.clone())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return seen


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_the_norm_over_three_meshes_and_placements_is_one_all_reduce_of_weighted_local_powers(monkeypatch, norm_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        params = []
        for placements in ([Shard(0), Shard(0)], [Shard(0), Replicate()], [Replicate(), Replicate()]):
            p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, placements))
            p.grad = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, placements)
            params.append(p)
        dp_only = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh["data_parallel"], [Shard(0)]))
        dp_only.grad = distribute_tensor(torch.full((4,), 3.0), mesh["data_parallel"], [Shard(0)])
        params.append(dp_only)
        seen = _counted_all_reduces(monkeypatch)
        total = total_grad_norm(params, norm_type)
        assert len(seen) == 1  # not one per (mesh, placements) group and mesh dimension
        local = [p.grad.to_local() for p in params]
        copies = [1, 2, 4, 2]  # replicated over tp; over dp and tp; the ranks of the other tp coordinate
        if norm_type == 2.0:
            want = sum(float(t.pow(2).sum()) / c for t, c in zip(local, copies))
            assert float(seen[0]) == pytest.approx(want, rel=1e-6)
            assert float(total) == pytest.approx(want ** 0.5, rel=1e-6)  # the fake all-reduce returns the input
        else:
            assert float(seen[0]) == float(total) == max(float(t.abs().max()) for t in local)


def test_clipping_scales_every_local_shard_by_the_one_norm(monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.full((8,), 2.0), mesh, [Shard(0)])
        seen = _counted_all_reduces(monkeypatch)
        norm = clip_grad_norm_([p], max_norm=1.0)
        assert len(seen) == 1 and float(norm) == pytest.approx(8.0 ** 0.5)  # this rank's two elements of 2.0
        torch.testing.assert_close(p.grad.to_local(), torch.full((2,), 2.0 / (8.0 ** 0.5 + 1e-6)))
