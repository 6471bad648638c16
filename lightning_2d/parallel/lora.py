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

The adapters and QLoRA's NF4 bases are model converters (``parallel.converters``): ``LoRAAdapters`` adds the
adapters to the meta model (at the plan's ``adapter_targets`` unless the settings name theirs), trains them alone and
keeps them alone in a checkpoint; ``NF4Bases`` stores the adapted layers' frozen weights in NF4 before FSDP shards
them.

The routed experts' adapters (``ops.lora.LoRAExperts``) are parameters of the experts module with the expert as
dimension 0: expert parallelism (``parallel.expert.ExpertParallel``, every parameter of the module ``Shard(0)``) and
the experts' FSDP split them with their experts, and they need no placement of their own. Split by hidden features
(the experts' tensor parallelism, ``MoETensorParallel``), they are placed as a column-wise (``w1``/``w3``) and a
row-wise (``w2``) base's (``expert_adapter_placements``); the replicated factors' local gradients are partial sums
(the experts compute on local parts, ``ops.moe.local_part``, whose gradient is declared ``Partial()``), which FSDP2
all-reduces over the tensor-parallel ranks as it does a dense adapter's. The shared experts keep their dense adapters,
placed as above inside the layer's ``MoETensorParallel``.

What LoRA cannot run with is refused before any process group by the registered checks below (``parallel/checks.py``;
``parallel/dims.py`` imports this module so they register before the layout's): float8, transformers' fused experts,
and the layouts and weights QLoRA's NF4 bases (``LoRA(quantize_base="nf4")``, FSDP-sharded 2-D weights only) cannot hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_2d.ops.lora import (
    ADAPTERS,
    LoRA,
    LoRAConfigError,
    LoRAExperts,
    LoRALinear,
    add_lora,
    is_adapter_parameter,
    lora_of,
    quantize_lora_bases,
    targets_reach_experts,
)
from lightning_2d.ops.nf4 import nf4_problem
from lightning_2d.parallel.checks import check
from lightning_2d.parallel.config import ParallelPlan

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

        from torch.distributed.tensor import Partial

        # The local gradients of the replicated tensors (the input of a column-wise base, the replicated factor) are
        # partial sums: each flows back through this rank's shard of the other factor (``local_adapter_grads``).
        if isinstance(self.style, ColwiseParallel):
            placements = {"lora_a": Replicate(), "lora_b": Shard(0)}
            local_grads = {"x": [Partial()], "lora_a": [Partial()], "lora_b": None, "out": [Shard(-1)]}
        elif isinstance(self.style, RowwiseParallel):
            placements = {"lora_a": Shard(1), "lora_b": Replicate()}
            local_grads = {"x": None, "lora_a": None, "lora_b": [Partial()], "out": [Partial()]}
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
        if device_mesh.ndim == 1:
            module.local_adapter_grads = local_grads
        return module


def with_adapter_placements(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``styles`` with every column- and row-wise style wrapped in ``WithAdapters``: an adapted linear layer gets its
    adapters' placements, every other module what its style gives it."""
    return {name: WithAdapters(style) if isinstance(style, (ColwiseParallel, RowwiseParallel)) else style
            for name, style in styles.items()}


def expert_adapter_placements(experts: nn.Module) -> list[tuple[str, Any]]:
    """The tensor-parallel placements of a ``LoRAExperts``' adapters beside its weights split by hidden features
    (``w1``/``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``: ``parallel.expert.MoETensorParallel``), as a column-wise and a
    row-wise base's: ``w1``/``w3``'s ``B`` ``(E, F, r)`` split with the hidden rows (``Shard(1)``), their ``A``
    replicated; ``w2``'s ``A`` ``(E, r, F)`` split with the hidden columns (``Shard(2)``), its ``B`` replicated (its
    output a partial sum, reduced with the experts'). ``[]`` for experts without adapters."""
    from torch.distributed.tensor import Replicate, Shard

    placements: list[tuple[str, Any]] = []
    for which in getattr(experts, "projections", ()):
        row_wise = which == "w2"
        placements += [(f"{which}_lora_a", Shard(2) if row_wise else Replicate()),
                       (f"{which}_lora_b", Replicate() if row_wise else Shard(1))]
    return placements


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRALinear, LoRAExperts)) for m in model.modules())


