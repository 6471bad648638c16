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

Beside ``lightning_2d``, each ``--compare-…`` flag adds a variant of it (a row of ``comparisons.COMPARISONS``: its
name, strategy and module overrides, what ``lightning_2d`` runs meanwhile), alternating with it; the report adds its
step-time and peak-memory ratios over ``lightning_2d``:

``simple_fsdp`` (``--compare-backends``)
    ``fsdp_backend="simple_fsdp"`` (``lightning_2d`` then runs ``fully_shard``); the report also shows both
    variants' collectives of one step (``collectives``: all-gathers, reduce-scatters, all-reduces; bucketed under
    ``--compile``).

``lora`` (``--compare-lora RANK``)
    Rank-``RANK`` LoRA adapters trained on the frozen base (``lora=``), against full fine-tuning at the same layout.

``expert_parallel`` (``--compare-expert-parallel EP``)
    A model with experts under ``expert_parallel_size=EP`` (``lightning_2d`` then runs ``1``: every rank holds every
    expert, FSDP-sharded).

``precomputed_reference`` (``--compare-precomputed-reference``, under ``--preference``)
    ``preference={..., "precompute_reference": True}``: the reference's log-probabilities read from the batches, the
    frozen copy never built (the values are found before it would be). ``SyntheticPairs`` gives synthetic values for every sequence, so no
    reference pass runs: the one-time pass of a real run is not timed.

``--preference LOSS_TYPE`` makes every variant train that preference loss on synthetic packed pairs
(``workload.SyntheticPairs``: each window whole pairs of a random prompt and two random completions, the same windows
whatever the layout) instead of next tokens: ``lightning_2d`` trains the whole model against a frozen copy of it
(reference ``copy``), ``lora`` its adapters against the base with them switched off (``adapters_off``), and the
report names each variant's reference beside its ratios.

All of them train the same seeded initial weights on the same synthetic tokens (the ranks of a
tensor-parallel group draw the same batch; data-parallel ranks different ones), so their first
losses agree (``precomputed_reference``'s only nearly: its reference values are synthetic). A step's time is the wall time between the ends of consecutive optimizer steps
(device synchronized before the clock is read), the slowest rank's; the first ``--warmup`` steps
of every run are dropped and the median is taken over the remaining steps of all rounds.

Each variant of each round is a fresh set of ``--devices × --num-nodes`` local processes
(``lightning_2d.tools.launch``), so peak memory is per run. Started under torchrun/SLURM (``RANK`` and
``WORLD_SIZE`` set), the benchmark instead runs every variant in place, one after the other, in
the processes it was started in.

One module per job: ``options`` (strategy flags generated from ``ParallelConfig``), ``comparisons`` (the
compared variants as data), ``settings`` (the command line checked, ``BenchmarkSettings``), ``workload`` (synthetic
tokens, seeded weights, AdamW), ``reference`` (the hand-written 2D plan), ``clock`` (the step clock), ``collectives``
(collectives per step), ``variants`` (the runs), ``processes`` (spawned jobs or in place), ``report`` (statistics and
the table) and ``cli``.
"""

from lightning_2d.tools.benchmark.cli import build_parser, main
from lightning_2d.tools.benchmark.clock import StepClock, StepClockCallback
from lightning_2d.tools.benchmark.comparisons import COMPARISONS, Comparison
from lightning_2d.tools.benchmark.options import (
    STRATEGY_DEFAULTS,
    add_strategy_options,
    field_docs,
    option_converter,
    option_flag,
    strategy_options,
)
from lightning_2d.tools.benchmark.processes import (
    BenchmarkJobError,
    run_in_place,
    run_job,
    run_spawned,
    started_by_launcher,
    worker_main,
)
from lightning_2d.tools.benchmark.reference import (
    build_reference_model,
    mean_cross_entropy,
    reference_2d_plan,
    reference_mp_policy,
)
from lightning_2d.tools.benchmark.report import (
    format_report,
    slowest_rank_step_times,
    steady_step_times,
    step_time_ratios,
    summarize,
    variant_summary,
)
from lightning_2d.tools.benchmark.settings import (
    OURS,
    REFERENCE_MODEL,
    VARIANTS,
    BenchmarkConfigError,
    BenchmarkSettings,
    settings_from_args,
)
from lightning_2d.tools.benchmark.variants import RUNNERS, HandWritten2DModule, run_variant
from lightning_2d.tools.benchmark.workload import (
    SyntheticPairs,
    SyntheticTokens,
    adamw_defaults,
    build_adamw,
    load_seeded_init,
    lr_warmup_steps,
    pair_window,
    pairs_per_window,
    synthetic_data,
    synthetic_loader,
)

__all__ = [
    "COMPARISONS",
    "OURS",
    "REFERENCE_MODEL",
    "RUNNERS",
    "STRATEGY_DEFAULTS",
    "VARIANTS",
    "BenchmarkConfigError",
    "BenchmarkJobError",
    "BenchmarkSettings",
    "Comparison",
    "HandWritten2DModule",
    "StepClock",
    "StepClockCallback",
    "SyntheticPairs",
    "SyntheticTokens",
    "adamw_defaults",
    "add_strategy_options",
    "build_adamw",
    "build_parser",
    "build_reference_model",
    "field_docs",
    "format_report",
    "load_seeded_init",
    "lr_warmup_steps",
    "main",
    "mean_cross_entropy",
    "option_converter",
    "option_flag",
    "pair_window",
    "pairs_per_window",
    "reference_2d_plan",
    "reference_mp_policy",
    "run_in_place",
    "run_job",
    "run_spawned",
    "run_variant",
    "settings_from_args",
    "slowest_rank_step_times",
    "started_by_launcher",
    "steady_step_times",
    "step_time_ratios",
    "strategy_options",
    "summarize",
    "synthetic_data",
    "synthetic_loader",
    "variant_summary",
    "worker_main",
]
