"""What ``lightning-2d plan`` plans: a ``ModelArgs`` preset of our Llama, or a Hugging Face Llama-family decoder
read from its ``config.json`` (``HFDecoderArgs``), and the two things the planner needs of either: its plan
(``plan_of``) and the model itself on the meta device (``build_meta``).

A Hugging Face decoder is planned as ``HFCausalLMModule`` trains it: the ``*ForCausalLM`` that ``transformers``
builds from the config, with the built-in plan (``hf_decoder_plan``) applied by the real ``parallelize_model``.
So its parameters (q/k/v biases, Qwen3's per-head norms, a tied head) and their shards are the model's own,
not a formula's; its activations are estimated by the same per-block formula as our Llama's with the family's
differences (``activations.hf_architecture``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_2d.models.hf_decoders import (
    HF_DECODER_TYPES,
    check_hf_decoder,
    hf_config_problems,
    hf_decoder_plan,
    hf_moe_layers,
    hf_validation_inputs,
    load_hf_config,
)
from lightning_2d.models.llama.model import PRESETS, ModelArgs, Transformer
from lightning_2d.models.llama.plan import llama_plan, llama_validation_inputs
from lightning_2d.ops.lora import LoRA
from lightning_2d.ops.moe import MoEArgs
from lightning_2d.ops.preference import PreferenceLoss
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.tools.planner.activations import Architecture, hf_architecture


@dataclass(frozen=True)
class HFDecoderArgs:
    """A Hugging Face Llama-family decoder's shapes under the names ``ModelArgs`` uses (what the activation model
    and the suggestions read), with its config.

    Args:
        name: Where it came from (the ``config.json`` path), for the report.
        fields: The config's fields as read (with the overrides applied): the report's ``model_args``.
        config: The ``transformers`` ``PretrainedConfig`` built from them.
    """

    name: str
    fields: dict[str, Any]
    config: Any = field(repr=False)

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    @property
    def dim(self) -> int:
        return int(self.config.hidden_size)

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def n_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.n_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.dim // self.n_heads)

    @property
    def ffn_hidden_dim(self) -> int:
        return int(self.config.intermediate_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def architecture(self) -> Architecture:
        return hf_architecture(self.model_type)

    @property
    def moe(self) -> Optional[MoEArgs]:
        """The experts of its sparse blocks (Qwen3-MoE, Mixtral: ``MoEArgs.from_hf_config``), else ``None``."""
        return MoEArgs.from_hf_config(self.config)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The blocks whose ``mlp`` is a mixture of experts (``hf_moe_layers``)."""
        return hf_moe_layers(self.config)

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layers

    @property
    def sliding_layers(self) -> int:
        """Layers attending within a sliding window (``layer_types``; Mistral: every layer when it has one)."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            return sum(kind == "sliding_attention" for kind in layer_types)
        return self.n_layers if getattr(self.config, "sliding_window", None) else 0

    def num_params(self) -> int:
        """Parameters of the model ``transformers`` builds (on the meta device), a tied weight once."""
        return sum(p.numel() for p in build_meta(self).parameters())


#: What the planner plans.
PlannedArgs = Union[ModelArgs, HFDecoderArgs]


def max_seq_len_field(args: PlannedArgs) -> str:
    """The field that bounds the sequence length, as ``--model-overrides`` names it."""
    return "max_position_embeddings" if isinstance(args, HFDecoderArgs) else "max_seq_len"


def _config_path(model: str) -> Optional[Path]:
    """``model`` as a path to a config file (a directory: its ``config.json``), if it names one that exists or
    looks like a path rather than a preset name."""
    path = Path(model)
    if path.is_dir():
        return path / "config.json"
    if path.exists() or path.suffix == ".json" or "/" in model or "\\" in model:
        return path
    return None


def read_model(model: Union[str, Mapping[str, Any]], overrides: Optional[Mapping[str, Any]], problems: list[str]
               ) -> Optional[PlannedArgs]:
    """The model ``plan_run`` was given, or ``None`` with its problems appended (each prefixed ``model:``).

    A preset name gives ``ModelArgs``; a ``config.json`` (or a directory holding one), or its fields as a mapping,
    a ``HFDecoderArgs``. Everything that can be checked from the file's text (is it JSON, a Llama-family
    ``model_type``) is checked before ``transformers`` is imported.

    Args:
        model: A ``ModelArgs`` preset (``llama3-8b`` …), a path, or a Hugging Face config's fields.
        overrides: ``ModelArgs`` fields to change, or the config's.
        problems: Where to append what is wrong.
    """
    if isinstance(model, Mapping):
        return _hf_args(dict(model), "the given config", overrides, problems)
    if isinstance(model, ModelArgs):  # as a LightningModule built it (a recipe's model: lightning_2d.tools.recipe)
        try:
            return replace(model, **(overrides or {}))
        except (ValueError, TypeError) as err:
            lines = [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]] or [str(err)]
            problems.extend(f"model: {line}" for line in lines if line)
            return None
    if model in PRESETS:
        try:
            return ModelArgs.from_name(model, **(overrides or {}))
        except (ValueError, TypeError) as err:
            lines = [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]] or [str(err)]
            problems.extend(f"model: {line}" for line in lines if line)
            return None
    path = _config_path(str(model))
    known = (f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json of a Llama-family decoder"
             f" (model_type {', '.join(HF_DECODER_TYPES)}), or a directory holding one")
    if path is None:
        problems.append(f"model: {model!r} is not a preset name nor a path; give {known}")
        return None
    if not path.is_file():
        where = f"{path.parent} holds no config.json" if path.parent.is_dir() and str(model) != str(path) else (
            f"{path} does not exist")
        problems.append(f"model: {where}; give {known}")
        return None
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(f"model: {path} is not a JSON config ({err}); give {known}")
        return None
    if not isinstance(fields, dict):
        problems.append(f"model: {path} holds a JSON {type(fields).__name__}, not a config's object of fields")
        return None
    return _hf_args(fields, str(path), overrides, problems)


def _hf_args(fields: dict[str, Any], name: str, overrides: Optional[Mapping[str, Any]], problems: list[str]
             ) -> Optional[HFDecoderArgs]:
    fields = {**fields, **(overrides or {})}
    model_type = fields.get("model_type")
    if model_type not in HF_DECODER_TYPES:
        what = "has no model_type" if model_type is None else f"has model_type {model_type!r}"
        problems.append(
            f"model: {name} {what}; the planner knows the Llama-family decoders of the built-in plan:"
            f" model_type {', '.join(HF_DECODER_TYPES)}"
        )
        return None

    try:
        config = load_hf_config(fields)
    except (ValueError, TypeError) as err:  # transformers' own validation of the fields
        problems.append(f"model: {name}: {err}")
        return None
    problems.extend(f"model: {problem}" for problem in hf_config_problems(config))
    return HFDecoderArgs(name=name, fields=fields, config=config)


def plan_of(args: PlannedArgs, config: ParallelConfig) -> ParallelPlan:
    """The plan the strategy applies to the model (names relative to the model itself)."""
    if isinstance(args, HFDecoderArgs):
        return hf_decoder_plan(args.config, config, module="")

    return llama_plan(args, config)


def validation_inputs_of(args: PlannedArgs, lora: Optional[LoRA],
                         preference: Optional[PreferenceLoss] = None) -> dict[str, Any]:
    """What the module that trains ``args`` says of itself to the checks (``CausalLMModule.validation_inputs``):
    ``LlamaLightningModule``'s for a preset, ``HFCausalLMModule``'s for a ``config.json``, with ``lora`` and
    ``preference``."""
    if isinstance(args, HFDecoderArgs):
        return {"owner": "HFCausalLMModule", "lora": lora, "preference": preference,
                **hf_validation_inputs(args.config)}

    return {"owner": "LlamaLightningModule", "lora": lora, "preference": preference, **llama_validation_inputs(args)}


def build_meta(args: PlannedArgs, loss_chunk_size: Optional[int] = None) -> nn.Module:
    """The model on the meta device, as the LightningModule builds it (fp32; a Hugging Face decoder with SDPA)."""
    if isinstance(args, HFDecoderArgs):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(args.config, attn_implementation="sdpa", dtype=torch.float32)
        check_hf_decoder(model)
        return model
    with torch.device("meta"):
        return Transformer(args, loss_chunk_size=loss_chunk_size)


def model_fields(args: PlannedArgs) -> dict[str, Any]:
    """The report's ``model_args``: ``ModelArgs``' fields, or the Hugging Face config's as read."""
    from dataclasses import asdict

    return dict(args.fields) if isinstance(args, HFDecoderArgs) else asdict(args)
