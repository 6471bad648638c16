"""Distillation's mechanics that know no model family: what the checks know of a teacher (``TeacherFacts``), the
registered checks refusing what cannot distil, and how a sharded head computes something other than its logits
(``head_computes``).

The teacher is a frozen model held beside the student (``parallel.frozen.FrozenModel``, name ``"teacher"``),
parallelized by its own family's plan on the student's meshes: FSDP-sharded, tensor-parallel where the student is,
its head's vocabulary rows on the same ranks as the student's (both plans shard a head over the vocabulary). The
fused loss needs both heads' weights gathered at once, and FSDP gathers a unit's weights only inside its call: so the
student's head call computes the loss (``head_computes``), and from inside the loss's autograd function (no graph)
the teacher's whole forward runs, its head handing its hidden states and weight over in turn. Every FSDP unit of the
teacher then gathers and frees as in any forward of it, and nothing of it enters the student's backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_2d.ops.distillation import DistillationConfig, DistillationConfigError
from lightning_2d.ops.preference import PreferenceLoss
from lightning_2d.parallel.checks import check


@dataclass(frozen=True)
class TeacherFacts:
    """What the checks know of a teacher before it is built (``parallel.checks.INPUTS["teacher"]``).

    Args:
        name: How it was given, for messages (``"preset 'debug' with {'dim': 256}"``, ``"folder /m/llama-8b"``).
        vocab_size: Its vocabulary's size.
        tp_divides: The sizes tensor parallelism must divide in it (its plan's ``tp_divides``: head counts).
        tokenizer: Its folder's tokenizer file and a digest of the vocabulary it maps (``None``: the folder has none,
            or it is not read from a folder).
    """

    name: str
    vocab_size: int
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    tokenizer: Optional[tuple[str, str]] = None


@contextmanager
def head_computes(head: nn.Module, compute: Callable[[torch.Tensor, torch.Tensor], Any]) -> Iterator[None]:
    """Within the context, a call of ``head`` (an output projection with a ``weight``: ours or transformers'
    ``lm_head``) returns ``compute(hidden, weight)`` instead of its logits, so that whatever calls the head (the
    model's own forward) runs it. The call's hooks run as for any forward: FSDP gathers the weight before and frees
    it after (SimpleFSDP gathers it when read), tensor parallelism hands ``compute`` the hidden states as the head
    would take them (replicated over the tensor-parallel ranks, the weight a vocabulary-sharded DTensor), and its
    output hook lets a plain tensor through (``parallel.styles.VocabParallelHead``)."""

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return compute(hidden, head.weight)

    head.forward = forward  # an instance attribute: nn.Module.__call__ runs it between the hooks
    try:
        yield
    finally:
        del head.forward


# ---- the checks (``parallel/checks.py``) of what cannot distil --------------------------------------------------
@check(error=DistillationConfigError)
def distillation_teacher(owner: str, distillation: Optional[DistillationConfig] = None,
                         teacher: Optional[TeacherFacts] = None) -> list[str]:
    """A teacher without the settings of its loss, or the settings without a teacher."""
    if teacher is not None and distillation is None:
        return [f"{owner} has a teacher ({teacher.name}) but no distillation=: how the student learns from it"
                " (e.g. distillation={'loss': 'forward_kl', 'alpha': 0.5}); or leave teacher out"]
    if distillation is not None and teacher is None:
        return [f"{owner}(distillation=...) needs teacher=: the model distilled from (a preset, an init_from folder,"
                " or a dict of model, init_from, model_overrides); or leave distillation out"]
    return []


@check(error=DistillationConfigError)
def teacher_vocabulary(vocab_size: int, teacher: TeacherFacts) -> list[str]:
    """The divergence compares the two models' distributions over the same token ids."""
    if teacher.vocab_size == vocab_size:
        return []
    return [f"the teacher ({teacher.name}) has a vocabulary of {teacher.vocab_size} tokens, the student"
            f" {vocab_size}: distillation compares their next-token distributions row by row, which needs the same"
            " vocabulary (and tokenizer). Pick a teacher of the student's family and tokenizer, or set the student's"
            f" vocab_size to {teacher.vocab_size} if it is the same tokenizer padded differently"]


@check(error=DistillationConfigError)
def teacher_tokenizer(teacher: TeacherFacts, model_tokenizer: tuple[str, str]) -> list[str]:
    """Equal vocabulary sizes do not make equal tokens: where both folders carry a tokenizer, they must map the same
    tokens to the same ids."""
    if teacher.tokenizer is None or teacher.tokenizer[1] == model_tokenizer[1]:
        return []
    return [f"the teacher's tokenizer ({teacher.tokenizer[0]}) maps other tokens to ids than the student's"
            f" ({model_tokenizer[0]}): a distribution over one's ids means nothing to the other. Distil from a"
            " teacher with the student's tokenizer"]


@check(error=DistillationConfigError)
def distillation_preference(distillation: DistillationConfig, preference: PreferenceLoss) -> list[str]:
    """One objective a step: a preference loss scores whole sequences against a reference, distillation each
    token against a teacher."""
    if distillation is None:
        return []
    return [f"distillation= with preference={{'loss_type': {preference.loss_type!r}, ...}}: one step trains one"
            " objective for now (the pairs' loss against a reference, or each token against a teacher). Distil"
            " first, then tune preferences from its checkpoint (init_from of its export), or drop one of them"]


@check(error=DistillationConfigError)
def distillation_pipeline(pipeline_parallel_size: int, distillation: DistillationConfig) -> list[str]:
    """Under a pipeline the student's last stage would need the teacher's final hidden states and its head for
    each micro-batch: not built yet."""
    if pipeline_parallel_size == 1 or distillation is None:
        return []
    return [f"distillation with pipeline_parallel_size={pipeline_parallel_size} is not supported yet: the student's"
            " last stage would need, for each micro-batch, the teacher's final hidden states (a forward-only"
            " pipeline of the teacher's stages before the schedule) and its head beside the student's. Use"
            " pipeline_parallel_size=1 (FSDP, tensor and context parallelism shard both models)"]


@check(error=DistillationConfigError)
def teacher_tensor_parallel(tp: int, teacher: TeacherFacts) -> list[str]:
    """The teacher is tensor-parallel where the student is, with its own plan: its head counts too."""
    bad = {name: size for name, size in teacher.tp_divides.items() if size % tp}
    if not bad:
        return []
    sizes = [d for d in range(1, max(teacher.tp_divides.values()) + 1)
             if all(size % d == 0 for size in teacher.tp_divides.values())]
    return [f"tensor_parallel_size ({tp}) must divide the teacher's {name} ({size}): the teacher is sharded by its"
            f" own plan on the student's meshes; try {', '.join(map(str, sizes))}" for name, size in bad.items()]


__all__ = [
    "TeacherFacts", "distillation_pipeline", "distillation_preference", "distillation_teacher", "head_computes",
    "teacher_tensor_parallel", "teacher_tokenizer", "teacher_vocabulary",
]
