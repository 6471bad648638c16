"""Context parallelism: each rank of the ``context_parallel`` mesh dimension holds a slice of every sequence.

**Load balance.** A sequence of ``T`` tokens is cut into ``2 · cp`` chunks; context rank ``r`` holds chunks ``r``
and ``2·cp - 1 - r`` (head-tail). Under causal attention a query's cost grows with its position, so every rank
gets one early and one late chunk: the same work on each (a rank holding the last quarter would do 7/16 of it).

**Exchange: all-gather of keys and values** (as Llama 3's training, "The Llama 3 Herd of Models" §3.3.2), picked by
measurement against a ring. Each attention layer all-gathers the ``(B, H_kv, T/cp, Dh)`` keys and values of the
context group (autograd: the backward reduce-scatters their gradients to the ranks that computed them), and
attends its local queries to all keys under a mask from the tokens' *global* indices: any mask (documents, not only
causal) in one attention call, on gloo as on NCCL, so the CPU tests exercise the very code the GPU runs (on CUDA the
mask is a FlexAttention block mask, attended through the process's compiled FlexAttention, ``ops.attention``). The
cost: the gathered keys and values of a layer, ``2 · B · H_kv · T · Dh`` elements, live until its backward (``≈ 1/(2·cp·H/H_kv)`` of the activations that CP divides by ``cp``).

The alternative, ``exchange="ring"`` (``_RingAttention``): each rank passes its key/value block to the next while it
attends to the one it holds, ``cp`` blocks merged by their log-sum-exp (online softmax), the gradients sent back
round the ring; it moves the same bytes (with grouped-query attention ``H_kv / H`` of the queries, 1/4 in Llama 3
8B) and never holds the whole sequence's keys. Measured side by side (``tests/benchmarks/bench_context.py
--exchanges all_gather ring``, CPU, seq 8192): the same activations within 5 % (the gathered keys are small), and
step times within the noise of 2 shared cores (three runs: the ring −14 % to +45 %), while the ring needs ``cp``
masked block calls and ``cp - 1`` dependent transfers per layer, each way. torch's
own ring (``torch.distributed.tensor.experimental.context_parallel``) runs only CUDA SDPA kernels or FlexAttention
and takes no masks. The ring stays for that comparison (and as the design to revisit if keys ever dominate), tested
against the all-gather in every context-parallel job; the strategies install the all-gather.

**Positions and the mask.** ``shard_sequence`` gives every rank its tokens, labels and ``position_ids`` (the global
positions of its tokens, or each packed document's positions under ``document_mask``): the model's rotary embedding
follows them unchanged. The mask is built once per forward (per micro-batch under a pipeline) by the model's
``build_attention_mask``, which ``apply_context_parallel`` replaces with ``ContextParallelAttention.mask``: one
all-gather of the positions, the documents derived from them (a document starts where a position is 0), and every
layer's core attends under that one mask. The loss, token counts and gradients then need nothing else: the loss group
is data × context (``data_context_parallel``), and FSDP shards over data-shard × context, as torchtitan.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F

from lightning_2d._compat import cpu_flash_attention, cpu_flash_attention_backward
from lightning_2d.ops.attention import AttentionMask, create_block_mask_for, flex_attention_for, is_block_mask
from lightning_2d.parallel.meshes import as_meshes
from lightning_2d.parallel.names import CP_DIM

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


#: How the context group exchanges keys and values (``ContextParallelAttention(exchange=...)``).
EXCHANGES = ("all_gather", "ring")


@functools.lru_cache(maxsize=64)
def _chunk_indices(seq_len: int, cp: int) -> tuple[torch.Tensor, ...]:
    chunk = seq_len // (2 * cp)
    return tuple(
        torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)])
        for r in range(cp)
    )


def local_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global indices of the tokens context rank ``rank`` holds: chunks ``rank`` and ``2·cp - 1 - rank`` of
    ``2·cp`` (``seq_len`` must be a multiple of ``2·cp``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 × context_parallel_size ({2 * cp})")
    return _chunk_indices(seq_len, cp)[rank]


def gathered_indices(seq_len: int, cp: int) -> torch.Tensor:
    """The global index of each position of an all-gather over the context group (rank 0's tokens first)."""
    return torch.cat(_chunk_indices(seq_len, cp))


def shard_sequence(
    batch: dict[str, torch.Tensor], cp: int, rank: int,
    keys: tuple[str, ...] = ("input_ids", "labels", "position_ids", "sequence_ids", "sequence_numbers",
                            "reference_logps", "distillation_mask"),
) -> dict[str, torch.Tensor]:
    """This context rank's slice of a batch of ``(B, T)`` tensors, with ``position_ids`` (the global positions of
    its tokens, unless the batch carries its documents' positions); ``sequence_ids`` (which sequence of a packed
    window each position belongs to: preference pairs) and ``distillation_mask`` (the positions a teacher distils,
    marked on whole rows) are sliced alike. Other entries are kept as they are."""
    seq_len = batch["input_ids"].shape[1]
    index = local_indices(seq_len, cp, rank).to(batch["input_ids"].device)
    out = dict(batch)
    if "position_ids" not in batch:
        out["position_ids"] = torch.arange(seq_len, device=index.device).expand_as(batch["input_ids"])
    for key in keys:
        if key in out:
            out[key] = out[key].index_select(1, index)
    return out


class ContextParallelAttention:
    """The attention of one context-parallel rank, in two parts that ``apply_context_parallel`` installs in a model:
    ``mask(position_ids, dtype)`` (the model's ``build_attention_mask``: once per forward) and ``__call__(q, k, v,
    mask)`` (every layer's ``Attention.attend``). ``q: (B, H, T/cp, Dh)``, ``k``/``v``: ``(B, H_kv, T/cp, Dh)``,
    ``position_ids``: ``(B, T/cp)`` from ``shard_sequence``; the output has ``q``'s shape.

    Args:
        group: The context-parallel process group.
        cp: Its size.
        rank: This rank's index in it.
        exchange: ``"all_gather"`` (what the strategies install) or ``"ring"`` (``_RingAttention``, CPU kernels).
        flex: Build FlexAttention block masks (``True``) or dense additive ones (``False``); ``None``: block masks on
            CUDA. The ring takes dense masks only.
    """

    def __init__(
        self, group: "ProcessGroup", cp: int, rank: int, exchange: str = "all_gather", flex: Optional[bool] = None
    ) -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"context-parallel exchange {exchange!r} is not one of {EXCHANGES}")
        if exchange == "ring" and flex:
            raise ValueError("the ring exchange attends block by block with CPU SDPA kernels: it takes no FlexAttention"
                             " block mask (flex=True); use exchange='all_gather'")
        self.group, self.cp, self.rank, self.exchange, self.flex = group, cp, rank, exchange, flex

    def _gather(self, x: torch.Tensor, differentiable: bool) -> torch.Tensor:
        """Every context rank's ``x`` concatenated along the sequence (dim 2 of heads, the last of positions), in
        rank order; ``differentiable``: its backward sums each rank's gradient of the copy back to its owner."""
        if differentiable:
            return _GatherSequence.apply(x, self.group, self.cp, self.rank)
        return torch.cat(_all_gather(x, self.group, self.cp), dim=-1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        if mask is None:
            raise ValueError("context parallelism needs each token's position_ids (lightning_2d.parallel.context."
                             "shard_sequence), from which the model builds the mask (ContextParallelAttention.mask)")
        if self.exchange == "ring":
            if q.is_cuda:
                raise NotImplementedError("the ring exchange runs CPU SDPA kernels; on CUDA use exchange='all_gather'")
            blocks, rows = mask
            return _RingAttention.apply(q, k, v, blocks, rows, self)
        keys, values = self._gather(k, True), self._gather(v, True)  # (B, H_kv, T, Dh), in gathered order
        if is_block_mask(mask):  # FlexAttention, compiled on CUDA: the blocks no query may see are skipped
            return flex_attention_for(q.device)(q, keys, values, block_mask=mask, enable_gqa=True)
        if mask.dtype != q.dtype:  # built in the activations' dtype; only an autocast region computes q in another
            mask = mask.to(q.dtype)
        # enable_gqa: the key/value heads are not repeated to the query heads (saved for backward at H_kv heads).
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def mask(self, position_ids: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> AttentionMask:
        """The mask of this rank's queries against the gathered keys, for every layer of one forward (one all-gather
        of integers): a FlexAttention block mask (``flex``; default on CUDA), or ``(B, 1, T/cp, T)`` additive in
        ``dtype`` (the activations': SDPA would convert a boolean mask into a new one in every layer); for the ring,
        that additive mask cut into its ``cp`` blocks, ``(cp, B, 1, T/cp, T/cp)`` (block ``j``: the keys rank ``j``
        holds), with which rows of each block see any key, ``(cp, B, 1, T/cp, 1)``."""
        if position_ids is None:
            raise ValueError("context parallelism needs each token's position_ids (lightning_2d.parallel.context."
                             "shard_sequence)")
        local_len = position_ids.shape[-1]
        seq_len = local_len * self.cp
        mine, order, query_document, key_document = self.layout(position_ids, seq_len)
        if position_ids.is_cuda if self.flex is None else self.flex:
            def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (order[kv_idx] <= mine[q_idx]) & (key_document[b, kv_idx] == query_document[b, q_idx])

            return create_block_mask_for(position_ids.device)(visible, position_ids.shape[0], None, local_len, seq_len,
                                     device=position_ids.device)
        visible = (order[None, :] <= mine[:, None]) & (query_document[:, :, None] == key_document[:, None, :])
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        mask = torch.zeros(visible.shape, dtype=dtype, device=position_ids.device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None]
        if self.exchange == "ring":  # the gathered order is rank after rank
            blocks = torch.stack(mask.chunk(self.cp, dim=-1))
            return blocks, (blocks > float("-inf")).any(-1, keepdim=True)
        return mask

    def shift(self, x: torch.Tensor, tag: int = 0) -> Callable[[], torch.Tensor]:
        """Start sending ``x`` to the next context rank and receiving the previous one's (a ring step); the
        returned call waits for both and gives what was received (compute in between overlaps the transfer).
        Transfers in flight together carry different ``tag``s."""
        import torch.distributed as dist

        received = torch.empty_like(x)
        peer = functools.partial(dist.get_global_rank, self.group)
        ops = [dist.P2POp(dist.isend, x.contiguous(), peer((self.rank + 1) % self.cp), self.group, tag),
               dist.P2POp(dist.irecv, received, peer((self.rank - 1) % self.cp), self.group, tag)]
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return wait

    def layout(self, position_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
        """The global indices of this rank's queries ``(T/cp,)`` and of the gathered keys ``(T,)``, and the document
        of each ``(B, T/cp)``, ``(B, T)``: a query sees a key not later in the sequence, in its own document (one
        starts where a position is 0)."""
        device = position_ids.device
        order = gathered_indices(seq_len, self.cp).to(device)
        mine = local_indices(seq_len, self.cp, self.rank).to(device)
        positions = torch.empty(position_ids.shape[0], seq_len, dtype=position_ids.dtype, device=device)
        positions[:, order] = self._gather(position_ids, False)  # every rank's positions, in sequence order
        document = (positions == 0).cumsum(-1)  # (B, T)
        return mine, order, document[:, mine], document[:, order]


def _all_gather(x: torch.Tensor, group: "ProcessGroup", size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries to every rank's keys, the keys and values passed round the context group
    (each rank sends its block to the next and attends to the one it receives, ``cp`` blocks in all), the blocks'
    outputs merged by their log-sum-exp (online softmax). Backward passes the keys and values round again with
    their gradients, which arrive back at their owner after ``cp`` steps. Saves only the local ``q, k, v``, the
    output and its log-sum-exp: no rank ever holds the whole sequence's keys. CPU SDPA kernels (``_compat``)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor,
                core: ContextParallelAttention) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        kv = torch.stack([k, v])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(core.cp):
            source = (core.rank - step) % core.cp
            arriving = core.shift(kv) if step < core.cp - 1 else None  # the next block, sent while this one runs
            block_out, block_lse = cpu_flash_attention(q, kv[0], kv[1], blocks[source], scale)
            block_lse = block_lse.masked_fill(~rows[source].squeeze(-1), float("-inf"))  # rows that saw no key
            merged = torch.logaddexp(lse, block_lse)
            safe = merged.masked_fill(merged == float("-inf"), 0.0)
            out = out * (lse - safe).exp()[..., None] + block_out.float() * (block_lse - safe).exp()[..., None]
            lse = merged
            if arriving is not None:
                kv = arriving()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, blocks)
        ctx.core, ctx.scale = core, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, blocks = ctx.saved_tensors
        core = ctx.core
        grad = grad.contiguous()
        kv = torch.stack([k, v])
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with the block it belongs to
        for step in range(core.cp):
            source = (core.rank - step) % core.cp
            arriving = core.shift(kv) if step < core.cp - 1 else None
            dq, dk, dv = cpu_flash_attention_backward(grad, q, kv[0], kv[1], out, lse, blocks[source], ctx.scale)
            grad_q += dq
            grad_kv += torch.stack([dk, dv])
            grad_kv = core.shift(grad_kv, tag=1)()  # after cp shifts, each block's gradient is back at its owner
            if arriving is not None:
                kv = arriving()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather of ``(B, H, T/cp, Dh)`` over the context group along the sequence; backward: reduce-scatter.

    Not ``torch.distributed.nn.functional.all_gather``: on gloo its backward scatters from each *group* rank
    as if it were a global rank ("Global rank 0 is not part of group", torch 2.13), so it fails in any
    subgroup. gloo has no reduce-scatter: there the gradient is all-reduced and each rank keeps its slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: "ProcessGroup", size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank = group, size, rank
        return torch.cat(_all_gather(x, group, size), dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        import torch.distributed as dist

        chunks = [c.contiguous() for c in grad.chunk(ctx.size, dim=2)]
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(out, chunks, group=ctx.group)
            return out, None, None, None
        total = torch.cat(chunks, dim=2)  # contiguous, rank after rank
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None, None, None


def apply_context_parallel(model: torch.nn.Module, cp_mesh: Any, attention: str, exchange: str = "all_gather") -> int:
    """Install the context-parallel attention of this rank of ``cp_mesh`` in ``model`` (``install_context_parallel``);
    returns how many attention modules got it."""
    core = ContextParallelAttention(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), exchange)
    return install_context_parallel(model, core, attention)


def install_context_parallel(model: torch.nn.Module, core: ContextParallelAttention, attention: str) -> int:
    """Make ``core`` the ``attend`` of every module of ``model`` whose name matches ``attention`` (``fnmatch``
    pattern, e.g. ``"layers.*.attention"``) and ``core.mask`` the ``build_attention_mask`` of every module that builds
    the masks (the model: once per forward, or per micro-batch in a pipeline stage); returns how many attention
    modules."""
    from fnmatch import fnmatch

    count = 0
    for name, module in model.named_modules():
        if fnmatch(name, attention) and hasattr(module, "attend"):
            module.attend = core
            count += 1
    if count == 0:
        raise ValueError(
            f"context parallelism found no attention module named like {attention!r} with an `attend` method in"
            f" {type(model).__name__}; the model's plan must name them (ParallelPlan.attention)"
        )
    builders = [module for module in model.modules() if hasattr(module, "build_attention_mask")]
    if not builders:
        raise ValueError(
            f"context parallelism found no module of {type(model).__name__} with a `build_attention_mask`: the model"
            " must build each batch's attention mask with it once per forward (as lightning_2d.Transformer does) and"
            " pass it to its attention modules' `attend`"
        )
    for module in builders:
        module.build_attention_mask = core.mask
    return count


def context_shard(batch: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """``batch`` as this rank holds it under ``mesh`` (``ParallelMeshes``, ``strategy.device_mesh`` or ``None``): its
    context rank's slice (``shard_sequence``) under context parallelism, else unchanged. What a training step calls
    first, under the Trainer (``CausalLMModule``) and in a Fabric loop alike."""
    meshes = as_meshes(mesh)
    cp_mesh = meshes.optional(CP_DIM) if meshes is not None else None
    if cp_mesh is None:
        return batch
    return shard_sequence(batch, cp_mesh.size(), cp_mesh.get_local_rank())
