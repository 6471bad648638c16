"""The feed-forward every block family takes: ``SwiGLU``, a dense block's MLP (``models.llama``) and a mixture of
experts' shared experts (``ops.moe``). Pure torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP, ``w2(silu(w1 x) · w3 x)``: a dense block's feed-forward (``models.llama``) and a mixture of
    experts' shared experts (``ops.moe``). The names ``w1``/``w2``/``w3`` are Meta's (checkpoints and plans use them).

    Args:
        dim: The model width.
        hidden_dim: The hidden size.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


__all__ = ["SwiGLU"]
