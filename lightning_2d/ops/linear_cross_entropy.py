"""Output projection fused with the cross-entropy, a chunk of tokens at a time: no full logits.

A Llama head maps every token to ``vocab_size`` logits. Computed the plain way, ``(tokens, vocab)``
logits are materialized, upcast to fp32 and kept for backward with their softmax: for Llama 3 8B
at 8k tokens per sequence that is 4 GB of fp32 per copy. Here the tokens are processed
``chunk_size`` rows at a time: each chunk's logits are computed, reduced to the loss, and turned
into their gradient contributions right away (as Liger-Kernel's fused linear cross-entropy does),
so at most one chunk of logits exists at any moment and nothing of size ``vocab`` is kept for
backward. Backward only scales the stored gradients by the incoming gradient (no recompute).

The chunk is sized by memory (``auto_chunk_tokens``): as many tokens as keep its fp32 logits within
``LOGITS_BUDGET`` numbers, never fewer than 1024, so a small vocabulary takes a whole micro-batch at once
(one collective per step under vocabulary parallelism) and a real one (≥ 16,384 rows per shard) the
1024 tokens it always had.

The same code runs vocabulary-parallel (each tensor-parallel rank holds rows
``[vocab_start, vocab_start + local_vocab)`` of the weight): the softmax needs the maximum and the
sum of exponentials over the whole vocabulary, which ``reduce`` supplies: one all-gather per chunk of
each shard's ``(max, Σ exp(z - max), target logit)`` per token (``VocabReduce.gather_``), combined
on every rank. This file is plain PyTorch; the collectives are passed in by
``lightning_2d.parallel.loss``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lightning_2d._compat import assert_async

IGNORE_INDEX = -100

#: Whether a backward of the loss computed now may run more than once (see ``replayable_backward``).
_REPLAYABLE_BACKWARD = contextvars.ContextVar("lightning_2d_replayable_backward", default=False)


@contextmanager
def replayable_backward() -> Iterator[None]:
    """Losses computed inside may be differentiated more than once through the same graph.

    By default the backward scales the gradients stored in forward in place and drops them (no copy, freed
    as soon as they are used). The zero-bubble pipeline schedules split each backward in two passes over a
    retained graph (``torch.distributed.pipelining``'s ``stage_backward_input``, then ``stage_backward_weight``
    from the nodes where the input and weight paths meet, which is this loss's node: it produces both the
    hidden-state and the head-weight gradients): the second pass calls the backward again. Inside this
    context the backward keeps the stored gradients and scales copies (they live until the graph is freed,
    after the weight pass).
    """
    token = _REPLAYABLE_BACKWARD.set(True)
    try:
        yield
    finally:
        _REPLAYABLE_BACKWARD.reset(token)


def backward_is_replayable() -> bool:
    """Whether a loss computed now is inside ``replayable_backward`` (a fused loss keeps its stored gradients)."""
    return _REPLAYABLE_BACKWARD.get()


#: fp32 numbers one chunk's logits may hold when the chunk is sized by memory (2**24: 64 MiB).
LOGITS_BUDGET = 2**24
#: The fewest tokens of a chunk sized by memory: the fixed chunk the fused losses had before, so a real vocabulary's
#: chunks (and their number of collectives) are what they were.
MIN_CHUNK_TOKENS = 1024


def auto_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk of the fused losses when none is given: as many as keep the chunk's ``(tokens, local_vocab)``
    fp32 logits within ``LOGITS_BUDGET`` numbers, never fewer than ``MIN_CHUNK_TOKENS``. Peak memory is then at most
    max(1024-token chunks', 64 MiB); a small vocabulary shard (256 / tp 2: 131,072 tokens) takes a whole micro-batch
    in one chunk, hence one collective instead of one per 1024 tokens.

    Args:
        local_vocab: Vocabulary rows of this rank's shard of the output projection.
    """
    return max(MIN_CHUNK_TOKENS, LOGITS_BUDGET // max(local_vocab, 1))


def chunk_tokens(chunk_size: Optional[int], n_tokens: int, local_vocab: int) -> int:
    """The tokens per chunk a fused loss uses: ``chunk_size``, or ``auto_chunk_tokens(local_vocab)`` when it is
    ``None``; at most ``n_tokens`` (and at least 1)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size!r}"
                         " (None: sized by memory, auto_chunk_tokens)")
    chunk = auto_chunk_tokens(local_vocab) if chunk_size is None else chunk_size
    return max(min(chunk, n_tokens), 1)


@dataclass(frozen=True)
class VocabReduce:
    """How the per-chunk statistics combine over vocabulary shards; identities on one device.

    Args:
        max_: In place, the element-wise maximum over the shards.
        sum_: In place, the element-wise sum over the shards.
        gather_: Every shard's tensor, stacked: ``(shards, *t.shape)`` (an all-gather). When given, the cross-entropy
            and log-probabilities combine their softmax statistics with it, one collective per chunk instead of
            ``max_`` then ``sum_``; ``None`` (one device, or a caller that only reduces) uses ``max_`` and ``sum_``.
    """

    max_: Callable[[torch.Tensor], None] = lambda t: None
    sum_: Callable[[torch.Tensor], None] = lambda t: None
    gather_: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


SINGLE_DEVICE = VocabReduce()


@dataclass
class _Chunk:
    """One chunk's softmax statistics over the whole vocabulary (``reduce`` combined the shards')."""

    rows: torch.Tensor  # (c,) 0 … c-1
    valid: torch.Tensor  # (c,) the label is not ignored
    here: torch.Tensor  # (c,) valid, and the target's logit lives on this shard
    target: torch.Tensor  # (c,) the target's row in this shard (0 where not ``here``)
    exp: torch.Tensor  # (c, local_vocab) fp32 exp(z - m), m a per-row shift: the chunk's only vocabulary-sized buffer
    row_max: torch.Tensor  # (c,) max over the whole vocabulary
    sum_exp: torch.Tensor  # (c,) Σ exp(z - max) over the whole vocabulary
    target_logit: torch.Tensor  # (c,) z[target] (0 where ignored)
    # (c,) ``exp × exp_scale / sum_exp`` is the softmax: exp(m - max) where ``exp`` is shifted by this shard's own
    # maximum m (the gathered statistics); None where it is shifted by the whole vocabulary's (max_ then sum_).
    exp_scale: Optional[torch.Tensor] = None

    def softmax_scale(self) -> torch.Tensor:
        """``(c,)``: the softmax over the whole vocabulary is ``exp × softmax_scale()[:, None]``."""
        return self.sum_exp.reciprocal() if self.exp_scale is None else self.exp_scale / self.sum_exp

    def softmax_(self) -> torch.Tensor:
        """``exp`` turned in place into the softmax over the whole vocabulary (one pass over the buffer)."""
        return self.exp.mul_(self.softmax_scale()[:, None])


def _chunk_statistics(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, vocab_start: int,
                      reduce: VocabReduce) -> _Chunk:
    """The logits of ``h``'s rows on this shard's vocabulary and their softmax statistics over every shard: under
    vocabulary parallelism one all-gather of ``3 × c`` numbers (``reduce.gather_``), or two all-reduces of ``c``
    and ``2 × c`` numbers (``max_``, ``sum_``) where no gather is given."""
    local_vocab = weight.shape[0]
    rows = torch.arange(h.shape[0], device=h.device)
    valid = y != IGNORE_INDEX
    target = y - vocab_start
    here = valid & (target >= 0) & (target < local_vocab)  # the target's logit lives on this shard
    target = torch.where(here, target, 0)

    logits = (h @ weight.t()).float()  # (c, local_vocab), the only vocab-sized buffer
    row_max = logits.amax(dim=-1)
    if reduce.gather_ is None:
        reduce.max_(row_max)
    target_logit = torch.where(here, logits[rows, target], 0.0)
    exp = logits.sub_(row_max[:, None]).exp_()  # in place: exp(z - max), this shard's max when gathering
    if reduce.gather_ is None:
        stats = torch.stack((exp.sum(dim=-1), target_logit))
        reduce.sum_(stats)
        sum_exp, target_logit = stats.unbind()
        return _Chunk(rows, valid, here, target, exp, row_max, sum_exp, target_logit)
    # Each shard's (m_r, s_r = Σ exp(z - m_r), its target logit or 0), gathered: M = max_r m_r,
    # S = Σ_r s_r exp(m_r - M), the target logit the one non-zero; the statistics max_ and sum_ would give.
    maxima, sums, targets = reduce.gather_(torch.stack((row_max, exp.sum(dim=-1), target_logit))).unbind(1)
    global_max = maxima.amax(dim=0)
    sum_exp = (sums * (maxima - global_max).exp()).sum(dim=0)
    exp_scale = (row_max - global_max).exp()  # this shard's exp(z - m_r) × exp(m_r - M) = exp(z - M)
    return _Chunk(rows, valid, here, target, exp, global_max, sum_exp, targets.sum(dim=0), exp_scale)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        vocab_start: int,
        reduce: VocabReduce,
        with_grads: bool,
    ) -> torch.Tensor:
        n_tokens = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grads else None
        # fp32 accumulation over the chunks, cast to the weight's dtype once in backward.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grads else None
        for start in range(0, n_tokens, chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            c = _chunk_statistics(h, weight, y, vocab_start, reduce)
            rows, valid, here, target, sum_exp = c.rows, c.valid, c.here, c.target, c.sum_exp
            # -log softmax(z)[target] = log Σ exp(z - max) + max - z[target]
            total += torch.where(valid, sum_exp.log() + c.row_max - c.target_logit, 0.0).sum()

            if not with_grads:
                continue
            # d loss / d z = softmax(z) - onehot(target), zero on ignored tokens.
            if weight.dtype == torch.float32 and h.dtype == torch.float32:
                # softmax = exp × r per row: r scales the narrow side of each product (the rows of the (c, D) result
                # and of h), and the one-hot term is a gather and a scatter of D-wide rows: no pass over the
                # (c, V) buffer beyond the two products.
                r = c.softmax_scale() * valid
                rows_here, t = rows[here], target[here]
                gh = grad_hidden[start : start + chunk_size]
                torch.mm(c.exp, weight, out=gh)
                gh.mul_(r[:, None]).index_add_(0, rows_here, weight[t], alpha=-1.0)
                grad_weight.addmm_(c.exp.t(), h * r[:, None]).index_add_(0, t, h[rows_here], alpha=-1.0)
                continue
            grad_logits = c.softmax_()
            grad_logits[rows[here], target[here]] -= 1.0
            grad_logits.mul_(valid[:, None])
            grad_logits = grad_logits.to(weight.dtype)
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
            grad_weight += grad_logits.t() @ h
        ctx.grads = (grad_hidden, grad_weight, weight.dtype)
        ctx.replayable = _REPLAYABLE_BACKWARD.get()
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "linear_cross_entropy's backward ran twice on one graph; compute the loss inside"
                " lightning_2d.ops.linear_cross_entropy.replayable_backward() to differentiate it more than once"
            )
        grad_hidden, grad_weight, weight_dtype = ctx.grads
        if grad_hidden is None:
            raise RuntimeError("linear_cross_entropy was computed without gradients (with_grads=False)")
        if ctx.replayable:  # a later pass calls this again: scale copies
            return (grad_hidden * grad_total.to(grad_hidden.dtype), (grad_weight * grad_total).to(weight_dtype),
                    None, None, None, None, None)
        ctx.grads = None
        grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        grad_weight = grad_weight.mul_(grad_total).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Labels must be token ids ``< vocab_size`` or ``-100``; checked without a host sync on GPU."""
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)
    message = f"labels must be token ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored)"
    if labels.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(f"{message}; got values {sorted(set(labels[bad].tolist()))[:8]}")
    else:
        assert_async(~bad.any(), message)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: Optional[int] = None,
    vocab_start: int = 0,
    reduce: VocabReduce = SINGLE_DEVICE,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels``, without the full logits.

    Equal (up to fp32 rounding of the sums) to
    ``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")``
    and its gradients.

    Args:
        hidden: ``(N, D)`` final hidden states, one row per token.
        weight: ``(V_local, D)`` output projection (this rank's vocabulary rows).
        labels: ``(N,)`` target ids in the *global* vocabulary; ``-100`` is ignored.
        chunk_size: Tokens per chunk: the largest logits buffer is ``chunk_size × V_local`` fp32.
            ``None``: sized by memory (``auto_chunk_tokens(V_local)``: within 64 MiB, at least 1024 tokens).
        vocab_start: Global id of ``weight``'s first row.
        reduce: Combines per-chunk statistics over vocabulary shards (see ``VocabReduce``).

    Returns:
        A 0-dim fp32 tensor: the sum over the non-ignored tokens.
    """
    chunk = chunk_tokens(chunk_size, hidden.shape[0], weight.shape[0])
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, vocab_start, reduce, with_grads)


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        vocab_start: int,
        reduce: VocabReduce,
    ) -> torch.Tensor:
        n_tokens = hidden.shape[0]
        log_probs = torch.zeros(n_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(n_tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, n_tokens, chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            c = _chunk_statistics(h, weight, y, vocab_start, reduce)
            chunk_lse = c.sum_exp.log() + c.row_max  # log Σ exp(z) over the whole vocabulary
            lse[start : start + chunk_size] = chunk_lse
            log_probs[start : start + chunk_size] = torch.where(c.valid, c.target_logit - chunk_lse, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size, ctx.vocab_start = chunk_size, vocab_start
        return log_probs

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor):  # type: ignore[override]
        # Each token's gradient has its own factor (a sequence's, a pair's): nothing can be summed ahead in forward,
        # so each chunk's logits are computed again; softmax from the stored log-normalizer, no collective.
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk_size, vocab_start, local_vocab = ctx.chunk_size, ctx.vocab_start, weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_log_probs = grad_log_probs.float()
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            valid = y != IGNORE_INDEX
            target = y - vocab_start
            here = valid & (target >= 0) & (target < local_vocab)
            g = torch.where(valid, grad_log_probs[start : start + chunk_size], 0.0)
            # d log softmax(z)[target] / d z = onehot(target) - softmax(z)
            grad_logits = (h @ weight.t()).float().sub_(lse[start : start + chunk_size, None]).exp_()
            grad_logits.mul_(-g[:, None])
            rows = torch.arange(h.shape[0], device=h.device)[here]
            grad_logits[rows, target[here]] += g[here]
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
            if grad_weight is not None and weight.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), h)
            elif grad_weight is not None:
                grad_weight += grad_logits.t() @ h  # as linear_cross_entropy: each chunk's product, summed in fp32
        return (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                None, None, None, None)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: Optional[int] = None,
    vocab_start: int = 0,
    reduce: VocabReduce = SINGLE_DEVICE,
) -> torch.Tensor:
    """Each token's log-probability of its label under ``softmax(hidden @ weight.T)``, without the full logits: what
    a sequence-level objective (preference tuning's, a sequence's score) sums per sequence.

    Equal (up to fp32 rounding) to ``log_softmax((hidden @ weight.T).float(), -1).gather(-1, labels)`` with 0 at
    ignored labels, and its gradients. Forward keeps one fp32 number per token (the log-normalizer) besides its
    inputs; backward computes each chunk's logits again (one matmul more than ``linear_cross_entropy``, whose
    gradient is one factor for every token and so is formed in forward).

    Args:
        hidden: ``(N, D)`` final hidden states, one row per token.
        weight: ``(V_local, D)`` output projection (this rank's vocabulary rows).
        labels: ``(N,)`` target ids in the *global* vocabulary; ``-100`` is ignored (log-probability 0).
        chunk_size: Tokens per chunk (``None``: sized by memory, ``auto_chunk_tokens(V_local)``).
        vocab_start: Global id of ``weight``'s first row.
        reduce: Combines per-chunk statistics over vocabulary shards (see ``VocabReduce``).

    Returns:
        ``(N,)`` fp32 log-probabilities (≤ 0), equal on every vocabulary shard.
    """
    chunk = chunk_tokens(chunk_size, hidden.shape[0], weight.shape[0])
    return _LinearLogProbs.apply(hidden, weight, labels, chunk, vocab_start, reduce)
