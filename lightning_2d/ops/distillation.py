"""Divergences between a teacher's and a student's next-token distributions (knowledge distillation): dense, on full
logits, and fused with both output projections, a chunk of tokens at a time.

The divergences are TRL 1.16's (the experimental ``GKDTrainer.generalized_jsd_loss``; ``DistillationTrainer``'s
chunked ``_chunked_divergence_loss`` computes the same), with ``p_s = softmax(z_s / T)``, ``p_t = softmax(z_t / T)``:

- ``beta = 0``: the forward KL, ``KL(p_t ‖ p_s) = Σ p_t (log p_t − log p_s)`` (mass-covering);
- ``beta = 1``: the reverse KL, ``KL(p_s ‖ p_t)`` (mode-seeking);
- ``0 < beta < 1``: the generalized Jensen–Shannon divergence ``β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m)`` with the
  mixture ``m = β p_t + (1 − β) p_s`` (β = 0.5: the symmetric JSD).

TRL's conventions, kept exactly: both models' logits are divided by the temperature ``T`` before the softmax, and the
loss is **not** multiplied by ``T²`` (Hinton et al.'s distillation loss is; TRL's is not, so its gradients shrink
as ``1 / T`` and more at high ``T``: a caller wanting Hinton's scale multiplies by ``T²``). ``beta`` selects the
divergence and its two ends are the KLs, not the generalized JSD's limits (which are 0 at both ends). The teacher
gets no gradient. The per-token divergences are summed over the tokens that count; the caller divides (TRL's
``batchmean``: by the number of such tokens; here ``parallel.loss.normalize_by_global_tokens``).

``linear_distillation`` never forms ``(tokens, vocab)`` logits: each chunk of ``chunk_size`` tokens is projected by
both heads, reduced to the divergence, and turned into the student's gradient with respect to its logits and so its
hidden states and head weight right away (as ``ops.linear_cross_entropy`` does for the cross-entropy); backward only
scales the stored gradients. Vocabulary-parallel: each rank holds the same rows ``[vocab_start, vocab_start +
V_local)`` of both heads, and ``reduce`` (a ``VocabReduce``) combines the shards' per-token statistics — three
all-reduces of at most ``2 × chunk`` numbers per chunk: both models' maxima, both sums of exponentials, then the
divergence's per-token sums (the reverse KL's and the JSD's gradients need them). No label enters, so the shard's
offset does not either. Pure ``torch``; the collectives are passed in by ``lightning_2d.parallel.loss``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX, SINGLE_DEVICE, VocabReduce, backward_is_replayable


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(logits.float() / temperature, dim=-1)


def _check(beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, between: generalized JSD), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KL(p_t ‖ p_s)`` of each token (``(..., V)`` logits → ``(...)`` fp32), at temperature ``T``: TRL's
    ``generalized_jsd_loss`` at ``beta=0`` before its reduction."""
    _check(0.0, temperature)
    s, t = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)  # kl_div(input, target) = KL(target ‖ input)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KL(p_s ‖ p_t)`` of each token (``(..., V)`` logits → ``(...)`` fp32): TRL's ``beta=1``."""
    _check(1.0, temperature)
    s, t = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)


def jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
        temperature: float = 1.0) -> torch.Tensor:
    """TRL's generalized Jensen–Shannon divergence of each token (``(..., V)`` logits → ``(...)`` fp32):
    ``β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m)``, ``m = β p_t + (1 − β) p_s``; ``beta=0`` is ``forward_kl``, ``beta=1``
    ``reverse_kl`` (TRL's switch, not the limits)."""
    _check(beta, temperature)
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, temperature)
    s, t = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    log_m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    kl_teacher = F.kl_div(log_m, t, reduction="none", log_target=True).sum(-1)
    kl_student = F.kl_div(log_m, s, reduction="none", log_target=True).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def counted_tokens(mask: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: the tokens that count. ``mask`` is a bool mask (True counts) or labels (``-100`` does not)."""
    return mask if mask.dtype == torch.bool else mask != IGNORE_INDEX


def dense_linear_distillation(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference for ``linear_distillation``: both models' full ``(N, V)`` logits, ``jsd`` of each token, summed
    over the tokens that count (arguments as there). Differentiable for the student only."""
    valid = counted_tokens(mask)
    student_logits = (student_hidden @ student_weight.t()).float()
    with torch.no_grad():
        teacher_logits = (teacher_hidden @ teacher_weight.t()).float()
    per_token = jsd(student_logits, teacher_logits, beta, temperature)
    return torch.where(valid, per_token, 0.0).sum(), valid.sum()


class _LinearDistillation(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        valid: torch.Tensor,
        chunk_size: int,
        reduce: VocabReduce,
        beta: float,
        temperature: float,
        needs: tuple[bool, bool],
    ) -> torch.Tensor:
        need_hidden, need_weight = needs
        total = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
        grad_hidden = torch.empty_like(student_hidden) if need_hidden else None
        # fp32 accumulation over the chunks, cast to the weight's dtype once in backward.
        grad_weight = torch.zeros(student_weight.shape, dtype=torch.float32, device=student_weight.device) \
            if need_weight else None
        for start in range(0, student_hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = student_hidden[rows]
            divergence, grad_logits = _chunk(h, student_weight, teacher_hidden[rows], teacher_weight, reduce, beta,
                                             temperature, need_hidden or need_weight)
            counts = valid[rows]
            total += torch.where(counts, divergence, 0.0).sum()
            if grad_logits is None:
                continue
            # d divergence / d z (z: the logits before the temperature) is 1/T that with respect to z / T.
            grad_logits = grad_logits.mul_((counts / temperature)[:, None]).to(student_weight.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, student_weight, out=grad_hidden[rows])
            if grad_weight is not None and student_weight.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), h)
            elif grad_weight is not None:
                grad_weight += grad_logits.t() @ h
        ctx.grads = (grad_hidden, grad_weight, student_weight.dtype)
        ctx.replayable = backward_is_replayable()
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "linear_distillation's backward ran twice on one graph; compute the loss inside"
                " lightning_2d.ops.linear_cross_entropy.replayable_backward() to differentiate it more than once"
            )
        grad_hidden, grad_weight, weight_dtype = ctx.grads
        if not ctx.replayable:
            ctx.grads = None
        scale = grad_total.float()
        if grad_hidden is not None:
            grad_hidden = grad_hidden * scale.to(grad_hidden.dtype) if ctx.replayable \
                else grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = (grad_weight * scale if ctx.replayable else grad_weight.mul_(scale)).to(weight_dtype)
        # The teacher's hidden states and head, the mask and the constants: no gradient.
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _chunk(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor, w_t: torch.Tensor, reduce: VocabReduce,
           beta: float, temperature: float, with_grads: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk: each token's divergence over the whole vocabulary (``(c,)``, equal on every shard) and, with
    ``with_grads``, its gradient with respect to this shard's student logits divided by ``T`` (``(c, V_local)``
    fp32). The largest buffers are ``(c, V_local)`` fp32: three at once at most (four in the JSD)."""
    z_s = (h_s @ w_s.t()).float().div_(temperature)  # as the dense form: logits / T
    z_t = (h_t @ w_t.t()).float().div_(temperature)
    maxima = torch.stack((z_s.amax(-1), z_t.amax(-1)))
    reduce.max_(maxima)
    log_p_s, log_p_t = z_s.sub_(maxima[0, :, None]), z_t.sub_(maxima[1, :, None])  # in place: z − max
    sums = torch.stack((log_p_s.exp().sum(-1), log_p_t.exp().sum(-1)))
    reduce.sum_(sums)
    log_p_s.sub_(sums[0].log()[:, None])  # in place: log softmax over the whole vocabulary
    log_p_t.sub_(sums[1].log()[:, None])
    if beta == 0.0:
        # KL(p_t ‖ p_s) = Σ p_t (log p_t − log p_s); d/d(z_s/T) = p_s − p_t
        p_t = log_p_t.exp()
        divergence = log_p_t.sub_(log_p_s).mul_(p_t).sum(-1)
        reduce.sum_(divergence)
        return divergence, log_p_s.exp_().sub_(p_t) if with_grads else None
    if beta == 1.0:
        # KL(p_s ‖ p_t) = Σ p_s (log p_s − log p_t); d/d(z_s/T) = p_s (log p_s − log p_t − KL)
        gap = torch.sub(log_p_s, log_p_t, out=log_p_t)
        p_s = log_p_s.exp_()
        divergence = (p_s * gap).sum(-1)
        reduce.sum_(divergence)
        return divergence, gap.mul_(p_s).addcmul_(p_s, divergence[:, None], value=-1.0) if with_grads else None
    # β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m), m = β p_t + (1 − β) p_s;
    # d/d(z_s/T) = (1 − β) p_s (log p_s − log m − KL(p_s ‖ m)) (the teacher's term's m-derivative cancels the rest).
    log_beta = math.log(beta)
    log_m = log_p_s + (math.log1p(-beta) - log_beta)
    torch.logaddexp(log_m, log_p_t, out=log_m)
    log_m.add_(log_beta)
    p_t = log_p_t.exp()
    kl_teacher = log_p_t.sub_(log_m).mul_(p_t).sum(-1)
    del p_t
    p_s = torch.exp(log_p_s, out=log_p_t)  # log p_t's buffer is free
    gap = log_p_s.sub_(log_m)  # log p_s − log m
    kl_student = torch.mul(p_s, gap, out=log_m).sum(-1)  # log m's buffer is free
    terms = torch.stack((beta * kl_teacher + (1 - beta) * kl_student, kl_student))
    reduce.sum_(terms)
    divergence, kl_student = terms.unbind()
    if not with_grads:
        return divergence, None
    return divergence, gap.sub_(kl_student[:, None]).mul_(p_s).mul_(1 - beta)


def linear_distillation(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_size: Optional[int] = 512,
    reduce: VocabReduce = SINGLE_DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed divergence between the teacher's and the student's next-token distributions, without full logits.

    Equal (up to fp32 rounding of the sums) to ``dense_linear_distillation`` and its gradients: TRL's
    ``generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature, reduction="sum")`` on
    ``hidden @ weight.T`` (see the module docstring for the conventions).

    Args:
        student_hidden: ``(N, D_s)`` the student's final hidden states, one row per token.
        student_weight: ``(V_local, D_s)`` the student's output projection (this rank's vocabulary rows).
        teacher_hidden: ``(N, D_t)`` the teacher's final hidden states for the same tokens (``D_t`` may differ).
        teacher_weight: ``(V_local, D_t)`` the teacher's output projection, the same vocabulary rows. Neither
            teacher tensor gets a gradient.
        mask: ``(N,)`` which tokens count: a bool mask (True counts) or labels (``-100`` does not).
        beta: 0: forward KL ``KL(p_t ‖ p_s)``; 1: reverse KL ``KL(p_s ‖ p_t)``; between: generalized JSD.
        temperature: Both models' logits are divided by it before the softmax (no ``T²`` factor: TRL's).
        chunk_size: Tokens per chunk: the largest buffers are three (JSD: four) ``chunk_size × V_local`` fp32.
            ``None``: all tokens in one chunk.
        reduce: Combines the per-chunk statistics over vocabulary shards (see ``VocabReduce``).

    Returns:
        ``(total, count)``: the 0-dim fp32 sum of the per-token divergences over the tokens that count (equal on
        every vocabulary shard; differentiable for the student's hidden states and head weight) and their number.
    """
    _check(beta, temperature)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")
    n_tokens = student_hidden.shape[0]
    if teacher_hidden.shape[0] != n_tokens or mask.shape != (n_tokens,):
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)}, teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} and mask {tuple(mask.shape)} must have one row per token")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's and the teacher's heads must hold the same vocabulary rows, got "
                         f"{student_weight.shape[0]} and {teacher_weight.shape[0]}")
    valid = counted_tokens(mask)
    grad = torch.is_grad_enabled()
    needs = (grad and student_hidden.requires_grad, grad and student_weight.requires_grad)
    chunk = max(n_tokens if chunk_size is None else chunk_size, 1)
    total = _LinearDistillation.apply(student_hidden, student_weight, teacher_hidden.detach(),
                                      teacher_weight.detach(), valid, chunk, reduce, beta, float(temperature), needs)
    return total, valid.sum()
