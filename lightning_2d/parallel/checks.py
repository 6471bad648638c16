"""Validation as a registry of checks: each a small function whose parameters say what it needs.

A check is registered with ``@check``; its parameters are the options it reads (fields of ``ParallelConfig``
or the strategies' ``StrategyOptions``, by name) and the inputs it needs (``INPUTS``: the world, the model's
plan, the sequence length, the device …). A parameter without a default is required: the check runs only once
it is known; one with a default is used when known. It returns its problems, each naming the values and the
fix. ``run_checks`` runs every check whose options and inputs are known, in registration order:

- with no inputs (``known=None``): the options' own problems, when an options dataclass is constructed;
- with inputs: the rest, wherever ``validate_parallel_dims`` runs (the Trainer's/Fabric's construction, the
  launcher, each rank's ``setup_environment``, the strategies' ``setup`` before parallelizing, the planner), every
  problem at once;
- with no options (``values={}``): the checks needing nothing but what a LightningModule says of itself
  (``CausalLMModule.validation_inputs``), at its construction.

Every refusal of a combination (an option against the world, the model, the batch, the hardware or how the model is
trained) is a check here, wherever it is defined: the options' own in ``parallel/config.py`` (and the strategies'
in ``integration/strategy_options.py``), those needing inputs in ``parallel/dims.py``, LoRA's in ``parallel/lora.py``, a
model family's in its module of ``models/`` (``models/hf_decoders.py``), the datamodule's against the module in
``integration/validation.py``. What a check may read besides the options is ``INPUTS``: the world and the batch
from the strategy, the model's structure on its ``ParallelPlan`` (``num_experts``, ``aux_loss_coef`` …), and what
the trained thing says of itself (``owner``, ``lora``, ``experts``, ``hf_config`` …:
``CausalLMModule.validation_inputs``, ``models.registry.validation_inputs_of`` for a model given to Fabric, the
planner's ``validation_inputs_of``).

A problem is raised as a ``ParallelConfigError`` listing every problem, unless its check declares another error
(``@check(error=LoRAConfigError)``: a refusal that keeps the class it always had); ``Problem`` carries it.

Because a check can read nothing but its parameters, the options' metadata (which checks report an option's
problems: ``Option.checks``, the docs' and the tests' view) is derived from the registry
(``checks_reading``) and cannot drift from the code.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

ProblemsFunction = Callable[..., list[str]]

#: What a check may need besides the options, and what it is.
INPUTS: dict[str, str] = {
    "world_size": "the number of processes",
    "devices_per_node": "processes per node",
    "num_nodes": "the number of nodes",
    "dp": "the data-parallel size, resolved from data_parallel_size and the world",
    "tp": "the tensor-parallel size, resolved from tensor_parallel_size and the world",
    "plan": "the model's ParallelPlan (the plan option, or the module's)",
    "precision": "the Trainer's/Fabric's precision",
    "seq_len": "the training sequence length",
    "batch_size": "the per-rank batch size",
    "device_type": "the accelerator's device type",
    "device_index": "this process's CUDA device (initializes CUDA: each rank, after forking)",
    "document_mask": "whether the batches keep packed documents apart (the datamodule's document_mask)",
    "owner": "the class name of what is trained (the LightningModule; the model given to Fabric), named by messages",
    "lora": "the LoRA settings (ops.lora.LoRA) the model trains with: the module's lora=, the adapters of a model"
            " given to Fabric, the planner's lora; None: the whole model is trained",
    "experts": "whether the model has mixture-of-experts layers (ours or transformers'), known before its plan",
    "supports_document_mask": "whether the module takes packed documents' positions (its supports_document_mask)",
    "hf_config": "the Hugging Face config of the HFCausalLMModule trained (the planner's, for a config.json)",
    "frozen": "whether the model given to fabric.setup is held frozen beside the trained one, a reference or a teacher"
              " (parallel.frozen.held_frozen: no parameter requires a gradient)",
    "preference": "the preference loss (ops.preference.PreferenceLoss) the module trains with (its preference=);"
                  " None: next-token training",
    "preference_units": "what a PreferenceDataModule's rows are: 'pairs' (chosen and rejected) or 'examples'"
                        " (unpaired, KTO's); None: unknown, or not preference data",
    "distillation": "the distillation settings (ops.distillation.DistillationConfig) the module trains with (its"
                    " distillation=); None: no teacher",
    "teacher": "what is known of the module's teacher before it is built (parallel.distillation.TeacherFacts: its"
               " vocabulary, tokenizer, head counts); None: no teacher",
    "vocab_size": "the trained model's vocabulary size",
    "model_tokenizer": "the trained model's tokenizer file (in its init_from folder) and a digest of its vocabulary;"
                       " None where it has none",
}
#: The options an input is made of, for the options' metadata (a check reading ``tp`` reads ``tensor_parallel_size``).
INPUT_OPTIONS: dict[str, tuple[str, ...]] = {
    "dp": ("data_parallel_size",), "tp": ("tensor_parallel_size",), "plan": ("plan",),
}


class Problem(str):
    """A problem a check reported (its message) that is raised as its check's ``error`` (``@check(error=...)``),
    not as the usual ``ParallelConfigError``."""

    error: type[Exception]

    @classmethod
    def of(cls, message: str, error: Optional[type[Exception]]) -> str:
        """``message`` as it is (raised as a ``ParallelConfigError``), or carrying ``error``."""
        if error is None:
            return message
        problem = cls(message)
        problem.error = error
        return problem


@dataclass(frozen=True)
class Check:
    """One registered check: its function and, read from its parameters, the options and inputs it needs; ``error``:
    the exception its problems are raised as (``None``: ``ParallelConfigError``)."""

    function: ProblemsFunction
    options: tuple[str, ...]
    required: tuple[str, ...]
    optional: tuple[str, ...]
    error: Optional[type[Exception]] = None

    @property
    def name(self) -> str:
        """The function's dotted name (``lightning_2d.parallel.dims.replica_groups``)."""
        return f"{self.function.__module__}.{self.function.__qualname__}"

    @property
    def reads(self) -> tuple[str, ...]:
        """Every option whose value it reads, directly or through an input."""
        derived = [o for i in (*self.required, *self.optional) for o in INPUT_OPTIONS.get(i, ())]
        return tuple(dict.fromkeys([*self.options, *derived]))

    def runs_with(self, values: Mapping[str, Any], known: Mapping[str, Any]) -> bool:
        """Whether every option it reads is in ``values`` and every input it requires is known."""
        return all(o in values for o in self.options) and all(known.get(i) is not None for i in self.required)

    def __call__(self, values: Mapping[str, Any], known: Mapping[str, Any]) -> list[str]:
        given = {o: values[o] for o in self.options}
        given.update({i: known[i] for i in (*self.required, *self.optional) if known.get(i) is not None})
        return [Problem.of(problem, self.error) for problem in self.function(**given)]


