"""Distillation's divergences: the dense ones are TRL's (``GKDTrainer.generalized_jsd_loss``, ``DistillationTrainer``'s
chunked loss) and the KL definitions; the fused, chunked one (both heads a chunk of tokens at a time, on vocabulary
shards) equals the dense one with its student gradients, and leaves the teacher alone."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_2d.ops.distillation import (
    dense_linear_distillation,
    forward_kl,
    jsd,
    linear_distillation,
    reverse_kl,
)
from lightning_2d.ops.linear_cross_entropy import VocabReduce, replayable_backward

#: fp32 sums of ~N·V terms in another order (chunks, shards, fused in-place steps): measured a few 1e-7 relative.
FP32 = 2e-6


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖: elementwise tolerances would flag near-zero entries that are sums of cancelling terms."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def _problem(dtype: torch.dtype = torch.float32, n: int = 150, student_dim: int = 32, teacher_dim: int = 48,
             vocab: int = 301):
    """A student and a wider teacher on the same vocabulary; every 7th token and tokens 40-59 (a whole chunk of 20)
    ignored."""
    g = torch.Generator().manual_seed(0)
    student_hidden = torch.randn(n, student_dim, generator=g).to(dtype).requires_grad_()
    student_weight = (torch.randn(vocab, student_dim, generator=g) * 0.3).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(n, teacher_dim, generator=g).to(dtype)
    teacher_weight = (torch.randn(vocab, teacher_dim, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    labels[40:60] = -100
    return student_hidden, student_weight, teacher_hidden, teacher_weight, labels


def _dense(problem, beta, temperature=1.0):
    student_hidden, student_weight, *_ = problem
    total, count = dense_linear_distillation(*problem, beta=beta, temperature=temperature)
    return total.detach(), count, torch.autograd.grad(total, (student_hidden, student_weight))


# ---- the dense divergences: TRL's and the definitions -----------------------------------------------------------
@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_dense_divergences_equal_trls_generalized_jsd_and_chunked_distillation_losses(beta, temperature):
    """Our per-token divergence summed over the counted tokens is TRL 1.16's ``GKDTrainer.generalized_jsd_loss``
    (``reduction="sum"``; ``batchmean`` divided by our count) on the same logits; the fused loss is
    ``DistillationTrainer``'s ``_chunked_divergence_loss`` on the same hidden states and heads
    (``num_items_in_batch=1``: its sum), which divides both models' logits by the temperature too and multiplies by
    no ``T²``."""
    pytest.importorskip("trl", reason="trl is in the test extra (pip install -e '.[test]')")
    from trl.experimental.gkd import GKDTrainer
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(1)
    student_logits, teacher_logits = torch.randn(2, 2, 9, 301, generator=g).unbind()
    labels = torch.randint(0, 301, (2, 9), generator=g)
    labels[0, :3] = -100
    ours = torch.where(labels != -100, jsd(student_logits, teacher_logits, beta, temperature), 0.0).sum()
    theirs = GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=beta,
                                             temperature=temperature, reduction="sum")
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    theirs_mean = GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=beta,
                                                  temperature=temperature)
    torch.testing.assert_close(ours / (labels != -100).sum(), theirs_mean, rtol=1e-6, atol=0)

    student_hidden, student_weight, teacher_hidden, teacher_weight, labels = _problem()
    mask = labels != -100
    theirs, _, count = _chunked_divergence_loss(student_hidden[None], teacher_hidden[None], student_weight,
                                                teacher_weight, mask[None], beta, num_items_in_batch=1,
                                                temperature=temperature)
    ours, our_count = linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                          beta=beta, temperature=temperature, chunk_size=32)
    torch.testing.assert_close(ours, theirs, rtol=FP32, atol=0)
    assert our_count == count == int(mask.sum())


def test_dense_divergences_are_the_kl_definitions_and_beta_switches_at_its_ends():
    """From the probabilities in float64: the forward KL ``Σ p_t log(p_t/p_s)``, the reverse ``Σ p_s log(p_s/p_t)``,
    the generalized JSD against ``m = β p_t + (1 − β) p_s``, all of ``softmax(z / T)``. ``beta`` 0 and 1 *are* the
    KLs (TRL's switch), while the generalized JSD itself goes to 0 at both ends."""
    g = torch.Generator().manual_seed(2)
    student_logits, teacher_logits = (torch.randn(2, 5, 64, generator=g) * 2).unbind()
    temperature = 1.5
    p_s = torch.softmax(student_logits.double() / temperature, -1)
    p_t = torch.softmax(teacher_logits.double() / temperature, -1)

    def kl(p, q):
        return (p * (p / q).log()).sum(-1)

    torch.testing.assert_close(forward_kl(student_logits, teacher_logits, temperature).double(), kl(p_t, p_s),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(reverse_kl(student_logits, teacher_logits, temperature).double(), kl(p_s, p_t),
                               rtol=1e-6, atol=1e-7)
    for beta in (0.5, 0.3):
        m = beta * p_t + (1 - beta) * p_s
        torch.testing.assert_close(jsd(student_logits, teacher_logits, beta, temperature).double(),
                                   beta * kl(p_t, m) + (1 - beta) * kl(p_s, m), rtol=1e-6, atol=1e-7)
    assert torch.equal(jsd(student_logits, teacher_logits, 0.0, temperature),
                       forward_kl(student_logits, teacher_logits, temperature))
    assert torch.equal(jsd(student_logits, teacher_logits, 1.0, temperature),
                       reverse_kl(student_logits, teacher_logits, temperature))
    for beta in (1e-6, 1 - 1e-6):
        assert float(jsd(student_logits, teacher_logits, beta, temperature).max()) < 1e-4
    assert float(forward_kl(student_logits, teacher_logits, temperature).min()) > 0.1


# ---- the fused loss against the dense one ------------------------------------------------------------------------
@pytest.mark.parametrize(("beta", "temperature", "chunk_size"), [
    (0.0, 1.0, 32), (0.0, 2.0, 50), (0.5, 1.0, 32), (0.3, 2.0, 50), (1.0, 1.0, 50), (1.0, 0.7, 32), (0.5, 1.0, None),
])
def test_fused_loss_and_student_gradients_equal_the_dense_computation(beta, temperature, chunk_size):
    """Chunks of 32 (not dividing the 150 tokens), 50 (dividing them) and one chunk; ignored tokens, one chunk wholly
    ignored: the sum, the count and the student's gradients (hidden states, head weight) are the dense ones, the
    incoming gradient (0.25) scaling them; a bool mask counts what the labels do."""
    problem = _problem()
    student_hidden, student_weight, *_, labels = problem
    want, want_count, (want_h, want_w) = _dense(problem, beta, temperature)
    total, count = linear_distillation(*problem, beta=beta, temperature=temperature, chunk_size=chunk_size)
    grad_h, grad_w = torch.autograd.grad(total * 0.25, (student_hidden, student_weight))
    assert total.dtype == torch.float32 and count == want_count == int((labels != -100).sum())
    torch.testing.assert_close(total, want, rtol=FP32, atol=0)
    assert relative_error(grad_h, want_h * 0.25) <= FP32
    assert relative_error(grad_w, want_w * 0.25) <= FP32
    assert not grad_h[labels == -100].any()  # an ignored token's hidden state gets nothing
    with torch.no_grad():
        by_mask, _ = linear_distillation(*problem[:4], labels != -100, beta=beta, temperature=temperature,
                                         chunk_size=chunk_size)
    assert torch.equal(by_mask, total.detach())


def test_the_teacher_gets_no_gradient_and_is_unchanged():
    """Teacher tensors that (wrongly) require gradients: none reaches them, their values stay, and the student's
    gradients are those of a teacher held constant."""
    student_hidden, student_weight, teacher_hidden, teacher_weight, labels = _problem()
    want = _dense((student_hidden, student_weight, teacher_hidden, teacher_weight, labels), 0.5)[2]
    teacher_hidden.requires_grad_()
    teacher_weight.requires_grad_()
    before = teacher_hidden.detach().clone(), teacher_weight.detach().clone()
    total, _ = linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta=0.5,
                                   chunk_size=32)
    total.backward()
    assert teacher_hidden.grad is None and teacher_weight.grad is None
    assert torch.equal(teacher_hidden, before[0]) and torch.equal(teacher_weight, before[1])
    assert relative_error(student_hidden.grad, want[0]) <= FP32
    assert relative_error(student_weight.grad, want[1]) <= FP32


def test_a_frozen_head_gets_no_gradient_and_no_grad_mode_keeps_nothing():
    """A frozen student head (LoRA's): only the hidden states' gradient is made, equal to the dense one; under
    ``no_grad`` the same value, nothing differentiable."""
    student_hidden, student_weight, teacher_hidden, teacher_weight, labels = _problem()
    want_total, _, (want_h, _) = _dense(_problem(), 1.0)
    student_weight.requires_grad_(False)
    total, _ = linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta=1.0,
                                   chunk_size=32)
    (grad_h,) = torch.autograd.grad(total, (student_hidden,))
    assert relative_error(grad_h, want_h) <= FP32
    with torch.no_grad():
        total, _ = linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                       beta=1.0, chunk_size=32)
    assert not total.requires_grad
    torch.testing.assert_close(total, want_total, rtol=FP32, atol=0)


