"""Hugging Face Llama-family decoders (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``)
under the 2D strategies: their parallel plan, their layout-independent initialization, and a
LightningModule that trains one. Public names are re-exported by ``lightning_2d.hf``.

These models share one module layout::

    model.embed_tokens                               vocabulary-parallel embedding
    model.layers.N.input_layernorm / post_attention_layernorm     RMSNorm (sequence-parallel)
    model.layers.N.self_attn.{q,k,v}_proj (+ bias)   column-wise: n_heads / tp heads per rank
    model.layers.N.self_attn.o_proj                  row-wise
    model.layers.N.mlp.{gate,up}_proj / down_proj    column-wise / row-wise
    model.norm, lm_head                              final norm, vocabulary-parallel head
    model.rotary_emb                                 rotary tables (non-persistent buffers)

Sequence parallelism differs from the plan of our own ``Transformer`` in one place. The HF model
runs code of its own between the embedding and the first layer on the embedding's output: the
positions (when ``position_ids`` is not given), the causal or padding mask and the rotary tables
are all derived from its shape. If the embedding returned this rank's slice of the sequence, as in
torchtitan's plan, each of those would silently describe a sequence ``tp`` times shorter. Here the
embedding's output stays whole (an all-reduce instead of a reduce-scatter) and the first layer
takes its slice (``SequenceShardInput``: no communication forward, an all-gather backward). The
extra cost is one activation-sized all-gather per step; every decoder layer runs exactly as under
torchtitan's plan, and a model called as ``model(input_ids)`` is correct with no extra arguments.

``transformers`` is imported only when one of these is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from lightning_2d.init import InitSpec
from lightning_2d.module import CausalLMModule
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.modules import canonical_name

if TYPE_CHECKING:
    from lightning_2d.hf import SafetensorsWeights

#: ``model_type`` values whose ``*ForCausalLM`` has the layout above.
HF_DECODER_TYPES = ("llama", "mistral", "qwen2")

#: Every parameter the built-in plan knows how to shard (names relative to the ``*ForCausalLM``).
_KNOWN_PARAMETER = re.compile(
    r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)"
    r"|model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.(weight|bias))"
)


def hf_config_problems(hf_config: Any) -> list[str]:
    """What keeps the built-in plan from applying to a model of ``hf_config`` (empty: it applies)."""
    problems = []
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in HF_DECODER_TYPES:
        problems.append(
            f"model_type {model_type!r} is not one of the Llama-family decoders the built-in plan knows"
            f" ({', '.join(HF_DECODER_TYPES)}); pass your own ParallelPlan to the strategy (or define"
            " parallel_plan(config) on your LightningModule)"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        problems.append(
            "tie_word_embeddings=True: the input embedding and lm_head share one weight, which tensor"
            " parallelism and FSDP shard as two modules; set tie_word_embeddings=False in the config (with"
            " init_from, the saved embedding is then read into lm_head as well when the checkpoint has no"
            " lm_head.weight)"
        )
    return problems


def check_hf_decoder(model: nn.Module) -> None:
    """Refuse a model whose parameters the built-in plan would not shard correctly (e.g. Qwen3's
    per-head ``q_norm``, whose gradient would then differ between tensor-parallel ranks)."""
    problems = hf_config_problems(model.config)
    unknown = [n for n, _ in model.named_parameters() if not _KNOWN_PARAMETER.fullmatch(canonical_name(n))]
    if unknown:
        problems.append(
            f"{type(model).__name__} has parameters outside the Llama layout the built-in plan shards"
            f" ({', '.join(unknown[:5])}{', …' if len(unknown) > 5 else ''}); pass your own ParallelPlan"
        )
    if problems:
        raise ValueError(f"{type(model).__name__} cannot use the built-in Hugging Face decoder plan:\n  - " + "\n  - ".join(problems))


def hf_decoder_plan(hf_config: Any, config: ParallelConfig, module: str = "model") -> ParallelPlan:
    """The tensor/sequence-parallel plan of a Hugging Face Llama-family ``*ForCausalLM``.

    Args:
        hf_config: The model's ``PretrainedConfig``.
        config: The strategy's options: ``sequence_parallel`` and ``loss_parallel`` shape the plan.
        module: Attribute of the owner holding the model (``"model"`` in ``HFCausalLMModule``;
            ``""`` when the plan applies to the model itself, as with Fabric).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_2d.parallel.tensor_parallel import SequenceShardInput

    if problems := hf_config_problems(hf_config):
        raise ValueError("The built-in Hugging Face decoder plan does not apply:\n  - " + "\n  - ".join(problems))
    sp, lp = config.sequence_parallel, config.loss_parallel
    between = Shard(1) if sp else Replicate()  # the residual stream between the layers
    block = "model.layers.*"
    styles: dict[str, Any] = {
        # Whole output even under SP: the model derives positions and masks from its shape (module docstring).
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp
        ),
    }
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        styles[f"{block}.{name}"] = ColwiseParallel()
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        styles[f"{block}.{name}"] = RowwiseParallel(output_layouts=between)
    if sp:
        styles["model.layers.0"] = SequenceShardInput("hidden_states")
        styles[f"{block}.input_layernorm"] = SequenceParallel()
        styles[f"{block}.post_attention_layernorm"] = SequenceParallel()
        # The decoder layer passes hidden_states to self_attn by keyword, to the MLP positionally.
        styles[f"{block}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        )
        styles[f"{block}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        # A plain tensor out of the base model (as without SP): lm_head gathers it.
        styles["model.norm"] = SequenceParallel(use_local_output=True)
    n_heads = hf_config.num_attention_heads
    return ParallelPlan(
        tensor_parallel=styles,
        blocks="model.layers",
        module=module,
        tp_divides={
            "num_attention_heads": n_heads,
            "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or n_heads,
        },
        input_units=("model.embed_tokens",),
        output_unit=("model.norm", "lm_head"),
        blocks_use_randomness=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0.0,
    )


class HFDecoderInit:
    """Layout-independent initialization of a Hugging Face Llama-family decoder (``ModelInitHooks``).

    The values follow the distributions of the model's own ``_init_weights`` (linear and embedding
    weights ``N(0, initializer_range)``, biases 0, RMSNorm weights 1) but are drawn by
    ``lightning_2d.init``: the same seed gives the same weights on one device and at every
    ``(dp, tp)`` layout. (Unlike ``_init_weights``, the ``pad_token_id`` row of the embedding is
    not zeroed.) The rotary tables are recomputed from the config.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def param_init_specs(self) -> dict[str, InitSpec]:
        std = float(getattr(self.model.config, "initializer_range", 0.02))
        specs, unknown = {}, []
        for module_name, module in self.model.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                name = canonical_name(f"{module_name}.{param_name}" if module_name else param_name)
                if param_name == "bias":
                    specs[name] = InitSpec("constant", value=0.0)
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    specs[name] = InitSpec("normal", std=std)
                elif "Norm" in type(module).__name__ and param_name == "weight":
                    specs[name] = InitSpec("constant", value=1.0)
                else:
                    unknown.append(f"{name} ({type(module).__name__})")
        if unknown:
            raise ValueError(
                f"No initialization is known for {', '.join(unknown)} of {type(self.model).__name__}; give the"
                " LightningModule a param_init_specs() returning an InitSpec for each (names relative to the model)"
            )
        return specs

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute each rotary module's tables (``inv_freq`` …) by building it again from its config."""
        for module in self.model.modules():
            buffers = dict(module.named_buffers(recurse=False))
            if not buffers or not hasattr(module, "config"):
                continue
            with torch.device("cpu"):
                fresh = type(module)(config=module.config)
            for name, value in fresh.named_buffers(recurse=False):
                if name in buffers:
                    buffers[name].copy_(value)


def load_hf_config(config: Union[str, Path, Mapping[str, Any], Any], overrides: Optional[Mapping[str, Any]] = None) -> Any:
    """A ``PretrainedConfig`` from a config object, a dict with ``model_type``, or a directory / ``config.json``."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        fields = config.to_dict()
    elif isinstance(config, Mapping):
        fields = dict(config)
    else:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(
                f"{config} is neither a Hugging Face model directory with a config.json nor a config.json file"
            )
        fields = json.loads(path.read_text())
    fields.update(overrides or {})
    if "model_type" not in fields:
        raise ValueError(f"The Hugging Face config needs a model_type (one of {', '.join(HF_DECODER_TYPES)}): {fields}")
    return AutoConfig.for_model(**fields)


class HFCausalLMModule(CausalLMModule):
    """Trains a Hugging Face Llama-family ``*ForCausalLM`` under ``ModelParallel2DStrategy`` (or any strategy).

    The model is built from its config on the meta device; under the 2D strategy it is parallelized
    with ``hf_decoder_plan`` and each rank allocates only its shards, initialized by
    ``HFDecoderInit`` (the same weights at every layout and on one device) or read from
    ``init_from`` block by block. Loss, metrics and optimizer are those of ``LlamaLightningModule``.

    Args:
        config: A ``PretrainedConfig``, a dict with ``model_type`` (``"llama"``, ``"mistral"``,
            ``"qwen2"``) and the fields to set, or a model directory / ``config.json``; ``None``:
            ``init_from``'s config.
        config_overrides: Fields to change (``{"num_hidden_layers": 2}``).
        init_from: A Hugging Face model directory (``config.json`` + ``model.safetensors`` or shards)
            to start from instead of a random init; each rank reads only the blocks it holds.
        attn_implementation: The ``transformers`` attention kernel (``"sdpa"``, ``"eager"`` …).
        learning_rate, weight_decay, betas, eps, fused, warmup_steps, max_steps, min_lr_ratio:
            AdamW and its warm-up/cosine schedule (see ``LlamaLightningModule``).
        init_seed: Seed of the initialization; ``None``: the run's seed.
    """

    def __init__(
        self,
        config: Union[str, dict, Any, None] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        init_from: Optional[str] = None,
        attn_implementation: str = "sdpa",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: Optional[bool] = None,
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        init_seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        if config is None and init_from is None:
            raise ValueError("HFCausalLMModule needs a config (a dict with model_type, or a directory) or init_from")
        self.hf_config = load_hf_config(config if config is not None else init_from, config_overrides)
        if problems := hf_config_problems(self.hf_config):
            raise ValueError("HFCausalLMModule cannot train this model:\n  - " + "\n  - ".join(problems))
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = self.hf_config.to_dict()  # plain data: checkpoints load weights_only
        self.model: Optional[nn.Module] = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def parallel_plan(self, config: ParallelConfig) -> ParallelPlan:
        return hf_decoder_plan(self.hf_config, config, module="model")

    def weights_source(self) -> Optional["SafetensorsWeights"]:
        """The ``init_from`` directory read block by block (names as in the model), if given."""
        from lightning_2d.hf import SafetensorsWeights

        init_from = self.hparams.get("init_from")
        if not init_from:
            return None
        assert self.model is not None
        return SafetensorsWeights(Path(init_from), {canonical_name(n): tuple(p.shape) for n, p in self.model.named_parameters()})

    def build_model(self) -> nn.Module:
        """The ``*ForCausalLM`` on the meta device (no memory, no initialization)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                self.hf_config, attn_implementation=self.hparams.attn_implementation, dtype=torch.float32
            )
        check_hf_decoder(model)
        return model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = self.build_model()
        strategy = self._trainer.strategy if self._trainer is not None else None
        if getattr(strategy, "materializes_meta_modules", False):
            self.model = model  # parallelized, then allocated shard by shard, by the strategy
            return
        # One device (the parity reference): the same materialization, the whole of each tensor.
        from lightning_2d.parallel.materialize import materialize_model

        self.model = model
        device = strategy.root_device if strategy is not None else torch.device("cpu")
        seed = self.init_seed if self.init_seed is not None else torch.initial_seed()
        if strategy is not None and strategy.world_size > 1:
            seed = strategy.broadcast(seed)
        materialize_model(model, device, seed=seed, weights=self.weights_source(), init_hooks=[self, HFDecoderInit(model)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return self.model(input_ids=input_ids, use_cache=False).logits

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["hf_config"] = self.hf_config.to_dict()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 · N`` (parameters except the embedding) + ``12 · L · H · Dh · T``."""
        c = self.hf_config
        heads, head_dim = c.num_attention_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        attention = c.hidden_size * head_dim * (2 * heads + 2 * kv)
        mlp = 3 * c.hidden_size * c.intermediate_size
        matmul_params = c.num_hidden_layers * (attention + mlp) + c.vocab_size * c.hidden_size
        return 6 * matmul_params + 12 * c.num_hidden_layers * heads * head_dim * seq_len
