"""Hugging Face directories read into a (sharded) model block by block, as a ``WeightSource``: each rank
reads only the rows and columns of the shards it holds, as memory-mapped safetensors slices
(``SafetensorsWeights``; ``HFWeights`` maps our Llama's names onto a Hugging Face Llama's and permutes the
RoPE rows back).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.checkpoint.hf.layout import (
    INDEX_FILE,
    SINGLE_FILE,
    expert_hf_name,
    expert_name,
    fused_expert_name,
    hf_name,
    hf_to_meta,
    model_args_from_hf,
    rotary_heads,
    same_shapes,
)
from lightning_2d.models.llama.model import ModelArgs, Transformer


class SafetensorsWeights:
    """Reads a directory of safetensors (``model.safetensors`` or shards + index) block by block, as a
    ``WeightSource``: each rank reads only the rows and columns of the shards it holds (memory-mapped
    slices), so loading a 70B directory into a sharded model never holds more than a block.

    Names are the stored names (a Hugging Face model's own); ``HFWeights`` maps ours onto them.

    Args:
        directory: The directory.
        expected: Name → shape of every parameter that will be read; when given, missing weights and
            shape mismatches are refused here, all listed, before anything is allocated.
    """

    def __init__(self, directory: Path, expected: Optional[Mapping[str, tuple[int, ...]]] = None) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.files = {k: self.directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.directory / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(self.directory / SINGLE_FILE, framework="pt") as f:
                self.files = {k: self.directory / SINGLE_FILE for k in f.keys()}
        else:
            pickled = sorted(p.name for p in self.directory.glob("*.bin"))
            never = (f"; its {', '.join(pickled)} is never read (a pickle, which could run code when loaded): write"
                     " safetensors where you trust the file, e.g. transformers' save_pretrained") if pickled else ""
            raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}{never}")
        if expected is not None:
            self._check(expected)

    def stored_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The stored tensors the model's parameter ``name`` (of ``shape``) is read from, with their shapes."""
        return [(self.key(name), tuple(shape))]

    def _check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        from safetensors import safe_open

        problems = []
        for name, shape in expected.items():
            for key, want in self.stored_parts(name, shape):
                if key not in self.files:
                    problems.append(f"{key}: missing")
                    continue
                with safe_open(self.files[key], framework="pt") as f:
                    stored = tuple(f.get_slice(key).get_shape())
                if stored != tuple(want):
                    problems.append(f"{key}: stored {stored}, the model's is {tuple(want)}")
        if problems:
            raise ValueError(
                f"{self.directory} does not hold the model's weights ({len(problems)} problem(s)):\n  - "
                + "\n  - ".join(problems[:20])
                + ("\n  - …" if len(problems) > 20 else "")
                + "\nCheck that the config matches the checkpoint's config.json."
            )

    def key(self, name: str) -> str:
        """The stored name of the model's parameter ``name``."""
        return name

    def read(
        self, stored: Any, name: str, rows: slice, cols: tuple[slice, ...], global_shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The block ``[rows, *cols]`` of ``stored`` (a safetensors slice) as the model expects it."""
        return stored[(rows, *cols)]

    @torch.no_grad()
    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: tuple[int, ...], offset: Optional[tuple[int, ...]]
    ) -> None:
        """Copy the block of weight ``name`` starting at ``offset`` (``None``: the whole) into ``out``.

        Args:
            out: The block to fill (its shape is the block's).
            name: The model's parameter name.
            global_shape: The full weight's shape.
            offset: Where the block starts in the full weight.
        """
        from safetensors import safe_open

        key = self.key(name)
        if key not in self.files:
            raise KeyError(f"{self.directory} has no weight {key!r} (for {name})")
        if out.numel() == 0:  # an empty local shard (more ranks than rows): nothing to read
            return
        offset = offset or (0,) * len(global_shape)
        rows = slice(offset[0], offset[0] + out.shape[0]) if global_shape else slice(None)
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
        with safe_open(self.files[key], framework="pt") as f:
            out.copy_(self.read(f.get_slice(key), name, rows, cols, global_shape))


class HFWeights(SafetensorsWeights):
    """A Hugging Face Llama, Qwen3, Qwen3-MoE or Mixtral directory read into our ``Transformer``: names mapped
    (``hf_name``), the rows of ``wq``/``wk`` (and the per-head norms' features) permuted back to Meta's rotary
    layout, and each block's experts stacked from their per-expert tensors or cut from transformers' fused ones
    (each rank reads only its experts' rows).

    The modules build one from ``init_from`` (``weights_source()``) and the strategies fill each rank's shards from
    it as they materialize the model; on one device ``Transformer.load_blocks`` reads it.

    Args:
        directory: The Hugging Face directory (``config.json``, ``model.safetensors`` or shards + index).
        args: The model's args; they must match ``config.json``.

    Raises:
        ValueError: ``args`` that do not match ``config.json``, or stored tensors missing or of another shape (all
            listed, before anything is allocated).
        FileNotFoundError: A directory without ``config.json`` or without its safetensors.

    Example:
        ```python
        from pathlib import Path
        from lightning_2d.hf import HFWeights, model_args_from_hf

        directory = Path("Meta-Llama-3-8B")
        weights = HFWeights(directory, model_args_from_hf(directory))
        weights.key("layers.0.attention.wq.weight")  # 'model.layers.0.self_attn.q_proj.weight'
        ```
    """

    def __init__(self, directory: Path, args: ModelArgs) -> None:
        self.args = args
        self.model_type = json.loads((Path(directory) / "config.json").read_text()).get("model_type", "llama") \
            if (Path(directory) / "config.json").is_file() else "llama"
        loaded = model_args_from_hf(Path(directory))
        if mismatch := same_shapes(args, loaded):
            raise ValueError(f"The model does not match {directory}/config.json: " + "; ".join(mismatch))
        # Every tensor the model reads is there, at its shape (a tied head reads the embedding's).
        with torch.device("meta"):
            expected = {name: tuple(param.shape) for name, param in Transformer(args).named_parameters()}
        super().__init__(directory, expected)

    def key(self, name: str) -> str:
        key = hf_name(name, self.model_type)
        router = re.match(r"layers\.(\d+)\.feed_forward\.router\.weight$", name)
        if router and self._fused(int(router.group(1))):  # transformers 5's own names: the router under `mlp`
            return f"model.layers.{router.group(1)}.mlp.gate.weight"
        return key

    def _fused(self, layer: int) -> bool:
        return fused_expert_name(layer, "w1") in self.files

    def stored_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        expert = expert_name(name)
        if expert is None:
            return super().stored_parts(name, shape)
        layer, which = expert
        experts, rows, cols = shape
        if self._fused(layer):
            return [(fused_expert_name(layer, which), (experts, 2 * rows, cols) if which != "w2" else tuple(shape))]
        return [(expert_hf_name(layer, which, e, self.model_type), (rows, cols)) for e in range(experts)]

    @torch.no_grad()
    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: tuple[int, ...], offset: Optional[tuple[int, ...]]
    ) -> None:
        expert = expert_name(name)
        if expert is None or out.numel() == 0:
            return super().fill_block_(out, name, global_shape, offset)
        from safetensors import safe_open

        layer, which = expert
        offset = offset or (0, 0, 0)
        first = offset[0]
        rows = slice(offset[1], offset[1] + out.shape[1])
        cols = slice(offset[2], offset[2] + out.shape[2])
        if self._fused(layer):  # transformers 5's (E, 2F, D) gate_up_proj / (E, D, F) down_proj
            key = fused_expert_name(layer, which)
            if which == "w3":  # the up rows follow the gate rows
                rows = slice(rows.start + global_shape[1], rows.stop + global_shape[1])
            with safe_open(self.files[key], framework="pt") as f:
                out.copy_(f.get_slice(key)[first:first + out.shape[0], rows, cols])
            return
        for i in range(out.shape[0]):  # this rank's experts only, one file read each
            key = expert_hf_name(layer, which, first + i, self.model_type)
            with safe_open(self.files[key], framework="pt") as f:
                out[i].copy_(f.get_slice(key)[rows, cols])

    def read(
        self, stored: Any, name: str, rows: slice, cols: tuple[slice, ...], global_shape: tuple[int, ...]
    ) -> torch.Tensor:
        heads = rotary_heads(name, self.args)
        if heads is None:
            return stored[(rows, *cols)]
        if len(global_shape) == 1:  # a per-head norm's weight: one head's features, permuted whole
            return hf_to_meta(stored[:], heads)[rows]
        # Rows of a head are permuted within the head: read the whole heads the block touches.
        head_rows = global_shape[0] // heads
        first, last = rows.start // head_rows, (rows.stop - 1) // head_rows + 1
        whole = stored[(slice(first * head_rows, last * head_rows), *cols)]
        return hf_to_meta(whole, last - first)[rows.start - first * head_rows : rows.stop - first * head_rows]


class TransformersExpertsWeights(SafetensorsWeights):
    """A Hugging Face mixture-of-experts folder read into transformers' own model (``HFCausalLMModule``), whose
    experts are fused in memory (``mlp.experts.gate_up_proj`` ``(E, 2F, D)``, ``mlp.experts.down_proj``
    ``(E, D, F)``): from files of the same fused layout as they are, or stacked from the per-expert files transformers
    saves (``….experts.E.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe.experts.E.w1`` …),
    each rank reading only the experts and rows it holds.

    Args:
        directory: The folder.
        expected: The model's parameter names and shapes (transformers' names).
        model_type: ``"qwen3_moe"`` or ``"mixtral"``.
    """

    def __init__(self, directory: Path, expected: Mapping[str, tuple[int, ...]], model_type: str) -> None:
        self.model_type = model_type
        super().__init__(directory, None)
        self._check(expected)

    def _per_expert(self, name: str) -> Optional[tuple[int, str]]:
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if match is None or name in self.files:  # not an experts tensor, or stored fused
            return None
        return int(match.group(1)), match.group(2)

    def key(self, name: str) -> str:
        router = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.weight", name)
        if router and name not in self.files and self.model_type == "mixtral":
            return f"model.layers.{router.group(1)}.block_sparse_moe.gate.weight"
        return name

    def stored_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        experts = self._per_expert(name)
        if experts is None:
            return super().stored_parts(name, shape)
        layer, which = experts
        count, rows, cols = shape
        if which == "down_proj":
            return [(expert_hf_name(layer, "w2", e, self.model_type), (rows, cols)) for e in range(count)]
        return [(expert_hf_name(layer, w, e, self.model_type), (rows // 2, cols))
                for e in range(count) for w in ("w1", "w3")]

    @torch.no_grad()
    def fill_block_(
        self, out: torch.Tensor, name: str, global_shape: tuple[int, ...], offset: Optional[tuple[int, ...]]
    ) -> None:
        experts = self._per_expert(name)
        if experts is None or out.numel() == 0:
            return super().fill_block_(out, name, global_shape, offset)
        from safetensors import safe_open

        layer, which = experts
        first, row, col = offset or (0, 0, 0)
        cols = slice(col, col + out.shape[2])
        half = global_shape[1] // 2  # gate_up_proj: the gate's rows, then the up projection's
        for i in range(out.shape[0]):
            if which == "down_proj":
                parts = [("w2", slice(row, row + out.shape[1]))]
            else:  # the block's rows of the gate (below half) and of the up projection (from half on)
                stop = row + out.shape[1]
                parts = [(w, slice(max(row, lo) - lo, min(stop, lo + half) - lo)) for w, lo in (("w1", 0), ("w3", half))
                         if max(row, lo) < min(stop, lo + half)]
            filled = 0
            for w, rows in parts:
                key = expert_hf_name(layer, w, first + i, self.model_type)
                with safe_open(self.files[key], framework="pt") as f:
                    block = f.get_slice(key)[rows, cols]
                out[i, filled:filled + block.shape[0]].copy_(block)
                filled += block.shape[0]
