"""``LlamaLightningModule``: a Llama transformer, its loss, metrics, optimizer and schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torchmetrics import MeanMetric

from lightning_2d._compat import trainer_of
from lightning_2d.checkpoint.hf import HFWeights, model_args_from_hf
from lightning_2d.checkpoint.hf.lora import BaseWithPeftAdapters, PeftAdapterWeights
from lightning_2d.checkpoint.subset import ADAPTERS_KEY, TrainedSubset, check_adapter_record
from lightning_2d.models import registry
from lightning_2d.models.llama.model import PRESETS, ModelArgs, RopeScaling, Transformer
from lightning_2d.ops.init import module_init_specs
from lightning_2d.integration.batches import document_positions_of, step_tokens_of
from lightning_2d.integration.distillation_module import Distillation, TeacherSpec, folder_tokenizer, teacher_fields
from lightning_2d.integration.preference_module import PreferenceTuning
from lightning_2d.ops.distillation import DistillationConfig, DistillationConfigError
from lightning_2d.ops.lora import LoRA
from lightning_2d.ops.preference import PreferenceLoss
from lightning_2d.models.llama.plan import llama_plan, llama_validation_inputs
from lightning_2d.parallel.checks import run_checks
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan, raise_if_problems
from lightning_2d.parallel.converters import ModelConverters
from lightning_2d.parallel.distillation import TeacherFacts
from lightning_2d.parallel.expert import LoadBalancing
from lightning_2d.parallel.frozen import materialize_frozen
from lightning_2d.parallel.context import context_shard
from lightning_2d.parallel.loss import next_token_loss, normalize_by_global_tokens
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.parallel.parallelize import convert_and_materialize
from lightning_2d.parallel.pipeline import Pipeline


#: The device types whose AdamW defaults to torch's fused kernel (``fused=None``).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def fused_adamw(requested: Optional[bool], device: torch.device) -> bool:
    """Whether AdamW runs fused: ``requested`` when given, else on ``FUSED_ADAMW_DEVICES`` (as torchtitan's default).
    On DTensor parameters the fused step is one op per parameter group, whose sharding DTensor works out once;
    the foreach step is about ten, each worked out again every step (torch 2.13 does not cache list-argument
    ops): on the 2x2 CPU parity jobs fused took a fifth less CPU in all."""
    return requested if requested is not None else device.type in FUSED_ADAMW_DEVICES


def warmup_cosine_schedule(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """LR factor per optimizer step: linear warm-up to 1 over ``warmup_steps``, then cosine to ``min_lr_ratio``.

    The first step runs at ``1 / warmup_steps`` of the peak (not 0, which would waste a step).
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class CausalLMModule(Distillation, PreferenceTuning, L.LightningModule):
    """What every next-token LightningModule here shares: the loss normalized by the global batch's
    tokens, logging, loss/perplexity metrics, greedy prediction, AdamW with warm-up and cosine decay.

    A subclass builds ``self.model`` in ``configure_model()``, defines ``forward(input_ids) → logits``
    and saves its hyperparameters (``learning_rate``, ``weight_decay``, ``betas``, ``eps``,
    ``fused``, ``warmup_steps``, ``max_steps``, ``min_lr_ratio``, ``init_seed``); it may override
    ``_loss`` (``LlamaLightningModule`` fuses the output projection into the loss).

    **Under pipeline parallelism** the model is split into stages over the pipeline ranks, and this
    module steps the pipeline itself, in ``training_step``: ``pipeline.train_step`` runs the forward and
    backward of every micro-batch (the schedule interleaves them) with ``grad_scale = 1 /
    accumulate_grad_batches`` (the division Lightning applies to the loss it differentiates), and
    returns the loss without a graph. So, through Lightning's own hooks, ``backward`` does nothing for it
    (and refuses a loss with a graph: a term added outside the pipeline would get no gradient), and the
    gradients are zeroed right after each optimizer step instead of at the start of an accumulation window
    (``optimizer_zero_grad`` runs after ``training_step``, which computed them). Everything else —
    accumulation, ``gradient_clip_val`` (the global norm over every stage), logging, checkpoints,
    validation (``pipeline.eval_step``) — is the Trainer's as usual. What changes meaning:
    ``on_before_backward`` sees a loss whose backward already ran (once per batch, not per micro-batch),
    ``on_after_backward`` sees the batch's gradients, and ``predict`` needs ``pipeline_parallel_size=1``.
    """

    #: Whether the model takes each packed document's ``position_ids`` (``TextDataModule(document_mask=True)``);
    #: the strategies refuse document masking before launch for a module that does not.
    supports_document_mask = False

    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        # Updated with values already reduced over the data-parallel group: no second sync.
        self.val_loss = MeanMetric(sync_on_compute=False)
        self.test_loss = MeanMetric(sync_on_compute=False)

    @property
    def init_seed(self) -> int | None:
        return self.hparams.init_seed

    @property
    def lora(self) -> Optional[LoRA]:
        """The adapters' settings (``lora=``), else ``None``: full fine-tuning."""
        return LoRA.of(self.hparams.get("lora"))

    @property
    def preference(self) -> Optional[PreferenceLoss]:
        """The preference loss (``preference=``: DPO and its relatives on ``PreferenceDataModule``'s pairs, KTO on its
        unpaired examples), else ``None``: next-token training."""
        return PreferenceLoss.of(self.hparams.get("preference"))

    def validation_inputs(self) -> dict[str, Any]:
        """What the registered checks (``parallel.checks.INPUTS``) may read of this module, before its model is built:
        its class (``owner``), its ``lora`` and ``preference`` settings, ``supports_document_mask``; a family adds
        its model's (``experts`` …). The strategies pass them to every validation
        (``models.registry.validation_inputs_of``)."""
        return {"owner": type(self).__name__, "lora": self.lora, "preference": self.preference,
                "supports_document_mask": self.supports_document_mask, **self.distillation_inputs()}

    def _refuse_now(self) -> None:
        """Raise the problems of the registered checks that read nothing but ``validation_inputs`` (no option, no world:
        LoRA on transformers' experts …), at construction, before anything is built or launched."""
        raise_if_problems(run_checks({}, self.validation_inputs()))

    def _set_lora(self, lora: "LoRA | dict | None") -> None:
        """Check ``lora`` now (before any process starts) and keep it as plain data in the hyperparameters. Under
        LoRA a checkpoint holds the adapters only: Lightning's own loaders (a single-device resume) then load it
        without the base (``strict_loading=False``; the 2D strategies check the adapters' names either way)."""
        self.hparams["lora"] = None if lora is None else LoRA.of(lora).to_dict()
        if lora is not None:
            self.strict_loading = False

    def _set_preference(self, preference: "PreferenceLoss | dict | None") -> None:
        """Check ``preference`` now (before any process starts) and keep it as plain data in the hyperparameters."""
        self.hparams["preference"] = None if preference is None else PreferenceLoss.of(preference).to_dict()

    def _with_lora_init(self, base: Any, model: torch.nn.Module, args: Optional[ModelArgs]) -> Any:
        """``base`` (the ``init_from`` source), with ``lora_init_from``'s adapters when given (checked against
        ``model``'s adapters now: every problem before any process starts)."""
        folder = self.hparams.get("lora_init_from")
        if not folder:
            return base
        if self.lora is None:
            raise ValueError(f"lora_init_from={folder!r} continues LoRA adapters, but lora= is not set: pass the"
                             " settings they were trained with (their adapter_config.json: r, lora_alpha)")
        if base is None:
            raise ValueError(f"lora_init_from={folder!r} needs the base its adapters were trained on: set init_from"
                             " (adapter_config.json's base_model_name_or_path names it)")

        # The adapters: the parameters their module initializes itself (no base holds them).
        own = {canonical_name(n) for n in module_init_specs(model)}
        expected = {canonical_name(n): tuple(p.shape) for n, p in model.named_parameters() if canonical_name(n) in own}
        return BaseWithPeftAdapters(base, PeftAdapterWeights(Path(folder), self.lora, args, expected))

    # ---- model converters (``parallel.converters``: ``lora=``'s adapters, QLoRA's NF4 bases) --------------------
    def _model_converters(self) -> ModelConverters:
        """The model converters this module asks for (what ``validation_inputs`` says: its ``lora=``), made with its
        plan; the strategies apply them (``parallelize_and_materialize``), one device ``configure_model`` does."""
        return ModelConverters.of(self._own_plan(), self.validation_inputs())

    def _own_plan(self) -> ParallelPlan:
        """The plan this module gives its model (the family's facts the converters read), layout aside."""
        return registry.resolve_plan(self, ParallelConfig(), None)

    def _converted(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (on the meta device) with the parameters its converters add (``lora=``'s adapters), to check the
        settings against it and read their names: the layout is not known (``shards=None``)."""
        self._model_converters().convert(model, None)
        return model

    def _configure_on_one_device(self) -> None:
        """Without the 2D strategy (one device: the parity reference): ``self.model`` (built on the meta device)
        converted and materialized as the strategies do, without the parallelism, with the same values."""
        trainer = trainer_of(self)
        strategy = trainer.strategy if trainer is not None else None
        device = strategy.root_device if strategy is not None else torch.device("cpu")
        seed = self.init_seed if self.init_seed is not None else torch.initial_seed()
        if strategy is not None and strategy.world_size > 1:
            seed = strategy.broadcast(seed)
        self._base_init_seed = seed
        try:
            convert_and_materialize(self, self._own_plan(), device, seed, self.validation_inputs(),
                                    registry.known_init_hooks)
            self.release_cached_frozen_models()  # a copy whose values the data's cache holds is never built
            for frozen in self.frozen_models():  # the same values as the trained model starts from (a teacher: its own)
                plan = frozen.plan_of(ParallelConfig()) if frozen.plan_of is not None else self._own_plan()
                materialize_frozen(frozen, plan, device, seed, registry.known_init_hooks)
        except BaseException:
            self.model = None  # not built: configure_model builds it again
            raise

    # ---- adapters-only checkpoints ------------------------------------------------------------
    def adapter_base(self) -> dict[str, Any]:
        """What the frozen base of a LoRA run is made of: ``init_from``'s folder, else the seed of its init."""
        init_from = self.hparams.get("init_from")
        if init_from:
            return {"init_from": str(Path(init_from).resolve()), "init_seed": None}
        parallelized = getattr(self._strategy(), "parallelized", None)
        seed = getattr(parallelized, "init_seed", None)
        return {"init_from": None, "init_seed": seed if seed is not None else self._base_init_seed}

    _base_init_seed: Optional[int] = None  # the seed a single-device configure_model initialized from

    def _own_checkpoint_subset(self) -> tuple[bool, Optional[TrainedSubset]]:
        """Whether this module applies its checkpoints' subset itself (under Lightning's own strategies, which it
        converts for; the 2D strategies' checkpoint IO applies it there), and the subset (``None``: the whole
        model)."""
        if getattr(self._strategy(), "materializes_meta_modules", False):
            return False, None
        return True, TrainedSubset.of(self._model_converters(), self.adapter_base())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Under LoRA, the checkpoint holds the adapters only (with their optimizer state, the data position and the
        schedule, as always) and records their settings and base (``adapter_base``): a resume rebuilds the base.
        The 2D strategies' checkpoint IO does this for them (``DistributedCheckpointIO.trained_subset``); under
        Lightning's own strategies the module applies the same subset here."""
        own, subset = self._own_checkpoint_subset()
        if own and subset is not None:
            subset.apply(checkpoint, "state_dict")
        self._record_reference(checkpoint)  # where a frozen reference copy comes from (preference_module)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adapters trained on another base or with other settings are refused before Lightning loads them (the 2D
        strategies' checkpoint IO checks the same earlier, before reading any tensor)."""
        record = checkpoint.get(ADAPTERS_KEY)
        own, subset = self._own_checkpoint_subset()
        if record is not None and own:
            check_adapter_record(record, subset, Path("<the checkpoint>"))
        self._check_reference(checkpoint)

    @property
    def vocab_size(self) -> int:
        """Size of the model's vocabulary (every token id of the data must be below it)."""
        raise NotImplementedError

    def _strategy(self) -> Any:
        """The strategy running this module (the Trainer's, or Fabric's when set up there), else ``None``."""
        trainer = trainer_of(self)
        if trainer is not None:
            return trainer.strategy
        return self.fabric.strategy if self.fabric is not None else None

    @property
    def pipeline(self) -> Pipeline | None:
        """The model's ``Pipeline`` under pipeline parallelism (the strategy's ``pipeline``: what
        ``parallelize_model`` returned for this model), else ``None``."""
        return getattr(self._strategy(), "pipeline", None)

    @property
    def meshes(self) -> Any:
        """What the loss and the context split read: the strategy's ``ParallelMeshes``, else ``device_mesh``
        (Lightning's own strategy's 2D mesh, or ``None`` without one)."""
        meshes = getattr(self._strategy(), "meshes", None)
        return meshes if meshes is not None else self.device_mesh

    # ---- steps --------------------------------------------------------------------------------
    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return next_token_loss(self(batch["input_ids"], **document_positions_of(batch)), batch["labels"], self.meshes,
                               **self._step_tokens(batch))

    def _step_tokens(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The step's token count for the loss (training batches of ``ChatDataModule``), else ``{}``."""
        trainer = trainer_of(self)
        accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        return step_tokens_of(batch, accumulate) if self.training else {}

    def _eval_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = context_shard(batch, self.meshes)
        preference = self.preference
        if preference is not None:
            _, mean, pairs, _ = self._preference_step(preference, batch, train=False)
            return mean, mean, pairs
        pipeline = self.pipeline
        if pipeline is not None:
            return pipeline.eval_step(batch["input_ids"], batch["labels"], **document_positions_of(batch))
        return self._loss(batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        rows = batch
        batch = context_shard(batch, self.meshes)  # under context parallelism: this rank's part of each sequence
        pipeline, preference = self.pipeline, self.preference
        global_tokens = None
        if self.distillation is not None:  # the student against its teacher (integration/distillation.py), whole rows
            loss, global_mean, global_tokens, metrics = self._distillation_step(rows, train=True)
            for name, value in metrics.items():
                self.log(name, value)
        elif preference is not None:  # a pair's loss (integration/preference.py; in the last stage under a pipeline)
            loss, global_mean, _, metrics = self._preference_step(preference, batch, train=True)
            for name, value in metrics.items():  # TRL's metrics beside it
                self.log(name, value)
        elif pipeline is not None:  # forward and backward of every micro-batch, here (see the class docstring)
            scale = 1.0 / self.trainer.accumulate_grad_batches
            loss, global_mean, global_tokens = pipeline.train_step(
                batch["input_ids"], batch["labels"], grad_scale=scale, **document_positions_of(batch),
                **self._step_tokens(batch),
            )
        else:
            loss, global_mean, global_tokens = self._loss(batch)
        router_loss = self._router_loss() if pipeline is None else None
        if router_loss is not None:  # a mixture of experts' load balancing, from this forward's routing
            loss = loss + router_loss
        if pipeline is not None:  # the stages added it inside the schedule: its value only
            self._log_pipelined_router_loss(pipeline)
        # Already reduced over the data-parallel group: no sync_dist needed.
        self.log("train_loss", global_mean, prog_bar=True)
        if global_tokens is not None:
            self.log("global_tokens", global_tokens)
        return loss

    def _router_loss(self) -> torch.Tensor | None:
        """The term a mixture of experts adds to the training loss (its load-balancing loss), else ``None``."""
        return None

    def _log_pipelined_router_loss(self, pipeline: Pipeline) -> None:
        """Under a pipeline the stages add a mixture of experts' load-balancing loss inside the schedule: log its
        value (nothing is added to the graph-free loss)."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.pipeline is None:
            super().backward(loss, *args, **kwargs)
        elif loss.requires_grad:
            raise RuntimeError(
                "Under pipeline parallelism the gradients are computed by pipeline.train_step in training_step;"
                " the loss given to backward has a graph, so a term was added outside the pipeline and would get"
                " no gradient. Return the loss of pipeline.train_step unchanged."
            )

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self.pipeline is None:  # under a pipeline the gradients are zeroed after each step (optimizer_step)
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.pipeline is not None:
            optimizer.zero_grad()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, global_mean, global_tokens = self._eval_loss(batch)
        self.val_loss.update(global_mean, weight=global_tokens)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, global_mean, global_tokens = self._eval_loss(batch)
        self.test_loss.update(global_mean, weight=global_tokens)

    def _log_loss_and_perplexity(self, metric: MeanMetric, prefix: str) -> None:
        loss = metric.compute()
        # Fresh states created under validate()'s inference mode would be inference tensors that a
        # later fit() (whose sanity check runs under no_grad) cannot update.
        with torch.inference_mode(False):
            metric.reset()
        # Already global (identical on every rank); sync_dist averages identical values and keeps
        # Lightning from warning about epoch-level logging without it.
        self.log(f"{prefix}_loss", loss, prog_bar=prefix == "val", sync_dist=True)
        self.log(f"{prefix}_perplexity", loss.exp(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._log_loss_and_perplexity(self.val_loss, "val")

    def on_test_epoch_end(self) -> None:
        self._log_loss_and_perplexity(self.test_loss, "test")

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Greedy next-token ids ``(B, T)`` and each sequence's mean negative log-likelihood ``(B,)``."""
        if context_shard(batch, self.meshes) is not batch:
            raise RuntimeError(
                "predict under context parallelism would return each rank's slice of the sequences; predict with"
                " context_parallel_size=1 (a checkpoint moves between layouts)"
            )
        logits = self(batch["input_ids"], **document_positions_of(batch))
        if hasattr(logits, "full_tensor"):  # vocabulary-sharded under loss parallelism
            logits = logits.full_tensor()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        mask = batch["labels"] != -100
        return {
            "next_token": logits.argmax(-1),
            "nll": (nll * mask).sum(-1) / mask.sum(-1).clamp(min=1),
        }

    # ---- optimization -------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        hp = self.hparams
        trained = [p for p in self.model.parameters() if p.requires_grad]  # under LoRA the adapters only
        decay = [p for p in trained if p.ndim >= 2]
        no_decay = [p for p in trained if p.ndim < 2]
        fused = fused_adamw(hp.fused, self.device)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            eps=hp.eps,
            fused=fused,
            foreach=None if fused else True,
        )
        total = hp.max_steps if hp.max_steps is not None else int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine_schedule(hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LlamaLightningModule(CausalLMModule):
    """Trains a Llama ``Transformer`` on next-token prediction.

    Works under a plain single-device ``Trainer`` (the reference for parity) and under
    ``ModelParallel2DStrategy``, which parallelizes and materializes the model built here on the
    meta device.

    Args:
        model: A preset name (``"debug"``, ``"llama3-8b"``, … see ``lightning_2d.models.llama.model.PRESETS``),
            ``ModelArgs`` (or their dict); ``None``: from ``init_from``'s ``config.json`` if given,
            else ``"debug"``.
        model_overrides: Fields of the preset to change (``{"n_layers": 2}``).
        learning_rate: Peak learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to norm weights).
        betas: AdamW betas.
        eps: AdamW epsilon.
        fused: AdamW implementation: ``True`` fused kernel, ``False`` foreach, ``None`` fused on
            CUDA and CPU (``fused_adamw``), foreach elsewhere.
        warmup_steps: Linear warm-up steps.
        max_steps: Steps of the cosine decay; ``None`` uses the Trainer's estimate of the run length.
        min_lr_ratio: Final learning rate as a fraction of ``learning_rate``.
        init_seed: Seed of the weight initialization; ``None`` uses the run's seed
            (``seed_everything``) broadcast from rank 0. The same seed gives the same weights at
            every parallel layout.
        init_from: A Hugging Face Llama directory (``config.json`` + ``model.safetensors`` or
            shards) to start from instead of a random init; under the 2D strategy each rank reads
            only the blocks it holds.
        fused_loss: Compute the training/validation loss with the output projection fused into the
            cross-entropy, ``loss_chunk_size`` tokens at a time: the ``(batch, seq, vocab)`` logits
            are never materialized, and under tensor parallelism never gathered (each rank works on
            its vocabulary slice). ``False``: logits, then ``F.cross_entropy`` (the strategy's
            ``loss_parallel`` option then decides whether the logits are gathered).
        loss_chunk_size: Tokens per chunk of the fused loss; the largest logits buffer is
            ``loss_chunk_size × vocab_size / tensor_parallel_size`` fp32 numbers. ``None``: sized by memory, as many
            tokens as keep that buffer within 64 MiB but never fewer than 1024 (``auto_chunk_tokens``): a small
            vocabulary's micro-batch in one chunk (one collective under tensor parallelism), a real one's 1024.
        lora: Train low-rank adapters instead of the whole model (``lightning_2d.LoRA`` or a dict of its fields):
            the base (``init_from``, or the seeded init) is frozen and only the adapters are optimized. Targets by
            our names (``wq``, ``w1`` …) or Hugging Face's (``q_proj``, ``gate_proj`` …); default all seven
            projections.
        lora_init_from: A peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) whose adapters
            start the training instead of peft's init; needs ``lora`` with its settings and ``init_from`` (its base).
        preference: Preference tuning (``lightning_2d.PreferenceLoss`` or a dict of its fields: DPO, IPO, hinge,
            robust, SimPO, ORPO on ``PreferenceDataModule``'s pairs, KTO on its unpaired examples) instead of
            next-token training; the reference of a DPO-family loss or KTO is, under ``lora``, the base with its
            adapters off.
        teacher: Distil from this model (with ``distillation``): a preset name, a Hugging Face Llama-family folder
            (``init_from``'s kind), or a dict of ``model``, ``init_from`` and ``model_overrides`` (as this module's);
            its vocabulary (and its folder's tokenizer) must be the student's. Held frozen beside the student: its
            own plan on the same meshes, FSDP-sharded, in no checkpoint or optimizer; without ``init_from`` the
            seeded init from the student's seed.
        distillation: How the student learns from ``teacher`` (``lightning_2d.DistillationConfig`` or a dict of its
            fields: the divergence, its temperature, ``alpha`` its weight against the next-token loss, the tokens).

    Raises:
        ModelArgsError: An unknown preset or ``ModelArgs`` field, or model args that do not hold together. This
            and the errors below are raised at construction, before the Trainer launches any process.
        ValueError: A ``loss_chunk_size`` below 1; ``lora``, ``preference`` or ``distillation`` settings out of
            their range (``LoRAConfigError``, ``PreferenceConfigError``, ``DistillationConfigError``); an
            ``init_from`` folder whose ``config.json`` or weights do not fit the model.
        ParallelConfigError: Settings that cannot go together, whatever the layout (each problem with its fix).
        FileNotFoundError: An ``init_from`` or ``lora_init_from`` folder without its files.

    Example:
        ```python
        import lightning as L
        from lightning_2d import LlamaLightningModule, LoRA, ModelParallel2DStrategy, TextDataModule

        # pre-training from the seeded init
        module = LlamaLightningModule("llama3-8b", learning_rate=3e-4, warmup_steps=2000, max_steps=100_000)
        # LoRA fine-tuning of a Hugging Face checkpoint
        module = LlamaLightningModule(init_from="Meta-Llama-3-8B/", lora=LoRA(rank=16, alpha=32))

        trainer = L.Trainer(devices=8, precision="bf16-mixed", strategy=ModelParallel2DStrategy(tensor_parallel_size=8))
        trainer.fit(module, TextDataModule("corpus/", tokenizer="Meta-Llama-3-8B/", seq_len=8192, batch_size=1))
        ```
    """

    supports_document_mask = True

    def __init__(
        self,
        model: Union[str, ModelArgs, dict, None] = None,
        model_overrides: dict[str, Any] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: bool | None = None,
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        init_seed: int | None = None,
        init_from: str | None = None,
        fused_loss: bool = True,
        loss_chunk_size: Optional[int] = None,
        lora: Union[LoRA, dict, None] = None,
        lora_init_from: str | None = None,
        preference: Union[PreferenceLoss, dict, None] = None,
        teacher: Union[str, dict, None] = None,
        distillation: Union[DistillationConfig, dict, None] = None,
    ) -> None:
        super().__init__()
        if loss_chunk_size is not None and loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be a positive number of tokens, got {loss_chunk_size}")
        self.save_hyperparameters()
        self._set_lora(lora)
        self._set_preference(preference)
        overrides = model_overrides or {}
        if any(isinstance(value, RopeScaling) for value in overrides.values()):  # plain data, as "model" below
            self.hparams["model_overrides"] = {
                key: asdict(value) if isinstance(value, RopeScaling) else value for key, value in overrides.items()
            }
        if model is None and init_from is not None:
            self.model_args = ModelArgs(**{**asdict(model_args_from_hf(Path(init_from))), **overrides})
        elif isinstance(model, (ModelArgs, dict)):
            fields = asdict(model) if isinstance(model, ModelArgs) else model
            self.model_args = ModelArgs(**{**fields, **overrides})
            self.hparams["model"] = asdict(self.model_args)  # plain data: checkpoints load weights_only
        else:
            self.model_args = ModelArgs.from_name(model or "debug", **overrides)
        self.model: Transformer | None = None
        self._set_distillation(teacher, distillation)
        self._refuse_now()
        if init_from is not None or lora_init_from is not None:  # the files against the model now, before any process
            self.weights_source()
        if self.lora is not None:  # the targets (and the model's kind) against the model now (a meta build: no memory)
            with torch.device("meta"):
                self._converted(Transformer(self.model_args))

    @property
    def vocab_size(self) -> int:
        return self.model_args.vocab_size

    def resolve_teacher(self, teacher: Any) -> TeacherSpec:
        """A Llama teacher: a preset name, a Hugging Face Llama-family folder, or ``{model, init_from,
        model_overrides}`` read as this module reads its own."""
        given = teacher_fields(teacher, ("model", "init_from", "model_overrides"))
        model, init_from, overrides = given.get("model"), given.get("init_from"), given.get("model_overrides") or {}
        if isinstance(model, ModelArgs):
            given["model"] = model = asdict(model)
        self.hparams["teacher"] = given  # plain data: checkpoints load weights_only
        if model is None and init_from is None:
            raise DistillationConfigError("teacher needs a model (a preset name, ModelArgs or their dict) or an"
                                          f" init_from folder, got {given}")
        if model is None:
            args = ModelArgs(**{**asdict(model_args_from_hf(Path(init_from))), **overrides})
        elif isinstance(model, dict):
            args = ModelArgs(**{**model, **overrides})
        elif model in PRESETS:
            args = ModelArgs.from_name(model, **overrides)
        else:
            raise DistillationConfigError(f"teacher={model!r} is neither a model folder (no directory there) nor a"
                                          f" preset ({', '.join(PRESETS)})")
        name = f"folder {init_from}" if init_from else f"preset {model!r}" if isinstance(model, str) else "ModelArgs"
        plan = llama_plan(args, ParallelConfig(), module="model")
        chunk = self.hparams.loss_chunk_size
        return TeacherSpec(
            facts=TeacherFacts(name + (f" with {overrides}" if overrides else ""), args.vocab_size, plan.tp_divides,
                               folder_tokenizer(init_from)),
            build=lambda: Transformer(args, loss_chunk_size=chunk),
            plan_of=lambda config: llama_plan(args, config, module="model"),
            weights=lambda model: HFWeights(Path(init_from), args) if init_from else None,
        )

    # ---- model construction -------------------------------------------------------------------
    def base_weights(self, folder: Optional[str]) -> HFWeights | None:
        """The weights of the Hugging Face Llama folder ``folder`` (read block by block), else ``None``."""
        return HFWeights(Path(folder), self.model_args) if folder else None

    def weights_source(self) -> HFWeights | None:
        """Where the initial weights come from instead of the seeded init (``init_from``), if anywhere."""
        base = self.base_weights(self.hparams.get("init_from"))
        if not self.hparams.get("lora_init_from"):
            return base
        with torch.device("meta"):  # the adapters' names and shapes
            model = self._converted(Transformer(self.model_args))
        return self._with_lora_init(base, model, self.model_args)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        # The exact shapes, so `lightning-2d export` needs neither the preset table nor the overrides.
        checkpoint["model_args"] = asdict(self.model_args)

    def validation_inputs(self) -> dict[str, Any]:
        return {**super().validation_inputs(), **llama_validation_inputs(self.model_args)}

    def parallel_plan(self, config: ParallelConfig) -> ParallelPlan:
        """The Llama plan: Meta's module names, the sizes tensor parallelism must divide, and the model's facts the
        checks read (``num_experts``, ``aux_loss_coef``)."""
        return llama_plan(self.model_args, config, module="model")

    @property
    def load_balancing(self) -> LoadBalancing:
        """The experts' load balancing over the strategy's meshes (``parallel.expert.LoadBalancing``: the object a
        Fabric loop uses too)."""
        return LoadBalancing(self.model_args.moe, self.meshes)

    def _router_loss(self) -> torch.Tensor | None:
        balancing = self.load_balancing.loss(self.model) if self.model is not None else None
        if balancing is None:
            return None
        term, value = balancing
        self.log("train_aux_loss", value)
        return term

    def _log_pipelined_router_loss(self, pipeline: Pipeline) -> None:
        value = self.load_balancing.pipelined_loss(pipeline)  # the stages trained it in the schedule
        if value is not None:
            self.log("train_aux_loss", value)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.model is not None:
            self.load_balancing.after_optimizer_step(self.model)  # aux-loss-free balancing, if the layers use it

    def configure_model(self) -> None:
        if self.model is not None:
            return
        trainer = trainer_of(self)
        strategy = trainer.strategy if trainer is not None else None
        config = getattr(strategy, "parallel_config", None)
        if getattr(config, "loss_parallel", False) and self.hparams.fused_loss:
            rank_zero_warn(
                "loss_parallel=True has no effect on LlamaLightningModule(fused_loss=True): the fused loss never"
                " gathers the logits (each rank works on its vocabulary slice) whatever the option. Drop"
                " loss_parallel, or use fused_loss=False to compute the loss from vocabulary-sharded logits."
            )
        # The empty model: the 2D strategy converts and parallelizes it, then allocates only each rank's shards; on
        # one device the same conversion, then the whole tensors (the same values).
        with torch.device("meta"):
            self.model = Transformer(self.model_args, loss_chunk_size=self.hparams.loss_chunk_size)
        self._declare_reference(lambda: Transformer(self.model_args, loss_chunk_size=self.hparams.loss_chunk_size))
        self._declare_teacher()
        if not getattr(strategy, "materializes_meta_modules", False):
            self._configure_on_one_device()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return self.model(input_ids, position_ids=position_ids)

    # ---- steps --------------------------------------------------------------------------------
    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        if self.hparams.fused_loss:
            loss_sum = self.model(batch["input_ids"], labels=batch["labels"], **document_positions_of(batch))
            return normalize_by_global_tokens(loss_sum, batch["labels"], self.meshes, **self._step_tokens(batch))
        return super()._loss(batch)

    def logits_of(self, model: torch.nn.Module, input_ids: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return model(input_ids, position_ids=position_ids)

    def token_log_probs(self, batch: dict[str, torch.Tensor], model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        """Each position's log-probability of its label from the fused head (``per_token=True``: no full logits,
        vocabulary-parallel under tensor parallelism)."""
        if not self.hparams.fused_loss:
            return super().token_log_probs(batch, model)
        model = model if model is not None else self.model
        assert model is not None, "call configure_model() first (the Trainer does)"
        return model(batch["input_ids"], labels=batch["labels"], per_token=True, **document_positions_of(batch))

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at ``seq_len`` (for throughput/MFU, see ``TokenThroughputMonitor``)."""
        return self.model_args.flops_per_token(seq_len)
