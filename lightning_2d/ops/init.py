"""Layout-independent, seeded parameter initialization.

A sharded parameter must get the same values whatever the ``(dp, tp)`` layout, so that a run
on 8 GPUs and a run on one device start from the same weights. Drawing from a global RNG cannot
give that: every rank would draw its shard from its own stream position. Instead each parameter
is cut into fixed *row blocks* that depend only on its global shape, and every block is drawn
from its own generator, seeded from ``(seed, parameter name, block index)``. A rank that holds
rows ``[r0, r1)`` of a parameter draws only the blocks that overlap them and keeps the part it
owns, so:

* the values at a global index never depend on who holds it (layout independence), and
* a rank draws about ``1 / (number of row shards)`` of each parameter, with at most
  ``BLOCK_NUMEL`` extra elements in memory at a time (no full-size temporary for a
  128k × 16k embedding).

This module is pure ``torch``: the model uses it for its single-device ``init_weights`` and
``lightning_2d.parallel.materialize`` uses it for DTensor shards, which is what makes the two
agree bit for bit.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

#: Elements drawn per block (rows are grouped until a block reaches about this size). Part of the
#: definition of the initial weights: changing it changes every seeded initialization.
BLOCK_NUMEL = 1 << 20


@dataclass(frozen=True)
class InitSpec:
    """How one parameter is initialized.

    Args:
        kind: ``"normal"``, ``"trunc_normal"`` (truncated at ``mean ± truncation · std``), ``"uniform"``
            (``U(-bound, bound)``) or ``"constant"``.
        std: Standard deviation for the random kinds.
        mean: Mean for the random kinds.
        value: The fill value for ``"constant"``.
        truncation: Cut-off in standard deviations for ``"trunc_normal"``.
        bound: The half-width of ``"uniform"``.
    """

    kind: Literal["normal", "trunc_normal", "uniform", "constant"]
    std: float = 1.0
    mean: float = 0.0
    value: float = 0.0
    truncation: float = 3.0
    bound: float = 1.0


def _name_key(seed: int, name: str) -> int:
    """A stable 63-bit key for ``(seed, name)`` (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_block(shape: Sequence[int]) -> int:
    """Number of dim-0 rows drawn together for a tensor of ``shape`` (depends on the shape only)."""
    if len(shape) == 0:
        return 1
    row_numel = math.prod(shape[1:])
    return max(1, BLOCK_NUMEL // max(1, row_numel))


def _draw(spec: InitSpec, shape: Sequence[int], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    if spec.kind == "normal":
        out.normal_(spec.mean, spec.std, generator=generator)
    elif spec.kind == "trunc_normal":
        cut = spec.truncation * spec.std
        torch.nn.init.trunc_normal_(
            out, mean=spec.mean, std=spec.std, a=spec.mean - cut, b=spec.mean + cut, generator=generator
        )
    elif spec.kind == "uniform":
        out.uniform_(-spec.bound, spec.bound, generator=generator)
    else:  # pragma: no cover - constants never reach here, see fill_block_
        raise ValueError(f"unknown random init kind {spec.kind!r}")
    return out


@torch.no_grad()
def fill_block_(
    out: torch.Tensor,
    spec: InitSpec,
    *,
    seed: int,
    name: str,
    global_shape: Sequence[int],
    offset: Sequence[int] | None = None,
) -> torch.Tensor:
    """Fill ``out`` with its part of the seeded initialization of a ``global_shape`` parameter.

    Args:
        out: The local tensor to write: the block ``offset[d] : offset[d] + out.shape[d]`` of the
            full parameter in every dimension ``d``. Any floating dtype; values are drawn in fp32.
        spec: How the parameter is initialized.
        seed: The run's initialization seed.
        name: The parameter's canonical name (``layers.0.attention.wq.weight``); part of the seed.
        global_shape: Shape of the full (unsharded) parameter.
        offset: Where ``out`` starts in the full parameter; ``None`` for the whole tensor.
    """
    global_shape = tuple(global_shape)
    offset = tuple(offset) if offset is not None else (0,) * len(global_shape)
    if len(offset) != len(global_shape) or out.dim() != len(global_shape):
        raise ValueError(
            f"{name}: local block of shape {tuple(out.shape)} at offset {offset} does not match a parameter of"
            f" shape {global_shape}"
        )
    if out.numel() == 0:
        return out
    if spec.kind == "constant":
        return out.fill_(spec.value)
    if len(global_shape) == 0:
        generator = torch.Generator(device=out.device).manual_seed(_name_key(seed, name))
        return out.copy_(_draw(spec, (), generator, out.device))

    per_block = rows_per_block(global_shape)
    row_start, row_stop = offset[0], offset[0] + out.shape[0]
    # Trailing dims: keep only the columns this rank owns.
    trailing = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    base_key = _name_key(seed, name)
    generator = torch.Generator(device=out.device)
    for block in range(row_start // per_block, (row_stop - 1) // per_block + 1):
        block_start = block * per_block
        block_rows = min(per_block, global_shape[0] - block_start)
        # Each block has its own stream; mixing the block index into the seed keeps streams apart.
        generator.manual_seed((base_key + block * 0x9E3779B97F4A7C15) & ((1 << 63) - 1))
        values = _draw(spec, (block_rows, *global_shape[1:]), generator, out.device)
        lo, hi = max(row_start, block_start), min(row_stop, block_start + block_rows)
        out[lo - row_start : hi - row_start].copy_(values[(slice(lo - block_start, hi - block_start), *trailing)])
    return out


class SeededInit:
    """The seeded initialization of a model's parameters as a source of blocks (see ``fill_block_``)."""

    def __init__(self, specs: dict[str, InitSpec], seed: int) -> None:
        self.specs, self.seed = specs, seed

    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: Sequence[int], offset: Sequence[int] | None
    ) -> None:
        if name not in self.specs:
            raise KeyError(f"no InitSpec for parameter {name!r}")
        fill_block_(out, self.specs[name], seed=self.seed, name=name, global_shape=global_shape, offset=offset)


def module_init_specs(model: "torch.nn.Module") -> dict[str, InitSpec]:
    """``{qualified name: InitSpec}`` of the parameters that submodules initialize themselves: a module defining
    ``own_param_init_specs()`` (names relative to it; ``ops.lora.LoRALinear``'s adapters) added to a model whose
    own init (its ``param_init_specs``, an ``init_from`` checkpoint) knows nothing of them."""
    specs: dict[str, InitSpec] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "own_param_init_specs", None)
        if callable(own):
            specs.update({f"{prefix}.{name}" if prefix else name: spec for name, spec in own().items()})
    return specs


class WithOwnInit:
    """A weight source that fills the parameters of ``specs`` by their seeded init and every other one from
    ``base`` (another source with ``fill_block_``: an ``init_from`` checkpoint without adapters, say).

    Args:
        base: The source of every other parameter.
        specs: ``{name: InitSpec}``, by the names the source is asked for.
        seed: The init seed.
    """

    def __init__(self, base: object, specs: dict[str, InitSpec], seed: int) -> None:
        self.base, self.own = base, SeededInit(dict(specs), seed)

    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: Sequence[int], offset: Sequence[int] | None
    ) -> None:
        covers = getattr(self.base, "covers", None)  # a base that has them (LoRA adapters from a folder) gives them
        own = name in self.own.specs and not (callable(covers) and covers(name))
        (self.own if own else self.base).fill_block_(out, name, global_shape, offset)  # type: ignore[attr-defined]
