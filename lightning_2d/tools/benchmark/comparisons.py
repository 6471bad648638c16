"""The variants of lightning_2d that a ``--compare-…`` flag runs beside it, as data: one row of ``COMPARISONS`` each
(name, flag, strategy overrides, module overrides, what lightning_2d runs meanwhile, the report's labels). The
settings check every row's overrides as lightning_2d's are checked, the runs build each the same way
(``BenchmarkSettings.strategy_kwargs`` / ``module_kwargs``) and the report gives each the same ratio line: a feature
gets its side-by-side benchmark as one more row.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.models.llama.plan import llama_validation_inputs
from lightning_2d.ops.preference import DPO_LOSSES, PreferenceLoss

#: A row's own refusal: ``(flag value, the model or None where it is invalid, the command line's strategy options,
#: its LlamaLightningModule options)`` → the message, or ``None`` when the variant can run.
Refusal = Callable[[Any, Optional[ModelArgs], dict[str, Any], dict[str, Any]], Optional[str]]


def _nothing(value: Any) -> dict[str, Any]:
    return {}


def _refuses_nothing(value: Any, model: Optional[ModelArgs], options: dict[str, Any],
                     module: dict[str, Any]) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Comparison:
    """A variant of lightning_2d that a flag adds, run alternating with it and reported as its ratios over it.

    Args:
        name: The variant's name (the report's row, the JSON, ``--worker``).
        flag: The flag that adds it: a switch, or an integer value where ``metavar`` is given.
        help: The flag's help.
        report_key: The key of its ratios in the report (JSON).
        strategy: Its ``ModelParallel2DStrategy`` options over the command line's, from the flag's value.
        module: Its ``LlamaLightningModule`` arguments over the command line's, from the flag's value (a dict
            merged into the command line's dict of that name, field by field: ``preference=``).
        baseline: The strategy options lightning_2d runs with while this variant runs beside it.
        label: The variant in the report's ratio line (``{value}``: the flag's), ``""`` for none.
        baseline_label: lightning_2d in that line.
        metavar: The value's name in the help; ``None``: the flag is a switch.
        refuse: What the row refuses itself (the value, the model) before its variant is checked as lightning_2d is.
    """

    name: str
    flag: str
    help: str
    report_key: str
    strategy: Callable[[Any], dict[str, Any]] = _nothing
    module: Callable[[Any], dict[str, Any]] = _nothing
    baseline: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    baseline_label: str = ""
    metavar: Optional[str] = None
    refuse: Refusal = _refuses_nothing

    @property
    def dest(self) -> str:
        """The flag's attribute of the parsed command line."""
        return self.flag.removeprefix("--").replace("-", "_")

    def add_flag(self, parser: argparse.ArgumentParser) -> None:
        if self.metavar is None:
            parser.add_argument(self.flag, action="store_true", help=self.help)
        else:
            parser.add_argument(self.flag, type=int, default=None, metavar=self.metavar, help=self.help)

    def value(self, args: argparse.Namespace) -> Any:
        """The flag's value on the command line (``True`` for a switch), ``None`` where it is not given."""
        value = getattr(args, self.dest, None)
        return None if value is False else value

    def describe(self, value: Any, *more: Optional[str]) -> str:
        """The variant in the report's ratio line: its name, its label and ``more`` (e.g. its reference)."""
        return labelled(self.name, self.label.format(value=value), *more)


def labelled(name: str, *labels: Optional[str]) -> str:
    """``name (label, label)`` of the labels that are not empty; ``name`` alone without one."""
    given = [label for label in labels if label]
    return f"{name} ({', '.join(given)})" if given else name


def _one_backend_given(value: Any, model: Optional[ModelArgs], options: dict[str, Any],
                       module: dict[str, Any]) -> Optional[str]:
    given = options.get("fsdp_backend", "fully_shard")
    if given == "fully_shard":
        return None
    return (f"--fsdp-backend {given} with --compare-backends, which runs both backends (lightning_2d under"
            " fully_shard, simple_fsdp under SimpleFSDP); drop --fsdp-backend")


