"""The benchmark's settings: the command line checked and the layout resolved before any process starts
(``settings_from_args`` raises ``BenchmarkConfigError`` listing every problem), as ``BenchmarkSettings``,
which the worker processes read back from JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch

from lightning_2d.errors import Lightning2DError
from lightning_2d.integration.module import LlamaLightningModule
from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy
from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.models.registry import validation_inputs_of
from lightning_2d.ops.distillation import DistillationConfigError
from lightning_2d.ops.lora import LoRAConfigError
from lightning_2d.ops.preference import LOSSES, UNPAIRED_LOSSES, PreferenceConfigError, PreferenceLoss
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_2d.parallel.dims import ParallelDims, validate_parallel_dims
from lightning_2d.tools.benchmark import comparisons  # its table read at each call: a test may add a row
from lightning_2d.tools.benchmark.options import option_flag, strategy_options

OURS = "lightning_2d"
#: ``--compare``'s variants: Lightning's ``ModelParallelStrategy`` and a torch loop, the plan written by hand.
HAND_WRITTEN = ("lightning", "plain")
VARIANTS = (OURS, *HAND_WRITTEN, *(row.name for row in comparisons.COMPARISONS))
#: PyTorch's 2D Llama example (``dtensor_2d_llama.py``): the shape the benchmark runs by default.
REFERENCE_MODEL = ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=32000)

_NO_COUNTERPART = "has no counterpart in the hand-written Lightning and plain torch variants of --compare"
#: What the hand-written variants cannot run, by option (above 1): what follows ``--option VALUE`` in the refusal.
HAND_WRITTEN_LACKS = {
    "data_parallel_replicate_size": f"(HSDP) {_NO_COUNTERPART} (they shard over every data-parallel rank); drop"
                                    " --compare or the option",
    "pipeline_parallel_size": f"{_NO_COUNTERPART} (neither has pipeline parallelism); drop --compare (to measure"
                              " lightning_2d alone) or the option",
    "context_parallel_size": f"{_NO_COUNTERPART} (neither splits the sequence); drop --compare (to measure"
                             " lightning_2d alone) or the option",
}
#: Lower bounds of the run's flags.
MINIMUMS = {"steps": 1, "warmup": 0, "rounds": 1, "devices": 1, "num_nodes": 1, "seq_len": 1, "global_batch_size": 1}


class BenchmarkConfigError(Lightning2DError, ValueError):
    """Impossible benchmark settings, found before any process starts; lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("Invalid benchmark settings:\n  - " + "\n  - ".join(self.problems))


