"""The comparison report: per variant the median step time of the slowest rank after warm-up and what follows
from it (tokens/s, TFLOP/s, MFU), peak memory and first loss, the step-time ratios, and the table.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning_2d.ops.linear_cross_entropy import auto_chunk_tokens
from lightning_2d.tools.benchmark.collectives import KINDS
from lightning_2d.tools.benchmark import comparisons  # its table read at each call: a test may add a row
from lightning_2d.tools.benchmark.options import STRATEGY_DEFAULTS
from lightning_2d.tools.benchmark.settings import OURS, BenchmarkSettings
from lightning_2d.tools.benchmark.workload import pairs_per_window


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
        # One step of rank 0 (the last warm-up step of the first run), by kind.
        "collectives_per_step": first[0].get("collectives"),
        # Under --collectives: the same step's collectives by issuer, kind and group (collectives.issuer_table).
        "collectives_by_issuer": first[0].get("collective_issuers"),
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
    hand_written = {v: s["median_step_s"] for v, s in summaries.items() if v not in comparisons.BY_NAME}
    ratios = step_time_ratios(hand_written) if len(hand_written) > 1 else {}
    return {"settings": asdict(settings), "in_place": in_place, "variants": summaries, "ratios": ratios,
            **{row.report_key: variant_ratios(summaries, row.name) for row in comparisons.COMPARISONS}, "runs": runs}


def variant_ratios(summaries: dict[str, dict[str, Any]], variant: str) -> Optional[dict[str, float]]:
    """``variant`` over ``lightning_2d``: median step time and peak memory per device (below 1: faster, or holding
    less); ``None`` unless both ran."""
    if variant not in summaries or OURS not in summaries:
        return None
    other, ours = summaries[variant], summaries[OURS]
    memory = ours["peak_memory_gib_per_device"]
    return {"step_time": other["median_step_s"] / ours["median_step_s"],
            "peak_memory": other["peak_memory_gib_per_device"] / memory if memory else None}


def _collectives(counts: Optional[dict[str, int]]) -> str:
    """``all-gathers/reduce-scatters/all-reduces`` (+ others), or ``-``."""
    if counts is None:
        return "-"
    text = "/".join(str(counts.get(kind, 0)) for kind in KINDS)
    return text + (f" +{counts['other']}" if counts.get("other") else "")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` (the first the header) in columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


def format_issuers(variant: str, issuers: list[dict[str, Any]]) -> list[str]:
    """One variant's ``--collectives`` table: per issuer, kind and group the count and the total elements and MB
    of the calls' inputs (``collectives.payload``: an all-gather's shard, a reduce-scatter's whole input)."""
    rows = [("issuer", "kind", "group", "count", "input elements", "MB")]
    for row in issuers:
        size = row["elements"] is not None
        rows.append((row["issuer"], row["kind"], row["group"], str(row["count"]),
                     f"{row['elements']:,}" if size else "-", f"{row['bytes'] / 1e6:,.3f}" if size else "-"))
    total = sum(row["count"] for row in issuers)
    return [f"collectives of {variant} by issuer ({total} in the counted step of rank 0):", *_table(rows)]


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
            (f"layout: (pp, dp, tp) = ({pp}, {s.dp}, {s.tp})"
             if (pp := s.strategy_options.get("pipeline_parallel_size", 1)) > 1
             else f"layout: (dp, tp) = ({s.dp}, {s.tp})")
            + f" on {s.world_size} {s.accelerator} process(es),"
            f" {s.num_nodes} node(s); precision {s.precision}"
        ),
        f"timing: {s.steps} steps after {s.warmup} warm-up, {s.rounds} round(s), median of the slowest rank per step",
        f"strategy options (lightning_2d): {options}",
        "loss (lightning_2d): " + (
            f"fused projection + cross-entropy, {loss_chunk_words(s)}"
            if s.module_options.get("fused_loss", True) else "logits, then F.cross_entropy"
        ),
    ]
    if s.preference is not None:
        lines.append(
            f"preference (every variant): {s.preference['loss_type']} on synthetic packed pairs"
            f" ({pairs_per_window(s.seq_len)} per window of {s.seq_len}), {s.reference_label()} for lightning_2d;"
            " TFLOP/s counts the trained model's passes, not the reference's forward"
        )
    if (teacher := s.module_options.get("teacher")) is not None:
        lines.append(
            f"distillation (lightning_2d): {s.module_options['distillation']['loss']} from the teacher {teacher}"
            " (a preset: its seeded weights); TFLOP/s counts the student's passes, not the teacher's forward"
        )
    if "lightning" in s.variants or "plain" in s.variants:
        lines.append(
            "hand-written variants (lightning, plain): the reference plan (sequence parallel, gathered logits, mean"
            " cross-entropy, FSDP2 per block and root)"
        )
    header = ("variant", "step ms", "tokens/s", "tokens/s/dev", "TFLOP/s/dev", "MFU %", "peak GiB/dev", "first loss",
              "AG/RS/AR per step")
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
            _collectives(v.get("collectives_per_step")),
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
    compared = [(row, ratios) for row in comparisons.COMPARISONS if (ratios := report.get(row.report_key))]
    if report["ratios"] or compared:
        lines.append("")
    for other, ratio in report["ratios"].items():
        lines.append(f"ours / {other} = {ratio:.3f}x step time ({1 / ratio:.3f}x the throughput)")
    for row, ratios in compared:
        memory = ratios["peak_memory"]
        ours = comparisons.labelled(OURS, row.baseline_label, s.reference_label())
        lines.append(
            f"{row.describe(s.compared[row.name], s.reference_label(row.name))} / {ours} = {ratios['step_time']:.3f}x"
            " step time" + (f", {memory:.3f}x peak memory per device" if memory is not None else "")
        )
    if any(v.get("collectives_per_step") for v in report["variants"].values()):
        lines.append("(AG/RS/AR: all-gathers, reduce-scatters and all-reduces of rank 0 in the last warm-up step;"
                     " +N: other collectives, broadcasts and all-to-alls)")
    for variant, v in report["variants"].items():
        if v.get("collectives_by_issuer") is not None:
            lines += ["", *format_issuers(variant, v["collectives_by_issuer"])]
    return "\n".join(lines)


def loss_chunk_words(s: BenchmarkSettings) -> str:
    """The fused loss's chunk as the run uses it: the given tokens, or the one sized by memory (``auto_chunk_tokens``
    of the vocabulary shard), with whether a micro-batch then fits in one chunk."""
    chunk = s.module_options.get("loss_chunk_size")
    if chunk is not None:
        return f"{chunk} tokens per chunk"
    auto = auto_chunk_tokens(-(-s.model_args.vocab_size // s.tp))  # the largest vocabulary shard
    options = {**STRATEGY_DEFAULTS, **s.strategy_options}
    if int(options.get("pipeline_parallel_size") or 1) > 1:  # the micro-batches are the schedule's
        return f"auto: {auto} tokens per chunk"
    tokens = s.local_batch_size * s.seq_len // int(options.get("context_parallel_size") or 1)
    if tokens <= auto:
        return f"auto: {tokens} tokens per chunk (one chunk per micro-batch)"
    return f"auto: {auto} tokens per chunk ({-(-tokens // auto)} chunks per micro-batch)"
