"""LoRA checkpoints out to Hugging Face: a peft adapter folder, or the adapters merged into their base.

A LoRA run's checkpoint holds the adapters only, with a record of their settings and base (``adapters`` in its
metadata: ``{"lora": {...}, "base": {"init_from": ..., "init_seed": ...}}``). From it:

- ``peft_tensors``/``adapter_config``: what ``peft.PeftModel.from_pretrained(base, folder)`` reads:
  ``adapter_model.safetensors`` under peft's key names (``base_model.model.model.layers.0.self_attn.q_proj
  .lora_A.weight``) and ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules`` in
  Hugging Face names, ``base_model_name_or_path`` from ``init_from``). Our Llama keeps Meta's rotary row order in
  ``wq``/``wk``; ``B``'s rows are those output rows, so they are permuted as the base weight is (``A`` is not).
- ``MergedWeights``: the base (read from ``init_from``, or drawn again from the recorded seed) with ``W + s·B A``
  folded in, one tensor at a time, as a checkpoint source the Hugging Face export writes like any other.

The routed experts' adapters (``ops.lora.LoRAExperts``: ``experts.w1_lora_a`` ``(E, r, in)``, ``…_lora_b``
``(E, out, r)``) go to peft as LoRA on transformers 5's fused expert parameters (peft's ``target_parameters``,
``lora.ParamWrapper``), and back (``lora_init_from``): ``mlp.experts.gate_up_proj`` takes ``w1``'s and ``w3``'s
adapters at once (``A`` stacked along the rank, ``B`` block-diagonal: rank ``2r`` and alpha ``2α`` in
``rank_pattern``/``alpha_pattern``, so the same scale), ``mlp.experts.down_proj`` ``w2``'s, in peft's flattened
layout (``lora_A`` ``(E·r, in)`` expert-major, ``lora_B`` ``(out, r·E)`` expert-minor). Both adapted:
``gate_up_proj``'s wrapper is the inner one (``experts.base_layer.lora_A``), as peft nests them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.checkpoint.errors import ExportError
from lightning_2d.checkpoint.hf.layout import (
    WeightInfo,
    expert_name,
    fused_expert_name,
    hf_name,
    hf_to_meta,
    meta_to_hf,
    rotary_heads,
)
from lightning_2d.checkpoint.hf.weights import HFWeights, SafetensorsWeights
from lightning_2d.models.hf_decoders import HFDecoderInit
from lightning_2d.models.llama.model import ModelArgs, Transformer
from lightning_2d.ops.init import SeededInit
from lightning_2d.ops.lora import ADAPTERS, EXPERT_ADAPTER_NAMES, LoRA

#: peft's prefix of every key: ``PeftModel.base_model`` (the LoRA model) → ``.model`` (the transformers model).
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_ADAPTER_NAME = re.compile(r"^(?P<module>.+)\.(?P<which>lora_a|lora_b)\.weight$")


def is_expert_adapter(name: str) -> bool:
    """Whether ``name`` is a routed experts' adapter (``layers.1.feed_forward.experts.w1_lora_a``)."""
    return name.rpartition(".")[2] in EXPERT_ADAPTER_NAMES


def split_adapter_name(name: str) -> tuple[str, str]:
    """``layers.0.attention.wq.lora_a.weight`` → ``("layers.0.attention.wq", "lora_a")``; a routed experts' adapter
    ``layers.1.feed_forward.experts.w1_lora_a`` → ``("layers.1.feed_forward.experts.w1", "lora_a")``."""
    if is_expert_adapter(name):
        module, _, param = name.rpartition(".")
        which, _, adapter = param.partition("_")
        return f"{module}.{which}", adapter
    match = _ADAPTER_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA adapter's weight (…lora_a.weight / …lora_b.weight)")
    return match["module"], match["which"]


def hf_module_name(module: str, native: bool) -> str:
    """The Hugging Face name of an adapted layer: ours mapped (``layers.0.attention.wq`` →
    ``model.layers.0.self_attn.q_proj``), a Hugging Face module's as it is."""
    return module if native else hf_name(module + ".weight").removesuffix(".weight")


