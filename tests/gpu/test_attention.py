"""The CUDA attention paths the CPU suite cannot run, in one process: FlexAttention block masks.

- Document masking (``TextDataModule(document_mask=True)``): on CUDA ``attend`` builds a FlexAttention block
  mask of the documents instead of the dense mask; it must give the dense path's output and gradients.
- Context parallelism: on CUDA each rank's ``ContextParallelAttention`` attends its queries to the gathered keys
  through a block mask of the global positions and documents. Here the exchange is simulated (the "all-gather"
  returns what every simulated rank holds, as tests/unit/test_context_parallel.py does on CPU): the output of
  each rank's slice must equal the whole sequence's attention. The exchange itself is the CPU suite's
  (tests/distributed/test_context_parallel.py), on gloo.
"""

from __future__ import annotations

import pytest
import torch

from lightning_2d.data.loading import document_positions
from lightning_2d.models.llama.model import attend, document_causal_mask
from lightning_2d.parallel.context import local_indices
from tests.unit.test_context_parallel import SimulatedRank

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("FlexAttention's block masks are the CUDA path (the CPU lane runs the dense one)")


def _inputs(batch: int = 2, heads: int = 8, kv_heads: int = 2, length: int = 256, dim: int = 64):
    torch.manual_seed(0)
    device = torch.device("cuda")
    q = torch.randn(batch, heads, length, dim, device=device, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, device=device, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, device=device, requires_grad=True)
    tokens = torch.zeros(batch, length, dtype=torch.long)
    tokens[:, [40, 41, 130, 200]] = 1  # documents of 41, 1, 89, 70 and 55 tokens
    return q, k, v, document_positions(tokens, eos_id=1).to(device)


def test_document_masking_with_a_block_mask_equals_the_dense_mask():
    q, k, v, positions = _inputs()
    out = attend(q, k, v, positions)  # CUDA: FlexAttention
    reps = q.shape[1] // k.shape[1]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1), attn_mask=document_causal_mask(positions)
    )
    torch.testing.assert_close(out, dense, rtol=2e-5, atol=2e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    dense_grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_block_mask_equals_the_whole_sequence(documents):
    cp = 4
    q, k, v, positions = _inputs()
    length = q.shape[2]
    if not documents:
        positions = torch.arange(length, device=q.device).expand(q.shape[0], length)
    reference = attend(q, k, v, positions if documents else None)
    slices = [local_indices(length, cp, r).to(q.device) for r in range(cp)]
    held = {"k": [k[:, :, s] for s in slices], "v": [v[:, :, s] for s in slices], "pos": [positions[:, s] for s in slices]}
    for rank, s in enumerate(slices):
        out = SimulatedRank(cp, rank, held)(q[:, :, s], held["k"][rank], held["v"][rank], held["pos"][rank])
        torch.testing.assert_close(out, reference[:, :, s], rtol=2e-5, atol=2e-5)
