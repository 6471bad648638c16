"""The fused output projection + cross-entropy equals logits + ``F.cross_entropy``, chunk by chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_2d.models.llama.model import ModelArgs, Transformer
from lightning_2d.ops.linear_cross_entropy import VocabReduce, linear_cross_entropy, linear_log_probs, replayable_backward


def _problem(dtype: torch.dtype, n: int = 150, dim: int = 32, vocab: int = 301):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, dim, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) * 0.2).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    labels[40:60] = -100  # a chunk (size 20) with no target at all
    return hidden, weight, labels


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖: elementwise tolerances would flag near-zero entries that are sums of cancelling terms."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def _reference(hidden, weight, labels):
    loss = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")
    grads = torch.autograd.grad(loss, (hidden, weight))
    return loss.detach(), grads


@pytest.mark.parametrize("chunk_size", [20, 64, 150, None])
def test_loss_and_gradients_equal_the_unfused_computation(chunk_size):
    hidden, weight, labels = _problem(torch.float32)
    loss_ref, (grad_h_ref, grad_w_ref) = _reference(hidden, weight, labels)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    # The incoming gradient (here 0.25) scales the stored gradients.
    grad_h, grad_w = torch.autograd.grad(loss * 0.25, (hidden, weight))
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    assert relative_error(grad_h, grad_h_ref * 0.25) <= 1e-6
    assert relative_error(grad_w, grad_w_ref * 0.25) <= 1e-6


def test_bf16_stays_within_bf16_rounding_of_the_unfused_computation():
    hidden, weight, labels = _problem(torch.bfloat16)
    loss_ref, (grad_h_ref, grad_w_ref) = _reference(hidden, weight, labels)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=32)
    grad_h, grad_w = torch.autograd.grad(loss, (hidden, weight))
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)  # both reduce the same bf16 logits in fp32
    # bf16 has 8 significant bits (2^-8 ≈ 4e-3 relative rounding); each chunk's product is rounded
    # before the fp32 sum, the reference rounds once: a few roundings apart.
    assert relative_error(grad_h, grad_h_ref) <= 1e-2
    assert relative_error(grad_w, grad_w_ref) <= 1e-2


def test_without_gradients_nothing_is_kept_and_the_value_is_the_same():
    hidden, weight, labels = _problem(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _reference(hidden, weight, labels)[0], rtol=1e-6, atol=0)


def test_a_replayable_loss_gives_the_same_gradients_on_every_pass():
    """The zero-bubble pipeline schedules run the loss node's backward twice over a retained graph (input pass,
    then weight pass): inside ``replayable_backward`` each pass gets the same gradients; outside, the second
    pass is refused by name instead of returning gradients scaled twice or nothing."""
    hidden, weight, labels = _problem(torch.float32)
    expected = _reference(hidden, weight, labels)[1]
    with replayable_backward():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=64) * 0.5
    for _ in range(2):
        grads = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
        for got, want in zip(grads, expected):
            assert relative_error(got, want * 0.5) < 1e-6
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=64)
    torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice on one graph; compute the loss inside"):
        torch.autograd.grad(loss, (hidden, weight))


def test_bad_chunk_size_is_refused():
    hidden, weight, labels = _problem(torch.float32)
    with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens or None, got 0"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def test_transformer_loss_equals_cross_entropy_of_its_logits():
    args = ModelArgs.from_name("debug", n_layers=2)
    model = Transformer(args, loss_chunk_size=24)
    model.init_weights(3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (3, 40), generator=g)
    labels = torch.randint(0, args.vocab_size, (3, 40), generator=g)
    labels[1, :9] = -100
    loss = model(tokens, labels=labels)
    loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(tokens)
    assert logits.shape == (3, 40, args.vocab_size)
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        assert relative_error(fused_grads[name], param.grad) <= 1e-5, name


def test_transformer_refuses_labels_outside_the_vocabulary():
    args = ModelArgs.from_name("debug", n_layers=1)
    model = Transformer(args)
    model.init_weights(0)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 256\) or -100 \(ignored\); got values \[256, 999\]"):
        model(tokens, labels=torch.tensor([[1, 2, 256, 3, 999, 4, -100, 5]]))
    with pytest.raises(ValueError, match=r"labels \(1, 4\) must have the shape of the tokens \(1, 8\)"):
        model(tokens, labels=torch.zeros(1, 4, dtype=torch.long))


# ---- each token's log-probability (``linear_log_probs``): what sequence-level objectives sum ----------------------
def _reference_log_probs(hidden, weight, labels):
    log_probs = F.log_softmax((hidden @ weight.t()).float(), dim=-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return log_probs.masked_fill(labels == -100, 0.0)


@pytest.mark.parametrize("chunk_size", [20, 64, None])
def test_log_probs_and_their_gradients_equal_log_softmax_with_a_factor_per_token(chunk_size):
    """Each token's gradient has its own factor (a sequence's weight in a preference loss): the backward, which
    recomputes each chunk's logits, gives what autograd through ``log_softmax`` gives; ignored tokens are 0."""
    hidden, weight, labels = _problem(torch.float32)
    factors = torch.randn(labels.shape[0], generator=torch.Generator().manual_seed(5))
    reference = _reference_log_probs(hidden, weight, labels)
    want = torch.autograd.grad((reference * factors).sum(), (hidden, weight))
    log_probs = linear_log_probs(hidden, weight, labels, chunk_size=chunk_size)
    got = torch.autograd.grad((log_probs * factors).sum(), (hidden, weight))
    assert log_probs.dtype == torch.float32 and bool((log_probs[labels == -100] == 0).all())
    torch.testing.assert_close(log_probs, reference, rtol=1e-6, atol=2e-6)
    for g, w in zip(got, want):
        assert relative_error(g, w) <= 1e-6
    # The summed log-probabilities are minus the fused cross-entropy.
    torch.testing.assert_close(-log_probs.sum(), linear_cross_entropy(hidden, weight, labels), rtol=1e-6, atol=0)


