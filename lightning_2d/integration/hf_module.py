"""``HFCausalLMModule``: a LightningModule training a Hugging Face Llama-family decoder
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) under the 2D
strategies.

The models' plan and layout-independent initialization live in ``lightning_2d.models.hf_decoders``;
the public names are re-exported by ``lightning_2d.hf``. ``transformers`` is imported only when used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_2d._compat import trainer_of
from lightning_2d.checkpoint.hf import SafetensorsWeights
from lightning_2d.checkpoint.hf.weights import TransformersExpertsWeights
from lightning_2d.integration.distillation_module import TeacherSpec, folder_tokenizer, teacher_fields
from lightning_2d.integration.module import CausalLMModule
from lightning_2d.models.hf_decoders import (
    hf_moe_layers,
    check_hf_decoder,
    hf_validation_inputs,
    hf_config_problems,
    hf_decoder_plan,
    load_hf_config,
)
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.ops.init import module_init_specs
from lightning_2d.ops.distillation import DistillationConfig, DistillationConfigError
from lightning_2d.ops.lora import LoRA
from lightning_2d.ops.preference import PreferenceLoss
from lightning_2d.ops.moe import MoEArgs
from lightning_2d.parallel.distillation import TeacherFacts
from lightning_2d.parallel.modules import canonical_name


class HFCausalLMModule(CausalLMModule):
    """Trains a Hugging Face Llama-family ``*ForCausalLM`` under ``ModelParallel2DStrategy`` (or any strategy).

    The model is built from its config on the meta device; under the 2D strategy it is parallelized
    with ``hf_decoder_plan`` and each rank allocates only its shards, initialized by
    ``HFDecoderInit`` (the same weights at every layout and on one device) or read from
    ``init_from`` block by block. Loss, metrics and optimizer are those of ``LlamaLightningModule``.

    Args:
        config: A ``PretrainedConfig``, a dict with ``model_type`` (``"llama"``, ``"mistral"``,
            ``"qwen2"``, ``"qwen3"``) and the fields to set, or a model directory / ``config.json``; ``None``:
            ``init_from``'s config.
        config_overrides: Fields to change (``{"num_hidden_layers": 2}``).
        init_from: A Hugging Face model directory (``config.json`` + ``model.safetensors`` or shards)
            to start from instead of a random init; each rank reads only the blocks it holds.
        attn_implementation: The ``transformers`` attention kernel (``"sdpa"``, ``"eager"`` …).
        learning_rate: Peak learning rate (AdamW, warm-up then cosine decay: see ``LlamaLightningModule``).
        weight_decay: AdamW weight decay, applied to matrices only.
        betas: AdamW betas.
        eps: AdamW epsilon.
        fused: AdamW implementation: ``True`` fused kernel, ``False`` foreach, ``None`` chosen by device.
        warmup_steps: Linear warm-up steps.
        max_steps: Steps of the cosine decay; ``None`` uses the Trainer's estimate of the run length.
        min_lr_ratio: Final learning rate as a fraction of ``learning_rate``.
        init_seed: Seed of the initialization; ``None``: the run's seed.
        lora: Train low-rank adapters instead of the whole model (``lightning_2d.LoRA`` or a dict of its fields);
            see ``LlamaLightningModule``. Targets by Hugging Face names (``q_proj`` …) or ours (``wq`` …).
        lora_init_from: A peft LoRA folder to start the adapters from (see ``LlamaLightningModule``).
        preference: Preference tuning instead of next-token training (see ``LlamaLightningModule``); each token's
            log-probability from the logits.
        teacher: Distil from this decoder (with ``distillation``): a Hugging Face model folder, or a dict of
            ``config``, ``init_from`` and ``config_overrides`` (as this module's); any family this module trains,
            its vocabulary (and its folder's tokenizer) the student's. See ``LlamaLightningModule``.
        distillation: How the student learns from ``teacher`` (``lightning_2d.DistillationConfig`` or a dict).

    Raises:
        ValueError: A model type this module does not train, a config it cannot build or a folder whose weights do
            not fit it; ``lora``, ``preference`` or ``distillation`` settings out of their range.
        ParallelConfigError: Settings that cannot go together, whatever the layout (each problem with its fix).
        FileNotFoundError: An ``init_from`` or ``lora_init_from`` folder without its files.

    Example:
        ```python
        import lightning as L
        from lightning_2d import ChatDataModule, ModelParallel2DStrategy
        from lightning_2d.hf import HFCausalLMModule

        module = HFCausalLMModule(init_from="Qwen3-8B/", learning_rate=1e-5, warmup_steps=100)
        trainer = L.Trainer(devices=8, precision="bf16-mixed", strategy=ModelParallel2DStrategy(tensor_parallel_size=4))
        trainer.fit(module, ChatDataModule("chats.jsonl", tokenizer="Qwen3-8B/", seq_len=4096, batch_size=2))
        ```

        From the command line: a recipe's ``model:`` with ``class_path: lightning_2d.hf.HFCausalLMModule``
        (``recipes/hf_llama_cpu.yaml``).
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
        lora: Union[LoRA, dict, None] = None,
        lora_init_from: Optional[str] = None,
        preference: Union[PreferenceLoss, dict, None] = None,
        teacher: Union[str, dict, None] = None,
        distillation: Union[DistillationConfig, dict, None] = None,
    ) -> None:
        super().__init__()
        if config is None and init_from is None:
            raise ValueError("HFCausalLMModule needs a config (a dict with model_type, or a directory) or init_from")
        self.hf_config = load_hf_config(config if config is not None else init_from, config_overrides)
        if problems := hf_config_problems(self.hf_config):
            raise ValueError("HFCausalLMModule cannot train this model:\n  - " + "\n  - ".join(problems))
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = self.hf_config.to_dict()  # plain data: checkpoints load weights_only
        self._set_lora(lora)
        self._set_preference(preference)
        self.model: Optional[nn.Module] = None
        self._set_distillation(teacher, distillation)
        self._refuse_now()  # transformers' per-rank auxiliary loss, LoRA on its experts …
        # Names and shapes against the files, the LoRA targets against the model: now (on the meta device), before
        # any process starts.
        if init_from is not None or lora_init_from is not None or self.lora is not None:
            self.model = self._converted(self.build_model())
            self.weights_source()
            self.model = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def validation_inputs(self) -> dict[str, Any]:
        return {**super().validation_inputs(), **hf_validation_inputs(self.hf_config)}

    def parallel_plan(self, config: ParallelConfig) -> ParallelPlan:
        return hf_decoder_plan(self.hf_config, config, module="model")

    def base_weights(self, folder: Optional[str]) -> Any:
        """The model directory ``folder`` read block by block (names as in the model; every parameter but those their
        module initializes itself: LoRA's adapters), else ``None``."""
        assert self.model is not None or not folder
        return folder_weights(folder, self.model, self.hf_config)

    def resolve_teacher(self, teacher: Any) -> TeacherSpec:
        """A Hugging Face teacher: a model folder, or ``{config, init_from, config_overrides}`` read as this module
        reads its own."""
        given = teacher_fields(teacher, ("config", "init_from", "config_overrides"))
        config, init_from = given.get("config"), given.get("init_from")
        if config is None and init_from is None:
            raise DistillationConfigError(f"teacher needs a config (a dict with model_type, or a directory) or an"
                                          f" init_from folder, got {given}")
        hf_config = load_hf_config(config if config is not None else init_from, given.get("config_overrides"))
        if problems := hf_config_problems(hf_config):
            raise DistillationConfigError("HFCausalLMModule cannot distil from this teacher:\n  - "
                                          + "\n  - ".join(problems))
        self.hparams["teacher"] = {**given, "config": hf_config.to_dict()}  # plain data: checkpoints load weights_only
        plan = hf_decoder_plan(hf_config, ParallelConfig(), module="model")
        attention = self.hparams.attn_implementation
        return TeacherSpec(
            facts=TeacherFacts(f"folder {init_from}" if init_from else f"a {hf_config.model_type} config",
                               int(hf_config.vocab_size), plan.tp_divides, folder_tokenizer(init_from)),
            build=lambda: build_decoder(hf_config, attention),
            plan_of=lambda parallel: hf_decoder_plan(hf_config, parallel, module="model"),
            weights=lambda model: folder_weights(init_from, model, hf_config),
        )

    def weights_source(self) -> Any:
        """The ``init_from`` directory read block by block (names as in the model), if given."""
        base = self.base_weights(self.hparams.get("init_from"))
        return self._with_lora_init(base, self.model, None)  # adapters: their own init, or lora_init_from's

    def build_model(self) -> nn.Module:
        """The ``*ForCausalLM`` on the meta device (no memory, no initialization)."""
        return build_decoder(self.hf_config, self.hparams.attn_implementation)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Converted, parallelized, then allocated shard by shard by the 2D strategy; on one device (the parity
        # reference) the same conversion and materialization, the whole of each tensor.
        self.model = self.build_model()
        self._declare_reference(self.build_model)
        self._declare_teacher()
        strategy = getattr(trainer_of(self), "strategy", None)
        if not getattr(strategy, "materializes_meta_modules", False):
            self._configure_on_one_device()

    #: Packed documents (``document_mask``, ``ChatDataModule(pack=True)``) are kept apart by transformers itself:
    #: given ``position_ids`` that restart and no attention mask, its mask builder attends within each document
    #: (``masking_utils.find_packed_sequence_indices``), and the rotary positions restart with them.
    supports_document_mask = True

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return self.logits_of(self.model, input_ids, position_ids)

    def logits_of(self, model: nn.Module, input_ids: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["hf_config"] = self.hf_config.to_dict()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 · N`` (parameters except the embedding) + ``12 · L · H · Dh · T``."""
        c = self.hf_config
        heads, head_dim = c.num_attention_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        attention = c.hidden_size * head_dim * (2 * heads + 2 * kv)
        mlp = 3 * c.hidden_size * c.intermediate_size
        sparse, moe = len(hf_moe_layers(c)), MoEArgs.from_hf_config(c)
        if sparse and moe is not None:  # a mixture of experts' active parameters: the router and the top-k experts
            active = c.hidden_size * moe.num_experts + 3 * c.hidden_size * moe.hidden_dim * moe.top_k  # (torchtitan's)
            mlp = (mlp * (c.num_hidden_layers - sparse) + active * sparse) // c.num_hidden_layers
        matmul_params = c.num_hidden_layers * (attention + mlp) + c.vocab_size * c.hidden_size
        return 6 * matmul_params + 12 * c.num_hidden_layers * heads * head_dim * seq_len


def build_decoder(hf_config: Any, attn_implementation: str) -> nn.Module:
    """A ``*ForCausalLM`` of ``hf_config`` on the meta device (no memory, no initialization)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    check_hf_decoder(model)
    return model


def folder_weights(folder: Optional[str], model: Optional[nn.Module], hf_config: Any) -> Any:
    """The model directory ``folder`` read block by block with ``model``'s names and shapes (every parameter but those
    their module initializes itself: LoRA's adapters), else ``None``."""
    if not folder:
        return None
    assert model is not None
    own = {canonical_name(n) for n in module_init_specs(model)}
    expected = {canonical_name(n): tuple(p.shape) for n, p in model.named_parameters() if canonical_name(n) not in own}
    if hf_moe_layers(hf_config):  # transformers' fused experts, from fused or per-expert files
        return TransformersExpertsWeights(Path(folder), expected, hf_config.model_type)
    return SafetensorsWeights(Path(folder), expected)