def peft_tensors(
    name: str, tensor: torch.Tensor, args: Optional[ModelArgs], dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """One of our adapter weights (its name as in the checkpoint's model) under peft's key, in the Hugging Face
    layout: what ``adapter_model.safetensors`` holds of it.

    Args:
        name: The adapter weight's name (``layers.0.attention.wq.lora_b.weight``).
        tensor: Its value.
        args: Our Llama's args (its ``wq``/``wk`` rotary row order is permuted); ``None`` for a Hugging Face
            module's checkpoint (names and layout already transformers').
        dtype: The exported dtype (default: as stored).
    """
    module, which = split_adapter_name(name)
    tensor = tensor.to(dtype or tensor.dtype)
    heads = rotary_heads(module + ".weight", args) if args is not None else None
    if heads is not None and which == "lora_b":
        tensor = meta_to_hf(tensor, heads)  # B's rows are the base's output rows
    key = f"{PEFT_PREFIX}{hf_module_name(module, args is None)}.{'lora_A' if which == 'lora_a' else 'lora_B'}.weight"
    return {key: tensor.contiguous()}


def target_modules(modules: Sequence[str], n_layers: int) -> list[str]:
    """peft's ``target_modules`` for the adapted layers (Hugging Face names): their last names (``q_proj``) when each
    such layer is adapted in all ``n_layers`` blocks, else the full names (peft matches a name's suffix)."""
    by_leaf: dict[str, set[int]] = {}
    for module in modules:
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", module)
        by_leaf.setdefault(module.rsplit(".", 1)[-1], set()).add(int(layer[1]) if layer else -1)
    if all(layers == set(range(n_layers)) for layers in by_leaf.values()):
        return sorted(by_leaf)
    return sorted(modules)


def adapter_config(record: Mapping[str, Any], modules: Sequence[str], n_layers: int,
                   experts: Sequence[str] = (), moe_model_type: Optional[str] = None) -> dict[str, Any]:
    """``adapter_config.json`` of peft's LoRA for ``record`` (the checkpoint's adapters record), the adapted layers
    (Hugging Face names) and the model's number of blocks; ``experts``: the adapted stacked experts of ours
    (``layers.1.feed_forward.experts.w1``), written as peft's ``target_parameters`` on transformers' fused experts.

    Raises:
        ExportError: What peft cannot load as trained: expert adapters with dropout (peft's ``ParamWrapper`` refuses
            ``lora_dropout``); on a mixture of experts (``moe_model_type``), adapters on a dense block's MLP (peft
            0.21 maps every ``gate_proj``/``up_proj``/``down_proj`` target of Qwen3-MoE and Mixtral to the fused
            experts when it loads).
    """
    lora = LoRA.of(record["lora"])
    assert lora is not None
    base = record.get("base") or {}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.get("init_from"),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": target_modules(modules, n_layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    dense_mlp = sorted({m.rsplit(".", 1)[-1] for m in modules} & {"gate_proj", "up_proj", "down_proj"})
    if moe_model_type is not None and dense_mlp:
        raise ExportError(
            f"adapters on the dense blocks' MLP ({', '.join(dense_mlp)}) of a {moe_model_type} model cannot be"
            " written for peft: peft maps every gate_proj/up_proj/down_proj target of this family to the fused"
            " experts when it loads (transformers 5's conversion), dropping them. Export with --merge-lora, or train"
            " lora.targets without the dense blocks' w1/w2/w3"
        )
    if experts:
        if lora.dropout:
            raise ExportError(
                f"the routed experts' adapters were trained with lora.dropout={lora.dropout}; peft's LoRA on"
                " parameters (target_parameters, how it adapts transformers' fused experts) refuses dropout. Export"
                " with --merge-lora"
            )
        parameters = sorted({fused_expert_name(*expert_name(m)) for m in experts})  # type: ignore[misc]
        config["target_parameters"] = parameters
        fused = _fused_projections(experts)
        widths = {len(p) for (_, name), p in fused.items() if name == "gate_up_proj"}
        if len(widths) > 1:
            raise ExportError(
                "some blocks adapt both w1 and w3 of their routed experts, others one of them: peft's rank_pattern"
                " gives every fused gate_up_proj one rank. Export with --merge-lora, or adapt the same projections in"
                " every block"
            )
        if widths - {1}:  # w1 and w3 in one fused gate_up_proj: rank 2r, the same scale
            n = max(widths)
            config["rank_pattern"] = {"gate_up_proj": lora.rank * n}
            config["alpha_pattern"] = {"gate_up_proj": lora.alpha * (n ** 0.5 if lora.rslora else n)}
    return config


def _fused_projections(experts: Sequence[str]) -> dict[tuple[int, str], list[str]]:
    """``{(block, fused name): [our projections in it, in order]}`` of the adapted stacked experts ``experts``."""
    fused: dict[tuple[int, str], list[str]] = {}
    for module in experts:
        layer, which = expert_name(module)  # type: ignore[misc]
        fused.setdefault((layer, "down_proj" if which == "w2" else "gate_up_proj"), []).append(which)
    return {key: sorted(p, key="w1w3w2".index) for key, p in fused.items()}


class PeftTensors:
    """``ExportPlan.convert`` of a peft folder: each dense adapter weight as it comes (``peft_tensors``); a block's
    routed experts' adapters once all of them are read, as peft's tensors of the fused parameters they adapt
    (module docstring).

    Args:
        names: Every adapter weight the export reads.
        args, dtype: As ``peft_tensors``'.
    """

    def __init__(self, names: Sequence[str], args: Optional[ModelArgs], dtype: Optional[torch.dtype]) -> None:
        self.args, self.dtype = args, dtype
        self.expected: dict[int, set[str]] = {}
        for name in names:
            if is_expert_adapter(name):
                layer = expert_name(split_adapter_name(name)[0])[0]  # type: ignore[index]
                self.expected.setdefault(layer, set()).add(name)
        self.pending: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_expert_adapter(name):
            return peft_tensors(name, tensor, self.args, self.dtype)
        layer = expert_name(split_adapter_name(name)[0])[0]  # type: ignore[index]
        pending = self.pending.setdefault(layer, {})
        pending[name] = tensor
        if set(pending) != self.expected[layer]:
            return {}
        return self._layer(layer, self.pending.pop(layer))

    def _layer(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        prefix = next(iter(tensors)).rpartition(".")[0]  # layers.N.feed_forward.experts
        experts = sorted({split_adapter_name(n)[0] for n in tensors})
        fused = _fused_projections(experts)
        nested = len(fused) == 2  # both fused parameters adapted: gate_up_proj's wrapper inside down_proj's
        out = {}
        for (_, parameter), projections in fused.items():
            a = torch.cat([tensors[f"{prefix}.{w}_lora_a"] for w in projections], dim=1)  # (E, n·r, in)
            b = torch.stack([torch.block_diag(*parts) for parts in zip(
                *[tensors[f"{prefix}.{w}_lora_b"].unbind(0) for w in projections])])  # (E, n·out, n·r)
            if parameter == "gate_up_proj" and projections == ["w3"]:  # up rows only: the gate rows' B is zero
                b = torch.cat([torch.zeros_like(b), b], dim=1)
            elif parameter == "gate_up_proj" and projections == ["w1"]:
                b = torch.cat([b, torch.zeros_like(b)], dim=1)
            experts_n, rank, in_features = a.shape
            module = fused_expert_name(layer, "w2").rpartition(".")[0]  # model.layers.N.mlp.experts
            where = f"{PEFT_PREFIX}{module}{'.base_layer' if nested and parameter == 'gate_up_proj' else ''}"
            dtype = self.dtype or a.dtype
            out[f"{where}.lora_A.weight"] = a.reshape(experts_n * rank, in_features).to(dtype).contiguous()
            b = b.permute(1, 2, 0).reshape(b.shape[1], rank * experts_n)  # (out, r·E): index j·E + e
            out[f"{where}.lora_B.weight"] = b.to(dtype).contiguous()
        return out


class MergedWeights:
    """A checkpoint source (``weights``, ``read(names)``, ``metadata``) of the base with the adapters merged in.

    Args:
        adapters: The LoRA checkpoint's source (its adapter weights).
        base: Where the base's full tensors come from: ``fill_block_(out, name, shape, None)`` by our names
            (``HFWeights``/``SafetensorsWeights`` of ``init_from``, or ``SeededInit`` of the recorded seed).
        base_weights: ``(name, shape)`` of every base parameter, in the model's order.
        dtype: The dtype the base is materialized in before merging (the stored adapters' by default).
    """

    def __init__(self, adapters: Any, base: Any, base_weights: Sequence[tuple[str, tuple[int, ...]]],
                 dtype: torch.dtype) -> None:
        record = LoRA.of(adapters.metadata["adapters"]["lora"])
        assert record is not None
        self.scale, self.adapters, self.base, self.dtype = record.scale, adapters, base, dtype
        self.metadata = {k: v for k, v in adapters.metadata.items() if k != "adapters"}
        self.weights = [WeightInfo(name, tuple(shape), dtype) for name, shape in base_weights]
        self.adapted = {split_adapter_name(w.name)[0] for w in adapters.weights}

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        shapes = {w.name: w.shape for w in self.weights}
        for name in names:
            tensor = torch.empty(shapes[name], dtype=torch.float32)
            self.base.fill_block_(tensor, name, shapes[name], None)
            module = name.removesuffix(".weight")
            if module in self.adapted and expert_name(name) is not None:  # stacked experts: W_e + s·B_e A_e
                pair = dict(self.adapters.read([f"{module}_{which}" for which in ADAPTERS]))
                tensor += torch.bmm(pair[f"{module}_lora_b"].float(), pair[f"{module}_lora_a"].float()) * self.scale
            elif module in self.adapted:
                pair = dict(self.adapters.read([f"{module}.{which}.weight" for which in ADAPTERS]))
                tensor += (pair[f"{module}.lora_b.weight"].float() @ pair[f"{module}.lora_a.weight"].float()) * self.scale
            yield name, tensor.to(self.dtype)


def base_weights_of(metadata: Mapping[str, Any], args: Optional[ModelArgs]) -> tuple[Any, list[tuple[str, tuple[int, ...]]]]:
    """The base of a LoRA checkpoint as a weight source (our names for our Llama, transformers' for a Hugging Face
    module's) and its ``(name, shape)`` list: ``init_from`` read again, else the seeded init drawn again."""
    base = metadata["adapters"].get("base") or {}
    init_from = base.get("init_from")
    hf_config = metadata.get("hf_config")
    if hf_config is not None:
        import transformers  # an optional dependency, needed by a Hugging Face module's checkpoint only

        config = transformers.AutoConfig.for_model(**hf_config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        if init_from:
            return SafetensorsWeights(Path(init_from), dict(shapes)), shapes
        return SeededInit(HFDecoderInit(model).param_init_specs(), int(base["init_seed"])), shapes
    assert args is not None
    with torch.device("meta"):
        model = Transformer(args)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if init_from:
        return HFWeights(Path(init_from), args), shapes
    return SeededInit(model.param_init_specs(), int(base["init_seed"])), shapes


class PeftAdapterWeights:
    """A peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) read into our adapters: a weight
    source (``fill_block_``) for the adapter weights of a model built with the same settings, names and rotary rows
    mapped back (``lora_init_from``: continue training from a published or earlier adapter).

    Args:
        folder: The peft folder.
        lora: The settings the model is built with; the folder's ``r``, ``lora_alpha`` and ``use_rslora`` must agree.
        args: Our Llama's args (names mapped, ``wq``/``wk`` rows permuted back); ``None`` for a Hugging Face module.
        expected: ``{our adapter name: shape}`` of the model's adapters: each must be in the folder at that shape.

    Raises:
        ValueError: A missing file, other settings, or adapters the folder lacks or holds at another shape (every
            problem at once).
    """

    def __init__(self, folder: Path, lora: LoRA, args: Optional[ModelArgs], expected: Mapping[str, tuple[int, ...]]):
        import json

        from safetensors.torch import load_file

        folder = Path(folder)
        problems = []
        config_file, weights_file = folder / ADAPTER_CONFIG_FILE, folder / ADAPTER_WEIGHTS_FILE
        if not config_file.is_file() or not weights_file.is_file():
            pickled = sorted(p.name for p in folder.glob("*.bin"))
            never = (f" ({', '.join(pickled)} is never read: a pickle, which could run code when loaded; peft's"
                     " save_pretrained writes safetensors)") if pickled else ""
            raise ValueError(f"lora_init_from={str(folder)!r} is not a peft LoRA folder: it needs {ADAPTER_CONFIG_FILE}"
                             f" and {ADAPTER_WEIGHTS_FILE}{never}")
        config = json.loads(config_file.read_text())
        if config.get("peft_type", "LORA") != "LORA":
            problems.append(f"its peft_type is {config.get('peft_type')!r}, not 'LORA'")
        for key, ours in (("r", lora.rank), ("lora_alpha", lora.alpha), ("use_rslora", lora.rslora)):
            if key in config and config[key] != ours:
                problems.append(f"its {key} is {config[key]!r}, this model's lora gives {ours!r}")
        stored = load_file(str(weights_file))
        self.args, self.tensors = args, {}
        experts = {n: tuple(shape) for n, shape in expected.items() if is_expert_adapter(n)}
        if experts:
            self.tensors.update(_experts_from_peft(stored, config, lora, experts, problems))
        for name, shape in expected.items():
            if name in experts:
                continue
            module, which = split_adapter_name(name)
            key = f"{PEFT_PREFIX}{hf_module_name(module, args is None)}.{'lora_A' if which == 'lora_a' else 'lora_B'}"
            tensor = stored.get(key + ".weight", stored.get(key + ".default.weight"))
            if tensor is None:
                problems.append(f"{key}.weight: missing (the model adapts {module})")
                continue
            if tuple(tensor.shape) != tuple(shape):
                problems.append(f"{key}.weight: stored {tuple(tensor.shape)}, the model's is {tuple(shape)}")
                continue
            heads = rotary_heads(module + ".weight", args) if args is not None else None
            if heads is not None and which == "lora_b":
                tensor = hf_to_meta(tensor, heads)
            self.tensors[name] = tensor
        if problems:
            raise ValueError(f"lora_init_from={str(folder)!r} does not fit this model's adapters:\n  - "
                             + "\n  - ".join(problems[:12]) + ("\n  - …" if len(problems) > 12 else ""))

    def covers(self, name: str) -> bool:
        return name in self.tensors

    def fill_block_(self, out: torch.Tensor, name: str, global_shape: Sequence[int], offset: Any) -> None:
        tensor = self.tensors[name]
        offset = tuple(offset) if offset is not None else (0,) * tensor.dim()
        out.copy_(tensor[tuple(slice(o, o + n) for o, n in zip(offset, out.shape))])


def _pattern(config: Mapping[str, Any], key: str, parameter: str) -> Any:
    """``config[key]``'s value for ``parameter`` (``rank_pattern``/``alpha_pattern``: ours write ``gate_up_proj``,
    peft's own conversion ``.*\\.gate_up_proj``), else ``None``."""
    return next((v for k, v in (config.get(key) or {}).items() if k.endswith(parameter)), None)


def _experts_from_peft(stored: Mapping[str, torch.Tensor], config: Mapping[str, Any], lora: LoRA,
                       expected: Mapping[str, tuple[int, ...]], problems: list[str]) -> dict[str, torch.Tensor]:
    """The routed experts' adapters ``expected`` (our names and shapes) from peft's LoRA on transformers' fused expert
    parameters (what ``PeftTensors`` writes): the inverse of its layout, each fused ``B`` required block-diagonal
    (``w1``'s and ``w3``'s adapters apart; an adapter peft trained on the whole ``gate_up_proj`` is not two of ours)
    and each fused parameter's scale ours. Problems are appended to ``problems``."""
    import math

    out: dict[str, torch.Tensor] = {}
    by_layer: dict[int, list[str]] = {}
    for name in expected:
        by_layer.setdefault(expert_name(split_adapter_name(name)[0])[0], []).append(name)  # type: ignore[index]
    for layer, names in sorted(by_layer.items()):
        prefix = names[0].rpartition(".")[0]
        fused = _fused_projections(sorted({split_adapter_name(n)[0] for n in names}))
        module = f"{PEFT_PREFIX}{fused_expert_name(layer, 'w2').rpartition('.')[0]}"
        for (_, parameter), projections in fused.items():
            where = f"{module}{'.base_layer' if len(fused) == 2 and parameter == 'gate_up_proj' else ''}"
            a, b = stored.get(f"{where}.lora_A.weight"), stored.get(f"{where}.lora_B.weight")
            shapes = [expected[f"{prefix}.{w}_lora_{ab}"] for w in projections for ab in "ab"]
            experts, rank, in_features = shapes[0]
            n = len(projections)
            out_features = shapes[1][1] * (2 if parameter == "gate_up_proj" else 1)
            want_a, want_b = (experts * n * rank, in_features), (out_features, n * rank * experts)
            if a is None or b is None:
                problems.append(f"{where}.lora_A/lora_B.weight: missing (the model adapts {prefix}'s"
                                f" {', '.join(projections)}, peft's {parameter})")
                continue
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                problems.append(f"{where}.lora_A/lora_B.weight: stored {tuple(a.shape)}/{tuple(b.shape)}, the"
                                f" model's {prefix} {'+'.join(projections)} needs {want_a}/{want_b}")
                continue
            r = _pattern(config, "rank_pattern", parameter) or config.get("r", lora.rank)
            alpha = _pattern(config, "alpha_pattern", parameter) or config.get("lora_alpha", lora.alpha)
            scale = alpha / (math.sqrt(r) if config.get("use_rslora", lora.rslora) else r)
            if not math.isclose(scale, lora.scale, rel_tol=1e-6):
                problems.append(f"{where}: peft scales {parameter} by {scale:g}, this model's lora by {lora.scale:g}")
                continue
            a = a.reshape(experts, n * rank, in_features)
            b = b.reshape(out_features, n * rank, experts).permute(2, 0, 1)  # (E, out, n·r)
            rest = b.clone()
            for k, which in enumerate(projections):
                rows = slice(None) if parameter == "down_proj" else slice(0, out_features // 2) if which == "w1" \
                    else slice(out_features // 2, out_features)
                cols = slice(k * rank, (k + 1) * rank)
                out[f"{prefix}.{which}_lora_a"] = a[:, cols].contiguous()
                out[f"{prefix}.{which}_lora_b"] = b[:, rows, cols].contiguous()
                rest[:, rows, cols] = 0
            if rest.any():
                problems.append(f"{where}.lora_B.weight: not block-diagonal over {'+'.join(projections)} (an adapter"
                                f" of the whole fused {parameter}, which per-projection adapters cannot hold)")
    return out


class BaseWithPeftAdapters:
    """A weight source of the base (``init_from``) and a peft folder's adapters (``covers`` the adapters' names)."""

    def __init__(self, base: Any, adapters: PeftAdapterWeights) -> None:
        self.base, self.adapters = base, adapters

    def covers(self, name: str) -> bool:
        return self.adapters.covers(name)

    def fill_block_(self, out: torch.Tensor, name: str, global_shape: Sequence[int], offset: Any) -> None:
        source = self.adapters if self.adapters.covers(name) else self.base
        source.fill_block_(out, name, global_shape, offset)