# ---- the converters (``parallel/converters.py``) ------------------------------------------------------------------
@dataclass(frozen=True)
class LoRAAdapters:
    """The adapters ``lora`` asks for, as a model converter: on the plan's default targets (``adapter_targets``, with
    its ``adapter_aliases``) unless the settings name theirs; the adapters alone train and a checkpoint keeps them
    alone, recording their settings (the base is the run's: ``init_from`` or its seeded init). A model that already
    has adapters (added by its owner) keeps them."""

    lora: LoRA
    targets: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: ParallelPlan, inputs: Mapping[str, Any]) -> Optional["LoRAAdapters"]:
        lora = inputs.get("lora")
        return cls(lora, tuple(plan.adapter_targets), dict(plan.adapter_aliases)) if lora is not None else None

    def convert(self, model: nn.Module, shards: Optional[int], device: Optional[torch.device]) -> None:
        if lora_of(model) is not None:
            return  # adapted by its owner (a model given to Fabric with its adapters, a configure_model of one's own)
        if self.lora.targets is None and not self.targets:
            raise LoRAConfigError(
                f"lora.targets is not set and the parallel plan of {type(model).__name__} names no default targets"
                " (ParallelPlan.adapter_targets): name the linear layers to adapt in lora.targets"
            )
        add_lora(model, self.lora, self.targets, self.aliases)

    def trained(self, name: str) -> bool:
        return is_adapter_parameter(name)

    @property
    def checkpoint_filter(self) -> Optional[Callable[[str], bool]]:
        return is_adapter_parameter

    def checkpoint_record(self) -> dict[str, Any]:
        return {"lora": self.lora.to_dict()}

    def freezes(self) -> bool:
        return True

    def plan_note(self, trained: int, numel: int) -> Optional[str]:
        return (
            f"LoRA (rank {self.lora.rank}): {trained:,} of this device's {numel:,} parameters are adapters;"
            " the frozen base holds no gradients, optimizer state or reduce-scatter buffer, its norms keep no normalized"
            " value for a weight gradient"
        )


@dataclass(frozen=True)
class NF4Bases:
    """QLoRA (``LoRA(quantize_base="nf4")``) as a model converter: the adapted layers' frozen weights become meta
    ``NF4Tensor``s before FSDP shards them (FSDP2 shards an NF4 weight only if it is the parameter when ``fully_shard``
    runs), each weight's split into ``shards`` row shards of whole scaler groups checked first, before any
    allocation; materialization fills them from the whole weights (``ops.nf4``). At ``shards=None`` (the layout not
    known) nothing is stored otherwise yet."""

    lora: LoRA

    @classmethod
    def of(cls, plan: ParallelPlan, inputs: Mapping[str, Any]) -> Optional["NF4Bases"]:
        lora = inputs.get("lora")
        return cls(lora) if lora is not None and lora.quantize_base is not None else None

    def convert(self, model: nn.Module, shards: Optional[int], device: Optional[torch.device]) -> None:
        if shards is not None:
            quantize_lora_bases(model, device, shards=shards)

    def trained(self, name: str) -> bool:
        return True  # the bases it stores are frozen already (the adapters' converter)

    @property
    def checkpoint_filter(self) -> Optional[Callable[[str], bool]]:
        return None

    def checkpoint_record(self) -> dict[str, Any]:
        return {}  # quantize_base is one of the adapters' settings (their record)

    def freezes(self) -> bool:
        return True

    def plan_note(self, trained: int, numel: int) -> Optional[str]:
        return "the adapted projections' weights are NF4 (about 0.52 bytes each, gathered as such)"


# ---- the checks (``parallel/checks.py``): what the adapters cannot run with -------------------------------------
QLORA = "lora.quantize_base='nf4' (QLoRA)"


@check
def lora_float8(float8: Any, lora: LoRA, owner: str) -> list[str]:
    """float8 swaps the projections for torchao's ``Float8Linear``, which adapters cannot wrap."""
    if lora is None or not float8:
        return []
    return [
        f"float8={float8!r} with LoRA adapters ({owner}(lora=...)): float8 swaps the projections for torchao's"
        " Float8Linear, which the adapters cannot wrap, and a frozen base gains little from float8 training. Use"
        " float8=False with lora, or train without lora"
    ]


