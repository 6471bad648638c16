"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear layers: ``y = x Wᵀ + s · B(A(dropout(x)))``.

``add_lora(model, LoRA(...), targets)`` puts a ``LoRALinear`` in the place of each targeted ``nn.Linear`` (under the
same name, holding the same ``weight`` and ``bias`` parameters) with two child linears, ``lora_a``
(``rank × in_features``) and ``lora_b`` (``out_features × rank``), and freezes every parameter that is not an
adapter's. The base names do not move (``layers.0.attention.wq.weight``), so ``init_from``, the parallel plans
and checkpoints of the base read the same; the adapters are ``layers.0.attention.wq.lora_a.weight`` etc.

The adapters' initialization is peft's: ``A`` Kaiming-uniform with ``a = √5`` (``U(-1/√in, 1/√in)``, what
``nn.Linear`` itself draws), ``B`` zero, so the adapted model starts as the base. It is drawn like every init here
(``lightning_2d.ops.init``), from the parameter's name and seed in row blocks, so it is the same at every layout:
``LoRALinear.own_param_init_specs()`` describes it (``ops.init.module_init_specs`` collects such specs, and
``ops.init.WithOwnInit`` adds them to any weight source, an ``init_from`` checkpoint included).

The routed experts of a mixture of experts (``ops.moe.GroupedExperts``: stacked ``w1``/``w3`` ``(E, F, D)``, ``w2``
``(E, D, F)``) take adapters per expert (``LoRAExperts``): for a projection of shape ``(E, out, in)``, ``A``
``(E, r, in)`` and ``B`` ``(E, out, r)``, parameters of the experts module itself (``experts.w1_lora_a``, the expert
first, so expert parallelism shards them with their experts), computed as the experts are: one grouped matrix product
for ``A`` and one for ``B`` per projection. A target names them as it names a linear layer (``w1``, ``gate_proj``,
``experts.w1``): the default targets adapt the routed experts' three projections too.

Pure ``torch``; the placements of ``A`` and ``B`` under tensor parallelism are ``lightning_2d.parallel.lora``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from torch import nn

from lightning_2d.ops.init import InitSpec
from lightning_2d.ops.moe import GroupedExperts, local_part
from lightning_2d.ops.nf4 import NF4_GROUP, QUANTIZATIONS, dequantize, is_nf4, nf4_shard_problem, to_nf4_weight

#: The attribute names of a ``LoRALinear``'s adapters (part of the parameter names).
ADAPTERS = ("lora_a", "lora_b")
#: The stacked projections of routed experts (``ops.moe.GroupedExperts``) that take adapters.
EXPERT_PROJECTIONS = ("w1", "w2", "w3")


