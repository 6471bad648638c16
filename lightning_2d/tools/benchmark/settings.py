"""The benchmark's settings: the command line checked and the layout resolved before any process starts
(``settings_from_args`` raises ``BenchmarkConfigError`` listing every problem), as ``BenchmarkSettings``,
which the worker processes read back from JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from lightning_2d.errors import Lightning2DError
from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy
from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_2d.parallel.dims import ParallelDims, validate_parallel_dims
from lightning_2d.tools.benchmark.options import option_flag, strategy_options

VARIANTS = ("lightning_2d", "lightning", "plain", "simple_fsdp", "lora", "expert_parallel")
OURS = "lightning_2d"
#: The lightning_2d variant under ``fsdp_backend="simple_fsdp"`` (``--compare-backends``; ``lightning_2d`` then runs
#: ``fully_shard``).
SIMPLE_FSDP = "simple_fsdp"
#: The lightning_2d variant training LoRA adapters on its frozen base (``--compare-lora RANK``).
LORA_VARIANT = "lora"
#: The lightning_2d variant under expert parallelism (``--compare-expert-parallel EP``; lightning_2d then runs EP 1).
EXPERT_PARALLEL = "expert_parallel"
#: PyTorch's 2D Llama example (``dtensor_2d_llama.py``): the shape the benchmark runs by default.
REFERENCE_MODEL = ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=32000)


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
            (``fused_loss``, ``loss_chunk_size``).
        dp: Resolved data-parallel size.
        tp: Resolved tensor-parallel size.
        variants: Which of ``VARIANTS`` to run.
        timeout: Seconds one job may take before it is killed.
        lora_rank: The adapters' rank of the ``lora`` variant (``--compare-lora``), else ``None``.
        expert_parallel: The ``expert_parallel`` variant's ``expert_parallel_size`` (``--compare-expert-parallel``),
            else ``None``.
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
    lora_rank: Optional[int] = None
    expert_parallel: Optional[int] = None

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
        """``ModelParallel2DStrategy`` arguments of ``variant``: the options with the mesh sizes resolved; when both
        backends run (``--compare-backends``), ``lightning_2d``'s FSDP backend is ``fully_shard`` and
        ``simple_fsdp``'s SimpleFSDP."""
        backend = {SIMPLE_FSDP: {"fsdp_backend": "simple_fsdp"}}.get(
            variant, {"fsdp_backend": "fully_shard"} if SIMPLE_FSDP in self.variants else {})
        if self.expert_parallel is not None:  # --compare-expert-parallel: this size in its variant, 1 in the others
            backend["expert_parallel_size"] = self.expert_parallel if variant == EXPERT_PARALLEL else 1
        return {**self.strategy_options, **backend, "data_parallel_size": self.dp, "tensor_parallel_size": self.tp}

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
    try:
        if args.model is not None:
            return ModelArgs.from_name(args.model, **overrides)
        if getattr(args, "recipe_model", None) is not None:  # a recipe's model (lightning_2d.tools.recipe)
            return ModelArgs(**{**asdict(args.recipe_model), **overrides})
        return ModelArgs(**{**asdict(REFERENCE_MODEL), **overrides})
    except ValueError as err:
        # "Invalid ModelArgs:\n  - a\n  - b" → one problem per line
        lines = [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]] or [str(err)]
        problems.extend(f"model: {line}" for line in lines if line)
        return None


def _strategy_accepts() -> set[str]:
    return set(inspect.signature(ModelParallel2DStrategy).parameters)


def _validate_layout(config: ParallelConfig, args: argparse.Namespace, model_args: Optional[ModelArgs]) -> ParallelDims:
    return validate_parallel_dims(
        config,
        world_size=args.devices * args.num_nodes,
        devices_per_node=args.devices,
        plan=llama_plan(model_args, config) if model_args is not None else None,
        precision=args.precision,
        seq_len=args.seq_len,
        num_nodes=args.num_nodes,
    )