@check(error=LoRAConfigError)
def lora_experts(lora: LoRA, experts: bool, hf_config: Any = None, plan: Optional[ParallelPlan] = None) -> list[str]:
    """transformers' own experts (``HFCausalLMModule``'s, or a transformers model given to Fabric: the plan runs them
    whole, ``plan.whole_experts``) are fused parameters that take no adapter: the routed experts would stay frozen
    while the rest trains. Our Llama's routed experts take adapters (``ops.lora.LoRAExperts``)."""
    if lora is None or not experts or (hf_config is None and (plan is None or plan.whole_experts is None)):
        return []
    return [
        "LoRA on transformers' own mixture of experts (HFCausalLMModule, or a transformers model given to Fabric) is"
        " not supported: its fused experts (gate_up_proj, down_proj parameters) take no adapter, so the routed experts"
        " would stay frozen while the rest trains. Train LlamaLightningModule(init_from=<the same folder>, lora=...),"
        " which reads the same files and adapts the routed experts per expert"
    ]


def _expert_aliases(plan: Optional[ParallelPlan]) -> Mapping[str, str]:
    return plan.adapter_aliases if plan is not None else {}


@check(error=LoRAConfigError)
def qlora_experts(lora: LoRA, experts: bool, plan: Optional[ParallelPlan] = None) -> list[str]:
    """NF4 bases are 2-D weights quantized in blocks and sharded by their rows (``ops.nf4``); the routed experts are
    stacked 3-D weights, split by expert under expert parallelism."""
    if lora is None or lora.quantize_base is None or not experts:
        return []
    if not targets_reach_experts(lora.targets, _expert_aliases(plan)):
        return []
    return [
        f"{QLORA} on the routed experts: their weights are stacked 3-D tensors (experts × out × in), split by expert"
        " under expert parallelism, and the NF4 bases (torchao's NF4Tensor) are 2-D weights quantized in blocks and"
        " sharded along their rows (not built for stacked experts). Use quantize_base=None, or lora.targets without"
        " the routed experts (e.g. ['wq', 'wk', 'wv', 'wo', 'shared_experts.w1', 'shared_experts.w2',"
        " 'shared_experts.w3'])"
    ]


@check
def qlora_weights(lora: LoRA, tp: int) -> list[str]:
    """NF4 bases need torchao, and whole weights: quantized in blocks, sharded along their rows by FSDP only
    (``lightning_2d.ops.nf4``)."""
    if lora.quantize_base is None:
        return []
    problems = [problem for problem in (nf4_problem(),) if problem is not None]
    if tp > 1:
        problems.append(
            f"{QLORA} with tensor_parallel_size={tp}: NF4 weights are quantized in blocks of the whole weight and"
            " torchao shards them along their rows for FSDP only; a tensor-parallel column shard is not such a cut."
            " Use tensor_parallel_size=1 (FSDP shards the NF4 bases), or quantize_base=None under tensor parallelism"
        )
    return problems


@check
def qlora_sharding(lora: LoRA, data_parallel_replicate_size: int, fsdp_backend: str) -> list[str]:
    """NF4 bases are gathered by torchao's all-gather, an FSDP2 (``fully_shard``) hook over a 1-D mesh."""
    if lora.quantize_base is None:
        return []
    problems = []
    if data_parallel_replicate_size > 1:
        problems.append(
            f"{QLORA} with data_parallel_replicate_size={data_parallel_replicate_size}: torchao's NF4 all-gather"
            " runs over a 1-D FSDP mesh, and HSDP shards over a 2-D one. Use data_parallel_replicate_size=1"
        )
    if fsdp_backend != "fully_shard":
        problems.append(
            f"{QLORA} with fsdp_backend={fsdp_backend!r}: the NF4 tensor's sharding hooks are FSDP2's"
            " (fully_shard). Use fsdp_backend='fully_shard'"
        )
    return problems


@check
def qlora_compile(lora: LoRA, compile: bool) -> list[str]:
    """A compiled block fails on the NF4 weights FSDP2 gathers (torch 2.13)."""
    if lora.quantize_base is None or not compile:
        return []
    return [
        f"{QLORA} with compile=True: a compiled block fails on the NF4 weights FSDP2 gathers (torch 2.13's AOT"
        " autograd finds a DeviceMesh among the tensors saved for backward; a block without FSDP compiles). Use"
        " compile=False with quantize_base='nf4'"
    ]