@dataclass
class BenchmarkSettings:
    """Everything a benchmark run needs (from ``settings_from_args``); written as JSON for the worker processes.

    Args:
        model: ``ModelArgs`` fields.
        seq_len: Tokens per sequence.
        global_batch_size: Sequences per optimizer step over all data-parallel ranks.
        accelerator: ``"cpu"`` or ``"gpu"``.
        devices: Processes per node.
        num_nodes: Nodes.
        precision: Trainer precision (``SUPPORTED_PRECISIONS``), applied the same way in all variants.
        steps: Timed steps per run.
        warmup: Steps run before the timed ones in every run (dropped).
        rounds: Runs of each variant, alternating between variants.
        seed: Seed of the initial weights and the synthetic tokens.
        strategy_options: ``ParallelConfig`` fields passed to ``ModelParallel2DStrategy``.
        module_options: ``LlamaLightningModule`` loss options of the lightning_2d variant
            (``fused_loss``, ``loss_chunk_size``; ``preference``: ``{"loss_type": ...}`` under ``--preference``).
        dp: Resolved data-parallel size.
        tp: Resolved tensor-parallel size.
        variants: Which of ``VARIANTS`` to run.
        timeout: Seconds one job may take before it is killed.
        compared: The variants of lightning_2d run beside it (rows of ``comparisons.COMPARISONS``), by name, each
            with its flag's value (``True`` for a switch).
        collectives_by_issuer: ``--collectives``: also record which code issued each collective of the counted
            step (``collectives.counted_collectives``), in every variant.
    """

    # No defaults here: the command line (build_parser) holds them.
    model: dict[str, Any]
    seq_len: int
    global_batch_size: int
    accelerator: str
    devices: int
    num_nodes: int
    precision: str
    steps: int
    warmup: int
    rounds: int
    seed: int
    strategy_options: dict[str, Any]
    module_options: dict[str, Any]
    dp: int
    tp: int
    variants: list[str]
    timeout: float
    compared: dict[str, Any]
    collectives_by_issuer: bool

    @property
    def model_args(self) -> ModelArgs:
        return ModelArgs(**self.model)

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def strategy_kwargs(self, variant: str = OURS) -> dict[str, Any]:
        """``ModelParallel2DStrategy`` arguments of ``variant`` (``OURS`` or a compared one): the options, each
        compared row's side of lightning_2d (``fully_shard`` under ``--compare-backends`` …) and the variant's own
        (``comparisons.strategy_overrides``), the mesh sizes resolved."""
        return {**self.strategy_options, **comparisons.strategy_overrides(self.compared, variant),
                "data_parallel_size": self.dp, "tensor_parallel_size": self.tp}

    def module_kwargs(self, variant: str = OURS) -> dict[str, Any]:
        """``LlamaLightningModule`` arguments of ``variant`` besides the model and schedule: the loss options and the
        variant's own (``lora=`` under ``--compare-lora``, ``precompute_reference`` merged into ``preference=``)."""
        return comparisons.module_arguments(self.module_options, self.compared, variant)

    @property
    def preference(self) -> Optional[dict[str, Any]]:
        """``--preference``'s loss (``LlamaLightningModule(preference=...)``), ``None``: next-token training."""
        return self.module_options.get("preference")

    def reference_label(self, variant: str = OURS) -> Optional[str]:
        """Where ``variant``'s preference loss takes its reference from (``"reference copy"``, ``"reference
        adapters_off"``, ``"reference copy, precomputed"``, ``"no reference"``), ``None`` without ``--preference``."""
        module = self.module_kwargs(variant)
        preference = PreferenceLoss.of(module.get("preference"))
        if preference is None:
            return None
        mode = preference.reference_mode(adapters=module.get("lora") is not None)
        if mode is None:
            return "no reference"
        return f"reference {mode}" + (", precomputed" if preference.precompute_reference else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BenchmarkSettings:
        return cls(**json.loads(text))


def _model_args(args: argparse.Namespace, problems: list[str]) -> Optional[ModelArgs]:
    overrides = {
        name: getattr(args, name)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
        if getattr(args, name) is not None
    }
    experts = {
        field: getattr(args, name, None)
        for name, field in (("n_experts", "num_experts"), ("top_k", "top_k"), ("expert_hidden_dim", "hidden_dim"))
        if getattr(args, name, None) is not None
    }
    try:
        if args.model is not None:
            model_args = ModelArgs.from_name(args.model, **overrides)
        elif getattr(args, "recipe_model", None) is not None:  # a recipe's model (lightning_2d.tools.recipe)
            model_args = ModelArgs(**{**asdict(args.recipe_model), **overrides})
        else:
            model_args = ModelArgs(**{**asdict(REFERENCE_MODEL), **overrides})
        if not experts:
            return model_args
        if model_args.moe is None:
            flags = ", ".join(option_flag(name) for name in ("n_experts", "top_k", "expert_hidden_dim")
                              if getattr(args, name, None) is not None)
            problems.append(f"{flags} need a model with experts (--model debug-moe, mixtral-8x7b, qwen3-30b-a3b)")
            return None
        return replace(model_args, moe=replace(model_args.moe, **experts))
    except ValueError as err:
        # "Invalid ModelArgs:\n  - a\n  - b" → one problem per line
        lines = [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]] or [str(err)]
        problems.extend(f"model: {line}" for line in lines if line)
        return None


def _strategy_accepts() -> set[str]:
    return set(inspect.signature(ModelParallel2DStrategy).parameters)


