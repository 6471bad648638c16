"""Models held beside the trained one, frozen: a preference loss's reference, a distillation teacher.

A ``FrozenModel`` wraps such a model (built on the meta device by its owner, like the trained one) with where its
values come from (``weights_source``: the trained model's ``init_from``, else the same seeded init: its initial
weights). The strategies parallelize and materialize it as they do the trained model, with the same plan (a
distillation teacher: its own family's, ``plan_of``) and meshes (``parallelize_frozen``: TP/SP, FSDP-sharded, its
parameters never requiring gradients); on one device
``materialize_frozen`` does the rest without the parallelism. The owner keeps it outside its registered modules, so
it has no optimizer state, is in no checkpoint and adds nothing to the gradient norm.

Under pipeline parallelism it is split as the trained model is (the same blocks in the same stages, on the same
pipeline ranks: ``pipeline_split``), each stage parallelized (TP/SP, FSDP) as the trained one's, and run by its own
``Pipeline`` (``FrozenModel.pipeline``) with forward-only schedules (``Pipeline.token_log_probs``: each token's
log-probability on the last stage's rank): a rank holds its stages' trained blocks and their frozen twins, and
nothing crosses the pipeline but the hidden states, as in training.

Under Fabric there is no owner to declare it: a model given to ``fabric.setup`` whose parameters are all frozen
(``held_frozen``) is such a model, parallelized by the same ``parallelize_frozen`` with its own plan; not under a
pipeline (``frozen_pipeline``): the strategy steps the trained model's pipeline only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_2d.parallel.checks import check
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.converters import ModelConverters
from lightning_2d.parallel.parallelize import Parallelized, convert_and_materialize, parallelize_and_materialize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_2d.parallel.meshes import ParallelMeshes
    from lightning_2d.parallel.pipeline import Pipeline


class FrozenModel(nn.Module):
    """``model`` (under the attribute the trained model's plan names, ``plan.module``), frozen, with the values
    ``weights_source()`` gives it (``None``: the seeded init).

    Args:
        name: What it is, for messages (``"reference"``).
        module_name: The attribute holding the model (the trained model's ``plan.module``: ``"model"``), so the
            trained model's plan applies to it as it is.
        model: The model, on the meta device.
        weights_source: Its initial values' source (the trained model's ``init_from``), or ``None``.
        plan_of: Its own plan for the strategy's options (a distillation teacher: its family's, from its own shape),
            ``module_name`` naming it; ``None``: the trained model's (a reference copy).
    """

    def __init__(self, name: str, module_name: str, model: nn.Module,
                 weights_source: Optional[Callable[[], Any]] = None,
                 plan_of: Optional[Callable[[ParallelConfig], ParallelPlan]] = None) -> None:
        super().__init__()
        self.name = name
        self.module_name = module_name
        self.plan_of = plan_of
        setattr(self, module_name, model)
        model.requires_grad_(False)
        self.eval()  # no dropout; the Trainer's train()/eval() never reach it (the owner does not register it)
        self._weights_source = weights_source
        #: Under pipeline parallelism, the ``Pipeline`` running its stages (set by ``parallelize_frozen``; forward
        #: only: ``token_log_probs``); calling the model then raises, as the trained one's does.
        self.pipeline: Optional["Pipeline"] = None

    def frozen(self) -> nn.Module:
        """The model held (``getattr(self, module_name)``; parallelized in place by the strategy)."""
        return getattr(self, self.module_name)

    def weights_source(self) -> Any:
        return self._weights_source() if self._weights_source is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.frozen()(*args, **kwargs)


def held_frozen(model: nn.Module, converters: ModelConverters) -> bool:
    """Whether ``model`` (given to ``fabric.setup``) is a model held frozen beside the trained one: it has parameters,
    none requires a gradient, and it asks for no model converter (adapters declared on a frozen base train).

    Args:
        model: The model, on the meta device.
        converters: The converters it asks for (``ModelConverters.of(plan, validation_inputs_of(model))``).
    """
    params = list(model.parameters())
    return bool(params) and not any(p.requires_grad for p in params) and not converters.converters


@check
def frozen_pipeline(frozen: bool, pipeline_parallel_size: int, owner: str = "the model") -> list[str]:
    """A frozen model given to ``fabric.setup`` is run whole by the user's loop: a pipeline would cut it into stages
    that nothing there runs (``fabric.strategy.pipeline`` steps the trained model's). A module's declared frozen
    models (``frozen_models()``) are split beside the trained stages and run by their own pipeline instead."""
    if not frozen or pipeline_parallel_size == 1:
        return []
    return [
        f"{owner} is a frozen model held beside the trained one (every parameter requires_grad=False), but"
        f" pipeline_parallel_size={pipeline_parallel_size} would split it into stages, and under Fabric only the"
        " trained model's pipeline is stepped (fabric.strategy.pipeline); the loop would call the frozen one whole."
        " Use pipeline_parallel_size=1 (FSDP, tensor and context parallelism shard it), or the Trainer with a module"
        " that declares it (LlamaLightningModule(preference=...): its reference copy is split beside the trained"
        " stages)"
    ]


def parallelize_frozen(frozen: nn.Module, mesh: "ParallelMeshes | DeviceMesh", config: ParallelConfig,
                       plan: ParallelPlan, precision: str, device: torch.device, seed: Callable[[], int],
                       known_init_hooks: Callable[[nn.Module], Any] = lambda model: None,
                       pipeline_split: Optional[list[int]] = None) -> Parallelized:
    """``parallelize_and_materialize`` of a frozen model (a ``FrozenModel``, or a model whose parameters are all
    frozen, given to ``fabric.setup``): ``plan`` (the trained model's for its copy; no converters: the frozen model is
    the initial one), the same meshes; its seeded init gives the trained model's initial values (``seed`` must return
    the trained model's).

    Its parameters are stored in the dtype FSDP computes in (``param_dtype``: bf16 under ``bf16-mixed``), not in fp32
    as a trained model's are (for its optimizer): FSDP casts each shard to ``param_dtype`` before gathering it, so the
    forward sees the same values, and the copy takes half the memory (``store_in``; buffers keep their dtype).
    Under FSDP2 every unit reshards after its forward (``reshard_after_every_forward``): the ``"default"`` policy
    keeps the output unit gathered for the backward that follows, and a frozen model has none, so its head would stay
    gathered from one step to the next (SimpleFSDP gathers a weight at each use, and without autograd nothing keeps
    it). Its parameters are frozen again afterwards: they never require gradients. Under ``compile=True`` its blocks
    are compiled too, as the trained model's (one graph more: their forward without grad), so that the reference
    computes with the trained model's kernels.

    Under pipeline parallelism the model is split into the stages of this rank (``pipeline_split``: the trained
    model's block counts per stage, ``Pipeline.split``, so that each rank holds the frozen twins of its trained
    blocks; ``None``: the options' own split) and the returned ``Parallelized.pipeline`` runs them; a ``FrozenModel``
    keeps it (``FrozenModel.pipeline``).

    Args:
        pipeline_split: Under pipeline parallelism, the blocks of each stage (the trained model's ``Pipeline.split``).
    """
    store_in(frozen, frozen_dtype(config, precision))
    if pipeline_split is not None and config.pipeline_parallel_size > 1:
        config = replace(config, pipeline_layers_per_stage=list(pipeline_split))
    parallelized = parallelize_and_materialize(frozen, mesh, config, plan, precision, device, seed, known_init_hooks)
    stages = parallelized.pipeline.stages if parallelized.pipeline is not None else []
    reshard_after_every_forward([frozen, *stages])  # a stage is its own FSDP root, not a submodule of the model
    frozen.requires_grad_(False)
    if isinstance(frozen, FrozenModel):
        frozen.pipeline = parallelized.pipeline
    return parallelized


def reshard_after_every_forward(modules: list[nn.Module]) -> None:
    """Every FSDP2 unit in ``modules`` frees its gathered parameters after its forward (a frozen model's: no backward
    follows). Set on the units once built, not through the options: the zero-bubble schedules refuse
    ``reshard_after_forward="always"`` for the trained model's split backward, which a frozen model does not run."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_reshard_after_forward(True, recurse=False)


def frozen_dtype(config: ParallelConfig, precision: str) -> torch.dtype:
    """The dtype a frozen model's parameters are stored in under ``precision``: the one FSDP computes in
    (``param_dtype``), or the stored one where that is lower (``bf16-true``'s bf16)."""
    compute = config.resolve_dtypes(precision).param_dtype
    stored = torch.bfloat16 if precision == "bf16-true" else torch.float32
    return compute if compute.itemsize < stored.itemsize else stored


def store_in(model: nn.Module, dtype: torch.dtype) -> None:
    """``model``'s floating parameters (on the meta device, before it is parallelized) as parameters of ``dtype``,
    frozen, a tied one still one parameter; its buffers keep their dtype (a rotary table is computed in fp32)."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                setattr(module, name, cast[id(param)])


def materialize_frozen(frozen: FrozenModel, plan: ParallelPlan, device: torch.device, seed: int,
                       known_init_hooks: Callable[[nn.Module], Any] = lambda model: None) -> None:
    """One device: ``convert_and_materialize`` of a frozen model (no converters), from ``seed`` or its weights."""
    convert_and_materialize(frozen, plan, device, seed, {}, known_init_hooks)


__all__ = [
    "FrozenModel", "frozen_dtype", "frozen_pipeline", "held_frozen", "materialize_frozen", "parallelize_frozen",
    "reshard_after_every_forward", "store_in",
]