def _positive_rank(rank: int, model: Optional[ModelArgs], options: dict[str, Any],
                   module: dict[str, Any]) -> Optional[str]:
    return None if rank >= 1 else f"--compare-lora takes the adapters' rank, a positive integer; got {rank} (e.g. 16)"


def _model_with_experts(size: int, model: Optional[ModelArgs], options: dict[str, Any],
                        module: dict[str, Any]) -> Optional[str]:
    if model is not None and llama_validation_inputs(model)["experts"]:
        return None
    return (f"--compare-expert-parallel {size} needs a model with experts (--model debug-moe, mixtral-8x7b,"
            " qwen3-30b-a3b)")


def _experts_over_tensor(size: int, model: Optional[ModelArgs], options: dict[str, Any],
                         module: dict[str, Any]) -> Optional[str]:
    if model is None or not llama_validation_inputs(model)["experts"]:
        return (f"--compare-experts-over-tensor {size} needs a model with experts (--model debug-moe, mixtral-8x7b,"
                " qwen3-30b-a3b)")
    tp = options.get("tensor_parallel_size")
    if not isinstance(tp, int) or tp < 2 or int(options.get("expert_parallel_size", 1) or 1) < 2:
        return (f"--compare-experts-over-tensor {size} compares expert parallelism over the tensor-parallel ranks with"
                " today's over the data ranks: give both, e.g. --tensor-parallel-size 2 --expert-parallel-size 2"
                f" (got tensor_parallel_size={tp}, expert_parallel_size={options.get('expert_parallel_size', 1)})")
    return None


def _reference_to_precompute(on: bool, model: Optional[ModelArgs], options: dict[str, Any],
                              module: dict[str, Any]) -> Optional[str]:
    preference = PreferenceLoss.of(module.get("preference"))
    if preference is None:
        return ("--compare-precomputed-reference compares a preference loss's reference precomputed with its frozen"
                f" copy, but nothing trains a preference loss; add --preference LOSS ({', '.join(DPO_LOSSES)})")
    if not preference.needs_reference:
        return (f"--compare-precomputed-reference with --preference {preference.loss_type}, which uses no reference"
                f" model: nothing to precompute; use a loss against a reference ({', '.join(DPO_LOSSES)}) or drop"
                " --compare-precomputed-reference")
    return None


def _teacher_to_drop(on: bool, model: Optional[ModelArgs], options: dict[str, Any],
                     module: dict[str, Any]) -> Optional[str]:
    if module.get("teacher") is not None:
        return None
    return ("--compare-no-teacher times the step without distillation's teacher, but nothing has one; add"
            " --teacher MODEL (e.g. --teacher debug with --model-overrides, or a preset)")