def test_bf16_inputs_are_computed_in_fp32_within_bf16_rounding():
    """bf16 hidden states and heads: the divergence is fp32 arithmetic on the bf16 logits (so equal to the dense form
    on the same logits far below bf16's rounding), the gradients bf16, a few bf16 roundings from the dense ones; the
    whole stays within bf16's rounding of the fp32 computation on the same (upcast) values."""
    problem = _problem(torch.bfloat16)
    student_hidden, student_weight, *_ = problem
    for beta in (0.0, 0.5, 1.0):
        want, _, want_grads = _dense(problem, beta, 2.0)
        total, _ = linear_distillation(*problem, beta=beta, temperature=2.0, chunk_size=32)
        grads = torch.autograd.grad(total, (student_hidden, student_weight))
        assert total.dtype == torch.float32 and grads[0].dtype == grads[1].dtype == torch.bfloat16
        torch.testing.assert_close(total, want, rtol=1e-5, atol=0)
        # bf16 has 8 significant bits (2^-8 ≈ 4e-3 relative rounding); each chunk's product is rounded before the
        # fp32 sum, the reference rounds once.
        for got, w in zip(grads, want_grads):
            assert relative_error(got, w) <= 1e-2
        upcast = tuple(t.detach().float().requires_grad_(t.requires_grad) for t in problem[:4]) + (problem[4],)
        fp32, _, _ = _dense(upcast, beta, 2.0)
        torch.testing.assert_close(total, fp32, rtol=2e-2, atol=0)  # the logits rounded to bf16 once


