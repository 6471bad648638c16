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


def test_off_checks_nothing_per_step(monkeypatch):
    """``non_finite="off"`` (benchmarks): no gradient read and no all-gather per step, a NaN gradient goes through
    to the optimizer as in plain Lightning."""
    import lightning_2d.integration.step_guard as step_guard

    monkeypatch.setattr(step_guard, "guard_step", lambda *a, **k: pytest.fail("guard_step called under non_finite='off'"))
    strategy = ModelParallel2DStrategy(non_finite="off")
    params = with_grads(torch.tensor([float("nan"), 1.0]))
    cpu = torch.device("cpu")
    strategy.step_guard.loss_flag = ZERO  # even a NaN loss
    assert strategy.step_guard.check(torch.optim.AdamW(params), 1, cpu) is True
    assert params[0].grad is not None and strategy.step_guard.loss_flag is None
    on = ModelParallel2DStrategy()  # the default still checks
    on.step_guard.loss_flag = ONE
    with pytest.raises(pytest.fail.Exception, match="guard_step called"):
        on.step_guard.check(torch.optim.AdamW(params), 1, cpu)


def _fit(module, tmp_path, ckpt_path=None, save_to=None):
    """A 1-process Trainer under the 2D strategy (a real, 1-rank process group)."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ModelParallel2DStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    try:
        trainer.fit(module, DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return trainer


def test_resuming_into_another_model_size_is_refused_quoting_both_shapes(tmp_path):
    from lightning_2d import LlamaLightningModule
    from lightning_2d.checkpoint.errors import CheckpointError

    saved = tmp_path / "two_layers.ckpt"
    _fit(LlamaLightningModule("debug", model_overrides={"n_layers": 2}, warmup_steps=1, max_steps=2), tmp_path,
         save_to=saved)
    fewer = LlamaLightningModule("debug", model_overrides={"n_layers": 1}, warmup_steps=1, max_steps=4)
    with pytest.raises(CheckpointError, match=r"does not fit the model .*\n  - 9 tensor\(s\) in the checkpoint but not in"
                       r" the model: model\.layers\.1\.attention\.wq\.weight"):
        _fit(fewer, tmp_path, ckpt_path=saved)  # before: the second layer was silently dropped
    wider = LlamaLightningModule("debug", model_overrides={"n_layers": 2, "dim": 256}, warmup_steps=1, max_steps=4)
    with pytest.raises(CheckpointError, match=r"model\.tok_embeddings\.weight: checkpoint \(256, 128\), model \(256, 256\)"):
        _fit(wider, tmp_path, ckpt_path=saved)