COMPARISONS: tuple[Comparison, ...] = (
    Comparison(
        name="simple_fsdp",
        flag="--compare-backends",
        help="also run lightning_2d under fsdp_backend='simple_fsdp' (variant simple_fsdp; lightning_2d then runs"
        " fully_shard), alternating, and report their step-time and peak-memory ratios and collectives per step (with"
        " --compile: the compiler's bucketed collectives)",
        report_key="backends",
        strategy=lambda on: {"fsdp_backend": "simple_fsdp"},
        baseline={"fsdp_backend": "fully_shard"},
        baseline_label="fully_shard",
        refuse=_one_backend_given,
    ),
    Comparison(
        name="lora",
        flag="--compare-lora",
        metavar="RANK",
        help="also run lightning_2d training rank-RANK LoRA adapters on its frozen base (variant lora), alternating"
        " with full fine-tuning at the same layout, and report their step-time and peak-memory ratios",
        report_key="lora",
        module=lambda rank: {"lora": {"rank": rank}},
        label="rank {value}",
        baseline_label="full fine-tuning",
        refuse=_positive_rank,
    ),
    Comparison(
        name="expert_parallel",
        flag="--compare-expert-parallel",
        metavar="EP",
        help="also run lightning_2d with expert_parallel_size=EP (variant expert_parallel; lightning_2d then runs"
        " expert_parallel_size=1), alternating, on a model with experts, and report their step-time and peak-memory"
        " ratios",
        report_key="expert_parallel",
        strategy=lambda size: {"expert_parallel_size": size},
        baseline={"expert_parallel_size": 1},
        label="expert_parallel_size {value}",
        baseline_label="expert_parallel_size 1",
        refuse=_model_with_experts,
    ),
    Comparison(
        name="experts_over_tensor",
        flag="--compare-experts-over-tensor",
        metavar="EP",
        help="with --tensor-parallel-size and --expert-parallel-size: also run lightning_2d with"
        " expert_parallel_size=EP over the tensor-parallel ranks (experts_over_tensor_parallel=True, variant"
        " experts_over_tensor: each tensor rank routes its own sequence slice, no expert work repeated), alternating"
        " with the command line's expert parallelism over the data ranks (every tensor rank computing its group's"
        " experts whole), and report their step-time and peak-memory ratios",
        report_key="experts_over_tensor",
        strategy=lambda size: {"expert_parallel_size": size, "experts_over_tensor_parallel": True},
        label="expert_parallel_size {value} over the tensor ranks",
        baseline_label="expert parallelism over the data ranks",
        refuse=_experts_over_tensor,
    ),
    Comparison(
        name="precomputed_reference",
        flag="--compare-precomputed-reference",
        help="under --preference: also run lightning_2d with precompute_reference=True (variant"
        " precomputed_reference; the reference's log-probabilities read from the batches, the frozen copy never"
        " built), alternating with lightning_2d's frozen copy, and report their step-time and"
        " peak-memory ratios. The synthetic pairs come with synthetic reference values, so no reference pass runs:"
        " the one-time pass a real run makes before training is not timed",
        report_key="precomputed_reference",
        module=lambda on: {"preference": {"precompute_reference": True}},
        refuse=_reference_to_precompute,
    ),
    Comparison(
        name="no_teacher",
        flag="--compare-no-teacher",
        help="under --teacher: also time the step without it (its ratios)",
        report_key="no_teacher",
        module=lambda on: {"teacher": None, "distillation": None},
        baseline_label="with the teacher",
        refuse=_teacher_to_drop,
    ),
)

#: The rows by variant name.
BY_NAME: dict[str, Comparison] = {row.name: row for row in COMPARISONS}


def compared_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The variants the command line adds, by name, each with its flag's value (``True`` for a switch)."""
    return {row.name: value for row in COMPARISONS if (value := row.value(args)) is not None}


def strategy_overrides(compared: dict[str, Any], variant: str) -> dict[str, Any]:
    """The strategy options of ``variant`` over the command line's, while ``compared`` run: each compared row's
    ``baseline`` (every variant but its own runs lightning_2d's side of it), then ``variant``'s own."""
    overrides = {k: v for name in compared for k, v in BY_NAME[name].baseline.items()}
    if variant in compared:
        overrides.update(BY_NAME[variant].strategy(compared[variant]))
    return overrides


def module_overrides(compared: dict[str, Any], variant: str) -> dict[str, Any]:
    """The ``LlamaLightningModule`` arguments of ``variant`` over the command line's."""
    return BY_NAME[variant].module(compared[variant]) if variant in compared else {}


def module_arguments(options: dict[str, Any], compared: dict[str, Any], variant: str) -> dict[str, Any]:
    """The ``LlamaLightningModule`` arguments of ``variant``: the command line's ``options`` and the variant's own
    (``module_overrides``), a dict of the variant's merged into the command line's dict of that name field by field
    (``{"preference": {"precompute_reference": True}}`` keeps ``--preference``'s loss)."""
    merged = dict(options)
    for name, value in module_overrides(compared, variant).items():
        given = options.get(name)
        merged[name] = {**given, **value} if isinstance(given, dict) and isinstance(value, dict) else value
    return merged