def settings_from_args(args: argparse.Namespace, world_size: Optional[int] = None) -> BenchmarkSettings:
    """Check the command line and resolve the layout; raises ``BenchmarkConfigError`` listing every problem.

    Args:
        args: Parsed by ``build_parser()``.
        world_size: ``WORLD_SIZE`` when started by torchrun/SLURM (it must equal ``devices × num_nodes``);
            ``None`` when the benchmark starts the processes itself.
    """
    problems: list[str] = []
    for name, minimum in (("steps", 1), ("warmup", 0), ("rounds", 1), ("devices", 1), ("num_nodes", 1),
                          ("seq_len", 1), ("global_batch_size", 1)):
        value = getattr(args, name)
        if value < minimum:
            problems.append(f"{option_flag(name)} must be at least {minimum}, got {value}")
    if args.timeout <= 0:
        problems.append(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.loss_chunk_size < 1:
        problems.append(f"--loss-chunk-size must be a positive number of tokens, got {args.loss_chunk_size}")
    model_args = _model_args(args, problems)
    if model_args is not None and args.seq_len > model_args.max_seq_len:
        problems.append(
            f"--seq-len ({args.seq_len}) exceeds the model's max_seq_len ({model_args.max_seq_len}); use a shorter"
            " sequence or a preset with a longer max_seq_len"
        )

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

    options = strategy_options(args)
    unknown = sorted(set(options) - _strategy_accepts())
    if unknown:
        problems.append(
            f"ModelParallel2DStrategy does not accept the ParallelConfig option(s) {', '.join(unknown)}; drop"
            f" {', '.join(option_flag(n) for n in unknown)}"
        )
    dp = tp = 0
    try:
        config = ParallelConfig(**options)
        dims = _validate_layout(config, args, model_args)
        dp, tp = dims.dp, dims.tp
        if args.compare and config.data_parallel_replicate_size > 1:
            problems.append(
                f"--data-parallel-replicate-size {config.data_parallel_replicate_size} (HSDP) has no counterpart in"
                " the hand-written Lightning and plain torch variants of --compare (they shard over every"
                " data-parallel rank); drop --compare or the option"
            )
        if args.compare and config.pipeline_parallel_size > 1:
            problems.append(
                f"--pipeline-parallel-size {config.pipeline_parallel_size} has no counterpart in the hand-written"
                " Lightning and plain torch variants of --compare (neither has pipeline parallelism); drop --compare"
                " (to measure lightning_2d alone) or the option"
            )
        if args.compare and config.context_parallel_size > 1:
            problems.append(
                f"--context-parallel-size {config.context_parallel_size} has no counterpart in the hand-written"
                " Lightning and plain torch variants of --compare (neither splits the sequence); drop --compare"
                " (to measure lightning_2d alone) or the option"
            )
        if getattr(args, "compare_backends", False):
            if "fsdp_backend" in options and options["fsdp_backend"] != "fully_shard":
                problems.append(
                    f"--fsdp-backend {options['fsdp_backend']} with --compare-backends, which runs both backends"
                    " (lightning_2d under fully_shard, simple_fsdp under SimpleFSDP); drop --fsdp-backend"
                )
            try:
                ParallelConfig(**{**options, "fsdp_backend": "simple_fsdp"})
            except ParallelConfigError as err:
                problems.extend(f"--compare-backends (the simple_fsdp variant): {p}" for p in err.problems
                                if p not in problems)
        if args.compare and not config.sequence_parallel:
            # The hand-written variants always use the reference plan, sequence parallel included.
            _validate_layout(ParallelConfig(**{**options, "sequence_parallel": True}), args, model_args)
    except ParallelConfigError as err:
        extra = [p for p in err.problems if p not in problems]
        if dp and extra:  # only the reference plan's check got here
            extra = [f"under --compare the lightning and plain variants use sequence parallelism: {p}" for p in extra]
        problems.extend(extra)
    lora_rank = getattr(args, "compare_lora", None)
    if lora_rank is not None and lora_rank < 1:
        problems.append(f"--compare-lora takes the adapters' rank, a positive integer; got {lora_rank} (e.g. 16)")
    expert_parallel = getattr(args, "compare_expert_parallel", None)
    if expert_parallel is not None:
        if model_args is None or model_args.moe is None or not model_args.moe_layers:
            problems.append(f"--compare-expert-parallel {expert_parallel} needs a model with experts (--model debug-moe,"
                            " mixtral-8x7b, qwen3-30b-a3b)")
        elif dp:
            try:
                _validate_layout(ParallelConfig(**{**options, "expert_parallel_size": expert_parallel}), args,
                                 model_args)
            except ParallelConfigError as err:
                problems.extend(f"--compare-expert-parallel (the expert_parallel variant): {p}" for p in err.problems)
    per_replica = getattr(args, "batch_size_per_replica", None)
    if dp and per_replica is not None:  # a recipe's data.batch_size: sequences per data-parallel replica
        args.global_batch_size = per_replica * dp
    if dp and args.global_batch_size % dp:
        fits = [b for b in (args.global_batch_size // dp * dp, (args.global_batch_size // dp + 1) * dp) if b > 0]
        problems.append(
            f"--global-batch-size ({args.global_batch_size}) must be divisible by the data-parallel size ({dp}):"
            f" every data-parallel rank trains the same number of sequences; try {' or '.join(map(str, fits))}"
        )
    if problems:
        raise BenchmarkConfigError(problems)
    assert model_args is not None
    return BenchmarkSettings(
        model=asdict(model_args),
        seq_len=args.seq_len,
        global_batch_size=args.global_batch_size,
        accelerator=accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        seed=args.seed,
        strategy_options=options,
        module_options={"fused_loss": args.fused_loss, "loss_chunk_size": args.loss_chunk_size},
        dp=dp,
        tp=tp,
        variants=[OURS, *([SIMPLE_FSDP] if getattr(args, "compare_backends", False) else []),
                  *([LORA_VARIANT] if getattr(args, "compare_lora", None) else []),
                  *([EXPERT_PARALLEL] if expert_parallel is not None else []),
                  *(["lightning", "plain"] if args.compare else [])],
        timeout=args.timeout,
        lora_rank=getattr(args, "compare_lora", None),
        expert_parallel=expert_parallel,
    )
