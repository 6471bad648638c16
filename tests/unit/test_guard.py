"""The non-finite guard's decisions (one process: the flags of a single rank; the agreement across ranks
is in tests/distributed/test_non_finite.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_2d import ModelParallel2DStrategy, ParallelConfigError
from lightning_2d.parallel.guard import NonFiniteStepError, NonFiniteWeightsError, check_finite_weights, guard_step


def with_grads(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


ONE, ZERO = torch.ones(()), torch.zeros(())


def test_a_finite_step_goes_ahead_untouched():
    params = with_grads(torch.ones(3), torch.full((2, 2), 1e30))
    assert guard_step(params, ONE, step=1, policy="raise")
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_raises_or_is_dropped(bad):
    grads = torch.ones(4)
    grads[2] = bad
    with pytest.raises(NonFiniteStepError, match=r"Step 7 stopped before the update \(non-finite gradients on rank\(s\) \[0\]\)"):
        guard_step(with_grads(torch.ones(3), grads), ONE, step=7, policy="raise")
    params = with_grads(torch.ones(3), grads)
    with pytest.warns(UserWarning, match=r"Step 7 skipped on every rank \(non-finite gradients on rank\(s\) \[0\]\)"):
        assert not guard_step(params, ONE, step=7, policy="skip")
    assert all(p.grad is None for p in params)  # AdamW then updates nothing
    optimizer = torch.optim.AdamW(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_non_finite_loss_alone_is_enough():
    with pytest.raises(NonFiniteStepError, match=r"non-finite loss on rank\(s\) \[0\]\)"):
        guard_step(with_grads(torch.ones(3)), ZERO, step=2, policy="raise")


def test_no_checkpoint_is_written_from_non_finite_weights(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    check_finite_weights(model, tmp_path / "ok")  # finite: nothing to say
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"Not saving .*bad: 1 parameter\(s\) hold NaN/inf values \(1\.bias; on rank\(s\) \[0\]\)"):
        check_finite_weights(model, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_the_policy_is_checked_at_construction():
    with pytest.raises(ParallelConfigError, match=r"non_finite='ignore' is not a policy; choose 'raise'"):
        ModelParallel2DStrategy(non_finite="ignore")
    assert ModelParallel2DStrategy(non_finite="skip").parallel_config.non_finite == "skip"
