"""Context parallelism's pure logic, in one process: the load-balanced slices, the batch each rank gets, and the
attention of one rank's queries to every rank's keys against the attention of the whole sequence. The exchange
itself (an autograd all-gather over the context group) runs for real in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_2d.data.loading import document_positions
from lightning_2d.ops.attention import attend, document_causal_mask, is_block_mask
from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.parallel.context import (
    ContextParallelAttention,
    gathered_indices,
    install_context_parallel,
    local_indices,
    shard_sequence,
)


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
        reference = attend(q, k, v, document_causal_mask(positions))
    else:
        positions = torch.arange(length).expand(batch, length)
        reference = attend(q, k, v, None)
    slices = [local_indices(length, cp, r) for r in range(cp)]
    held = {"k": [k[:, :, s] for s in slices], "v": [v[:, :, s] for s in slices], "pos": [positions[:, s] for s in slices]}
    for rank, s in enumerate(slices):
        core = SimulatedRank(cp, rank, held)
        out = core(q[:, :, s], held["k"][rank], held["v"][rank], core.mask(held["pos"][rank], q.dtype))
        torch.testing.assert_close(out, reference[:, :, s], rtol=1e-6, atol=1e-6)


def test_without_positions_the_context_parallel_core_refuses():
    core = SimulatedRank(2, 0, {})
    with pytest.raises(ValueError, match="context parallelism needs each token's position_ids"):
        core(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), None)
    with pytest.raises(ValueError, match="context parallelism needs each token's position_ids"):
        core.mask(None)


class ThreadRank(ContextParallelAttention):
    """One context rank of ``cp`` run as threads of this process: the exchanges meet on a shared board (all-gather:
    every rank's tensor; ring shift: the previous rank's), so the whole group runs forward and backward for real."""

    def __init__(self, cp: int, rank: int, board: dict, exchange: str, flex: bool | None = None) -> None:
        super().__init__(group=None, cp=cp, rank=rank, exchange=exchange, flex=flex)  # type: ignore[arg-type]
        self.board = board

    def _meet(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.board["slots"], self.board["barrier"]
        slots[self.rank] = x
        barrier.wait()
        seen = list(slots)
        barrier.wait()
        return seen

    def _gather(self, x: torch.Tensor, differentiable: bool) -> torch.Tensor:
        if differentiable:  # the gradient of each rank's copy summed back to its owner: the sum over the ranks
            return _ThreadGather.apply(x, self)
        return torch.cat(self._meet(x), dim=-1)

    def shift(self, x: torch.Tensor, tag: int = 0):  # noqa: ANN201
        received = self._meet(x)[(self.rank - 1) % self.cp].clone()
        return lambda: received


class _ThreadGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, core):  # noqa: ANN001, ANN205
        ctx.core = core
        return torch.cat(core._meet(x), dim=2)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        core = ctx.core
        total = torch.stack(core._meet(grad)).sum(0)
        return total.chunk(core.cp, dim=2)[core.rank].clone(), None


@pytest.mark.parametrize("exchange", ["all_gather", "ring"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_each_exchange_gives_the_whole_sequences_attention_and_gradients(exchange, cp, documents):
    """Every rank of the group at once (threads), forward and backward: the outputs and the gradients of the
    queries, keys and values each rank holds equal those of one attention over the whole sequence. The ring merges
    ``cp`` blocks by their log-sum-exp and sends each key block's gradient back round the ring to its owner."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 32, 8
    q, k, v = (torch.randn(batch, h, length, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    if documents:
        tokens = torch.zeros(batch, length, dtype=torch.long)
        tokens[:, [3, 9, 10, 20]] = 1  # documents of 4, 6, 1, 10 and 11 tokens
        positions = document_positions(tokens, eos_id=1)
        reference = attend(q, k, v, document_causal_mask(positions))
    else:
        positions = torch.arange(length).expand(batch, length)
        reference = attend(q, k, v, None)
    grad = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, (q, k, v), grad)

    def rank_main(rank: int, board: dict) -> tuple:
        s = local_indices(length, cp, rank)
        mine = [t.detach()[:, :, s].clone().requires_grad_() for t in (q, k, v)]
        core = ThreadRank(cp, rank, board, exchange)
        out = core(*mine, core.mask(positions[:, s], q.dtype))
        out.backward(grad[:, :, s])
        return (s, out.detach(), *(t.grad for t in mine))

    results = run_thread_ranks(cp, rank_main)
    got = [torch.empty_like(t) for t in (reference, q, k, v)]
    for s, *tensors in results.values():
        for whole, part in zip(got, tensors):
            whole[:, :, s] = part
    for name, value, want in zip(("output", "dq", "dk", "dv"), got, (reference.detach(), *expected)):
        torch.testing.assert_close(value, want, rtol=1e-5, atol=2e-6, msg=name)


def test_an_unknown_exchange_is_refused():
    with pytest.raises(ValueError, match=r"exchange 'tree' is not one of \('all_gather', 'ring'\)"):
        ContextParallelAttention(group=None, cp=2, rank=0, exchange="tree")  # type: ignore[arg-type]


def run_thread_ranks(cp: int, rank_main) -> dict:  # noqa: ANN001
    """``rank_main(rank, board)`` for every rank of ``cp`` at once, as threads meeting on one board
    (``ThreadRank``); their results by rank. A failing rank aborts the board so the others do not wait."""
    import threading

    board = {"slots": [None] * cp, "barrier": threading.Barrier(cp, timeout=120)}
    results, failures = {}, []

    def main(rank: int) -> None:
        try:
            results[rank] = rank_main(rank, board)
        except BaseException as error:
            board["barrier"].abort()
            failures.append(error)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results


def blocks_of(mask: torch.Tensor, size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ``size × size`` block of a ``(B, Q, K)`` boolean mask: whether any / every query sees its key."""
    tiles = mask.unflatten(1, (-1, size)).unflatten(3, (-1, size))  # (B, Q/size, size, K/size, size)
    return tiles.any(4).any(2), tiles.all(4).all(2)


def check_block_mask(block_mask, dense: torch.Tensor) -> None:  # noqa: ANN001
    """``block_mask``'s block tables (what the CUDA kernel reads to skip or fully compute a block) against the dense
    ``(B, Q, K)`` mask: the blocks it visits are those with any visible key, its full blocks those with all."""
    some, every = blocks_of(dense)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), some)
    assert torch.equal(block_mask.full_kv_num_blocks[:, 0], every.sum(-1).int())
    assert torch.equal(block_mask.kv_num_blocks[:, 0] + block_mask.full_kv_num_blocks[:, 0], some.sum(-1).int())


#: torch warns on every eager FlexAttention call; on CPU eager is what runs (ops.attention: compiled on CUDA only).
EAGER_FLEX = "ignore:flex_attention called without torch.compile"


@pytest.mark.filterwarnings(EAGER_FLEX)
@pytest.mark.parametrize("cp, documents", [(2, False), (2, True), (4, True)],
                         ids=["causal-2", "documents-2", "documents-4"])
def test_the_flex_block_mask_path_gives_the_dense_paths_and_the_rings_output(cp, documents):
    """The CUDA code path on CPU (``flex=True``: block masks, FlexAttention; forward only, torch has no FlexAttention
    backward on CPU): every rank's queries of its load-balanced slices (head-tail chunks), against the gathered keys
    at their own heads (grouped-query attention, H 4 / H_kv 2), equal the whole sequence's attention, the dense
    all-gather and the ring on the same ranks; its block tables are the dense mask's, and skip blocks."""
    torch.manual_seed(0)
    # 512 tokens: at cp 2 chunks of 128 (FlexAttention's block), so causal blocks are skipped; at cp 4 each query
    # block holds an early and a late chunk, and blocks are skipped across documents.
    batch, heads, kv_heads, length, dim = 2, 4, 2, 512, 16
    q, k, v = (torch.randn(batch, h, length, dim) for h in (heads, kv_heads, kv_heads))
    if documents:
        tokens = torch.zeros(batch, length, dtype=torch.long)
        tokens[0, [50, 130, 131, 300, 400]] = 1  # documents across and inside 128-token blocks
        tokens[1, [255, 260]] = 1
        positions = document_positions(tokens, eos_id=1)
    else:
        positions = torch.arange(length).expand(batch, length)
    whole = document_causal_mask(positions)
    reference = attend(q, k, v, whole)

    def rank_main(rank: int, board: dict) -> dict:
        mine = local_indices(length, cp, rank)
        held, pos = [t[:, :, mine] for t in (q, k, v)], positions[:, mine]
        outs = {}
        with torch.no_grad():
            for name, exchange, flex in (("flex", "all_gather", True), ("dense", "all_gather", False),
                                         ("ring", "ring", False)):
                core = ThreadRank(cp, rank, board, exchange, flex=flex)
                mask = core.mask(pos, q.dtype)
                if flex:
                    check_block_mask(mask, whole[:, 0][:, mine][:, :, gathered_indices(length, cp)])
                    outs["skipped"] = int(mask.to_dense().numel() - mask.to_dense().sum())
                outs[name] = core(*held, mask)
        outs["reference"] = reference[:, :, mine]
        return outs

    results = run_thread_ranks(cp, rank_main)
    worst = {other: max(float((r["flex"] - r[other]).abs().max()) for r in results.values())
             for other in ("reference", "dense", "ring")}
    kind = "documents" if documents else "causal"
    print(f"\nflex context-parallel forward (cp {cp}, {kind}): max |flex - x| {worst}")
    for r in results.values():
        for other in ("reference", "dense", "ring"):
            torch.testing.assert_close(r["flex"], r[other], rtol=1e-5, atol=2e-6, msg=other)
    assert sum(r["skipped"] for r in results.values()) > 0  # blocks no query sees are not visited


def test_the_ring_takes_no_block_mask():
    with pytest.raises(ValueError, match="the ring exchange .* takes no FlexAttention block mask"):
        ContextParallelAttention(group=None, cp=2, rank=0, exchange="ring", flex=True)  # type: ignore[arg-type]


def count_masks(model: Any) -> tuple[list, list]:
    """Record every mask the model builds and the mask every layer's attention core receives."""
    builds, seen = [], []
    builder = model.build_attention_mask

    def build(position_ids: torch.Tensor, dtype: Any = None) -> Any:
        mask = builder(position_ids, dtype)
        builds.append(mask)
        return mask

    model.build_attention_mask = build
    for layer in model.layers.values():
        core = layer.attention.attend

        def attend_recording(q, k, v, mask, core=core):  # noqa: ANN001, ANN202
            seen.append(mask)
            return core(q, k, v, mask)

        layer.attention.attend = attend_recording
    return builds, seen


@pytest.mark.filterwarnings(EAGER_FLEX)
@pytest.mark.parametrize("flex", [False, True], ids=["dense", "block"])
def test_a_context_parallel_model_builds_one_mask_per_forward_for_all_its_layers(flex):
    """A 4-layer model with packed documents on 2 context ranks (threads): ``install_context_parallel`` makes the core's
    ``mask`` the model's builder, so each rank gathers the positions and builds its mask once per forward (dense, or
    CUDA's block mask, forced), the same object in every layer; each rank's logits equal the whole model's at its
    tokens."""
    import copy

    args, cp, length = PRESETS["debug"], 2, 128
    model = Transformer(args)
    model.init_weights(0)
    tokens = torch.randint(2, args.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    tokens[0, [30, 70, 71]] = 1
    tokens[1, [100]] = 1
    positions = document_positions(tokens, eos_id=1)
    with torch.no_grad():
        reference = model(tokens, position_ids=positions)

    def rank_main(rank: int, board: dict) -> tuple:
        replica = copy.deepcopy(model)
        core = ThreadRank(cp, rank, board, "all_gather", flex=flex)
        assert install_context_parallel(replica, core, "layers.*.attention") == args.n_layers
        assert replica.build_attention_mask == core.mask
        builds, seen = count_masks(replica)
        part = shard_sequence({"input_ids": tokens, "position_ids": positions}, cp, rank)
        with torch.no_grad():
            logits = [replica(part["input_ids"], position_ids=part["position_ids"]) for _ in range(2)]
        return logits[-1], builds, seen

    for rank, (logits, builds, seen) in run_thread_ranks(cp, rank_main).items():
        assert len(builds) == 2, f"rank {rank}: {len(builds)} masks built in 2 forwards of {args.n_layers} layers"
        assert len(seen) == 2 * args.n_layers and all(m is builds[1] for m in seen[args.n_layers:])
        assert is_block_mask(builds[1]) == flex
        torch.testing.assert_close(logits, reference[:, local_indices(length, cp, rank)], rtol=1e-5, atol=1e-5)


def test_a_model_that_builds_no_mask_is_refused():
    class OnlyAttention(torch.nn.Module):
        attend = staticmethod(attend)

    model = torch.nn.Sequential(OnlyAttention())
    with pytest.raises(ValueError, match="no module of Sequential with a `build_attention_mask`"):
        install_context_parallel(model, ContextParallelAttention(None, 2, 0), "0")  # type: ignore[arg-type]
