"""``lightning-2d benchmark``: time a model/layout; ``--compare`` puts it side by side with hand-written 2D code.

    lightning-2d benchmark                          # reference shape, (dp, tp) = (2, 2) on 4 CPU processes
    lightning-2d benchmark --compare --json out.json
    python -m lightning_2d.tools.benchmark --compare --accelerator gpu --devices 8 --tensor-parallel-size 8 \\
        --precision bf16-mixed --model llama3-8b --n-layers 4 --seq-len 4096 --global-batch-size 8

Variants (``--compare`` runs all three, alternating ``a, b, c, a, b, c, ...`` for ``--rounds``):

``lightning_2d``
    ``lightning.Trainer`` + ``ModelParallel2DStrategy`` (options from the command line, generated
    from ``ParallelConfig``) + ``LlamaLightningModule`` with its defaults.
``lightning``
    Lightning's own ``ModelParallelStrategy`` with a LightningModule whose ``configure_model``
    applies the Llama TP/SP plan by hand, as PyTorch's 2D example and torchtitan do
    (``reference_2d_plan``), a plain mean cross-entropy, AdamW.
``plain``
    A torch loop without Lightning: ``init_process_group``, ``init_device_mesh``, the same
    ``reference_2d_plan``, model, data and optimizer.

All three train the same seeded initial weights on the same synthetic tokens (the ranks of a
tensor-parallel group draw the same batch; data-parallel ranks different ones), so their first
losses agree. A step's time is the wall time between the ends of consecutive optimizer steps
(device synchronized before the clock is read), the slowest rank's; the first ``--warmup`` steps
of every run are dropped and the median is taken over the remaining steps of all rounds.

Each variant of each round is a fresh set of ``--devices × --num-nodes`` local processes
(``lightning_2d.tools.launch``), so peak memory is per run. Started under torchrun/SLURM (``RANK`` and
``WORLD_SIZE`` set), the benchmark instead runs every variant in place, one after the other, in
the processes it was started in.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import sys
import tempfile
import time
import types
import typing
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F

from lightning_2d.integration.callbacks import peak_memory_gib, peak_tflops, reset_peak_memory, synchronize
from lightning_2d.models.llama.model import PRESETS, ModelArgs, Transformer
from lightning_2d.parallel.config import (
    PRECISION_TO_DTYPES,
    SUPPORTED_PRECISIONS,
    ParallelConfig,
    ParallelConfigError,
)
from lightning_2d.parallel.options import options_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_2d.parallel.dims import ParallelDims

VARIANTS = ("lightning_2d", "lightning", "plain")
OURS = "lightning_2d"
#: PyTorch's 2D Llama example (``dtensor_2d_llama.py``): the shape the benchmark runs by default.
REFERENCE_MODEL = ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=32000)
#: Benchmark defaults of strategy options (the rest keep ``ParallelConfig``'s): with the default
#: 4 devices this is the reference ``(dp, tp) = (2, 2)`` layout.
STRATEGY_DEFAULTS: dict[str, Any] = {"data_parallel_size": "auto", "tensor_parallel_size": 2}


class BenchmarkConfigError(ValueError):
    """Impossible benchmark settings, found before any process starts; lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("Invalid benchmark settings:\n  - " + "\n  - ".join(self.problems))


class BenchmarkJobError(RuntimeError):
    """A rank of a benchmark job failed or the job ran out of time."""


# ---- strategy options, generated from ParallelConfig ----------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """Each option's docstring (the fields of ``cls``: ``lightning_2d.parallel.options``), as one line of text."""
    return {opt.name: re.sub(r"``(.*?)``", r"\1", opt.doc) for opt in options_of(cls)}


