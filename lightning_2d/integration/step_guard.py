"""The step-guard part of the 2D strategies: the first loss, each micro-batch's loss and the update.

``StepGuard`` holds what the ``non_finite`` option needs between a strategy's ``backward`` and its
``optimizer_step``: whether the first loss was checked, and a device flag that every micro-batch's loss
multiplies into (no host sync on the training path). Before the update every rank agrees, in one
collective, whether the losses and gradients since the last step are finite (``parallel.guard.guard_step``).
It knows no strategy: the Trainer and Fabric strategies call it from their ``backward`` and
``optimizer_step``, and a unit test drives it alone.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_2d.parallel.guard import finite_flag, guard_step


class NonFiniteLossError(RuntimeError):
    """The first loss of a run is NaN/inf: the initial weights or the inputs are broken."""


def check_first_loss(loss: torch.Tensor) -> None:
    """Stop before the first backward when the first loss is not finite on any rank (every rank raises).

    A model materialized from uninitialized memory, or a broken input pipeline, shows here; training
    on would spread NaN through every weight while the run looks alive. One all-reduce of a flag, once.
    """
    import torch.distributed as dist

    value = loss.detach()
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    finite = torch.isfinite(value).all().to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not bool(finite.item()):
        raise NonFiniteLossError(
            f"The loss of the first training step is not finite (this rank: {value.float().flatten()[:1].item()};"
            " every rank checked): the initial weights or the inputs are broken — e.g. tensors of a meta-device"
            " model left uninitialized, weights loaded from a corrupt checkpoint, or token ids outside the"
            " vocabulary. Stopped before the first optimizer step, so nothing was trained or saved on top of it."
        )


class StepGuard:
    """The ``non_finite`` policy between backward and the optimizer update.

    Args:
        policy: ``"raise"``, ``"skip"`` or ``"off"`` (``ParallelConfig.non_finite``).
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        #: The product of every micro-batch's finite flag since the last step (``None``: no backward yet).
        self.loss_flag: Optional[torch.Tensor] = None
        self.first_loss_checked = False

    def before_backward(self, loss: torch.Tensor) -> None:
        """The first loss of the run is checked on every rank, once (``check_first_loss``)."""
        if not self.first_loss_checked:
            self.first_loss_checked = True
            check_first_loss(loss)

    def after_backward(self, loss: torch.Tensor) -> None:
        """Fold this micro-batch's loss into the flag; after backward, so that what ``on_before_backward``
        hooks did to the loss counts too."""
        if self.policy == "off":
            return
        local = loss.detach()
        if isinstance(local, DTensor):
            local = local.to_local()
        finite = finite_flag([local], local.device)
        flag = self.loss_flag
        self.loss_flag = finite if flag is None else flag * finite.to(flag.device)

    def check(self, optimizer: Optimizer, step: int, device: torch.device) -> bool:
        """Whether the step may update the weights: every rank agrees (``guard_step``); under ``"raise"`` a
        non-finite step raises, under ``"skip"`` its gradients are dropped and ``False`` comes back."""
        flag, self.loss_flag = self.loss_flag, None
        if self.policy == "off":
            return True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if flag is None:  # no backward through the strategy (e.g. a manual loop without it)
            flag = torch.ones((), device=device)
        return guard_step(params, flag, step, self.policy)

    def guard_optimizer_step(
        self, optimizer: Any, args: tuple, kwargs: dict[str, Any], step: int, device: torch.device,
        gradients_ready: Callable[[], None] = lambda: None,
    ) -> tuple[tuple, dict[str, Any]]:
        """The arguments of the strategy's ``optimizer_step`` with the guard in place.

        The Trainer passes a closure that runs forward and backward inside the step: ``gradients_ready`` (the
        deferred reductions that complete the gradients, ``Parallelized.finish_gradients``) and the guard run right
        after it, before gradient clipping and ``on_before_optimizer_step``. Fabric calls the step after the
        user's ``fabric.backward``: they run here, at once.
        """
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps it
        closure: Optional[Callable[[], Any]] = kwargs.get("closure", args[0] if args and callable(args[0]) else None)
        if closure is None:
            gradients_ready()
            self.check(inner, step, device)
            return args, kwargs

        def guarded_closure() -> Any:
            result = closure()
            gradients_ready()
            self.check(inner, step, device)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": guarded_closure}
        return (guarded_closure, *args[1:]), kwargs