def test_a_replayable_loss_gives_the_same_gradients_on_every_pass():
    """The zero-bubble pipeline schedules run the loss node's backward twice (input pass, weight pass): inside
    ``replayable_backward`` each pass gets the same gradients; outside, the second pass is refused by name."""
    problem = _problem()
    student_hidden, student_weight, *_ = problem
    want = _dense(problem, 0.5)[2]
    with replayable_backward():
        total, _ = linear_distillation(*problem, beta=0.5, chunk_size=64)
    for _ in range(2):
        grads = torch.autograd.grad(total * 0.5, (student_hidden, student_weight), retain_graph=True)
        for got, w in zip(grads, want):
            assert relative_error(got, w * 0.5) <= FP32
    total, _ = linear_distillation(*problem, beta=0.5, chunk_size=64)
    torch.autograd.grad(total, (student_hidden, student_weight), retain_graph=True)
    with pytest.raises(RuntimeError, match="linear_distillation's backward ran twice on one graph"):
        torch.autograd.grad(total, (student_hidden, student_weight))


def test_bad_arguments_are_refused():
    problem = _problem()
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\] .*got 1.5"):
        linear_distillation(*problem, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be positive, got 0"):
        linear_distillation(*problem, beta=0.5, temperature=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens or None, got 0"):
        linear_distillation(*problem, beta=0.5, chunk_size=0)
    student_hidden, student_weight, teacher_hidden, teacher_weight, labels = problem
    with pytest.raises(ValueError, match="the same vocabulary rows, got 301 and 300"):
        linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight[:300], labels, beta=0.5)
    with pytest.raises(ValueError, match=r"mask \(149,\) must have one row per token"):
        linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels[:149], beta=0.5)


