"""Low-rank adapters under tensor parallelism: the placements of ``A`` and ``B`` beside their base linear's.

A ``LoRALinear`` (``lightning_2d.ops.lora``) computes ``x Wᵀ + s · (x Aᵀ) Bᵀ``. Its base takes the plan's style,
and the adapters take the placements that keep the adapter's output laid out as the base's (torchtitan's and NeMo
Automodel's choice), with no collective of their own:

- **column-wise base** (``W`` ``Shard(0)``: each rank computes a slice of the output features): ``A`` is
  ``Replicate()`` (the input is whole on every rank), ``B`` is ``Shard(0)`` like ``W``, so ``x Aᵀ Bᵀ`` is the same
  output slice;
- **row-wise base** (``W`` ``Shard(1)``: each rank holds a slice of the input features and a partial sum of the
  output): ``A`` is ``Shard(1)`` like ``W``, so ``x Aᵀ`` is a partial sum, and ``B`` is ``Replicate()``; ``B`` is
  linear, so ``x Aᵀ Bᵀ`` is a partial sum of the output as well, reduced with the base's by the style's one
  all-reduce (or reduce-scatter under sequence parallelism).

Wrapping every column- and row-wise style of a plan (``with_adapter_placements``) keeps the plans themselves
unaware of adapters: a module without them is parallelized by the style as before.

QLoRA's NF4 bases (``LoRA(quantize_base="nf4")``) are FSDP-sharded only: ``qlora_problems`` says which layouts cannot
hold them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_2d.ops.lora import ADAPTERS, LoRALinear
from lightning_2d.ops.nf4 import nf4_problem
from lightning_2d.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class WithAdapters(ParallelStyle):
    """``style`` (column- or row-wise) on a linear layer, its adapters (if any) placed to match (module docstring)."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def __getattr__(self, name: str) -> Any:  # the wrapped style's layouts, for whoever reads them
        if name == "style":
            raise AttributeError(name)
        return getattr(self.style, name)

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        if not isinstance(module, LoRALinear):
            return self.style._apply(module, device_mesh)
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        if isinstance(self.style, ColwiseParallel):
            placements = {"lora_a": Replicate(), "lora_b": Shard(0)}
        elif isinstance(self.style, RowwiseParallel):
            placements = {"lora_a": Shard(1), "lora_b": Replicate()}
        else:  # pragma: no cover - with_adapter_placements wraps only these two
            raise TypeError(f"no adapter placements for {type(self.style).__name__}")
        # The base style distributes every parameter of the module it is given (recursively): hide the adapters
        # from it, then give them their own placements.
        children = {name: module._modules.pop(name) for name in (*ADAPTERS, "lora_dropout")}
        try:
            module = self.style._apply(module, device_mesh)
        finally:
            module._modules.update(children)
        for name in ADAPTERS:
            adapter = children[name]
            weight = adapter.weight
            adapter.weight = nn.Parameter(distribute_tensor(weight, device_mesh, [placements[name]]),
                                          requires_grad=weight.requires_grad)
        return module


def with_adapter_placements(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``styles`` with every column- and row-wise style wrapped in ``WithAdapters``: an adapted linear layer gets its
    adapters' placements, every other module what its style gives it."""
    return {name: WithAdapters(style) if isinstance(style, (ColwiseParallel, RowwiseParallel)) else style
            for name, style in styles.items()}


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def qlora_problems(config: ParallelConfig, tp: Optional[int]) -> list[str]:
    """What keeps NF4 base weights (``LoRA(quantize_base="nf4")``) from the strategy's layout: they are FSDP-sharded
    over one mesh dimension, by torchao's all-gather, and quantized whole (``lightning_2d.ops.nf4``). ``tp``: the
    tensor-parallel size where known (``None``: not resolved yet)."""
    what = "lora.quantize_base='nf4' (QLoRA)"
    problems = []
    if (problem := nf4_problem()) is not None:
        problems.append(problem)
    if tp is not None and tp > 1:
        problems.append(
            f"{what} with tensor_parallel_size={tp}: NF4 weights are quantized in blocks of the whole weight and"
            " torchao shards them along their rows for FSDP only; a tensor-parallel column shard is not such a cut."
            " Use tensor_parallel_size=1 (FSDP shards the NF4 bases), or quantize_base=None under tensor parallelism"
        )
    if config.data_parallel_replicate_size > 1:
        problems.append(
            f"{what} with data_parallel_replicate_size={config.data_parallel_replicate_size}: torchao's NF4 all-gather"
            " runs over a 1-D FSDP mesh, and HSDP shards over a 2-D one. Use data_parallel_replicate_size=1"
        )
    if config.fsdp_backend != "fully_shard":
        problems.append(
            f"{what} with fsdp_backend={config.fsdp_backend!r}: the NF4 tensor's sharding hooks are FSDP2's"
            " (fully_shard). Use fsdp_backend='fully_shard'"
        )
    if config.compile:
        problems.append(
            f"{what} with compile=True: a compiled block fails on the NF4 weights FSDP2 gathers (torch 2.13's AOT"
            " autograd finds a DeviceMesh among the tensors saved for backward; a block without FSDP compiles). Use"
            " compile=False with quantize_base='nf4'"
        )
    return problems