class LoRAConfigError(ValueError):
    """A LoRA setting that cannot work; says which value and what to use instead."""


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on the model's linear projections; the base model is frozen.

    Args:
        rank: The adapters' inner size ``r``.
        alpha: Scale numerator: the adapter's output is multiplied by ``alpha / rank`` (``alpha / √rank`` with
            ``rslora``).
        dropout: Dropout on the adapter's input (``0``: none).
        targets: The linear layers to adapt, by their last name (``"wq"``) or a dotted suffix
            (``"attention.wq"``); ``None``: the model's attention and MLP projections (a mixture of experts' routed
            experts included: ``LoRAExperts``). A model accepts its own names and the Hugging Face names
            (``q_proj``, ``gate_proj``, …) of the same layers.
        rslora: Rank-stabilized scaling, ``alpha / √rank`` (Kalajdzievski 2023; peft's ``use_rslora``).
        quantize_base: ``"nf4"``: QLoRA (Dettmers et al. 2023), the adapted layers' frozen weights stored as 4-bit
            NormalFloat (torchao's ``NF4Tensor``, ``lightning_2d.ops.nf4``) and dequantized in each forward; ``None``:
            the base keeps its dtype. Under the 2D strategy NF4 weights are FSDP-sharded (not tensor-parallel).

    Raises:
        LoRAConfigError: A setting out of its range (every problem in one message); a ``ValueError``.

    Example:
        ```python
        from lightning_2d import LlamaLightningModule, LoRA

        lora = LoRA(rank=16, alpha=32, targets=["wq", "wv"])   # or Hugging Face's names: ["q_proj", "v_proj"]
        qlora = LoRA(rank=64, alpha=16, quantize_base="nf4")   # every projection, the frozen base in 4 bits
        module = LlamaLightningModule(init_from="Meta-Llama-3-8B/", lora=qlora)
        ```

        In a recipe: ``model: {init_from: ..., lora: {rank: 16, alpha: 32}}``.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Optional[tuple[str, ...]] = None
    rslora: bool = False
    quantize_base: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.targets, (list, str)):
            object.__setattr__(self, "targets", (self.targets,) if isinstance(self.targets, str) else tuple(self.targets))
        problems = []
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            problems.append(f"rank must be a positive integer, got {self.rank!r} (typical: 8, 16, 64)")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            problems.append(f"alpha must be a positive number, got {self.alpha!r} (typical: twice the rank)")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None and (not self.targets or not all(isinstance(t, str) and t for t in self.targets)):
            problems.append(f"targets must be a non-empty list of layer names, got {self.targets!r}; or omit it for"
                            " the attention and MLP projections")
        if self.quantize_base is not None and self.quantize_base not in QUANTIZATIONS:
            problems.append(f"quantize_base must be one of {list(QUANTIZATIONS)} or None, got {self.quantize_base!r}")
        if problems:
            raise LoRAConfigError("Invalid LoRA settings: " + "; ".join(problems))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def of(cls, value: "LoRA | Mapping[str, Any] | None") -> "Optional[LoRA]":
        """A ``LoRA`` from itself, a dict (yaml) or ``None``; an unknown key is an error naming the known ones."""
        if value is None or isinstance(value, LoRA):
            return value
        if not isinstance(value, Mapping):
            raise LoRAConfigError(f"lora must be a LoRA or a dict of its fields, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise LoRAConfigError(f"Unknown LoRA setting(s) {unknown}; the settings are {sorted(known)}")
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (hyperparameters, checkpoints); ``quantize_base`` only when set, so the records of adapters
        trained before it existed still compare equal."""
        data = {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets) if self.targets is not None else None, "rslora": self.rslora}
        if self.quantize_base is not None:
            data["quantize_base"] = self.quantize_base
        return data


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter: ``F.linear(x, weight, bias) + scale · lora_b(lora_a(dropout(x)))``.

    ``LoRALinear.from_linear(linear, lora)`` makes one around an existing layer's parameters (the same ``weight`` and
    ``bias`` objects: their values, names and sharding are the base's), which ``add_lora`` puts in the layer's place.
    Under tensor parallelism its inputs and parameters are DTensors and the same expression computes the sharded
    result (``lightning_2d.parallel.lora``).

    Args:
        in_features, out_features, bias, device, dtype: As ``nn.Linear``'s.
        lora: The adapters' settings.
    """

    def __init__(self, in_features: int, out_features: int, lora: LoRA, bias: bool = True,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._add_adapters(lora, device, dtype)

    def _add_adapters(self, lora: LoRA, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> None:
        self.lora_a = nn.Linear(self.in_features, lora.rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(lora.rank, self.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        self.scale = lora.scale
        self.quantize_base = lora.quantize_base
        self.settings = lora  # what the checks read of a model given with its adapters (``lora_of``)

    @classmethod
    def from_linear(cls, linear: nn.Linear, lora: LoRA) -> "LoRALinear":
        """A ``LoRALinear`` holding ``linear``'s own parameters, its adapters on their device and dtype."""
        if type(linear) is not nn.Linear:
            raise LoRAConfigError(
                f"LoRA adapts plain nn.Linear layers; this target is a {type(linear).__name__}. Leave it out of"
                " lora.targets (float8 layers: train LoRA without float8)"
            )
        device, dtype = linear.weight.device, linear.weight.dtype
        adapted = cls(linear.in_features, linear.out_features, lora, bias=linear.bias is not None, device="meta",
                      dtype=dtype)  # nothing allocated: the parameters are the layer's
        adapted.weight, adapted.bias = linear.weight, linear.bias
        adapted._add_adapters(lora, device, dtype)
        adapted.train(linear.training)
        return adapted

    #: Set by ``adapters_disabled``: the layer computes its base alone (a preference loss's reference model).
    adapters_off = False
    #: Set by a parallel style that made the input, the weights and the adapters DTensors
    #: (``parallel.lora.WithAdapters``): the local gradients' placements of ``x``, ``lora_a`` and ``lora_b`` (``None``:
    #: as the tensor; ``[Partial()]``: a replicated tensor whose local gradients are partial sums), and ``out``, the
    #: placements of the output the style expects (a column-wise base's ``Shard(-1)``, a row-wise one's
    #: ``Partial()``). The base's product and the adapters' then run on local tensors and the sum is wrapped once in
    #: that layout: the same numbers without DTensor's per-op dispatch, which at small widths costs more than the
    #: products (``benchmark --compare-lora``). A dropout, an NF4 base, or a bias beside a row-wise base (added once,
    #: not per rank) keep the DTensor expression.
    local_adapter_grads: Optional[Mapping[str, Any]] = None

    def _local_forward(self, x: torch.Tensor, grads: Mapping[str, Any]) -> Optional[torch.Tensor]:
        if not (isinstance(self.lora_dropout, nn.Identity) and hasattr(x, "device_mesh") and not is_nf4(self.weight)):
            return None
        if self.bias is not None and grads["out"][0].is_partial():
            return None
        x_local = local_part(x, grads["x"])
        a = local_part(self.lora_a.weight, grads["lora_a"])
        b = local_part(self.lora_b.weight, grads["lora_b"])
        bias = local_part(self.bias) if self.bias is not None else None
        # The scale on the rank-wide intermediate, not the output: ``rank`` numbers per token scaled, not ``out``.
        y = torch.nn.functional.linear(x_local, local_part(self.weight), bias) + ((x_local @ a.t()) * self.scale) @ b.t()
        return type(x).from_local(y, x.device_mesh, grads["out"], run_check=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapters_off:
            return super().forward(x)
        if self.local_adapter_grads is not None:
            out = self._local_forward(x, self.local_adapter_grads)
            if out is not None:
                return out
        return super().forward(x) + self.lora_b(self.lora_a(self.lora_dropout(x)) * self.scale)

    def own_param_init_specs(self) -> dict[str, InitSpec]:
        """The adapters' init, by names relative to this module (peft's: ``A`` Kaiming-uniform, ``B`` zero)."""
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=√5) of a (rank, in_features) weight
        return {"lora_a.weight": InitSpec("uniform", bound=bound), "lora_b.weight": InitSpec("constant", value=0.0)}

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``weight + scale · B A`` (plain tensors): the linear layer that computes what this one does (an NF4 base
        dequantized)."""
        weight = dequantize(self.weight) if is_nf4(self.weight) else self.weight
        return weight + (self.lora_b.weight @ self.lora_a.weight) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.out_features}, scale={self.scale:g}"


def _rank_aligned(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` ``(E, r, in)`` and ``B`` ``(E, out, r)`` with zero rank rows/columns added up to a rank whose rows are a
    multiple of 16 bytes: ``grouped_mm`` refuses other strides ("strides should be multiple of 16 bytes": rank 3 in
    float32, rank 4 in bfloat16). The zeros add nothing to ``B A``."""
    pad = -a.shape[1] % max(1, 16 // a.element_size())
    if not pad:
        return a, b
    return (torch.cat([a, a.new_zeros(a.shape[0], pad, a.shape[2])], dim=1),
            torch.cat([b, b.new_zeros(b.shape[0], b.shape[1], pad)], dim=2))


class LoRAExperts(GroupedExperts):
    """Routed experts (``ops.moe.GroupedExperts``) with per-expert low-rank adapters on ``projections``: expert ``e``'s
    projection ``W_e`` (``out × in``) computes ``x W_eᵀ + s · (dropout(x) A_eᵀ) B_eᵀ``, with ``A`` ``(E, r, in)``
    and ``B`` ``(E, out, r)`` stacked parameters of this module (``w1_lora_a``, ``w1_lora_b`` …), the expert as
    dimension 0 like the weights'. With ``grouped_mm`` each adapter is one grouped product over the experts (``A``, then
    ``B``), else the loop computes the same per expert; both on the local parts (``ops.moe.local_part``), so expert
    parallelism's ``Shard(0)`` splits the adapters with their experts.

    ``LoRAExperts.from_experts(experts, lora, projections)`` makes one holding ``experts``' own weights (the same
    parameter objects), which ``add_lora`` puts in its place.
    """

    #: Set by ``adapters_disabled``: the experts compute their base alone.
    adapters_off = False

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, lora: LoRA,
                 projections: Sequence[str] = EXPERT_PROJECTIONS) -> None:
        super().__init__(dim, hidden_dim, num_experts)
        self._add_adapters(lora, projections, None, None)

    def _add_adapters(self, lora: LoRA, projections: Sequence[str], device: Optional[torch.device],
                      dtype: Optional[torch.dtype]) -> None:
        self.projections = tuple(p for p in EXPERT_PROJECTIONS if p in projections)
        for which in self.projections:
            experts, out_features, in_features = getattr(self, which).shape
            self.register_parameter(f"{which}_lora_a", nn.Parameter(
                torch.empty(experts, lora.rank, in_features, device=device, dtype=dtype)))
            self.register_parameter(f"{which}_lora_b", nn.Parameter(
                torch.empty(experts, out_features, lora.rank, device=device, dtype=dtype)))
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        self.scale = lora.scale
        self.quantize_base = lora.quantize_base
        self.settings = lora  # what the checks read of a model given with its adapters (``lora_of``)

    @classmethod
    def from_experts(cls, experts: GroupedExperts, lora: LoRA, projections: Sequence[str]) -> "LoRAExperts":
        """A ``LoRAExperts`` holding ``experts``' own weights, adapters on ``projections`` on their device and dtype."""
        if type(experts) is not GroupedExperts:
            raise LoRAConfigError(f"LoRA adapts ops.moe.GroupedExperts; this target is a {type(experts).__name__}")
        with torch.device("meta"):  # nothing allocated: the weights are the experts'
            adapted = cls.__new__(cls)
            GroupedExperts.__init__(adapted, 1, 1, experts.num_experts)
        for which in EXPERT_PROJECTIONS:
            setattr(adapted, which, getattr(experts, which))
        adapted._add_adapters(lora, projections, experts.w1.device, experts.w1.dtype)
        adapted.train(experts.training)
        return adapted

    def _adapters(self, which: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if self.adapters_off or which not in self.projections:
            return None
        return self._local(f"{which}_lora_a"), self._local(f"{which}_lora_b")

    def _project(self, x: torch.Tensor, which: str, offsets: torch.Tensor) -> torch.Tensor:
        out = super()._project(x, which, offsets)
        adapters = self._adapters(which)
        if adapters is None:
            return out
        a, b = _rank_aligned(*adapters)
        low = torch.nn.functional.grouped_mm(self.lora_dropout(x), a.transpose(-2, -1), offs=offsets)
        return out + torch.nn.functional.grouped_mm(low * self.scale, b.transpose(-2, -1), offs=offsets)

    def _expert_project(self, rows: torch.Tensor, which: str, expert: int) -> torch.Tensor:
        out = super()._expert_project(rows, which, expert)
        adapters = self._adapters(which)
        if adapters is None:
            return out
        a, b = adapters
        return out + ((self.lora_dropout(rows) @ a[expert].t()) * self.scale) @ b[expert].t()

    def own_param_init_specs(self) -> dict[str, InitSpec]:
        """The adapters' init (peft's: ``A`` Kaiming-uniform over its input features, ``B`` zero)."""
        specs = {}
        for which in self.projections:
            bound = 1.0 / math.sqrt(getattr(self, which).shape[-1])
            specs[f"{which}_lora_a"] = InitSpec("uniform", bound=bound)
            specs[f"{which}_lora_b"] = InitSpec("constant", value=0.0)
        return specs

    @torch.no_grad()
    def merged_weight(self, which: str) -> torch.Tensor:
        """``W + s · B A`` per expert (plain tensors, ``(E, out, in)``): the stacked weight that computes what ``which``
        does with its adapters."""
        weight = getattr(self, which)
        if which not in self.projections:
            return weight
        return weight + torch.bmm(getattr(self, f"{which}_lora_b"), getattr(self, f"{which}_lora_a")) * self.scale

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, projections={list(self.projections)},"
                f" rank={self.settings.rank}, scale={self.scale:g}")


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter called ``name`` (a qualified name) belongs to an adapter: a ``LoRALinear``'s
    (``….wq.lora_a.weight``) or a ``LoRAExperts``' (``….experts.w1_lora_a``)."""
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-2] in ADAPTERS) or parts[-1] in EXPERT_ADAPTER_NAMES


#: The parameter names of a ``LoRAExperts``' adapters.
EXPERT_ADAPTER_NAMES = frozenset(f"{which}_{adapter}" for which in EXPERT_PROJECTIONS for adapter in ADAPTERS)


def targets_reach_experts(targets: Optional[Sequence[str]], aliases: Mapping[str, str] = {}) -> bool:
    """Whether ``targets`` (``None``: the defaults, which adapt them) name routed experts' projections: a target
    ``w1``/``w2``/``w3`` (or its alias, ``gate_proj`` …) alone or after ``experts.`` (``experts.w1``,
    ``layers.1.feed_forward.experts.w1``). What the checks read before any model exists."""
    if targets is None:
        return True
    for target in targets:
        parts = aliases.get(target, target).split(".")
        if parts[-1] in EXPERT_PROJECTIONS and (len(parts) == 1 or parts[-2] == "experts"):
            return True
    return False


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def add_lora(
    model: nn.Module,
    lora: LoRA,
    default_targets: Sequence[str],
    aliases: Mapping[str, str] = {},
) -> list[str]:
    """Adapt ``model``'s targeted linear layers in place and freeze everything else; return the adapted names.

    Args:
        model: The model (any device, the meta device included).
        lora: The settings; ``lora.targets`` (or ``default_targets``) name layers by their last name or a dotted
            suffix of their qualified name.
        default_targets: The model family's attention and MLP projections.
        aliases: Other names of the same layers (Hugging Face's ``q_proj`` → our ``wq``), accepted in ``targets``.

    Raises:
        LoRAConfigError: A target matches no linear layer (the message lists the model's linear layer names), or
            the model already has adapters.
    """
    if any(isinstance(m, (LoRALinear, LoRAExperts)) for m in model.modules()):
        raise LoRAConfigError(f"{type(model).__name__} already has LoRA adapters; add them once")
    wanted = [aliases.get(t, t) for t in (lora.targets or default_targets)]
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    # The routed experts' stacked projections, by the names a linear layer would have (``….experts.w1``).
    stacked = {f"{name}.{which}": (name, which) for name, m in model.named_modules()
               if isinstance(m, GroupedExperts) for which in EXPERT_PROJECTIONS}
    unmatched = [t for t, w in zip(lora.targets or default_targets, wanted)
                 if not any(_matches(name, w) for name in (*linears, *stacked))]
    if unmatched:
        leaves = sorted({re.sub(r"^(.*\.)?", "", n) for n in linears})
        experts = " and the routed experts' w1, w2, w3 (experts.w1 …)" if stacked else ""
        raise LoRAConfigError(
            f"lora.targets {unmatched} match no linear layer of {type(model).__name__}; its linear layers are"
            f" called {leaves}{experts}" + (f" (Hugging Face names accepted: {sorted(aliases)})" if aliases else "")
        )
    adapted = [name for name in linears if any(_matches(name, w) for w in wanted)]
    for name in adapted:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear.from_linear(linears[name], lora))  # the same name, the same parameters
    projections: dict[str, list[str]] = {}
    for name, (module, which) in stacked.items():
        if any(_matches(name, w) for w in wanted):
            projections.setdefault(module, []).append(which)
            adapted.append(name)
    for module, which in projections.items():
        parent_name, _, child = module.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRAExperts.from_experts(model.get_submodule(module), lora, which))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))
    return adapted


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every ``LoRALinear`` of ``model`` computes its base alone: the model before its adapters (what a
    preference loss compares with under LoRA, without a second copy). A compiled block recompiles once for it (the
    flag is in its guards)."""
    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))]
    for layer in layers:
        layer.adapters_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_off = False


def lora_of(model: nn.Module) -> Optional[LoRA]:
    """The settings ``model``'s adapters were added with (``add_lora``), or ``None`` if it has none."""
    return next((m.settings for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))), None)


