"""``Distillation``: what ``teacher=`` and ``distillation=`` add to the causal-LM modules — the teacher, a frozen model
held beside the student (``parallel.frozen.FrozenModel``, name ``"teacher"``, parallelized by its own family's plan),
what the checks know of it before it is built (``TeacherFacts``), and the step of ``integration/distillation.py``.

A mixin of ``CausalLMModule`` (``integration/module.py``), which gives it ``hparams``, ``model``, ``meshes``,
``vocab_size``, ``logits_of`` and ``frozen_models``; each module says how its family reads a teacher
(``resolve_teacher``: ``LlamaLightningModule`` a preset or a Llama-family folder, ``HFCausalLMModule`` a
transformers config or folder).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_2d._compat import trainer_of
from lightning_2d.integration.batches import step_tokens_of
from lightning_2d.integration.distillation import distillation_step
from lightning_2d.models.llama.tokenizer import model_folder_tokenizer, vocabulary_digest
from lightning_2d.models.registry import output_head
from lightning_2d.ops.distillation import DistillationConfig, DistillationConfigError
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.distillation import TeacherFacts
from lightning_2d.parallel.frozen import FrozenModel


@dataclass(frozen=True)
class TeacherSpec:
    """A teacher as its module's family reads it (``resolve_teacher``), before anything is built.

    Args:
        facts: What the checks know of it.
        build: Its model, built on the meta device by the caller.
        plan_of: Its family's plan for the strategy's options (``module="model"``, as the student's).
        weights: ``model → `` its weights' source (its ``init_from`` folder read block by block, names as in
            ``model``), else ``None``: the seeded init (the student's seed).
    """

    facts: TeacherFacts
    build: Callable[[], nn.Module]
    plan_of: Callable[[ParallelConfig], ParallelPlan]
    weights: Callable[[nn.Module], Any]


def folder_tokenizer(folder: Optional[str]) -> Optional[tuple[str, str]]:
    """The tokenizer file of model folder ``folder`` and a digest of its vocabulary (``vocabulary_digest``), else
    ``None``."""
    path = model_folder_tokenizer(Path(folder).expanduser()) if folder else None
    return (str(path), vocabulary_digest(path)) if path is not None else None


def teacher_fields(value: Any, keys: tuple[str, ...], folder_key: str = "init_from") -> dict[str, Any]:
    """``teacher=`` as a dict of ``keys``: a folder (a string naming a directory) as ``{folder_key: value}``, a dict
    checked for unknown keys; anything else is the family's (a preset name: ``{keys[0]: value}``)."""
    if isinstance(value, str):
        return {folder_key: value} if Path(value).expanduser().is_dir() else {keys[0]: value}
    if not isinstance(value, Mapping):
        raise DistillationConfigError(f"teacher must be a preset name, a model folder or a dict of {', '.join(keys)};"
                                      f" got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise DistillationConfigError(f"teacher has no field(s) {unknown}; its fields: {', '.join(keys)}")
    return dict(value)


class Distillation:
    """The distillation half of a causal-LM module (see the module docstring)."""

    _teacher_spec: Optional[TeacherSpec] = None
    _teacher: Optional[FrozenModel] = None  # not a registered module: no optimizer state, in no checkpoint
    _student_tokenizer: Optional[tuple[str, str]] = None

    @property
    def distillation(self) -> Optional[DistillationConfig]:
        """The distillation settings (``distillation=``), else ``None``: no teacher."""
        return DistillationConfig.of(self.hparams.get("distillation"))

    @property
    def teacher(self) -> Optional[FrozenModel]:
        """The teacher once ``configure_model`` declared it (parallelized by the strategy), else ``None``."""
        return self._teacher

    def resolve_teacher(self, teacher: Any) -> TeacherSpec:
        """How this module's family reads ``teacher=`` (a module implements it)."""
        raise NotImplementedError

    def _set_distillation(self, teacher: Any, distillation: "DistillationConfig | dict | None") -> None:
        """Check ``teacher`` and ``distillation`` now (before any process starts: the teacher's shape, its folder's
        files, its vocabulary and tokenizer against the student's) and keep them as plain data in the
        hyperparameters."""
        self.hparams["distillation"] = None if distillation is None else DistillationConfig.of(distillation).to_dict()
        if teacher is None:
            return
        self._teacher_spec = self.resolve_teacher(teacher)
        self._student_tokenizer = folder_tokenizer(self.hparams.get("init_from"))
        with torch.device("meta"):  # its folder's files against its shape, now
            self._teacher_spec.weights(self._teacher_spec.build())

    def distillation_inputs(self) -> dict[str, Any]:
        """What the registered checks read of the distillation (``parallel.distillation``): its settings, the
        teacher's facts, the student's vocabulary and tokenizer."""
        spec = self._teacher_spec
        inputs: dict[str, Any] = {"distillation": self.distillation,
                                  "teacher": spec.facts if spec is not None else None}
        if spec is not None:
            inputs.update(vocab_size=self.vocab_size, model_tokenizer=self._student_tokenizer)
        return inputs

    def frozen_models(self) -> list[FrozenModel]:
        """The models held beside the trained one: those of the other objectives (a preference reference), and the
        teacher."""
        held = super().frozen_models()  # type: ignore[misc]
        return [*held, self._teacher] if self._teacher is not None else held

    def _declare_teacher(self) -> None:
        """Under ``teacher=``: its model on the meta device, held frozen beside the student with its own plan and
        values (its ``init_from``, else the seeded init from the student's seed)."""
        spec = self._teacher_spec
        if spec is None:
            return
        with torch.device("meta"):
            model = spec.build()
        weights = spec.weights(model)  # its names and shapes read now, on the meta model
        teacher = FrozenModel("teacher", "model", model, lambda: weights, plan_of=spec.plan_of)
        object.__setattr__(self, "_teacher", teacher)  # kept out of the module's registered children

    def _distillation_step(self, batch: dict[str, torch.Tensor], train: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``integration.distillation.distillation_step`` of the student and its teacher on ``batch`` (whole rows)."""
        teacher, config = self._teacher, self.distillation
        assert teacher is not None and config is not None and self.model is not None, "configure_model() first"
        trainer = trainer_of(self)
        accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        step = step_tokens_of(batch, accumulate) if train else {}
        return distillation_step(self.model, teacher.frozen(), batch, config, self.meshes, **step,
                                 logits_of=self.logits_of, head_of=output_head)


__all__ = ["Distillation", "TeacherSpec", "folder_tokenizer", "teacher_fields"]