def option_converter(hint: Any) -> Callable[[str], Any]:
    """An argparse ``type=`` for a field annotated ``hint``: the first member of the annotation the text fits.

    ``None`` for ``none``, a ``bool`` for ``true``/``false``, an ``int`` for digits, a ``Literal``
    value, a ``float``, a ``list[int]`` from ``1,2,3`` or a JSON list, else the string itself where
    ``str`` or ``torch.dtype`` (whose names ``ParallelConfig`` converts) is allowed, or where the annotation
    is a choice of words (``Literal`` strings and no number): ``ParallelConfig``'s check then names the
    valid ones and the fix.
    """
    members = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    literals = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    words = bool(literals) and all(isinstance(v, str) for v in literals) and int not in members and float not in members
    int_lists = any(typing.get_origin(m) is list and typing.get_args(m) == (int,) for m in members)

    def int_list(text: str) -> Optional[list[int]]:
        try:
            value = json.loads(text) if text.lstrip().startswith("[") else [int(v) for v in text.split(",")]
        except ValueError:  # json.JSONDecodeError is a ValueError
            return None
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return value if ok else None

    def convert(text: str) -> Any:
        if type(None) in members and text.lower() == "none":
            return None
        if int_lists and (value := int_list(text)) is not None:
            return value
        if bool in members and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if int in members and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if text in [str(v) for v in literals]:
            return next(v for v in literals if str(v) == text)
        if float in members:
            try:
                return float(text)
            except ValueError:
                pass
        if str in members or torch.dtype in members or words:
            return text
        names = [str(m) if typing.get_origin(m) is list else getattr(m, "__name__", str(m))
                 for m in members if typing.get_origin(m) is not Literal]
        allowed = ", ".join([*names, *(repr(v) for v in literals)])
        raise argparse.ArgumentTypeError(f"{text!r} is not one of: {allowed}")

    convert.__name__ = str(hint)  # argparse names the type in its error message
    return convert


