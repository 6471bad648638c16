"""Llama 2 / Llama 3 transformer.

Plain PyTorch, no ``torch.distributed``: parallelism is applied from outside
(``lightning_2d.parallel``) by module name, so the names follow Meta's reference implementation
(``tok_embeddings``, ``layers.N.attention.wq`` …) and its checkpoints map onto this model.

Tensor parallelism shards ``wq/wk/wv`` by output features, so inside a tensor-parallel rank the
attention sees ``n_heads / tp`` heads. The forward pass infers the local head count from the
tensor shapes instead of trusting ``n_heads``, which is why the model needs no edit to run
sharded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_2d.errors import Lightning2DError
# document_causal_mask: re-exported, where it was defined before the attention core moved to ops.
from lightning_2d.ops.attention import AttentionMask, attend, attention_mask, document_causal_mask  # noqa: F401
from lightning_2d.ops.init import InitSpec, SeededInit, module_init_specs
from lightning_2d.ops.linear_cross_entropy import check_labels, linear_cross_entropy, linear_log_probs
from lightning_2d.ops.feed_forward import SwiGLU
from lightning_2d.ops.moe import MoE, MoEArgs, MoEConfigError, RouterStats, is_sparse_block


#: The rotary scalings ``rope_table`` implements (``RopeScaling.rope_type``).
ROPE_SCALING_TYPES = ("llama3",)


class ModelArgsError(Lightning2DError, ValueError):
    """Model hyper-parameters that cannot build a model (an unknown preset or field, a bad rotary scaling); lists
    every problem."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Meta's ``apply_scaling``; ``rope_type: "llama3"`` in Hugging Face).

    Rotary frequencies whose wavelength is longer than ``original_max_position_embeddings / low_freq_factor``
    positions are divided by ``factor``, those shorter than ``original_max_position_embeddings / high_freq_factor``
    are kept, and those between are interpolated smoothly: a model pre-trained at the original length then reads
    sequences ``factor`` times longer. The defaults are Llama 3.1's.

    Args:
        rope_type: The kind of scaling; ``"llama3"`` only (``ROPE_SCALING_TYPES``).
        factor: What the low frequencies are divided by (at least 1).
        low_freq_factor: Frequencies with wavelengths over ``original_max_position_embeddings / low_freq_factor``
            are divided by ``factor`` (positive).
        high_freq_factor: Frequencies with wavelengths under ``original_max_position_embeddings / high_freq_factor``
            are kept (greater than ``low_freq_factor``).
        original_max_position_embeddings: The context length of pre-training before the scaling (positive).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if problems := rope_scaling_problems({f.name: getattr(self, f.name) for f in fields(self)}):
            raise ModelArgsError("Invalid rope_scaling:\n  - " + "\n  - ".join(problems))

    def scale(self, freqs: torch.Tensor) -> torch.Tensor:
        """The scaled rotary frequencies (radians per position), elementwise: no data-dependent control flow,
        so on the meta device nothing is computed. The same operations, in the same order, as Hugging Face's
        ``_compute_llama3_parameters`` (so the same fp32 values)."""
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_freq_wavelen, freqs / self.factor, freqs)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        between = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(between, smoothed, scaled)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rope_scaling_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the fields of a ``RopeScaling`` given as a dict (empty: nothing), each problem naming
    the field, its value and what is accepted; a missing field takes its default."""
    known = [f.name for f in fields(RopeScaling)]
    problems = [
        f"rope_scaling has no field {key!r}; its fields are {', '.join(known)}" for key in values if key not in known
    ]
    rope_type = values.get("rope_type", RopeScaling.rope_type)
    if rope_type not in ROPE_SCALING_TYPES:
        problems.append(
            f"rope_scaling.rope_type {rope_type!r} is not supported; supported: "
            + ", ".join(repr(t) for t in ROPE_SCALING_TYPES) + " (or rope_scaling None: no scaling)"
        )
    factor = values.get("factor", RopeScaling.factor)
    if not (_is_number(factor) and factor >= 1):
        problems.append(f"rope_scaling.factor must be a number of at least 1, got {factor!r}")
    low = values.get("low_freq_factor", RopeScaling.low_freq_factor)
    high = values.get("high_freq_factor", RopeScaling.high_freq_factor)
    if not (_is_number(low) and low > 0):
        problems.append(f"rope_scaling.low_freq_factor must be a positive number, got {low!r}")
    if not _is_number(high):
        problems.append(f"rope_scaling.high_freq_factor must be a number, got {high!r}")
    elif _is_number(low) and high <= low:
        problems.append(
            f"rope_scaling.high_freq_factor ({high!r}) must be greater than low_freq_factor ({low!r}): the"
            " frequencies between the two wavelengths are interpolated"
        )
    original = values.get("original_max_position_embeddings", RopeScaling.original_max_position_embeddings)
    if not (isinstance(original, int) and not isinstance(original, bool) and original > 0):
        problems.append(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {original!r}")
    return problems


@dataclass
class ModelArgs:
    """Shape of a Llama model. Field names follow Meta's ``ModelArgs``.

    Args:
        dim: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads.
        n_kv_heads: Number of key/value heads (grouped-query attention); ``None`` means ``n_heads``.
        vocab_size: Number of token ids.
        multiple_of: The SwiGLU hidden size is rounded up to a multiple of this.
        ffn_dim_multiplier: Optional factor on the SwiGLU hidden size (Llama 2 70B, Llama 3).
        norm_eps: Epsilon of RMSNorm.
        rope_theta: Base period of the rotary position embedding.
        max_seq_len: Longest sequence the rotary table covers.
        depth_init: Scale the init of each block's output projections by its depth
            (``0.02 / sqrt(2 · (layer_id + 1))``, as torchtitan) instead of by the model depth.
        hidden_dim: The SwiGLU hidden size itself, instead of deriving it from ``multiple_of`` and
            ``ffn_dim_multiplier`` (for imported models).
        rope_scaling: Scaling of the rotary frequencies (Llama 3.1's): a ``RopeScaling`` or the dict of its
            fields (``{"rope_type": "llama3", "factor": 8.0, ...}``, as from yaml or JSON, kept as a
            ``RopeScaling``); ``None``: no scaling.
        tie_word_embeddings: One weight serves the token embedding and the output head (Llama 3.2 1B/3B): the
            ``output.weight`` *is* ``tok_embeddings.weight``, its gradient the sum of both uses.
        moe: Mixture-of-experts feed-forward layers (``lightning_2d.ops.moe.MoEArgs`` or the dict of its fields):
            the blocks ``moe_layer_step`` and ``dense_layers`` pick have a router and routed experts instead of
            the dense SwiGLU; ``None``: every block dense.
        moe_layer_step: Every ``moe_layer_step``-th block is a mixture of experts (blocks ``step-1, 2·step-1, …``:
            Qwen3-MoE's ``decoder_sparse_step``); 1: every block.
        dense_layers: Blocks that stay dense whatever ``moe_layer_step`` says (Qwen3-MoE's ``mlp_only_layers``).
        head_size: Each attention head's size when it is not ``dim / n_heads`` (Qwen3: 128 at ``dim`` 2048 with 32
            heads; Hugging Face's ``head_dim``); ``None``: ``dim / n_heads``.
        qk_norm: Normalize each query and key head (an RMSNorm over the head's features, one weight shared by the
            heads) before the rotary embedding, as Qwen3 does (``q_norm``/``k_norm``).

    Raises:
        ModelArgsError: Fields that do not hold together (every problem in one message); ``from_name``: an unknown
            preset or field. A ``Lightning2DError`` and a ``ValueError``.

    Example:
        ```python
        from lightning_2d import ModelArgs

        args = ModelArgs.from_name("llama3-8b", max_seq_len=16384)  # a preset, fields changed
        small = ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=32000)
        small.num_params()
        ```
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    depth_init: bool = True
    hidden_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    moe: MoEArgs | None = None
    moe_layer_step: int = 1
    dense_layers: list[int] = field(default_factory=list)
    head_size: int | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.moe, Mapping):  # a dict from yaml/JSON, or asdict() of these args (checkpoints)
            try:
                self.moe = MoEArgs(**self.moe)
            except (MoEConfigError, TypeError) as err:
                problems.append(f"moe: {err}")
        elif self.moe is not None and not isinstance(self.moe, MoEArgs):
            problems.append(f"moe must be None, a MoEArgs or the dict of its fields, got {self.moe!r}")
        if not isinstance(self.moe_layer_step, int) or self.moe_layer_step < 1:
            problems.append(f"moe_layer_step must be a positive integer, got {self.moe_layer_step!r}")
        self.dense_layers = list(self.dense_layers)  # a list: what yaml, JSON and asdict() give back
        if bad := [i for i in self.dense_layers if not isinstance(i, int) or not 0 <= i < max(self.n_layers, 1)]:
            problems.append(f"dense_layers must be block indices in [0, {self.n_layers}), got {bad}")
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.n_kv_heads is not None and self.n_kv_heads < 1:
            problems.append(f"n_kv_heads must be a positive integer or None, got {self.n_kv_heads}")
        if self.head_size is not None and (not isinstance(self.head_size, int) or self.head_size < 1):
            problems.append(f"head_size must be a positive integer or None, got {self.head_size!r}")
        elif self.dim > 0 and self.n_heads > 0:
            if self.head_size is None and self.dim % self.n_heads:
                problems.append(f"n_heads ({self.n_heads}) must divide dim ({self.dim}), or give head_size")
            elif self.head_dim % 2:
                problems.append(f"the head size dim / n_heads ({self.head_dim}) must be even for rotary embeddings")
            if self.kv_heads > 0 and self.n_heads % self.kv_heads:
                problems.append(f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})")
        if isinstance(self.rope_scaling, Mapping):
            # A dict from yaml/JSON, or asdict() of these args (checkpoints store them so).
            if scaling_problems := rope_scaling_problems(self.rope_scaling):
                problems.extend(scaling_problems)
            else:
                self.rope_scaling = RopeScaling(**self.rope_scaling)
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            problems.append(
                f"rope_scaling must be None, a RopeScaling or the dict of its fields, got {self.rope_scaling!r}"
            )
        if problems:
            raise ModelArgsError("Invalid ModelArgs:\n  - " + "\n  - ".join(problems))

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` is a mixture of experts (Qwen3-MoE's rule: ``moe``, not among
        ``dense_layers``, and ``(layer_id + 1) % moe_layer_step == 0``)."""
        return self.moe is not None and is_sparse_block(layer_id, self.moe_layer_step, self.dense_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the mixture-of-experts blocks."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads, with ``None`` resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Each attention head's size: ``head_size``, else ``dim / n_heads``."""
        return self.head_size if self.head_size is not None else self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, computed as in Meta's reference (``4·dim · 2/3``, scaled, rounded up)."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelArgs:
        """A published configuration by name (see ``PRESETS``), with fields optionally overridden."""
        if name not in PRESETS:
            raise ModelArgsError(f"Unknown model name {name!r}. Known names: {', '.join(PRESETS)}")
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ModelArgsError(f"Unknown ModelArgs fields {sorted(unknown)}; fields are {[f.name for f in fields(cls)]}")
        return replace(PRESETS[name], **overrides)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Number of parameters of a ``Transformer`` with these args; ``active``: those one token goes through (a
        mixture-of-experts block counts its router, ``top_k`` routed and its shared experts), what the FLOPs are
        counted on."""
        d, q_dim, kv_dim, h = self.dim, self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn_hidden_dim
        attention_and_norms = d * (2 * q_dim + 2 * kv_dim) + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        sparse = len(self.moe_layers)
        feed_forward = (self.n_layers - sparse) * 3 * d * h
        if sparse:
            assert self.moe is not None
            feed_forward += sparse * self.moe.num_params(d, active=active)
        embedding = self.vocab_size * d
        total = embedding * (1 if self.tie_word_embeddings else 2) + self.n_layers * attention_and_norms + feed_forward + d
        # A tied weight is also the output head's matmul: it stays in the count without the embedding.
        return total - embedding if exclude_embedding and not self.tie_word_embeddings else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), torchtitan's convention.

        ``6 · N`` for the matmuls over the parameters except the embedding (a lookup), plus
        ``12 · L · H · Dh · T`` for the attention scores and their weighted sums at sequence length ``T``. A
        mixture of experts counts its active parameters (``num_params(active=True)``), as torchtitan.
        """
        return 6 * self.num_params(exclude_embedding=True, active=True) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


#: Published shapes. ``debug`` is ours: a model that trains on CPU in seconds and still has
#: grouped-query attention and shapes divisible by tensor-parallel sizes 1, 2 and 4.
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=32, max_seq_len=512,
        rope_theta=10000.0,
    ),
    "llama2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256, max_seq_len=4096),
    "llama2-13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256, max_seq_len=4096),
    "llama2-70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, multiple_of=4096,
        ffn_dim_multiplier=1.3, max_seq_len=4096,
    ),
    "llama3-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3-70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3-405b": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.2, rope_theta=500000.0, max_seq_len=8192,
    ),
}
# Mixtures of experts. ``debug-moe`` is ours, ``debug``'s shape with 8 routed experts (top 2) and a shared one in
# blocks 1-3 and a dense block 0 (as DeepSeek's first blocks): every path of the layer, trained on CPU in seconds.
PRESETS["debug-moe"] = replace(
    PRESETS["debug"], moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=64, num_shared_experts=1, aux_loss_coef=0.01),
    dense_layers=[0],
)
# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1's config.json): 46.7 B parameters, 12.9 B active per token.
PRESETS["mixtral-8x7b"] = ModelArgs(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, hidden_dim=14336, rope_theta=1e6,
    max_seq_len=32768, moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=14336, aux_loss_coef=0.02),
)
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json): 128 experts, 8 per token, per-head q/k norms and a head size of
# 128 at width 2048; 30.5 B parameters, 3.3 B active per token.
PRESETS["qwen3-30b-a3b"] = ModelArgs(
    dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_size=128, qk_norm=True, vocab_size=151936,
    hidden_dim=6144, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
    moe=MoEArgs(num_experts=128, top_k=8, hidden_dim=768, aux_loss_coef=0.001),
)
# Llama 3.1: the Llama 3 shapes, 128K tokens of context through the scaled rotary frequencies. The rotary table
# is then 131072 rows (64 MiB in fp32 at head size 128); the planner builds it on the meta device.
_LLAMA31_SCALING = RopeScaling(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
PRESETS["llama3.1-8b"] = replace(PRESETS["llama3-8b"], max_seq_len=131072, rope_scaling=_LLAMA31_SCALING)
PRESETS["llama3.1-70b"] = replace(PRESETS["llama3-70b"], max_seq_len=131072, rope_scaling=_LLAMA31_SCALING)
PRESETS["llama3.1-405b"] = replace(PRESETS["llama3-405b"], max_seq_len=131072, rope_scaling=_LLAMA31_SCALING)
# Llama 3.2's small models: tied embeddings, the rotary scaling of 3.1 with factor 32.
_LLAMA32_SCALING = replace(_LLAMA31_SCALING, factor=32.0)
PRESETS["llama3.2-1b"] = ModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.5,
    rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA32_SCALING, tie_word_embeddings=True,
)
PRESETS["llama3.2-3b"] = ModelArgs(
    dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.0,
    rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA32_SCALING, tie_word_embeddings=True,
)


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The rotary frequencies (radians per position) of the ``head_dim // 2`` pairs, in fp32, scaled if
    ``scaling`` is given (Hugging Face's ``inv_freq``)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    return freqs if scaling is None else scaling.scale(freqs)


def rope_table(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """Cosines and sines of the rotary angles: ``(max_seq_len, head_dim // 2, 2)`` in fp32.

    Equal to Meta's complex ``freqs_cis`` (stored as real pairs so that dtype conversions of the
    module never drop its imaginary part), with Llama 3.1's frequency scaling if ``scaling`` is given.
    Built on the meta device (``device`` or the default device), it allocates nothing.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device=device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of ``x: (B, T, H, Dh)`` by ``rope: (T, Dh/2, 2)``, or by
    ``rope: (B, T, Dh/2, 2)`` (each sequence's own positions: packed documents)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, Dh/2, 2)
    real, imag = pairs.unbind(-1)
    cos, sin = rope[..., None, :, 0], rope[..., None, :, 1]  # ([B,] T, 1, Dh/2) broadcast over B and H
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 whatever the parameter dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    ``attend(q, k, v, mask)`` is the attention core (``lightning_2d.ops.attention.attend``), ``mask`` what the model's
    ``build_attention_mask`` built once for the batch; context parallelism replaces both on the instances with ones
    that exchange keys and values across ranks (``lightning_2d.parallel.context``).
    """

    attend = staticmethod(attend)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3's per-head norms (their weight's features in our interleaved rotary order, as wq's rows).
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds n_heads / tp of them.
        xq = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, Hq, Dh)
        xk = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, Hkv, Dh)
        xv = self.wv(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, Hkv, Dh)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, rope), apply_rotary_emb(xk, rope)

        q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H, T, Dh), (B, H_kv, T, Dh)
        out = self.attend(q, k, v, mask)  # (B, H, T, Dh)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, T, dim)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        # A mixture-of-experts block keeps the name: the norms, checkpoints and plans address `feed_forward`.
        self.feed_forward: nn.Module = (MoE(args.dim, args.moe) if args.moe is not None and args.is_moe_layer(layer_id)
                                        else SwiGLU(args.dim, args.ffn_hidden_dim))
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        # The mask by keyword: the tensor-parallel plan's input layouts cover (x, rope) only.
        if mask is None:
            h = x + self.attention(self.attention_norm(x), rope)
        else:
            h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class VocabProjection(nn.Linear):
    """The output head: logits, or with ``labels`` the summed cross-entropy without full logits.

    ``linear_cross_entropy`` is the function that computes the loss from ``(hidden, weight, labels)``;
    under tensor parallelism ``lightning_2d.parallel`` replaces it on the instance with its
    vocabulary-parallel form (the weight then holds a slice of the vocabulary).

    Args:
        dim: Width of the hidden states.
        vocab_size: Number of token ids.
        loss_chunk_size: Tokens per chunk of the fused loss (``None``: sized by memory, ``auto_chunk_tokens``).
    """

    linear_cross_entropy = staticmethod(linear_cross_entropy)
    #: Each token's log-probability of its label (``lightning_2d.ops.linear_log_probs``), replaced like
    #: ``linear_cross_entropy`` under tensor parallelism.
    linear_log_probs = staticmethod(linear_log_probs)

    def __init__(self, dim: int, vocab_size: int, loss_chunk_size: int | None = None) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.loss_chunk_size = loss_chunk_size

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, per_token: bool = False) -> torch.Tensor:
        if labels is None:
            return super().forward(x)  # (B, T, vocab_size)
        hidden = x.flatten(0, -2)  # (B·T, dim)
        if per_token:  # (B, T): each token's log-probability of its label, 0 where ignored
            return self.linear_log_probs(hidden, self.weight, labels.flatten(),
                                         chunk_size=self.loss_chunk_size).view(labels.shape)
        return self.linear_cross_entropy(hidden, self.weight, labels.flatten(), chunk_size=self.loss_chunk_size)


class Transformer(nn.Module):
    """The Llama decoder: ``tokens (B, T) -> logits (B, T, vocab_size)`` in fp32, or the loss.

    ``model(tokens, labels=labels)`` returns the *summed* next-token cross-entropy over the targets
    that are not ``-100``, computed by the output head a chunk of ``loss_chunk_size`` tokens at a
    time so the ``(B, T, vocab_size)`` logits never exist (see ``lightning_2d.ops.linear_cross_entropy``).

    Build it on the meta device (``with torch.device("meta"): Transformer(args)``) and materialize it
    with ``to_empty(device=...)`` followed by ``init_weights(seed)``, or let the parallel strategy do
    the materialization shard by shard (same values, see ``lightning_2d.ops.init``).

    With ``position_ids`` the forward builds the attention mask once (``build_attention_mask(position_ids, dtype)``,
    a replaceable attribute like ``Attention.attend``: context parallelism installs its own) and every layer uses it.

    Args:
        args: The shape.
        loss_chunk_size: Tokens per chunk of the fused output-projection + cross-entropy (``None``: sized by
            memory, ``lightning_2d.ops.linear_cross_entropy.auto_chunk_tokens``).

    Example:
        ```python
        import torch
        from lightning_2d import ModelArgs, Transformer

        with torch.device("meta"):
            model = Transformer(ModelArgs.from_name("debug"))
        model.to_empty(device="cpu")
        model.init_weights(seed=0)  # the values every parallel layout gets from seed 0
        tokens = torch.randint(0, model.args.vocab_size, (2, 64))
        logits = model(tokens)                       # (2, 64, vocab_size), fp32
        loss_sum = model(tokens[:, :-1], labels=tokens[:, 1:])  # summed cross-entropy, no logits materialized
        ```
    """

    #: ``(position_ids, dtype) -> mask`` of one batch for every layer's ``attend`` (``ops.attention.attention_mask``:
    #: a FlexAttention block mask on CUDA, the dense mask elsewhere).
    build_attention_mask = staticmethod(attention_mask)

    def __init__(self, args: ModelArgs, loss_chunk_size: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0", "1", … keeps Meta's names and lets a block be swapped for a
        # wrapped one (activation checkpointing, compile) in place.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = VocabProjection(args.dim, args.vocab_size, loss_chunk_size)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two modules
        # Not persistent: derived from args, so checkpoints do not carry it.
        self.register_buffer("rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta,
                                                scaling=args.rope_scaling), persistent=False)

    def check_inputs(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> None:
        """Refuse a sequence longer than ``max_seq_len``, and labels or positions of another shape or range."""
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"Sequence length {tokens.shape[1]} exceeds max_seq_len ({self.args.max_seq_len}); raise max_seq_len"
                " or use shorter sequences"
            )
        if labels is not None:
            if labels.shape != tokens.shape:
                raise ValueError(f"labels {tuple(labels.shape)} must have the shape of the tokens {tuple(tokens.shape)}")
            check_labels(labels, self.args.vocab_size)
        if position_ids is not None and position_ids.shape != tokens.shape:
            raise ValueError(
                f"position_ids {tuple(position_ids.shape)} must have the shape of the tokens {tuple(tokens.shape)}"
            )

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """Logits, or with ``labels`` the summed loss (``per_token=True``: each token's log-probability of its label,
        ``(B, T)`` fp32, 0 where ignored); with ``position_ids`` (each token's position in its document,
        ``lightning_2d.data.document_positions``) the packed documents are kept apart: rotary positions restart at
        each document and attention stays within it."""
        self.check_inputs(tokens, labels, position_ids)
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        if position_ids is None:
            rope = self.rope[: tokens.shape[1]]
            for layer in self.layers.values():
                h = layer(h, rope)
        else:
            rope = self.rope[position_ids]  # (B, T, Dh/2, 2): each document from position 0
            mask = self.build_attention_mask(position_ids, h.dtype)  # once: every layer attends under it
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        h = self.norm(h)
        if labels is None:
            return self.output(h).float()  # (B, T, vocab_size), fp32 for a stable loss
        return self.output(h, labels=labels, per_token=per_token)  # 0-dim fp32: the summed cross-entropy

    def param_init_specs(self) -> dict[str, InitSpec]:
        """How each parameter (by canonical name) is initialized; the init follows torchtitan."""
        args = self.args
        specs: dict[str, InitSpec] = {"tok_embeddings.weight": InitSpec("normal", std=1.0)}
        for i in range(args.n_layers):
            out_std = 0.02 / math.sqrt(2 * ((i + 1) if args.depth_init else args.n_layers))
            prefix = f"layers.{i}."
            for name in ("attention.wq", "attention.wk", "attention.wv"):
                specs[prefix + name + ".weight"] = InitSpec("trunc_normal", std=0.02)
            specs[prefix + "attention.wo.weight"] = InitSpec("trunc_normal", std=out_std)
            if args.is_moe_layer(i):  # torchtitan's MoE init: router and gates 0.02, up and down by depth
                specs[prefix + "feed_forward.router.weight"] = InitSpec("trunc_normal", std=0.02)
                # The routed experts' stacked tensors (``experts.w1`` …), the shared experts' Linears (``….weight``).
                names = ["feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3"]
                if args.moe is not None and args.moe.shared_dim:
                    names += [f"feed_forward.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
                for name in names:
                    gate = name.endswith("w1") or name.endswith("w1.weight")
                    specs[prefix + name] = InitSpec("trunc_normal", std=0.02 if gate else out_std)
            else:
                specs[prefix + "feed_forward.w1.weight"] = InitSpec("trunc_normal", std=0.02)
                for name in ("feed_forward.w2", "feed_forward.w3"):
                    specs[prefix + name + ".weight"] = InitSpec("trunc_normal", std=out_std)
            for name in ("attention_norm", "ffn_norm") + (("attention.q_norm", "attention.k_norm") if args.qk_norm else ()):
                specs[prefix + name + ".weight"] = InitSpec("constant", value=1.0)
        specs["norm.weight"] = InitSpec("constant", value=1.0)
        specs["output.weight"] = InitSpec("trunc_normal", std=args.dim**-0.5)
        if args.tie_word_embeddings:  # the shared weight starts as the head would: logits of the untied scale
            specs["tok_embeddings.weight"] = specs.pop("output.weight")
        specs.update(module_init_specs(self))  # adapters (``ops.lora``), if any: their own init
        return specs

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts feed-forward layers, in block order (those of this rank's pipeline stages)."""
        return [layer.feed_forward for layer in self.layers.values() if isinstance(layer.feed_forward, MoE)]

    def router_stats(self) -> list[RouterStats]:
        """The last forward's routing statistics of every mixture-of-experts layer (what load balancing reads)."""
        return [moe.last_stats for moe in self.moe_layers() if moe.last_stats is not None]

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the rotary table in fp32, e.g. after ``to_empty``; zero the experts' balancing bias."""
        device = device if device is not None else self.rope.device
        args = self.args
        self.rope = rope_table(
            args.head_dim, args.max_seq_len, args.rope_theta, device=device, scaling=args.rope_scaling
        )
        for moe in self.moe_layers():
            moe.reset_buffers(device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter from ``seed`` (the values a sharded model gets too)."""
        self.load_blocks(SeededInit(self.param_init_specs(), seed))

    @torch.no_grad()
    def load_blocks(self, source: Any) -> None:
        """Fill every (unsharded) parameter from ``source.fill_block_(out, name, shape, offset)``."""
        for name, param in self.named_parameters():
            source.fill_block_(param, name, tuple(param.shape), None)
        self.init_buffers()