CHECKS: list[Check] = []


def check(
    function: Optional[ProblemsFunction] = None, *, error: Optional[type[Exception]] = None
) -> Any:
    """Register ``function`` as a check (a decorator, bare or ``@check(error=...)``); its parameters name the options
    and inputs it needs. ``error``: the exception its problems are raised as, when not ``ParallelConfigError``."""
    if function is None:
        return lambda decorated: check(decorated, error=error)
    options, required, optional = [], [], []
    for param in inspect.signature(function).parameters.values():
        if param.name not in INPUTS:
            options.append(param.name)
        elif param.default is inspect.Parameter.empty:
            required.append(param.name)
        else:
            optional.append(param.name)
    if any(c.function.__qualname__ == function.__qualname__ and c.function.__module__ == function.__module__
           for c in CHECKS):
        raise TypeError(f"check {function.__module__}.{function.__qualname__} is registered twice")
    CHECKS.append(Check(function, tuple(options), tuple(required), tuple(optional), error))
    return function


def run_checks(values: Mapping[str, Any], known: Optional[Mapping[str, Any]] = None) -> list[str]:
    """The problems of every check that can run: with ``known=None`` those needing no input (the options' own),
    else those needing at least one input, all of them known (``None``: unknown), and reading only options in
    ``values`` (``{}``: the checks of what a module says of itself)."""
    problems: list[str] = []
    for registered in CHECKS:
        if (known is None) != bool(registered.required):
            if registered.runs_with(values, known or {}):
                problems += registered(values, known or {})
    return problems


def checks_reading(option: str) -> tuple[str, ...]:
    """The dotted names of the registered checks that read ``option`` (its ``Option.checks``; the checks register
    when their modules are imported, all of them by ``integration/strategy_options.py``, which reads this)."""
    return tuple(c.name for c in CHECKS if option in c.reads)
