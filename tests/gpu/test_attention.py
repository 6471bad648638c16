"""The CUDA attention paths the CPU suite cannot run, in one process: FlexAttention block masks, forward and backward.

torch has no FlexAttention backward on CPU; the CPU suite checks the block-mask forward against the dense path
(tests/unit/test_attention.py, tests/unit/test_context_parallel.py). Here, on CUDA:

- Document masking (``TextDataModule(document_mask=True)``): the model builds one FlexAttention block mask per batch
  (``ops.attention.attention_mask``) and every layer attends under it through the process's one compiled FlexAttention;
  the output and the gradients of ``q``, ``k``, ``v`` equal dense SDPA's, and so do a whole model's parameter gradients.
- Compiled once: ``torch.compile`` wraps FlexAttention (and ``create_block_mask``) once for the process, whatever the
  path and the number of layers and forwards, and torch never warns that FlexAttention ran unfused.
- Context parallelism (all-gather): each rank's ``ContextParallelAttention`` attends its queries to the gathered keys
  under a block mask of the global positions and documents. The exchange is simulated in one process (the
  "all-gather" returns what every simulated rank holds, as tests/unit/test_context_parallel.py does on CPU): every
  rank's output equals the whole sequence's attention, and the gradients summed over the ranks equal its gradients.
  The exchange itself is the CPU suite's (tests/distributed/test_context_parallel.py), on gloo.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

from lightning_2d.data.loading import document_positions
from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.ops import attention as ops_attention
from lightning_2d.ops.attention import attend, attention_mask, document_causal_mask
from lightning_2d.parallel.context import local_indices
from tests.unit.test_context_parallel import SimulatedRank

pytestmark = pytest.mark.gpu

#: torch's warning when FlexAttention runs uncompiled (the unfused path that materializes the scores).
UNFUSED = "without torch.compile"


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("FlexAttention's block masks are the CUDA path (the CPU lane runs the dense one)")


def _inputs(batch: int = 2, heads: int = 8, kv_heads: int = 2, length: int = 512, dim: int = 64):
    torch.manual_seed(0)
    device = torch.device("cuda")
    q = torch.randn(batch, heads, length, dim, device=device, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, device=device, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, device=device, requires_grad=True)
    tokens = torch.zeros(batch, length, dtype=torch.long)
    tokens[:, [40, 41, 130, 300]] = 1  # documents of 41, 1, 89, 170 and 211 tokens, across 128-token blocks
    return q, k, v, document_positions(tokens, eos_id=1).to(device)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    reps = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1), attn_mask=document_causal_mask(positions)
    )


def test_document_masking_with_a_block_mask_equals_the_dense_mask(report):
    q, k, v, positions = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mask = attention_mask(positions)  # CUDA: a block mask, built by the compiled create_block_mask
        assert ops_attention.is_block_mask(mask)
        out = attend(q, k, v, mask)  # the compiled FlexAttention, grouped-query heads not repeated
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert not [w for w in caught if UNFUSED in str(w.message)], [str(w.message) for w in caught]
    dense = _dense(q, k, v, positions)
    dense_grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    report.check("flex_document_forward_max_abs", float((out - dense).abs().max()), 2e-5)
    torch.testing.assert_close(out, dense, rtol=2e-5, atol=2e-5)
    for name, got, want in zip("qkv", grads, dense_grads):
        report.check(f"flex_document_grad_{name}_max_abs", float((got - want).abs().max()), 1e-4)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_model_with_documents_trains_like_the_dense_mask_and_compiles_flex_once(monkeypatch, report):
    """A 4-layer model, two forward/backward passes and a second model: one ``torch.compile`` of FlexAttention and
    one of ``create_block_mask`` for the process; the block-mask model's loss and gradients equal the dense one's."""
    compiled: list[Any] = []
    real_compile = torch.compile

    def counting_compile(fn: Any, *args: Any, **kwargs: Any) -> Any:
        compiled.append(getattr(fn, "__name__", fn))
        return real_compile(fn, *args, **kwargs)

    monkeypatch.setattr(ops_attention, "_compiled", {})
    monkeypatch.setattr(torch, "compile", counting_compile)
    args = PRESETS["debug"]
    device = torch.device("cuda")
    tokens = torch.randint(2, args.vocab_size, (2, 512), generator=torch.Generator().manual_seed(0))
    tokens[:, [60, 200, 201, 400]] = 1
    positions = document_positions(tokens, eos_id=1).to(device)
    tokens, labels = tokens.to(device), tokens.roll(-1, 1).to(device)

    def loss_and_grads(flex: bool, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = Transformer(args).to(device)
        model.init_weights(seed)
        model.build_attention_mask = functools.partial(attention_mask, flex=flex)
        for _ in range(2):
            model.zero_grad()
            loss = model(tokens, labels=labels, position_ids=positions)
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {(flex, seed): loss_and_grads(flex, seed) for flex in (True, False) for seed in (0, 1)}
    assert not [w for w in caught if UNFUSED in str(w.message)], [str(w.message) for w in caught]
    ours = [name for name in compiled if name in ("flex_attention", "create_block_mask")]
    assert sorted(ours) == ["create_block_mask", "flex_attention"], compiled
    assert ops_attention.flex_attention_for(device) is ops_attention.compiled_flex_attention()
    for seed in (0, 1):
        (loss, grads), (dense_loss, dense_grads) = runs[True, seed], runs[False, seed]
        torch.testing.assert_close(loss, dense_loss, rtol=1e-4, atol=1e-4)
        worst = max(float((g - d).abs().max()) for g, d in zip(grads, dense_grads))
        report.check(f"flex_model_grad_max_abs_seed{seed}", worst, 1e-4)
        for got, want in zip(grads, dense_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_block_mask_forward_and_backward_equal_the_whole_sequence(documents, report):
    cp = 2
    q, k, v, positions = _inputs(length=1024)
    length = q.shape[2]
    if not documents:
        positions = torch.arange(length, device=q.device).expand(q.shape[0], length)
    reference = attend(q, k, v, document_causal_mask(positions) if documents else None)
    grad = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    slices = [local_indices(length, cp, r).to(q.device) for r in range(cp)]
    held = {"k": [k[:, :, s] for s in slices], "v": [v[:, :, s] for s in slices], "pos": [positions[:, s] for s in slices]}
    total = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank, s in enumerate(slices):
            core = SimulatedRank(cp, rank, held)
            mask = core.mask(held["pos"][rank], q.dtype)
            assert ops_attention.is_block_mask(mask)
            out = core(q[:, :, s], held["k"][rank], held["v"][rank], mask)
            report.check(f"flex_cp_forward_max_abs_rank{rank}_{'documents' if documents else 'causal'}",
                         float((out - reference[:, :, s]).abs().max()), 2e-5)
            torch.testing.assert_close(out, reference[:, :, s], rtol=2e-5, atol=2e-5)
            total = total + (out * grad[:, :, s]).sum()
        grads = torch.autograd.grad(total, (q, k, v))  # each rank's gathered keys flow back to their owner
    assert not [w for w in caught if UNFUSED in str(w.message)], [str(w.message) for w in caught]
    for name, got, want in zip("qkv", grads, expected):
        report.check(f"flex_cp_grad_{name}_max_abs_{'documents' if documents else 'causal'}",
                     float((got - want).abs().max()), 1e-4)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
