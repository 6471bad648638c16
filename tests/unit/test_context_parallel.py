"""Context parallelism's pure logic, in one process: the load-balanced slices, the batch each rank gets, and the
attention of one rank's queries to every rank's keys against the attention of the whole sequence. The exchange
itself (an autograd all-gather over the context group) runs for real in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from lightning_2d.data.loading import document_positions
from lightning_2d.models.llama.model import attend
from lightning_2d.parallel.context import ContextParallelAttention, gathered_indices, local_indices, shard_sequence


def test_each_rank_holds_one_early_and_one_late_chunk_and_together_every_token_once():
    assert local_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert gathered_indices(16, 4).sort().values.tolist() == list(range(16))
    # The causal work (keys each query sees) is the same on every rank: the point of the head-tail split.
    work = [int((local_indices(64, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match=r"sequence length 12 is not a multiple of 2 × context_parallel_size \(8\)"):
        local_indices(12, 4, 0)


def test_shard_sequence_slices_tokens_labels_and_positions_alike():
    tokens = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": tokens, "labels": tokens + 100, "other": torch.ones(2)}
    part = shard_sequence(batch, 2, 1)
    assert part["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]] * 2  # global positions: the rotary embedding follows them
    assert part["other"] is batch["other"]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])  # packed documents keep their own positions
    part = shard_sequence({"input_ids": tokens[:1], "position_ids": positions}, 2, 0)
    assert part["position_ids"].tolist() == [[0, 1, 1, 2]]


class SimulatedRank(ContextParallelAttention):
    """One context rank whose all-gathers return what every simulated rank holds (no process group)."""

    def __init__(self, cp: int, rank: int, held: dict[str, list[torch.Tensor]]) -> None:
        super().__init__(group=None, cp=cp, rank=rank)  # type: ignore[arg-type]
        self.held = held

    def _gather(self, x: torch.Tensor, differentiable: bool) -> torch.Tensor:
        name = next(n for n, parts in self.held.items() if any(p is x for p in parts))
        return torch.cat(self.held[name], dim=2 if differentiable else -1)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("documents", [False, True])
def test_one_ranks_queries_against_every_ranks_keys_equal_the_whole_sequences_attention(cp, documents):
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 16, 8
    q, k, v = torch.randn(batch, heads, length, dim), torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    if documents:
        ends = torch.tensor([3, 9, 10, 15])  # documents of 4, 6, 1, 5 tokens (end-of-text ids at these indices)
        tokens = torch.zeros(batch, length, dtype=torch.long)
        tokens[:, ends] = 1
        positions = document_positions(tokens, eos_id=1)
        reference = attend(q, k, v, positions)
    else:
        positions = torch.arange(length).expand(batch, length)
        reference = attend(q, k, v, None)
    slices = [local_indices(length, cp, r) for r in range(cp)]
    held = {"k": [k[:, :, s] for s in slices], "v": [v[:, :, s] for s in slices], "pos": [positions[:, s] for s in slices]}
    for rank, s in enumerate(slices):
        core = SimulatedRank(cp, rank, held)
        out = core(q[:, :, s], held["k"][rank], held["v"][rank], held["pos"][rank])
        torch.testing.assert_close(out, reference[:, :, s], rtol=1e-6, atol=1e-6)


def test_without_positions_the_context_parallel_core_refuses():
    core = SimulatedRank(2, 0, {})
    with pytest.raises(ValueError, match="context parallelism needs each token's position_ids"):
        core(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), None)
