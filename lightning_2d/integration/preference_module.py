"""``PreferenceTuning``: what ``preference=`` adds to the causal-LM modules — each token's log-probability under
the trained model and under the reference (a frozen copy held beside it, the base with its adapters off, or values
precomputed into the data), the models held beside the trained one, and the step that dispatches to the paired and
KTO losses of ``integration/preference.py``, pipelined or not.

A mixin of ``CausalLMModule`` (``integration/module.py``), which gives it ``hparams``, ``lora``, ``preference``,
``model``, ``meshes``, ``pipeline``, ``adapter_base`` and ``_own_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d._compat import trainer_of
from lightning_2d.checkpoint.errors import CheckpointError
from lightning_2d.integration.batches import document_positions_of
from lightning_2d.integration.preference import (
    kto_step,
    pipelined_kto_step,
    pipelined_preference_step,
    preference_step,
    reference_key,
    reference_pass,
)
from lightning_2d.ops.lora import adapters_disabled
from lightning_2d.ops.preference import PreferenceConfigError, PreferenceLoss
from lightning_2d.parallel.frozen import FrozenModel
from lightning_2d.parallel.loss import loss_parallel_context


class PreferenceTuning:
    """The preference-tuning half of a causal-LM module (see the module docstring)."""

    # ---- preference tuning (``preference=``, ``integration/preference.py``) ------------------------------------
    def logits_of(self, model: torch.nn.Module, input_ids: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``model``'s logits (the trained model, or one held beside it), as ``forward`` gives the trained one's."""
        raise NotImplementedError

    def token_log_probs(self, batch: dict[str, torch.Tensor], model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        """``(B, T)``: each position's log-probability of its label under ``model`` (the trained one by default; 0
        where ignored), from its logits; ``LlamaLightningModule`` computes it in its fused head instead."""
        logits = self.logits_of(model if model is not None else self.model, batch["input_ids"],
                                **document_positions_of(batch))
        with loss_parallel_context(logits):
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                                    ignore_index=-100, reduction="none")
        if hasattr(nll, "full_tensor"):  # vocabulary-sharded logits under loss parallelism
            nll = nll.full_tensor()
        return -nll.view(batch["labels"].shape)

    def reference_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``token_log_probs`` under the reference model: its frozen copy (``reference="copy"``), else (under LoRA)
        the model with its adapters switched off; the batch's own values once a pass computed them
        (``precompute_reference``: each sequence's at its first position). Under pipeline parallelism a forward-only
        run of the copy's stages (``FrozenModel.pipeline``) or of the trained stages with their adapters off: the
        values on the last stage's rank only (``None`` elsewhere)."""
        if "reference_logps" in batch:
            return batch["reference_logps"]
        assert self.model is not None
        tokens, labels, positions = batch["input_ids"], batch["labels"], document_positions_of(batch)
        if self._reference is not None:
            if self._reference.pipeline is not None:  # its stages beside the trained ones, on the same ranks
                return self._reference.pipeline.token_log_probs(tokens, labels, **positions)
            return self.token_log_probs(batch, self._reference.frozen())
        with adapters_disabled(self.model):
            pipeline = self.pipeline
            if pipeline is not None:
                return pipeline.token_log_probs(tokens, labels, **positions)
            return self.token_log_probs(batch)

    # ---- models held beside the trained one (``parallel.frozen``) -------------------------------------------------
    _reference: Optional[FrozenModel] = None  # not a registered module: no optimizer state, in no checkpoint

    def frozen_models(self) -> list[FrozenModel]:
        """The models held beside the trained one, frozen (a preference loss's reference copy): the strategies
        parallelize and materialize them as they do the trained model (``parallel.frozen``), with its plan."""
        return [self._reference] if self._reference is not None else []

    def _declare_reference(self, build: Callable[[], torch.nn.Module]) -> None:
        """Under a preference loss whose reference is a copy (``reference="copy"``, or ``"auto"`` without LoRA),
        ``build()`` on the meta device held as the frozen reference, its values the trained model's initial ones."""
        preference = self.preference
        if preference is None or preference.reference_mode(adapters=self.lora is not None) != "copy":
            return
        with torch.device("meta"):
            model = build()
        folder = preference.reference_from or self.hparams.get("init_from")
        reference = FrozenModel("reference", self._own_plan().module, model, lambda: self.base_weights(folder))
        object.__setattr__(self, "_reference", reference)  # kept out of the module's registered children

    #: The key of the reference values the data holds (``precompute_reference``), once set.
    _reference_precomputed: Optional[str] = None

    def on_fit_start(self) -> None:
        self._precompute_reference()

    def on_validation_start(self) -> None:
        self._precompute_reference()  # validate() alone; within fit, done at its start

    def on_test_start(self) -> None:
        self._precompute_reference()

    def _reference_data(self) -> Any:
        """The data module ``precompute_reference`` writes the reference's values into (a ``PreferenceDataModule``)."""
        trainer = trainer_of(self)
        data = getattr(trainer, "datamodule", None)
        if not callable(getattr(data, "reference_loaders", None)):
            raise PreferenceConfigError(
                "preference precompute_reference=True writes the reference's log-probabilities into the preference"
                f" data's cache, but this run's data is {type(data).__name__ if data is not None else 'not a data'}"
                " module: pass a lightning_2d.PreferenceDataModule (datamodule=...), or leave precompute_reference out"
            )
        return data

    def _cached_reference(self, data: Any, key: str) -> bool:
        """Whether every rank found reference ``key``'s values in the data's cache; if so they are the data's now,
        and the frozen copy is let go (built or not: the steps read the values from their batches)."""
        trainer = trainer_of(self)
        values = data.load_reference_log_probs(key)
        if not trainer.strategy.reduce_boolean_decision(values is not None, all=True):
            return False
        self._use_reference_values(data, values, key)
        return True

    def _use_reference_values(self, data: Any, values: Any, key: str) -> None:
        data.set_reference_log_probs(values)
        self._reference_precomputed = key
        object.__setattr__(self, "_reference", None)  # the frozen copy: no longer read

    def release_cached_frozen_models(self) -> None:
        """Under ``precompute_reference`` with a frozen copy: once the trained model is built (the seed of its initial
        weights, part of the values' key, known) and before the copy is, read the reference's values from the data's
        cache; found on every rank, the copy is dropped unbuilt (never materialized nor sharded). The builders call
        it: the strategy before parallelizing the frozen models (``_parallelize_frozen``), one device before
        materializing them (``_configure_on_one_device``). A miss leaves the copy to be built, and the pass to run at
        fit start (``_precompute_reference``)."""
        preference = self.preference
        if (preference is None or not preference.precompute_reference or self._reference is None
                or self._reference_precomputed is not None or trainer_of(self) is None):
            return
        data = self._reference_data()
        self._cached_reference(data, reference_key(self.reference_identity())[0])

    def _precompute_reference(self) -> None:
        """Under ``precompute_reference``: give the data module each sequence's reference log-probability, read from
        its cache or computed by one pass (``integration.preference.reference_pass``) and saved there, then release
        the frozen copy: the steps read the values from their batches. (With a frozen copy a cache hit was found
        before the copy was built: ``release_cached_frozen_models``.)"""
        preference = self.preference
        if preference is None or not preference.precompute_reference or self._reference_precomputed is not None:
            return
        trainer = trainer_of(self)
        data = self._reference_data()
        key, identity = reference_key(self.reference_identity())
        if not self._cached_reference(data, key):
            pipeline = self.pipeline
            values = reference_pass(self.reference_log_probs, data.reference_loaders(), data.sequence_count,
                                    self.meshes, self.device, pipeline.pp_group if pipeline is not None else None)
            if trainer.local_rank == 0:  # one writer per machine (the cache may be a machine's own disk)
                data.save_reference_log_probs(key, values, identity)
            trainer.strategy.barrier("precompute_reference")
            self._use_reference_values(data, values, key)

    #: Hyperparameters that do not change a model's log-probabilities (the reference values' key leaves them out).
    _OPTIMIZATION_HPARAMS = ("learning_rate", "weight_decay", "betas", "eps", "fused", "warmup_steps", "max_steps",
                             "min_lr_ratio", "preference", "lora_init_from")

    def reference_identity(self) -> dict[str, Any]:
        """What the reference's log-probabilities depend on (``precompute_reference`` keys its values by a digest):
        its mode, the model's settings, the weights (``adapter_base``: ``init_from`` or the seed; ``reference_from``)
        and the precision."""
        preference = self.preference
        assert preference is not None
        trainer = trainer_of(self)
        model = {key: value for key, value in self.hparams.items() if key not in self._OPTIMIZATION_HPARAMS}
        return {"mode": preference.reference_mode(adapters=self.lora is not None), "model": model,
                "precision": str(trainer.precision) if trainer is not None else None,
                "reference_from": preference.reference_from, **self.adapter_base()}

    #: The checkpoint entry naming where a frozen reference copy's values come from (``_record_reference``).
    REFERENCE_RECORD_KEY = "lightning_2d.preference_reference"

    def _reference_record(self) -> Optional[dict[str, Any]]:
        """Where this run's frozen reference copy comes from (``reference_from``'s or ``init_from``'s folder, else
        the seed of the trained model's init), ``None`` without a copy (adapters off: the adapters' record names the
        base; a reference-free loss)."""
        preference = self.preference
        if preference is None or preference.reference_mode(adapters=self.lora is not None) != "copy":
            return None
        if preference.reference_from:
            return {"reference_from": str(Path(preference.reference_from).expanduser().resolve())}
        base = self.adapter_base()
        return {"init_from": base["init_from"]} if base["init_from"] else {"init_seed": base["init_seed"]}

    def _record_reference(self, checkpoint: dict[str, Any]) -> None:
        record = self._reference_record()
        if record is not None:
            checkpoint[self.REFERENCE_RECORD_KEY] = record

    def _check_reference(self, checkpoint: dict[str, Any]) -> None:
        """A resume whose frozen copy would come from other weights than the saved run's (another seed, most often:
        without ``init_seed`` each run draws one) is refused: its preference loss would compare with another model."""
        saved, current = checkpoint.get(self.REFERENCE_RECORD_KEY), self._reference_record()
        if saved is None or current is None or saved == current:
            return
        fix = (f"set init_seed={saved['init_seed']}" if "init_seed" in saved else
               f"set {next(iter(saved))}={next(iter(saved.values()))!r}")
        raise CheckpointError(
            f"This checkpoint's preference reference (a frozen copy) came from {saved}; this run's would come from"
            f" {current}, so its loss would compare with another model. {fix[0].upper() + fix[1:]} to resume it"
        )

    def base_weights(self, folder: Optional[str]) -> Any:
        """The weights of the model folder ``folder`` (``init_from``'s kind), else ``None`` (the seeded init)."""
        raise NotImplementedError

    def _preference_step(self, preference: PreferenceLoss, batch: dict[str, torch.Tensor],
                         train: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        trainer = trainer_of(self)
        count = "step_pairs" if preference.paired else "step_examples"  # the step's units, what the loss averages
        step = {count: batch[count], "accumulate": int(trainer.accumulate_grad_batches)
                if trainer is not None else 1} if train and count in batch else {}
        pipeline = self.pipeline
        if not preference.paired:  # KTO: unpaired examples and their KL sequences
            if pipeline is not None:  # the KL estimate by forward-only runs, then the losses in the last stage
                return pipelined_kto_step(pipeline, preference, batch, self.reference_log_probs, self.meshes,
                                          train=train, **step)
            return kto_step(preference, batch, self.token_log_probs, self.reference_log_probs, self.meshes, **step)
        if pipeline is not None:  # the pairs' losses in the last stage, per micro-batch
            return pipelined_preference_step(pipeline, preference, batch, self.reference_log_probs, self.meshes,
                                             train=train, **step)
        return preference_step(preference, batch, self.token_log_probs,
                               self.reference_log_probs if preference.needs_reference else None, self.meshes, **step)


__all__ = ["PreferenceTuning"]
