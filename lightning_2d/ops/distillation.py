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
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX, SINGLE_DEVICE, VocabReduce, backward_is_replayable


#: The divergences ``DistillationConfig.loss`` names, and the ``beta`` of ``jsd`` each is (TRL's switch at the ends).
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
#: Which positions ``DistillationConfig.tokens`` distils.
DISTILLED_TOKENS = ("trained", "all")


class DistillationConfigError(ValueError):
    """Distillation settings that cannot train (an unknown divergence, alpha outside (0, 1] …), raised before anything
    is built."""


@dataclass(frozen=True)
class DistillationConfig:
    """How a student learns from a teacher's next-token distributions (``distillation=`` on the modules).

    The step's loss is ``alpha · D + (1 − alpha) · NLL``: ``D`` the divergence below, averaged over the distilled
    tokens of the global batch, ``NLL`` the usual next-token loss, averaged over the trained tokens. TRL 1.16's
    ``DistillationTrainer`` has no such weight (its loss is the divergence alone: ``alpha=1``, the default); the
    weight follows TRL's convex form where it mixes a distillation term with another objective
    (``SDPOConfig.distillation_weight``: ``(1 − w) · policy_loss + w · distillation_loss``) and Hinton et al.'s
    ``alpha`` on the soft targets (without their ``T²``: TRL's).

    Args:
        loss: ``forward_kl`` (``KL(p_teacher ‖ p_student)``, mass-covering: the usual choice on fixed data, TRL's
            ``beta=0``), ``reverse_kl`` (``KL(p_student ‖ p_teacher)``, mode-seeking: TRL's ``beta=1``, its
            ``DistillationConfig`` default, made for the student's own generations), ``jsd`` (TRL's generalized
            Jensen–Shannon divergence with ``beta``).
        beta: ``jsd``'s mixture weight ``β`` in (0, 1) (``β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m)``, ``m = β p_t +
            (1 − β) p_s``); ``None``: 0.5 for ``jsd``. Not for the KLs (they are its two ends).
        temperature: Both models' logits are divided by it before the softmax; the loss is not multiplied by ``T²``
            (TRL's convention: multiply ``alpha``'s term yourself for Hinton's scale).
        alpha: The weight of the divergence, in (0, 1]; ``1 − alpha`` weighs the next-token loss (logged either way).
        tokens: Where the student is distilled: ``trained``, the positions whose label counts (``labels != -100``:
            a chat's assistant tokens, TRL's completion mask; every position of plain text); ``all``, every position
            of a document up to its last trained one (the prompts too, not the padding nor what follows a document's
            last trained token).
        chunk_size: Tokens per chunk of the fused heads (the divergence and the next-token loss): the largest buffers
            are three (``jsd``: four) ``chunk_size × vocab / tensor_parallel_size`` fp32 numbers.

    Raises:
        DistillationConfigError: A setting out of its range (every problem in one message); a ``ValueError``.

    Example:
        ```python
        from lightning_2d import DistillationConfig, LlamaLightningModule

        module = LlamaLightningModule(
            init_from="Llama-3.2-1B/",
            teacher="Llama-3.1-8B/",  # its vocabulary the student's
            distillation=DistillationConfig(loss="forward_kl", temperature=2.0, alpha=0.5),
        )
        ```
    """

    loss: str = "forward_kl"
    beta: Optional[float] = None
    temperature: float = 1.0
    alpha: float = 1.0
    tokens: str = "trained"
    chunk_size: int = 512

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise DistillationConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """What makes these settings unable to train (empty: none)."""
        out = []
        if self.loss not in DIVERGENCES:
            out.append(f"distillation loss must be one of {', '.join(DIVERGENCES)}; got {self.loss!r}")
        if self.beta is not None and self.loss != "jsd":
            out.append(f"distillation beta={self.beta!r} weighs jsd's mixture, but loss={self.loss!r}: the KLs are"
                       " its two ends (TRL's beta 0 and 1); leave beta out, or use loss='jsd'")
        elif self.beta is not None and not (_number(self.beta) and 0.0 < self.beta < 1.0):
            out.append(f"distillation beta must be in (0, 1) for jsd, got {self.beta!r}: its ends are the KLs, use"
                       " loss='forward_kl' (TRL's beta 0) or loss='reverse_kl' (beta 1)")
        if not (_number(self.temperature) and self.temperature > 0):
            out.append(f"distillation temperature must be a positive number, got {self.temperature!r}")
        if not (_number(self.alpha) and 0.0 < self.alpha <= 1.0):
            out.append(f"distillation alpha must be in (0, 1] (the divergence's weight; 1 - alpha weighs the"
                       f" next-token loss), got {self.alpha!r}; without a teacher, leave teacher and distillation out")
        if self.tokens not in DISTILLED_TOKENS:
            out.append(f"distillation tokens must be one of {', '.join(DISTILLED_TOKENS)}, got {self.tokens!r}")
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 1):
            out.append(f"distillation chunk_size must be a positive number of tokens, got {self.chunk_size!r}")
        return out

    @classmethod
    def of(cls, value: "DistillationConfig | Mapping[str, Any] | None") -> Optional["DistillationConfig"]:
        """``value`` as settings (a dict of the fields, from a recipe or a checkpoint's hyperparameters)."""
        if value is None or isinstance(value, DistillationConfig):
            return value
        if not isinstance(value, Mapping):
            raise DistillationConfigError(f"distillation must be a DistillationConfig or a dict of its fields, got"
                                          f" {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise DistillationConfigError(f"distillation has no field(s) {unknown}; its fields:"
                                          f" {', '.join(f.name for f in fields(cls))}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (hyperparameters, checkpoints)."""
        return asdict(self)

    @property
    def divergence_beta(self) -> float:
        """TRL's ``beta`` of the divergence: 0 (forward KL), 1 (reverse KL), or ``jsd``'s."""
        if self.loss == "forward_kl":
            return 0.0
        if self.loss == "reverse_kl":
            return 1.0
        return 0.5 if self.beta is None else float(self.beta)

    @property
    def metric(self) -> str:
        """The logged name of the divergence's mean (``distill/forward_kl``, ``distill/reverse_kl``,
        ``distill/jsd``)."""
        return f"distill/{self.loss}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        teacher: "TeacherHead",
        valid: torch.Tensor,
        chunk_size: int,
        reduce: VocabReduce,
        beta: float,
        temperature: float,
        needs: tuple[bool, bool],
    ) -> torch.Tensor:
        # Forward runs without a graph (autograd's rule): so does the teacher, called from here.
        results: list[tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = []

        def consume(hidden: torch.Tensor, weight: torch.Tensor) -> None:
            _check_teacher(student_hidden, student_weight, hidden, weight)
            results.append(_distill(student_hidden, student_weight, hidden.detach(), weight.detach(), valid,
                                    chunk_size, reduce, beta, temperature, needs))

        teacher(consume)
        if len(results) != 1:
            raise RuntimeError(f"the teacher's head must hand over its hidden states and weight once, not {len(results)}"
                               " times")
        total, grad_hidden, grad_weight = results[0]
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
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _distill(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
             teacher_weight: torch.Tensor, valid: torch.Tensor, chunk_size: int, reduce: VocabReduce, beta: float,
             temperature: float, needs: tuple[bool, bool],
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The summed divergence and the student's gradients (hidden states, head weight; ``None`` where ``needs`` says
    no), chunk by chunk: what ``_LinearDistillation`` computes in forward."""
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
    return total, grad_hidden, grad_weight


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
    _check_teacher(student_hidden, student_weight, teacher_hidden, teacher_weight)
    return linear_distillation_from(
        student_hidden, student_weight, lambda consume: consume(teacher_hidden, teacher_weight), mask, beta=beta,
        temperature=temperature, chunk_size=chunk_size, reduce=reduce,
    )


#: ``teacher(consume)`` calls ``consume(teacher_hidden, teacher_weight)`` once, while they exist: ``(N, D_t)`` the
#: teacher's final hidden states and ``(V_local, D_t)`` its head's rows (``linear_distillation_from``).
TeacherHead = Callable[[Callable[[torch.Tensor, torch.Tensor], None]], None]


def linear_distillation_from(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: TeacherHead,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_size: Optional[int] = 512,
    reduce: VocabReduce = SINGLE_DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_distillation`` with the teacher's side handed over by ``teacher`` (a ``TeacherHead``) while the loss
    runs, not before it: a sharded teacher's head weight exists whole only inside a call of its head (FSDP gathers
    it there and frees it after), so ``teacher`` runs the teacher's forward and calls ``consume`` from inside its
    head. It is called in the autograd function's forward, without a graph: the teacher records nothing for backward
    (no activation kept, no hook of its sharding in the student's backward). Arguments and returns as
    ``linear_distillation``'s."""
    _check(beta, temperature)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")
    n_tokens = student_hidden.shape[0]
    if mask.shape != (n_tokens,):
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and mask {tuple(mask.shape)} must have one row"
                         " per token")
    valid = counted_tokens(mask)
    grad = torch.is_grad_enabled()
    needs = (grad and student_hidden.requires_grad, grad and student_weight.requires_grad)
    chunk = max(n_tokens if chunk_size is None else chunk_size, 1)
    total = _LinearDistillation.apply(student_hidden, student_weight, teacher, valid, chunk, reduce, beta,
                                      float(temperature), needs)
    return total, valid.sum()


def _check_teacher(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                   teacher_weight: torch.Tensor) -> None:
    if teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must have one row per token")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's and the teacher's heads must hold the same vocabulary rows, got "
                         f"{student_weight.shape[0]} and {teacher_weight.shape[0]}")