# ---- vocabulary shards ---------------------------------------------------------------------------------------------
class SimulatedShards:
    """``shards`` tensor-parallel ranks as threads: each rank's ``VocabReduce`` combines every rank's statistics as the
    all-reduces do (as ``test_linear_cross_entropy.py``'s shards)."""

    def __init__(self, shards: int) -> None:
        self.barrier, self.slots = threading.Barrier(shards), [None] * shards
        self.shards = shards

    def reduce(self, rank: int) -> VocabReduce:
        def combine(op):
            def reduce_(t: torch.Tensor) -> None:
                self.slots[rank] = t.clone()
                self.barrier.wait()
                combined = op(torch.stack(self.slots))
                self.barrier.wait()
                t.copy_(combined)
            return reduce_
        return VocabReduce(max_=combine(lambda s: s.amax(0)), sum_=combine(lambda s: s.sum(0)))

    def run(self, work) -> list:
        results: list = [None] * self.shards

        def one(rank: int) -> None:
            results[rank] = work(rank)

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(self.shards)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(r is not None for r in results), "a simulated rank failed"
        return results


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tp", [2, 4])
def test_vocabulary_shards_combine_to_the_whole_vocabulary(tp, beta):
    """The vocabulary split as ``Shard(0)`` splits it over ``tp`` ranks (301 rows: uneven), both heads alike, one
    thread a rank: every rank returns the whole vocabulary's sum, the ranks' partial hidden-state gradients sum to the
    whole one (DTensor's ``Partial``) and their head-weight gradients are its rows."""
    problem = _problem()
    student_hidden, student_weight, teacher_hidden, teacher_weight, labels = problem
    want, _, (want_h, want_w) = _dense(problem, beta, 2.0)
    rows = [len(r) for r in torch.arange(student_weight.shape[0]).chunk(tp)]
    starts = [sum(rows[:r]) for r in range(tp)]
    shards = SimulatedShards(tp)

    def rank(r: int):
        local = slice(starts[r], starts[r] + rows[r])
        h = student_hidden.detach().clone().requires_grad_()
        w = student_weight.detach()[local].clone().requires_grad_()
        total, _ = linear_distillation(h, w, teacher_hidden, teacher_weight[local], labels, beta=beta,
                                       temperature=2.0, chunk_size=32, reduce=shards.reduce(r))
        return (total.detach(), *torch.autograd.grad(total, (h, w)))

    results = shards.run(rank)
    for total, _, _ in results:
        torch.testing.assert_close(total, want, rtol=FP32, atol=0)
    assert relative_error(sum(r[1] for r in results), want_h) <= FP32
    assert relative_error(torch.cat([r[2] for r in results]), want_w) <= FP32


def test_vocab_parallel_distillation_reads_the_dtensor_heads_and_refuses_a_teacher_sharded_otherwise(tmp_path):
    """``parallel.loss.vocab_parallel_linear_distillation`` on a world of one (a tensor-parallel mesh of 1): the
    DTensor heads' local rows and offsets, the value and the student's gradients of the plain op; a teacher head on
    another vocabulary is refused by name. (Tensor parallelism over ranks: the simulated shards above.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_2d.parallel.loss import vocab_parallel_linear_distillation

    problem = _problem()
    want, want_count, (want_h, want_w) = _dense(problem, 0.5)
    student_hidden, student_weight, teacher_hidden, teacher_weight, labels = problem
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        h = distribute_tensor(student_hidden.detach(), mesh, [Replicate()]).requires_grad_()
        w = distribute_tensor(student_weight.detach(), mesh, [Shard(0)]).requires_grad_()
        t_h = distribute_tensor(teacher_hidden, mesh, [Replicate()])
        t_w = distribute_tensor(teacher_weight, mesh, [Shard(0)])
        total, count = vocab_parallel_linear_distillation(h, w, t_h, t_w, labels, beta=0.5, chunk_size=32)
        total.backward()
        torch.testing.assert_close(total, want, rtol=FP32, atol=0)
        assert count == want_count
        assert relative_error(h.grad.full_tensor(), want_h) <= FP32
        assert relative_error(w.grad.full_tensor(), want_w) <= FP32
        other = distribute_tensor(torch.cat([teacher_weight, teacher_weight[:1]]), mesh, [Shard(0)])
        refused = r"the teacher's head \(vocabulary 302, rows from 0 here\) must be sharded as the student's"
        with pytest.raises(ValueError, match=refused):
            vocab_parallel_linear_distillation(h, w, t_h, other, labels, beta=0.5)
    finally:
        dist.destroy_process_group()