def option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_strategy_options(
    parser: argparse.ArgumentParser,
    defaults: Optional[dict[str, Any]] = None,
    description: str = "ModelParallel2DStrategy / ParallelConfig options; they apply to the lightning_2d variant",
) -> None:
    """One flag per ``ParallelConfig`` field (``--sequence-parallel/--no-sequence-parallel``, ...).

    Help comes from the field's docstring; an unset flag keeps the strategy's default (or the one in
    ``defaults``: the benchmark's ``STRATEGY_DEFAULTS`` unless given). ``lightning-2d plan`` uses it too.
    """
    defaults = STRATEGY_DEFAULTS if defaults is None else defaults
    group = parser.add_argument_group("strategy options", description)
    hints = typing.get_type_hints(ParallelConfig)
    docs = field_docs(ParallelConfig)
    for f in fields(ParallelConfig):
        hint = hints[f.name]
        default = defaults.get(f.name, f.default)
        help_text = f"{docs.get(f.name, f'ParallelConfig.{f.name}')} (default: {default})".replace("%", "%%")
        if hint is bool:
            group.add_argument(option_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(option_flag(f.name), dest=f.name, type=option_converter(hint), default=None,
                               metavar=f.name.upper(), help=help_text)


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ParallelConfig`` fields given on the command line, on top of ``STRATEGY_DEFAULTS``."""
    given = {f.name: getattr(args, f.name) for f in fields(ParallelConfig) if getattr(args, f.name, None) is not None}
    return {**STRATEGY_DEFAULTS, **given}


# ---- settings -------------------------------------------------------------------------------------
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

    def strategy_kwargs(self) -> dict[str, Any]:
        """``ModelParallel2DStrategy`` arguments: the options with the mesh sizes resolved."""
        return {**self.strategy_options, "data_parallel_size": self.dp, "tensor_parallel_size": self.tp}

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
        return ModelArgs(**{**asdict(REFERENCE_MODEL), **overrides})
    except ValueError as err:
        # "Invalid ModelArgs:\n  - a\n  - b" → one problem per line
        lines = [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]] or [str(err)]
        problems.extend(f"model: {line}" for line in lines if line)
        return None


def _strategy_accepts() -> set[str]:
    from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy

    return set(inspect.signature(ModelParallel2DStrategy).parameters)


def _validate_layout(config: ParallelConfig, args: argparse.Namespace, model_args: Optional[ModelArgs]) -> ParallelDims:
    from lightning_2d.models.llama.plan import llama_plan
    from lightning_2d.parallel.dims import validate_parallel_dims

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
        if args.compare and not config.sequence_parallel:
            # The hand-written variants always use the reference plan, sequence parallel included.
            _validate_layout(ParallelConfig(**{**options, "sequence_parallel": True}), args, model_args)
    except ParallelConfigError as err:
        extra = [p for p in err.problems if p not in problems]
        if dp and extra:  # only the reference plan's check got here
            extra = [f"under --compare the lightning and plain variants use sequence parallelism: {p}" for p in extra]
        problems.extend(extra)
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
        variants=list(VARIANTS) if args.compare else [OURS],
        timeout=args.timeout,
    )


# ---- what every variant shares --------------------------------------------------------------------
class SyntheticTokens(torch.utils.data.Dataset):
    """This data-parallel rank's batches of random tokens, drawn up front (not in the timed loop).

    Sample ``i`` of the global stream is drawn from a generator seeded by ``(seed, i)``, so a
    sample's tokens do not depend on the layout; data-parallel rank ``r`` takes, of each global
    batch, the ``r``-th slice of ``local_batch_size`` samples.

    Args:
        settings: Shape, steps and seed.
        dp_rank: This rank's index in the data-parallel dimension.
    """

    def __init__(self, settings: BenchmarkSettings, dp_rank: int) -> None:
        local, vocab = settings.local_batch_size, settings.model_args.vocab_size
        rows = []
        for step in range(settings.total_steps):
            for j in range(local):
                index = step * settings.global_batch_size + dp_rank * local + j
                g = torch.Generator().manual_seed(settings.seed * 1_000_003 + index)
                rows.append(torch.randint(0, vocab, (settings.seq_len + 1,), generator=g))
        self.tokens = torch.stack(rows)  # (steps · local_batch, seq_len + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def synthetic_loader(settings: BenchmarkSettings, rank: int) -> torch.utils.data.DataLoader:
    """The loader of global ``rank``: tensor-parallel groups are consecutive ranks, so its data-parallel
    index is ``rank // tp`` (the same in Lightning's mesh and in ``init_device_mesh((dp, tp))``)."""
    dataset = SyntheticTokens(settings, dp_rank=rank // settings.tp)
    return torch.utils.data.DataLoader(dataset, batch_size=settings.local_batch_size, shuffle=False)


class StepClock:
    """Wall time between the ends of consecutive optimizer steps, and each step's loss.

    Args:
        device: Synchronized before the clock is read, so queued kernels count for their step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self._last: Optional[float] = None

    @property
    def started(self) -> bool:
        return self._last is not None

    def start(self) -> None:
        # Peak memory counts from the first step: what setup allocated and freed is not training's.
        reset_peak_memory(self.device)
        synchronize(self.device)
        self._last = time.perf_counter()

    def tick(self, loss: torch.Tensor) -> None:
        """One optimizer step has ended; ``loss`` is its loss (read after the clock)."""
        assert self._last is not None, "call start() before the first step"
        synchronize(self.device)
        now = time.perf_counter()
        self.step_times.append(now - self._last)
        self._last = now
        self.losses.append(float(loss))


def adamw_defaults() -> dict[str, Any]:
    """``LlamaLightningModule``'s optimizer hyper-parameters (its constructor defaults): one source of truth."""
    from lightning_2d.integration.module import LlamaLightningModule

    parameters = inspect.signature(LlamaLightningModule.__init__).parameters
    names = ("learning_rate", "weight_decay", "betas", "eps", "fused", "warmup_steps", "min_lr_ratio")
    return {name: parameters[name].default for name in names}


def lr_warmup_steps(settings: BenchmarkSettings) -> int:
    return max(1, settings.warmup)


def build_adamw(
    model: torch.nn.Module, device: torch.device, settings: BenchmarkSettings
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule for the hand-written variants, following ``LlamaLightningModule.configure_optimizers``:
    weight decay on matrices only, fused on CUDA and foreach elsewhere, linear warm-up then cosine."""
    from lightning_2d.integration.module import warmup_cosine_schedule

    hp = adamw_defaults()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    fused = hp["fused"] if hp["fused"] is not None else device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp["learning_rate"],
        betas=tuple(hp["betas"]),
        eps=hp["eps"],
        fused=fused,
        foreach=None if fused else True,
    )
    schedule = warmup_cosine_schedule(lr_warmup_steps(settings), settings.total_steps, hp["min_lr_ratio"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def reference_2d_plan(
    model: Transformer, tp_mesh: "DeviceMesh", dp_mesh: "DeviceMesh", mp_policy: "MixedPrecisionPolicy"
) -> None:
    """The Llama 2D layout written by hand, as in PyTorch's 2D example and torchtitan's ``parallelize_llama``.

    Tensor parallel with sequence parallelism: the embedding is sharded over the vocabulary and
    emits sequence shards, every block gathers the sequence at the attention/feed-forward entry,
    shards ``wq/wk/wv/w1/w3`` by columns and ``wo/w2`` by rows (back to sequence shards), norms
    run on the shards, the logits are gathered. Then FSDP2 per block (each but the last reshards
    after forward) and at the root. The model's attention reads its local head count from the
    shapes, so no head count is rewritten.

    Args:
        model: A ``Transformer`` (on the meta device, or materialized).
        tp_mesh: The tensor-parallel sub-mesh.
        dp_mesh: The data-parallel sub-mesh.
        mp_policy: FSDP2's mixed-precision policy.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def reference_mp_policy(precision: str) -> "MixedPrecisionPolicy":
    """FSDP2's policy for ``precision``, the same dtypes ``ModelParallel2DStrategy`` derives by default."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype, reduce_dtype = PRECISION_TO_DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def build_reference_model(settings: BenchmarkSettings, tp_mesh: "DeviceMesh", dp_mesh: "DeviceMesh") -> Transformer:
    """The hand-written variants' model: built on the meta device, then ``reference_2d_plan``."""
    with torch.device("meta"):
        model = Transformer(settings.model_args)
    if settings.precision == "bf16-true":
        model.to(torch.bfloat16)  # the shards themselves are bf16, as under ModelParallel2DStrategy
    reference_2d_plan(model, tp_mesh, dp_mesh, reference_mp_policy(settings.precision))
    return model


@torch.no_grad()
def load_seeded_init(model: Transformer, seed: int) -> None:
    """Overwrite each rank's shards with the values ``Transformer.init_weights(seed)`` gives the full
    model, and recompute the rotary table: every variant then starts from the same weights."""
    from lightning_2d.ops.init import SeededInit
    from lightning_2d.parallel.materialize import local_block
    from lightning_2d.parallel.modules import canonical_name

    source = SeededInit(model.param_init_specs(), seed)
    device = torch.device("cpu")
    for name, param in model.named_parameters():
        local, offset = local_block(param)
        source.fill_block_(local, canonical_name(name), tuple(param.shape), offset)
        device = local.device
    model.init_buffers(device)


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The hand-written variants' loss: the mean over this rank's tokens (FSDP averages over replicas)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# ---- the three variants (one rank each) ------------------------------------------------------------
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _quiet_lightning() -> None:
    # The synthetic loader needs no workers, and the benchmark sets no logger on purpose.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*`self.log\(\)` but .*logger.*")


class StepClockCallback(L.Callback):
    """A ``StepClock`` driven by the Trainer: started at the first batch, ticked at every batch end."""

    def __init__(self) -> None:
        self.clock: Optional[StepClock] = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.clock is None:
            self.clock = StepClock(pl_module.device)
            self.clock.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.clock is not None
        # LlamaLightningModule logs the global-batch mean; a module that logs nothing returns its loss.
        self.clock.tick(trainer.callback_metrics.get("train_loss", outputs["loss"]))


def _trainer(settings: BenchmarkSettings, strategy: Any, precision: str, callback: L.Callback) -> L.Trainer:
    return L.Trainer(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=strategy,
        precision=precision,
        max_steps=settings.total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # Each rank gets its own synthetic loader (see synthetic_loader): no sampler on top.
        use_distributed_sampler=False,
        callbacks=[callback],
        default_root_dir=tempfile.gettempdir(),
    )


def run_lightning_2d(settings: BenchmarkSettings) -> tuple[StepClock, torch.device, torch.dtype]:
    """Variant ``lightning_2d``: Trainer + ``ModelParallel2DStrategy`` + ``LlamaLightningModule``."""
    from lightning_2d.integration.module import LlamaLightningModule
    from lightning_2d.integration.trainer_strategy import ModelParallel2DStrategy

    module = LlamaLightningModule(
        model=settings.model_args,
        init_seed=settings.seed,
        warmup_steps=lr_warmup_steps(settings),
        max_steps=settings.total_steps,
        **settings.module_options,
    )
    strategy = ModelParallel2DStrategy(**settings.strategy_kwargs())
    callback = StepClockCallback()
    trainer = _trainer(settings, strategy, settings.precision, callback)
    trainer.fit(module, train_dataloaders=synthetic_loader(settings, _rank()))
    dtype = strategy.parallel_config.resolve_dtypes(settings.precision).param_dtype
    assert callback.clock is not None and dtype is not None
    return callback.clock, strategy.root_device, dtype


class HandWritten2DModule(L.LightningModule):
    """What a user writes for Lightning's ``ModelParallelStrategy`` today: the 2D plan in ``configure_model``.

    Args:
        settings: Model shape, precision, seed and optimizer schedule.
    """

    def __init__(self, settings: BenchmarkSettings) -> None:
        super().__init__()
        self.settings = settings
        self.model: Optional[Transformer] = None

    def configure_model(self) -> None:
        if self.model is None:
            mesh = self.device_mesh
            self.model = build_reference_model(self.settings, mesh["tensor_parallel"], mesh["data_parallel"])

    def on_fit_start(self) -> None:
        # Lightning materialized the meta model with each module's reset_parameters(), whose values
        # depend on the layout (and the Transformer's rotary table has none): load the seeded
        # values the other variants start from.
        assert self.model is not None
        load_seeded_init(self.model, self.settings.seed)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return mean_cross_entropy(self.model(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        optimizer, scheduler = build_adamw(self.model, self.device, self.settings)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run_lightning(settings: BenchmarkSettings) -> tuple[StepClock, torch.device, torch.dtype]:
    """Variant ``lightning``: Lightning's ``ModelParallelStrategy``, ``reference_2d_plan`` in ``configure_model``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    # Replaced by the seeded init in on_fit_start (see HandWritten2DModule).
    warnings.filterwarnings("ignore", message=r"Parameter initialization incomplete.*")
    strategy = ModelParallelStrategy(data_parallel_size=settings.dp, tensor_parallel_size=settings.tp)
    callback = StepClockCallback()
    # Precision goes through FSDP2's policy in reference_2d_plan, as in the other variants; Lightning's
    # bf16 plugins would add autocast or a module conversion on top.
    trainer = _trainer(settings, strategy, "32-true", callback)
    trainer.fit(HandWritten2DModule(settings), train_dataloaders=synthetic_loader(settings, _rank()))
    assert callback.clock is not None
    return callback.clock, strategy.root_device, PRECISION_TO_DTYPES[settings.precision][0]


def run_plain(settings: BenchmarkSettings) -> tuple[StepClock, torch.device, torch.dtype]:
    """Variant ``plain``: a torch training loop, no Lightning."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if settings.accelerator == "gpu":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():  # in place, an earlier variant may have created it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (settings.dp, settings.tp), mesh_dim_names=("dp", "tp"))
    model = build_reference_model(settings, mesh["tp"], mesh["dp"])
    model.to_empty(device=device)
    load_seeded_init(model, settings.seed)
    optimizer, scheduler = build_adamw(model, device, settings)
    loader = synthetic_loader(settings, dist.get_rank())

    clock = StepClock(device)
    clock.start()
    for batch in loader:
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        loss = mean_cross_entropy(model(input_ids), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        clock.tick(loss.detach())
    return clock, device, PRECISION_TO_DTYPES[settings.precision][0]


RUNNERS: dict[str, Callable[[BenchmarkSettings], tuple[StepClock, torch.device, torch.dtype]]] = {
    "lightning_2d": run_lightning_2d,
    "lightning": run_lightning,
    "plain": run_plain,
}


def run_variant(variant: str, settings: BenchmarkSettings) -> dict[str, Any]:
    """Run one variant on this rank; returns its step times, losses, peak memory and the device's peak."""
    from lightning_2d.parallel.dims import destroy_process_group_at_exit

    _quiet_lightning()
    clock, device, dtype = RUNNERS[variant](settings)
    destroy_process_group_at_exit()
    return {
        "variant": variant,
        "rank": _rank(),
        "device": str(device),
        "step_times": clock.step_times,
        "losses": clock.losses,
        "peak_memory_gib": peak_memory_gib(device),
        "peak_tflops": peak_tflops(device, dtype),
        "compute_dtype": str(dtype).removeprefix("torch."),
    }


# ---- processes ----------------------------------------------------------------------------------
def started_by_launcher() -> bool:
    """Whether torchrun/SLURM (or anyone) already started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _child_env(settings: BenchmarkSettings) -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    if settings.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N processes each running as many threads as cores would oversubscribe.
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_job(variant: str, settings: BenchmarkSettings, settings_path: Path, job_dir: Path) -> list[dict[str, Any]]:
    """Start ``settings.world_size`` local processes running ``variant``; each rank's result, by rank."""
    from lightning_2d.tools.launch import launch_processes

    argv = [sys.executable, "-m", "lightning_2d.tools.benchmark", "--worker", variant,
            "--settings", str(settings_path), "--out", str(job_dir)]
    job = launch_processes(
        argv, job_dir, nprocs=settings.world_size, num_nodes=settings.num_nodes, timeout=settings.timeout,
        env=_child_env(settings),
    )
    if not job.ok:
        failed = job.failed_rank()
        what = f"rank {failed} failed" if failed is not None else f"timed out after {settings.timeout:.0f}s"
        ranks = [failed] if failed is not None else None
        raise BenchmarkJobError(f"benchmark variant {variant!r}: {what}\n{job.describe(ranks, tail=4000)}")
    return [job.rank_output(rank) for rank in range(settings.world_size)]


def run_spawned(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every round of every variant as its own local job; the runs in the order they ran."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="lightning-2d-benchmark-") as tmp:
        settings_path = Path(tmp) / "settings.json"
        settings_path.write_text(settings.to_json())
        for round_ in range(settings.rounds):
            for variant in settings.variants:
                log(f"[benchmark] round {round_ + 1}/{settings.rounds}: {variant} on {settings.world_size} processes")
                ranks = run_job(variant, settings, settings_path, Path(tmp) / f"round{round_}-{variant}")
                runs.append({"variant": variant, "round": round_, "ranks": ranks})
    return runs


def run_in_place(settings: BenchmarkSettings) -> Optional[list[dict[str, Any]]]:
    """Run every round of every variant in this process (one rank of an external launch).

    Returns the runs (all ranks' results) on rank 0, ``None`` elsewhere. Peak memory counts from each
    run's first step (on CPU where Linux lets the resident peak be reset; elsewhere the process's
    peak so far).
    """
    import torch.distributed as dist

    mine = []
    for round_ in range(settings.rounds):
        for variant in settings.variants:
            if _rank() == 0:
                print(f"[benchmark] round {round_ + 1}/{settings.rounds}: {variant} (in place)", flush=True)
            mine.append({"variant": variant, "round": round_, "result": run_variant(variant, settings)})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    return [
        {"variant": run["variant"], "round": run["round"], "ranks": [ranks[i]["result"] for ranks in gathered]}
        for i, run in enumerate(mine)
    ]


# ---- statistics and the report -------------------------------------------------------------------
def slowest_rank_step_times(per_rank: list[list[float]]) -> list[float]:
    """Per step, the longest time any rank took (the ranks wait for each other in collectives)."""
    lengths = {len(times) for times in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks recorded different numbers of steps: {[len(t) for t in per_rank]}")
    return [max(step) for step in zip(*per_rank)]


def steady_step_times(runs: list[dict[str, Any]], warmup: int) -> list[float]:
    """The step times of all ``runs`` (of one variant) after each run's first ``warmup`` steps."""
    steady: list[float] = []
    for run in runs:
        steady.extend(slowest_rank_step_times([rank["step_times"] for rank in run["ranks"]])[warmup:])
    return steady


def variant_summary(settings: BenchmarkSettings, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time and what follows from it (throughput, TFLOP/s, MFU), peak memory, first loss."""
    steady = steady_step_times(runs, settings.warmup)
    median = statistics.median(steady)
    tokens_per_sec = settings.tokens_per_step / median
    per_device = tokens_per_sec / settings.world_size
    tflops = settings.model_args.flops_per_token(settings.seq_len) * per_device / 1e12
    peak = runs[0]["ranks"][0].get("peak_tflops")
    first = runs[0]["ranks"]
    return {
        "median_step_s": median,
        "step_times_s": steady,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": per_device,
        "tflops_per_device": tflops,
        "mfu_percent": 100.0 * tflops / peak if peak else None,
        "peak_memory_gib_per_device": max(rank["peak_memory_gib"] for run in runs for rank in run["ranks"]),
        # Mean over ranks: the global-batch mean whether a rank reports its own mean (equal token
        # counts on every replica) or the global one.
        "first_loss": statistics.fmean(rank["losses"][0] for rank in first),
        "compute_dtype": first[0].get("compute_dtype"),
        "ranks": sorted({rank["rank"] for run in runs for rank in run["ranks"]}),
        "rounds": len(runs),
    }


def step_time_ratios(medians: dict[str, float], ours: str = OURS) -> dict[str, float]:
    """``ours``' median step time over each other variant's (below 1: ours is faster)."""
    return {other: medians[ours] / median for other, median in medians.items() if other != ours}


def summarize(settings: BenchmarkSettings, runs: list[dict[str, Any]], in_place: bool = False) -> dict[str, Any]:
    """The report: settings, a summary per variant, the ratios, and every rank's raw records.

    Args:
        settings: What ran.
        runs: ``{"variant", "round", "ranks": [rank record, ...]}`` in the order they ran.
        in_place: Whether the variants ran one after the other in the same processes.
    """
    summaries = {v: variant_summary(settings, [r for r in runs if r["variant"] == v]) for v in settings.variants}
    ratios = step_time_ratios({v: s["median_step_s"] for v, s in summaries.items()}) if len(summaries) > 1 else {}
    return {"settings": asdict(settings), "in_place": in_place, "variants": summaries, "ratios": ratios, "runs": runs}


def _fmt(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table, settings and ratios of ``summarize``'s report."""
    s = BenchmarkSettings(**report["settings"])
    args = s.model_args
    options = ", ".join(f"{k}={v}" for k, v in s.strategy_options.items() if k not in STRATEGY_DEFAULTS) or "defaults"
    lines = [
        (
            f"model: dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads ({args.kv_heads} kv), vocab"
            f" {args.vocab_size}; {args.num_params() / 1e6:.1f}M parameters,"
            f" {args.flops_per_token(s.seq_len) / 1e6:.1f} MFLOP/token"
        ),
        f"data: seq {s.seq_len}, global batch {s.global_batch_size} ({s.tokens_per_step} tokens/step)",
        (
            (f"layout: (pp, dp, tp) = ({pp}, {s.dp}, {s.tp})" if (pp := s.strategy_options.get("pipeline_parallel_size", 1)) > 1
             else f"layout: (dp, tp) = ({s.dp}, {s.tp})")
            + f" on {s.world_size} {s.accelerator} process(es),"
            f" {s.num_nodes} node(s); precision {s.precision}"
        ),
        f"timing: {s.steps} steps after {s.warmup} warm-up, {s.rounds} round(s), median of the slowest rank per step",
        f"strategy options (lightning_2d): {options}",
        "loss (lightning_2d): " + (
            f"fused projection + cross-entropy, {s.module_options['loss_chunk_size']} tokens per chunk"
            if s.module_options.get("fused_loss", True) else "logits, then F.cross_entropy"
        ),
    ]
    if len(s.variants) > 1:
        lines.append(
            "hand-written variants (lightning, plain): the reference plan (sequence parallel, gathered logits, mean"
            " cross-entropy, FSDP2 per block and root)"
        )
    header = ("variant", "step ms", "tokens/s", "tokens/s/dev", "TFLOP/s/dev", "MFU %", "peak GiB/dev", "first loss")
    rows = [header]
    for variant, v in report["variants"].items():
        rows.append((
            variant,
            _fmt(v["median_step_s"] * 1e3, 2),
            _fmt(v["tokens_per_sec"], 0),
            _fmt(v["tokens_per_sec_per_device"], 0),
            _fmt(v["tflops_per_device"], 4),
            _fmt(v["mfu_percent"], 1),
            _fmt(v["peak_memory_gib_per_device"], 3),
            f"{v['first_loss']:.6f}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    for row in rows:
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
    if report.get("in_place") and s.accelerator == "cpu" and not Path("/proc/self/clear_refs").exists():
        lines.append(
            "(in place on CPU: a variant's peak memory is its processes' peak so far, earlier variants included)"
        )
    if report["ratios"]:
        lines.append("")
        for other, ratio in report["ratios"].items():
            lines.append(f"ours / {other} = {ratio:.3f}x step time ({1 / ratio:.3f}x the throughput)")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-2d benchmark`` parser, strategy options included."""
    parser = argparse.ArgumentParser(
        prog="lightning-2d benchmark",
        description="Train a Llama model for --warmup + --steps steps and print the median step time, tokens/s"
        " (global and per device), TFLOP/s, MFU (GPU), peak memory per device and the settings. --compare runs,"
        " alternating, ModelParallel2DStrategy (lightning_2d), Lightning's ModelParallelStrategy with the plan"
        " hand-written (lightning) and a plain torch loop (plain), and prints the step-time ratios.",
    )
    parser.add_argument("--compare", action="store_true", help="run the three variants side by side")
    model = parser.add_argument_group(
        "model", "default: PyTorch's 2D example (dim 256, 2 layers, 16 heads, vocab 32000)"
    )
    model.add_argument("--model", choices=list(PRESETS), default=None, help="a preset to start from")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"):
        model.add_argument(option_flag(name), type=int, default=None, help=f"ModelArgs.{name}")
    run = parser.add_argument_group("run")
    run.add_argument("--seq-len", type=int, default=256)
    run.add_argument("--global-batch-size", type=int, default=8, help="sequences per step over all replicas")
    run.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    run.add_argument("--devices", type=int, default=4, help="processes per node")
    run.add_argument("--num-nodes", type=int, default=1)
    run.add_argument("--precision", choices=SUPPORTED_PRECISIONS, default="32-true")
    run.add_argument("--steps", type=int, default=18, help="timed steps per run")
    run.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every run")
    run.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the tokens")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take before it is killed")
    run.add_argument("--json", type=Path, default=None, help="write the settings, summaries and raw step times here")
    module = parser.add_argument_group("LlamaLightningModule (the lightning_2d variant)")
    module.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=True,
                        help="output projection fused with the cross-entropy, chunk by chunk (default); "
                        "--no-fused-loss: logits, then F.cross_entropy")
    module.add_argument("--loss-chunk-size", type=int, default=1024, help="tokens per chunk of the fused loss")
    add_strategy_options(parser)
    # Internal: one rank of a job started by run_job.
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def worker_main(variant: str, settings_path: Path, out_dir: Path) -> None:
    """One rank of a job started by ``run_job``: run ``variant``, write ``out_dir/rank{RANK}.json``."""
    settings = BenchmarkSettings.from_json(settings_path.read_text())
    result = run_variant(variant, settings)
    (out_dir / f"rank{_rank()}.json").write_text(json.dumps(result))


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-2d benchmark`` / ``python -m lightning_2d.tools.benchmark``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        if args.settings is None or args.out is None:
            parser.error("--worker needs --settings and --out")
        worker_main(args.worker, args.settings, args.out)
        return
    in_place = started_by_launcher()
    try:
        settings = settings_from_args(args, world_size=int(os.environ["WORLD_SIZE"]) if in_place else None)
    except BenchmarkConfigError as err:
        parser.error(str(err))
    if in_place:
        runs = run_in_place(settings)
        if runs is None:
            return
    else:
        try:
            runs = run_spawned(settings, log=lambda line: print(line, flush=True))
        except BenchmarkJobError as err:
            print(err, file=sys.stderr)
            raise SystemExit(1) from None
    report = summarize(settings, runs, in_place=in_place)
    print(format_report(report), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
