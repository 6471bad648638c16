"""The parts the 2D strategies are composed of, each driven alone (one process, no strategy): the step guard,
the checkpoint IO, the precision swap, the pipeline runner, the model context of validation, and the wiring
that makes the strategies use them."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_2d import ModelParallel2DStrategy, ParallelConfigError
from lightning_2d.checkpoint.discovery import is_complete
from lightning_2d.checkpoint.errors import CheckpointError
from lightning_2d.integration import strategy_base
from lightning_2d.integration.checkpoint_io import DistributedCheckpointIO
from lightning_2d.integration.precision import FSDP2Precision, fsdp2_precision
from lightning_2d.integration.step_guard import NonFiniteLossError, StepGuard
from lightning_2d.integration.validation import model_context
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.guard import NonFiniteStepError

CPU = torch.device("cpu")


def _params(grad: float) -> list[nn.Parameter]:
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), grad)
    return [p]


# ---- step guard ----------------------------------------------------------------------------------
def test_the_step_guard_stops_a_nan_first_loss_before_its_backward():
    guard = StepGuard("raise")
    with pytest.raises(NonFiniteLossError, match="The loss of the first training step is not finite"):
        guard.before_backward(torch.tensor(float("nan")))
    guard.before_backward(torch.tensor(float("nan")))  # checked once: later losses are the flag's to judge


def test_the_step_guard_folds_every_micro_batch_loss_into_the_step():
    guard = StepGuard("raise")
    for loss in (1.0, float("inf"), 2.0):  # one non-finite micro-batch of three
        guard.after_backward(torch.tensor(loss))
    opt = torch.optim.SGD(_params(1.0), lr=0.1)
    with pytest.raises(NonFiniteStepError, match=r"Step 4 stopped before the update \(non-finite loss on rank\(s\) \[0\]\)"):
        guard.check(opt, 4, CPU)
    assert guard.loss_flag is None  # the next step starts clean
    skip = StepGuard("skip")
    skip.after_backward(torch.tensor(float("nan")))
    params = _params(1.0)
    with pytest.warns(UserWarning, match="Step 5 skipped"):
        assert skip.check(torch.optim.SGD(params, lr=0.1), 5, CPU) is False
    assert params[0].grad is None


def test_the_guard_runs_after_the_trainers_closure_and_at_once_under_fabric():
    calls: list[str] = []
    guard = StepGuard("raise")
    guard.check = lambda optimizer, step, device: calls.append(f"check {step}") or True  # type: ignore[method-assign]
    opt = torch.optim.SGD(_params(1.0), lr=0.1)
    args, kwargs = guard.guard_optimizer_step(opt, (), {"closure": lambda: calls.append("closure")}, 3, CPU)
    assert calls == []  # nothing before the optimizer runs the closure
    kwargs["closure"]()
    assert calls == ["closure", "check 3"]
    calls.clear()
    args, kwargs = guard.guard_optimizer_step(opt, (), {}, 4, CPU)  # Fabric: no closure
    assert calls == ["check 4"] and args == () and kwargs == {}


# ---- checkpoint IO -------------------------------------------------------------------------------
def _io(sharded: bool = True) -> DistributedCheckpointIO:
    return DistributedCheckpointIO(
        0, 1, barrier=lambda *a, **k: None, broadcast=lambda obj, src=0: obj, sharded=sharded, async_save=False,
        layout={"world_size": 1, "data_parallel": 1, "tensor_parallel": 1},
    )


def test_the_checkpoint_io_is_a_lightning_checkpoint_io_that_writes_complete_checkpoints(tmp_path):
    io = _io()
    assert isinstance(io, CheckpointIO)
    model = nn.Linear(4, 2)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [], "global_step": 7}
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert is_complete(tmp_path / "a.ckpt")
    metadata = io.load_checkpoint(tmp_path / "a.ckpt")  # weights-only always: weights_only=False is refused (#42)
    with pytest.raises(CheckpointError, match="weights_only=False was passed"):
        io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)
    assert metadata["global_step"] == 7
    assert metadata["lightning_2d"]["layout"] == {"world_size": 1, "data_parallel": 1, "tensor_parallel": 1}
    io.check_fits(io.resolve(tmp_path / "a.ckpt"), "state_dict", model)
    with pytest.raises(CheckpointError, match=r"does not fit the model Linear \(2 problem\(s\)\):\n  - weight: checkpoint \(2, 4\), model \(3, 4\)"):
        io.check_fits(tmp_path / "a.ckpt", "state_dict", nn.Linear(4, 3))
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    with pytest.raises(TypeError, match="storage_options"):
        io.path_to_save(tmp_path / "b.ckpt", storage_options={"bucket": "x"})


def test_the_checkpoint_io_enters_the_fsdp_backends_state_access_around_every_state_dict_path(tmp_path):
    """SimpleFSDP's "reading a parameter is a collective" stays behind the FSDP backend object: the strategy resolves
    it once, hands its ``state_access`` to the checkpoint IO, and the IO enters it around each state-dict path
    (Fabric's save state, ``check_fits``, and what the strategies run through ``state_dict_call``: Lightning's
    state-dict methods and loads). Fails with the access left out of any of them."""
    from contextlib import contextmanager

    from lightning_2d.parallel.fsdp_backend import BACKENDS

    inside: list[bool] = [False]
    entered: list[str] = []

    @contextmanager
    def access():
        entered.append("state")
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    io = DistributedCheckpointIO(
        0, 1, barrier=lambda *a, **k: None, broadcast=lambda obj, src=0: obj, sharded=True, async_save=False,
        layout={"world_size": 1}, state_access=access,
    )
    model = nn.Linear(4, 2)
    tensors, metadata = io.state_dicts({"state_dict": model, "step": 3}, model)
    assert entered == ["state"] and set(tensors["state_dict"]) == {"weight", "bias"} and metadata == {"step": 3}
    io.save(tensors, metadata, tmp_path / "a.ckpt")
    io.check_fits(io.resolve(tmp_path / "a.ckpt"), "state_dict", model)
    assert entered == ["state", "state"]
    assert io.state_dict_call(lambda value: (inside[0], value), 5) == (True, 5) and not inside[0]
    assert _io().state_dict_call(lambda: 1) == 1  # no backend given: nothing to enter
    strategy = ModelParallel2DStrategy(fsdp_backend="simple_fsdp")
    assert strategy.fsdp_backend is BACKENDS["simple_fsdp"]
    assert ModelParallel2DStrategy().fsdp_backend is BACKENDS["fully_shard"]


def test_only_simple_fsdp_and_the_checkpoint_io_know_how_state_is_read():
    """#43: ``sharded_parameters()`` was entered at 9 sites outside its module; now SimpleFSDP's backend object is its
    one user in the package, and in ``integration/`` only the checkpoint IO calls torch's state-dict APIs."""
    from pathlib import Path

    package = Path(strategy_base.__file__).resolve().parents[1]
    naming = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "sharded_parameters" in p.read_text())
    assert naming == ["parallel/simple_fsdp.py"]
    state_dict_apis = sorted(str(p.relative_to(package)) for p in (package / "integration").rglob("*.py")
                             if "torch.distributed.checkpoint.state_dict" in p.read_text())
    assert state_dict_apis == ["integration/checkpoint_io.py"]


