"""Expert parallelism's token exchange: each rank of an expert-parallel group holds ``E / EP`` of a layer's experts,
and the tokens routed to an expert travel to its rank and back (torchtitan's all-to-all dispatcher, dropless).

``ExpertExchange(group, num_experts)`` is what an ``ops.moe.MoE`` layer calls instead of running all its experts
itself (``MoE.expert_exchange``; the layer knows nothing of ``torch.distributed``). With this rank's assignments
sorted by expert (``ops.moe.dispatch``) and their counts per expert:

1. **Counts first**: one ``all_to_all_single`` of the ``E`` counts, so each rank learns how many tokens every rank
   sends to each of its local experts (and the split sizes of the token exchange).
2. **Tokens**: a differentiable ``all_to_all_single`` with those uneven splits (zero allowed) sends each rank's
   tokens to their experts' ranks. They arrive grouped by source rank, then local expert; a fixed permutation
   groups them by local expert for ``GroupedExperts`` (one grouped matrix product over the local experts).
3. **Back**: the inverse permutation and the reverse ``all_to_all_single`` return each output to where its token
   came from, in the order it left. The backward pass runs the same exchanges in reverse.

Every permutation and split follows from the counts alone: the same on every run, whatever the routing, an expert
or a whole rank receiving nothing included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class ExpertExchange:
    """Send tokens to the ranks of their experts and the outputs back, over ``group``.

    Args:
        group: The expert-parallel process group (``EP`` ranks; rank ``r`` holds experts ``r·E/EP … (r+1)·E/EP − 1``).
        num_experts: The layer's experts ``E``; ``EP`` must divide it.
    """

    def __init__(self, group: "ProcessGroup", num_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs a number of experts divisible by {self.size}, got"
                f" {num_experts}; use an expert_parallel_size that divides {num_experts}"
            )
        self.num_experts = num_experts
        self.local_experts = num_experts // self.size

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local_experts

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The experts' outputs for ``tokens`` (this rank's assignments sorted by global expert, ``counts`` per
        expert), computed on the ranks that hold the experts; ``experts(local_tokens, local_counts)`` runs this rank's
        experts on what it received, grouped by local expert."""
        size, local = self.size, self.local_experts
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # equal splits: `local` counts per rank
        send_splits = counts.view(size, local).sum(dim=1).tolist()
        by_source = received_counts.view(size, local)  # [source rank, local expert]
        receive_splits = by_source.sum(dim=1).tolist()
        received = all_to_all_single(tokens.new_empty(sum(receive_splits), tokens.shape[-1]), tokens,
                                     receive_splits, send_splits, group=self.group)
        grouped = _by_expert_order(by_source)
        out = experts(received[grouped], by_source.sum(dim=0))
        back = torch.empty_like(out).index_copy_(0, grouped, out)  # source-rank order again
        return all_to_all_single(out.new_empty(tokens.shape[0], out.shape[-1]), back, send_splits, receive_splits,
                                 group=self.group)


def _by_expert_order(by_source: torch.Tensor) -> torch.Tensor:
    """The permutation that takes received tokens from (source rank, local expert) order to (local expert, source
    rank) order: ``received[perm]`` is grouped by local expert. ``by_source``: counts ``[source, expert]``."""
    sources, experts = by_source.shape
    starts = torch.cumsum(by_source.reshape(-1), dim=0) - by_source.reshape(-1)  # where each (source, expert) run starts
    starts, lengths = starts.view(sources, experts).t().reshape(-1), by_source.t().reshape(-1)
    if int(lengths.sum()) == 0:
        return torch.zeros(0, dtype=torch.long, device=by_source.device)
    return torch.cat([torch.arange(int(s), int(s) + int(n), device=by_source.device)
                      for s, n in zip(starts.tolist(), lengths.tolist())])


__all__ = ["ExpertExchange"]