def quantized_bases(model: nn.Module) -> dict[str, "LoRALinear"]:
    """The ``LoRALinear`` layers whose frozen weight is (to be) quantized (``LoRA.quantize_base``), by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear) and m.quantize_base}


def quantize_lora_bases(model: nn.Module, device: Optional[torch.device] = None, shards: int = 1) -> list[str]:
    """Store the frozen weights of ``model``'s QLoRA layers (``LoRA(quantize_base="nf4")``) as ``NF4Tensor``s, in place;
    return the quantized weights' names. Layers already quantized are left alone.

    A real weight is quantized now; a meta weight becomes a meta ``NF4Tensor`` that materialization fills
    (``ops.nf4.fill_nf4_``), with its constants on ``device``. ``shards``: the row shards each weight will be cut into
    (FSDP's); a weight that cannot be cut into whole scaler groups is refused before anything is allocated.

    Raises:
        LoRAConfigError: A weight's shape does not fit NF4 blocks or the shards (all such weights listed).
        ImportError: torchao is missing or too old (the message says how to install it).
    """
    layers = {name: m for name, m in quantized_bases(model).items() if not is_nf4(m.weight)}
    # One line per kind of layer: the blocks' numbers become ``*`` (``layers.*.feed_forward.w1.weight``).
    problems = list(dict.fromkeys(
        p for name, m in layers.items()
        if (p := nf4_shard_problem(re.sub(r"(^|\.)\d+(?=\.)", r"\1*", f"{name}.weight"), tuple(m.weight.shape), shards))
    ))
    if problems:
        raise LoRAConfigError(
            "lora.quantize_base='nf4' cannot store these weights in NF4: " + "; ".join(problems)
            + f". Leave them out of lora.targets, train with quantize_base=None, or use a data-parallel size whose"
            f" shards hold whole groups of {NF4_GROUP:,} elements"
        )
    for m in layers.values():
        m.weight = nn.Parameter(to_nf4_weight(m.weight, device), requires_grad=False)
    return [f"{name}.weight" for name in layers]


__all__ = ["ADAPTERS", "EXPERT_PROJECTIONS", "LoRA", "LoRAConfigError", "LoRAExperts", "LoRALinear",
           "adapters_disabled", "add_lora", "is_adapter_parameter", "quantize_lora_bases", "quantized_bases",
           "targets_reach_experts"]