# ---- precision -----------------------------------------------------------------------------------
def test_stock_precision_plugins_give_way_to_fsdp2s_policy_and_custom_ones_stay():
    swapped = fsdp2_precision(MixedPrecision("bf16-mixed", "cpu"), FSDP2Precision)
    assert type(swapped) is FSDP2Precision and swapped.precision == "bf16-mixed"
    assert type(fsdp2_precision(Precision(), FSDP2Precision)) is FSDP2Precision

    class Mine(Precision):
        pass

    mine = Mine()
    assert fsdp2_precision(mine, FSDP2Precision) is mine


# ---- validation ----------------------------------------------------------------------------------
class _Module:
    def __init__(self, plan):
        self._plan = plan

    def parallel_plan(self, config):
        if isinstance(self._plan, Exception):
            raise self._plan
        return self._plan


class _Data:
    seq_len, batch_size = 64, True  # a bool is not a batch size


def test_the_model_context_is_found_the_same_way_before_launch_and_in_each_rank():
    plan = ParallelPlan(blocks="layers", tp_divides={"n_heads": 4})
    context = model_context(_Module(plan), _Data(), ParallelConfig(), None)
    assert context == {"plan": plan, "seq_len": 64, "batch_size": None}
    needs_model = _Module(AttributeError("reads the built model"))
    assert model_context(needs_model, None, ParallelConfig(), None, before_launch=True)["plan"] is None
    with pytest.raises(AttributeError):
        model_context(needs_model, None, ParallelConfig(), None)
    with pytest.raises(ParallelConfigError):
        model_context(_Module(ParallelConfigError(["bad"])), None, ParallelConfig(), None, before_launch=True)


# ---- wiring --------------------------------------------------------------------------------------
def test_every_validation_goes_through_one_function(monkeypatch):
    seen = []
    real = strategy_base.validate_parallel_dims
    monkeypatch.setattr(strategy_base, "validate_parallel_dims", lambda *a, **k: seen.append(k) or real(*a, **k))
    L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallel2DStrategy(), logger=False)
    assert len(seen) == 1 and seen[0]["world_size"] == 1  # construction
    from lightning.fabric import Fabric
    from lightning_2d.fabric import ModelParallel2DStrategy as FabricStrategy

    Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy())
    assert len(seen) == 2


def test_a_users_checkpoint_io_is_refused_at_construction():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    with pytest.raises(ParallelConfigError, match=r"own CheckpointIO .*got AsyncCheckpointIO.*async_checkpoint=True"):
        L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallel2DStrategy(), plugins=[AsyncCheckpointIO()])