def _run_problems(args: argparse.Namespace, model_args: Optional[ModelArgs]) -> list[str]:
    """The run's own flags: counts, timeout, loss chunk, sequence length against the model."""
    problems = [f"{option_flag(name)} must be at least {minimum}, got {getattr(args, name)}"
                for name, minimum in MINIMUMS.items() if getattr(args, name) < minimum]
    if args.timeout <= 0:
        problems.append(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.loss_chunk_size is not None and args.loss_chunk_size < 1:
        problems.append(f"--loss-chunk-size must be a positive number of tokens, got {args.loss_chunk_size}")
    if args.collectives_by_issuer and args.warmup < 1:
        problems.append("--collectives breaks down the last warm-up step's collectives: it needs --warmup 1 or more,"
                        f" got {args.warmup}")
    if model_args is not None and args.seq_len > model_args.max_seq_len:
        problems.append(
            f"--seq-len ({args.seq_len}) exceeds the model's max_seq_len ({model_args.max_seq_len}); use a shorter"
            " sequence or a preset with a longer max_seq_len"
        )
    return problems


def _accelerator(args: argparse.Namespace, world_size: Optional[int], problems: list[str]) -> str:
    """``--accelerator`` resolved (``auto``: GPU where CUDA is), and the world it is asked for checked."""
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "gpu" and not torch.cuda.is_available():
        problems.append("--accelerator gpu, but CUDA is not available here; use --accelerator cpu")
    elif accelerator == "gpu" and world_size is None and torch.cuda.device_count() < args.devices:
        problems.append(
            f"--devices {args.devices} on GPU, but this machine has {torch.cuda.device_count()} CUDA device(s);"
            f" use --devices {torch.cuda.device_count()} or fewer"
        )
    if world_size is not None and args.devices * args.num_nodes != world_size:
        problems.append(
            f"started with WORLD_SIZE={world_size}, but --devices {args.devices} × --num-nodes {args.num_nodes} ="
            f" {args.devices * args.num_nodes}; pass the devices per node and the nodes of the launch"
        )
    return accelerator


def _check_variant(
    options: dict[str, Any], module: dict[str, Any], args: argparse.Namespace, model_args: Optional[ModelArgs]
) -> tuple[Optional[ParallelDims], list[str]]:
    """One variant of lightning_2d checked as its strategy checks it: its options (``ParallelConfig``), its module
    (``LlamaLightningModule(model, **module)``: what the module refuses of itself, what it says of itself to the
    checks) and the layout on this world and model; its mesh sizes (``None`` where refused) and its problems."""
    problems: list[str] = []
    inputs: dict[str, Any] = {}
    if model_args is not None:
        try:
            inputs = validation_inputs_of(LlamaLightningModule(model=model_args, **module))
        except (LoRAConfigError, ParallelConfigError, PreferenceConfigError, DistillationConfigError) as err:
            problems += _problems_of(err)
    try:
        config = ParallelConfig(**options)
        dims = validate_parallel_dims(
            config,
            world_size=args.devices * args.num_nodes,
            devices_per_node=args.devices,
            plan=llama_plan(model_args, config) if model_args is not None else None,
            precision=args.precision,
            seq_len=args.seq_len,
            num_nodes=args.num_nodes,
            **inputs,
        )
    except (LoRAConfigError, ParallelConfigError, PreferenceConfigError, DistillationConfigError) as err:
        return None, problems + _problems_of(err)
    return (None if problems else dims), problems


def _problems_of(err: Exception) -> list[str]:
    """A refusal's problems: ``raise_if_problems`` lists them (``problems``); a ``LoRA`` refusing its own fields
    does not."""
    return list(getattr(err, "problems", None) or [str(err)])


def _hand_written_problems(options: dict[str, Any], args: argparse.Namespace,
                           model_args: Optional[ModelArgs]) -> list[str]:
    """What ``--compare``'s hand-written variants cannot run of lightning_2d's (valid) ``options``."""
    config = ParallelConfig(**options)
    problems = [f"{option_flag(name)} {getattr(config, name)} {why}" for name, why in HAND_WRITTEN_LACKS.items()
                if getattr(config, name) > 1]
    if not config.sequence_parallel:  # they always use the reference plan, sequence parallel included
        _, layout = _check_variant({**options, "sequence_parallel": True}, {}, args, model_args)
        problems += [f"under --compare the lightning and plain variants use sequence parallelism: {p}" for p in layout]
    return problems


def _layout_problems(args: argparse.Namespace, options: dict[str, Any], compared: dict[str, Any],
                     model_args: Optional[ModelArgs],
                     module: dict[str, Any]) -> tuple[Optional[ParallelDims], list[str]]:
    """lightning_2d's layout (its mesh sizes, ``None`` where refused) and every other variant's: ``--compare``'s
    hand-written ones, each compared row (what it refuses itself, else its overrides checked as lightning_2d is).
    ``module``: the module options the checks read (``preference``), lightning_2d's and, merged, each row's."""
    problems: list[str] = []
    if unknown := sorted(set(options) - _strategy_accepts()):
        problems.append(
            f"ModelParallel2DStrategy does not accept the ParallelConfig option(s) {', '.join(unknown)}; drop"
            f" {', '.join(option_flag(n) for n in unknown)}"
        )
    ours = {**options, **comparisons.strategy_overrides(compared, OURS)}
    dims, layout = _check_variant(ours, module, args, model_args)
    problems += layout
    if dims is not None and args.compare:
        problems += _hand_written_problems(ours, args, model_args)
    for row in (row for row in comparisons.COMPARISONS if row.name in compared):
        if (refusal := row.refuse(compared[row.name], model_args, options, module)) is not None:
            problems.append(refusal)
        elif dims is not None:  # the variant's checks, where lightning_2d's hold
            _, theirs = _check_variant({**options, **comparisons.strategy_overrides(compared, row.name)},
                                       comparisons.module_arguments(module, compared, row.name), args, model_args)
            problems += [f"{row.flag} (the {row.name} variant): {p}" for p in theirs]
    return dims, problems


def _preference(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """``--preference``'s module option (``{"preference": {"loss_type": ...}}``, ``{}`` without), and what the
    benchmark cannot run of it: unpaired losses (its data are pairs), the hand-written variants (next tokens only),
    windows too short for a pair."""
    loss = getattr(args, "preference", None)
    if loss is None:
        return {}
    if loss in UNPAIRED_LOSSES:
        pairwise = ", ".join(name for name in LOSSES if name not in UNPAIRED_LOSSES)
        problems.append(f"--preference {loss} scores unpaired examples, but the benchmark's synthetic data are pairs"
                        f" (SyntheticPairs); use a pairwise loss ({pairwise})")
    if args.compare:
        problems.append(f"--preference {loss} has no counterpart in the hand-written Lightning and plain torch variants"
                        " of --compare (they train next tokens); drop --compare (the --compare-... rows run beside"
                        " lightning_2d under the same loss)")
    if args.seq_len < 2:
        problems.append(f"--preference packs whole pairs (a chosen and a rejected sequence) into each window of"
                        f" --seq-len, which needs at least 2 positions; got {args.seq_len}")
    return {"preference": {"loss_type": loss}}


def _distillation(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """``--teacher``'s and ``--distillation``'s module options (``{"teacher": ..., "distillation": {"loss": ...}}``,
    ``{}`` without), and what the benchmark cannot run of them: a divergence without a teacher, the hand-written
    variants (next tokens only)."""
    teacher, loss = getattr(args, "teacher", None), getattr(args, "distillation", None)
    if teacher is None:
        if loss is not None:
            problems.append(f"--distillation {loss} distils from a teacher: give it with --teacher MODEL (a preset or a"
                            " Llama folder), or drop --distillation")
        return {}
    if args.compare:
        problems.append(f"--teacher {teacher} has no counterpart in the hand-written Lightning and plain torch variants"
                        " of --compare (they train next tokens); drop --compare (--compare-no-teacher times the"
                        " step without it)")
    return {"teacher": teacher, "distillation": {"loss": loss or "forward_kl"}}


def _global_batch_size(args: argparse.Namespace, dp: int, problems: list[str]) -> int:
    """``--global-batch-size`` (or a recipe's per-replica ``data.batch_size`` times ``dp``), checked against ``dp``."""
    per_replica = getattr(args, "batch_size_per_replica", None)
    if not dp:
        return args.global_batch_size
    size = per_replica * dp if per_replica is not None else args.global_batch_size
    if size % dp:
        fits = [b for b in (size // dp * dp, (size // dp + 1) * dp) if b > 0]
        problems.append(
            f"--global-batch-size ({size}) must be divisible by the data-parallel size ({dp}):"
            f" every data-parallel rank trains the same number of sequences; try {' or '.join(map(str, fits))}"
        )
    return size


def settings_from_args(args: argparse.Namespace, world_size: Optional[int] = None) -> BenchmarkSettings:
    """Check the command line and resolve the layout; raises ``BenchmarkConfigError`` listing every problem.

    Args:
        args: Parsed by ``build_parser()``.
        world_size: ``WORLD_SIZE`` when started by torchrun/SLURM (it must equal ``devices × num_nodes``);
            ``None`` when the benchmark starts the processes itself.
    """
    model_problems: list[str] = []
    model_args = _model_args(args, model_problems)
    problems = [*_run_problems(args, model_args), *model_problems]
    accelerator = _accelerator(args, world_size, problems)
    options, compared = strategy_options(args), comparisons.compared_from_args(args)
    preference = {**_preference(args, problems), **_distillation(args, problems)}
    dims, layout = _layout_problems(args, options, compared, model_args, preference)
    problems += layout
    dp, tp = (dims.dp, dims.tp) if dims is not None else (0, 0)
    global_batch_size = _global_batch_size(args, dp, problems)
    if problems:
        raise BenchmarkConfigError(problems)
    assert model_args is not None
    return BenchmarkSettings(
        model=asdict(model_args),
        seq_len=args.seq_len,
        global_batch_size=global_batch_size,
        accelerator=accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        seed=args.seed,
        strategy_options=options,
        module_options={"fused_loss": args.fused_loss, "loss_chunk_size": args.loss_chunk_size, **preference},
        dp=dp,
        tp=tp,
        variants=[OURS, *compared, *(HAND_WRITTEN if args.compare else ())],
        timeout=args.timeout,
        compared=compared,
        collectives_by_issuer=args.collectives_by_issuer,
    )