def test_bf16_log_probs_stay_within_bf16_rounding_and_replay_their_backward():
    """bf16 inputs: fp32 log-probabilities of the same bf16 logits, gradients in bf16; the backward keeps nothing it
    consumes, so a retained graph differentiates twice to the same gradients (the zero-bubble schedules' passes)."""
    hidden, weight, labels = _problem(torch.bfloat16)
    factors = torch.randn(labels.shape[0], generator=torch.Generator().manual_seed(6))
    reference = _reference_log_probs(hidden, weight, labels)
    want = torch.autograd.grad((reference * factors).sum(), (hidden, weight))
    log_probs = linear_log_probs(hidden, weight, labels, chunk_size=32)
    torch.testing.assert_close(log_probs, reference, rtol=1e-5, atol=1e-5)
    passes = [torch.autograd.grad((log_probs * factors).sum(), (hidden, weight), retain_graph=True) for _ in range(2)]
    for got in passes:
        assert got[0].dtype == got[1].dtype == torch.bfloat16
        for g, w in zip(got, want):
            assert relative_error(g, w) <= 1e-2
    for a, b in zip(*passes):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens or None, got 0"):
        linear_log_probs(hidden, weight, labels, chunk_size=0)


def test_log_probs_on_vocabulary_shards_combine_to_the_whole_vocabulary():
    """The vocabulary split in 3 uneven shards, one thread a shard, their statistics combined by a ``VocabReduce``
    over the threads (what the tensor-parallel all-reduces do): every shard returns the whole vocabulary's
    log-probabilities, and the shards' partial hidden-state gradients sum to the whole one (DTensor's ``Partial``),
    their weight gradients are the rows of the whole one."""
    import threading

    hidden, weight, labels = _problem(torch.float32)
    factors = torch.randn(labels.shape[0], generator=torch.Generator().manual_seed(7))
    reference = _reference_log_probs(hidden, weight, labels)
    want_h, want_w = torch.autograd.grad((reference * factors).sum(), (hidden, weight))
    bounds = [0, 90, 200, weight.shape[0]]
    shards = len(bounds) - 1
    barrier, slots = threading.Barrier(shards), [None] * shards

    def combine(i: int, op):
        def reduce_(t: torch.Tensor) -> None:
            slots[i] = t.clone()
            barrier.wait()
            combined = op(torch.stack(slots))
            barrier.wait()
            t.copy_(combined)
        return reduce_

    results: list = [None] * shards

    def run(i: int) -> None:
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach()[bounds[i]: bounds[i + 1]].clone().requires_grad_()
        reduce = VocabReduce(max_=combine(i, lambda s: s.amax(0)), sum_=combine(i, lambda s: s.sum(0)))
        log_probs = linear_log_probs(h, w, labels, chunk_size=32, vocab_start=bounds[i], reduce=reduce)
        results[i] = (log_probs.detach(), *torch.autograd.grad((log_probs * factors).sum(), (h, w)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for log_probs, _, _ in results:
        torch.testing.assert_close(log_probs, reference, rtol=1e-6, atol=2e-6)
    assert relative_error(sum(r[1] for r in results), want_h) <= 1e-6
    assert relative_error(torch.cat([r[2] for r in results]), want_w) <= 1e-6


def test_transformer_per_token_log_probs_equal_log_softmax_of_its_logits():
    args = ModelArgs.from_name("debug", n_layers=2)
    model = Transformer(args, loss_chunk_size=24)
    model.init_weights(3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (3, 40), generator=g)
    labels = torch.randint(0, args.vocab_size, (3, 40), generator=g)
    labels[1, :9] = -100
    log_probs = model(tokens, labels=labels, per_token=True)
    assert log_probs.shape == (3, 40)
    log_probs.sum(dim=1).mul(torch.tensor([1.0, -2.0, 0.5])).sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = _reference_log_probs(model(tokens).flatten(0, 1), torch.eye(args.vocab_size), labels.flatten())
    reference.view(3, 40).sum(dim=1).mul(torch.tensor([1.0, -2.0, 0.5])).sum().backward()
    torch.testing.assert_close(log_probs.detach(), reference.view(3, 40).detach(), rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        assert relative_error(fused_grads[name], param.grad) <= 1e-5, name


def test_auto_chunk_keeps_the_logits_within_64_mib_and_never_fewer_than_1024_tokens():
    from lightning_2d.ops.linear_cross_entropy import LOGITS_BUDGET, auto_chunk_tokens, chunk_tokens

    assert LOGITS_BUDGET == 2**24
    assert auto_chunk_tokens(256 // 2) == 131072  # the debug recipe's vocabulary at tp 2: any micro-batch in one chunk
    assert auto_chunk_tokens(32000) == 1024  # a real vocabulary: the 1024 tokens it always had
    assert auto_chunk_tokens(128256 // 8) == 1046  # Llama 3's at tp 8: 1046 × 16032 ≤ 2**24
    assert 1046 * 16032 <= LOGITS_BUDGET < 1047 * 16032
    assert chunk_tokens(None, 2048, 128) == 2048 and chunk_tokens(None, 5000, 32000) == 1024
    assert chunk_tokens(64, 2048, 128) == 64 and chunk_tokens(64, 10, 128) == 10
    with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens or None, got 0"):
        chunk_tokens(0, 10, 128)


def _shard_threads(n_shards: int, run):
    """``run(i, reduce)`` on ``n_shards`` threads, their ``VocabReduce`` the collectives over the threads (what the
    tensor-parallel group does), each callable counted per shard: ``(results, counts)``."""
    import threading

    barrier, slots = threading.Barrier(n_shards), [None] * n_shards
    counts = [{"max_": 0, "sum_": 0, "gather_": 0} for _ in range(n_shards)]

    def exchange(i: int, t: torch.Tensor) -> torch.Tensor:
        slots[i] = t.clone()
        barrier.wait()
        stacked = torch.stack(slots)
        barrier.wait()
        return stacked

    def reduce_for(i: int, gather: bool) -> VocabReduce:
        def max_(t):
            counts[i]["max_"] += 1
            t.copy_(exchange(i, t).amax(0))

        def sum_(t):
            counts[i]["sum_"] += 1
            t.copy_(exchange(i, t).sum(0))

        def gather_(t):
            counts[i]["gather_"] += 1
            return exchange(i, t)

        return VocabReduce(max_=max_, sum_=sum_, gather_=gather_ if gather else None)

    results: list = [None] * n_shards
    errors: list = []

    def target(i: int) -> None:
        try:
            results[i] = run(i, reduce_for)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n_shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, counts


@pytest.mark.parametrize("n_shards", [2, 4])
def test_gathered_statistics_equal_the_two_all_reduces_and_the_dense_loss(n_shards):
    """The vocabulary split in uneven shards, one thread a shard: the loss and gradients from one all-gather of each
    shard's (max, Σ exp, target logit) equal those of the max and sum all-reduces and of dense ``F.cross_entropy``,
    with ignored labels, chunks without a target, and targets on other shards; exactly one collective per chunk."""
    hidden, weight, labels = _problem(torch.float32)
    # Rows far apart per shard: the shards' maxima differ, so the exp(m_r - M) rescaling matters.
    with torch.no_grad():
        weight[: weight.shape[0] // 3] *= 4.0
    loss_ref, (grad_h_ref, grad_w_ref) = _reference(hidden, weight, labels)
    bounds = torch.linspace(0, weight.shape[0], n_shards + 1).long().tolist()
    bounds[1] -= 17  # uneven
    chunk = 32
    n_chunks = -(-hidden.shape[0] // chunk)

    def run_with(gather: bool):
        def run(i: int, reduce_for) -> tuple:
            h = hidden.detach().clone().requires_grad_()
            w = weight.detach()[bounds[i]: bounds[i + 1]].clone().requires_grad_()
            loss = linear_cross_entropy(h, w, labels, chunk_size=chunk, vocab_start=bounds[i],
                                        reduce=reduce_for(i, gather))
            return (loss.detach(), *torch.autograd.grad(loss * 0.5, (h, w)))
        return _shard_threads(n_shards, run)

    gathered, gathered_counts = run_with(gather=True)
    reduced, reduced_counts = run_with(gather=False)
    assert gathered_counts == [{"max_": 0, "sum_": 0, "gather_": n_chunks}] * n_shards
    assert reduced_counts == [{"max_": n_chunks, "sum_": n_chunks, "gather_": 0}] * n_shards
    for results in (gathered, reduced):
        for loss, _, _ in results:
            torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
        assert relative_error(sum(r[1] for r in results), grad_h_ref * 0.5) <= 1e-6
        assert relative_error(torch.cat([r[2] for r in results]), grad_w_ref * 0.5) <= 1e-6
    for (lg, hg, wg), (lr, hr, wr) in zip(gathered, reduced):
        torch.testing.assert_close(lg, lr, rtol=1e-6, atol=0)
        assert relative_error(hg, hr) <= 1e-6 and relative_error(wg, wr) <= 1e-6


def test_gathered_log_probs_equal_log_softmax_with_one_collective_per_chunk():
    hidden, weight, labels = _problem(torch.float32)
    factors = torch.randn(labels.shape[0], generator=torch.Generator().manual_seed(7))
    reference = _reference_log_probs(hidden, weight, labels)
    want_h, want_w = torch.autograd.grad((reference * factors).sum(), (hidden, weight))
    bounds = [0, 90, 200, weight.shape[0]]

    def run(i: int, reduce_for) -> tuple:
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach()[bounds[i]: bounds[i + 1]].clone().requires_grad_()
        log_probs = linear_log_probs(h, w, labels, chunk_size=32, vocab_start=bounds[i], reduce=reduce_for(i, True))
        return (log_probs.detach(), *torch.autograd.grad((log_probs * factors).sum(), (h, w)))

    results, counts = _shard_threads(3, run)
    assert counts == [{"max_": 0, "sum_": 0, "gather_": 5}] * 3  # 150 tokens: 5 chunks, backward needs none
    for log_probs, _, _ in results:
        torch.testing.assert_close(log_probs, reference, rtol=1e-6, atol=2e-6)
    assert relative_error(sum(r[1] for r in results), want_h) <= 1e-6
    assert relative_error(torch.cat([r[2] for r in results]), want_w) <= 1e-6


def test_the_default_chunk_is_sized_by_memory():
    """No chunk given: a small vocabulary's tokens in one chunk (one collective), a large one's 1024 at a time."""
    hidden, weight, labels = _problem(torch.float32, n=2500, dim=8, vocab=64)
    calls = []

    def gather_(t):
        calls.append(t.shape)
        return t.unsqueeze(0)

    loss = linear_cross_entropy(hidden, weight, labels, reduce=VocabReduce(gather_=gather_))
    loss_ref, _ = _reference(hidden, weight, labels)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    assert calls == [(3, 2500)]
    calls.clear()
    wide = torch.zeros(20000, 8)  # 20000 rows: 2**24 // 20000 = 838 < 1024
    linear_log_probs(hidden.detach(), wide, labels, reduce=VocabReduce(gather_=gather_))
    assert calls == [(3, 1024), (3, 1024), (3, 452)]
