"""Pictures of a plan, a mesh, a pipeline step and training runs, drawn with matplotlib (the ``plot`` extra).

One function per picture, each writing a PNG sized for a page of the docs (900 pixels wide):

- ``plot_memory(report, path)``: the planner's per-device memory, one stacked bar per pipeline rank
  (``lightning-2d plan ... --plot PATH``);
- ``plot_mesh(layout, path)``: which global rank holds which mesh coordinates, ranks grouped by node, read from
  the mesh the strategies build (``ParallelDims.build_mesh`` in the planner's fake world; ``mesh_table``)
  (``lightning-2d plan ... --plot-mesh PATH``);
- ``plot_pipeline(runs, path)``: each rank's forward, backward and idle time in one measured pipeline step
  (``tests/benchmarks/bench_pipeline.py --plot PATH``);
- ``plot_losses(runs, path)``: loss curves from Lightning ``CSVLogger`` files
  (``python -m lightning_2d.tools.plots loss A.csv B.csv --labels A B --out PATH``).

matplotlib is imported when a picture is drawn, never at import; without it the functions raise
``PlotsUnavailable`` naming the extra to install. The figures are ``matplotlib.figure.Figure`` objects drawn on
the Agg canvas: pyplot (its global figure registry and backend) is never touched.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_2d.parallel.dims import ParallelDims
from lightning_2d.parallel.names import CP_DIM, DP_REPLICATE_DIM, DP_SHARD_DIM, PP_DIM, TP_DIM
from lightning_2d.tools.planner.report import GIB, PlanReport
from lightning_2d.tools.planner.world import fake_world

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL_HINT = "pip install 'lightning-2d[plot]'"
#: Width of every picture in pixels (``WIDTH_IN`` inches at ``DPI``).
DPI, WIDTH_IN = 100, 9.0


class PlotsUnavailable(ImportError):
    """matplotlib is not installed: the message names the extra that installs it."""


def _figure(height_in: float) -> "Figure":
    """A figure on the Agg canvas, outside pyplot (no global state: nothing to close, no backend switch)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotsUnavailable(f"drawing pictures needs matplotlib, which is not installed: {INSTALL_HINT}") from err
    figure = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: "Figure", path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, format="png", facecolor="white")
    return path


# ---- memory ---------------------------------------------------------------------------------------
#: The stacked categories, bottom to top, with their colours (colour-blind safe: Okabe-Ito).
MEMORY_CATEGORIES: dict[str, str] = {
    "parameters": "#0072B2",
    "gradients": "#56B4E9",
    "optimizer state": "#009E73",
    "FSDP buffers": "#E69F00",
    "activations": "#D55E00",
}
RESERVE_COLOUR, LIMIT_COLOUR = "#BBBBBB", "#CC0000"


@dataclass(frozen=True)
class MemoryBar:
    """One device's estimate: ``parts`` (bytes per ``MEMORY_CATEGORIES`` entry) add up to ``total_bytes``."""

    label: str
    parts: dict[str, int]
    total_bytes: int


def memory_bars(report: PlanReport) -> list[MemoryBar]:
    """The bars ``plot_memory`` draws: one per pipeline rank (one without a pipeline).

    Parameters include the module buffers (the rotary table) and a preference loss's frozen reference copy; FSDP
    buffers are the all-gathered parameters, the reduce-scatter buffers and the unsharded gradients kept between
    micro-batches.
    """
    entries: list[tuple[str, Mapping[str, Any]]]
    if report.pipeline:
        entries = []
        for r in report.pipeline:
            holds = "+".join(n for n in ("embedding", "head") if r[n])
            label = f"pp rank {r['pipeline_rank']}\nstages {','.join(map(str, r['stages']))}"
            entries.append((label + (f"\n{holds}" if holds else ""), r))
    else:
        entries = [("every device", {k: v for k, v in vars(report).items() if k.endswith("_bytes")})]
    bars = []
    for label, e in entries:
        parts = {
            "parameters": e["param_bytes"] + e["buffer_bytes"] + e.get("reference_bytes", 0)
                          + e.get("teacher_bytes", 0),
            "gradients": e["grad_bytes"],
            "optimizer state": e["optimizer_bytes"],
            "FSDP buffers": e["all_gather_bytes"] + e["reduce_scatter_bytes"] + e["accumulation_bytes"],
            "activations": e["activation_bytes"],
        }
        bars.append(MemoryBar(label, parts, e["total_bytes"]))
    return bars


def _layout_text(dims: Mapping[str, int]) -> str:
    short = {PP_DIM: "pp", DP_REPLICATE_DIM: "replicate", DP_SHARD_DIM: "shard", CP_DIM: "cp", TP_DIM: "tp"}
    return " × ".join(f"{short[k]} {v}" for k, v in dims.items() if k in short)


def plot_memory(report: PlanReport, path: Union[str, Path]) -> Path:
    """The per-device memory of a plan as stacked bars, one per pipeline rank, against the device's memory.

    Args:
        report: ``plan_run``'s report.
        path: The PNG to write (folders are created).

    Returns:
        ``path``.
    """
    bars = memory_bars(report)
    figure = _figure(5.2)
    ax = figure.add_subplot()
    x = list(range(len(bars)))
    bottoms = [0.0] * len(bars)
    for category, colour in MEMORY_CATEGORIES.items():
        heights = [b.parts[category] / GIB for b in bars]
        ax.bar(x, heights, bottom=bottoms, color=colour, label=category, width=0.65, edgecolor="white", linewidth=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    reserve = report.reserve_bytes / GIB
    ax.bar(x, [reserve] * len(bars), bottom=bottoms, color="white", edgecolor=RESERVE_COLOUR, hatch="///",
           linewidth=0.5, width=0.65, label="reserve (CUDA context, NCCL, fragmentation)")
    for i, bar in enumerate(bars):
        ax.annotate(f"{bar.total_bytes / GIB:.1f}", (i, bottoms[i] + reserve), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    memory = report.device_memory_bytes / GIB
    ax.axhline(memory, color=LIMIT_COLOUR, linestyle="--", linewidth=1.2, label=f"device memory ({memory:g} GiB)")
    ax.set_xticks(x, [b.label for b in bars], fontsize=8)
    ax.set_ylabel("GiB per device")
    ax.set_ylim(0, max(memory, max(bottoms) + reserve) * 1.08)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    figure.legend(loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    figure.suptitle(f"{report.model} on {report.num_nodes} × {report.devices_per_node} devices:"
                    f" {_layout_text(report.dims)} — {report.verdict}", fontsize=11)
    schedule = ""
    if report.pipeline:
        config, microbatches = report.parallel_config, report.pipeline[0]["microbatches"]
        schedule = f", {config['pipeline_schedule']} × {microbatches} micro-batches"
    ac = report.parallel_config["activation_checkpointing"]
    ax.set_title(f"{report.precision}, seq_len {report.seq_len}, micro batch {report.micro_batch_size}{schedule},"
                 f" AC {ac}; numbers: estimated peak (GiB)", fontsize=9)
    return _save(figure, path)


# ---- mesh -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPlace:
    """Where a global rank sits: its node (``rank // devices_per_node``, the order launchers number ranks in),
    its device on the node and its mesh coordinates (dimension name → index, in the mesh's order)."""

    rank: int
    node: int
    local_rank: int
    coordinates: dict[str, int]


def dims_of(report: PlanReport) -> ParallelDims:
    """The ``ParallelDims`` of a plan's layout."""
    d = report.dims
    return ParallelDims(dp_replicate=d[DP_REPLICATE_DIM], dp_shard=d[DP_SHARD_DIM], tp=d[TP_DIM],
                        pp=d.get(PP_DIM, 1), cp=d.get(CP_DIM, 1))


def mesh_table(dims: ParallelDims, devices_per_node: int) -> list[RankPlace]:
    """Every global rank's mesh coordinates, read from the mesh the strategies build (``ParallelDims.build_mesh``,
    in the planner's fake process group), in rank order: the coordinates of the layout's dimensions (``as_dict``;
    the root's size-1 pipeline and context dimensions say nothing).

    Args:
        dims: The mesh sizes.
        devices_per_node: Ranks per node.
    """
    layout = dims.as_dict()
    with fake_world(dims.world_size):
        root = dims.build_mesh("cpu").root
        names, ranks = root.mesh_dim_names or (), root.mesh  # ranks[coordinates] = global rank
        places = []
        for coordinates in itertools.product(*(range(n) for n in ranks.shape)):
            rank = int(ranks[coordinates])
            places.append(RankPlace(rank, rank // devices_per_node, rank % devices_per_node,
                                    {n: c for n, c in zip(names, coordinates) if n in layout}))
    return sorted(places, key=lambda p: p.rank)


_SHORT = {PP_DIM: "pp", DP_REPLICATE_DIM: "rep", DP_SHARD_DIM: "shard", CP_DIM: "cp", TP_DIM: "tp"}
#: Cell colours by (pipeline rank, replica): one hue per pipeline rank, lighter for later replicas.
_HUES = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#999999"]


def _tint(colour: str, amount: float) -> tuple[float, float, float]:
    """``colour`` mixed with white (``amount`` 0: unchanged, 1: white)."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)  # type: ignore[return-value]


def plot_mesh(layout: Union[PlanReport, ParallelDims], path: Union[str, Path], *,
              devices_per_node: Optional[int] = None, max_nodes: int = 8) -> Path:
    """The grid of global ranks, one row per node, each cell naming its mesh coordinates; colour by pipeline rank
    and replica, tensor-parallel groups outlined.

    Args:
        layout: A plan (its layout and devices per node) or ``ParallelDims``.
        path: The PNG to write.
        devices_per_node: Ranks per node (taken from a plan; needed with ``ParallelDims``).
        max_nodes: Nodes drawn at most (the title says how many are left out).
    """
    if isinstance(layout, PlanReport):
        dims, devices_per_node = dims_of(layout), devices_per_node or layout.devices_per_node
    else:
        dims = layout
    if not devices_per_node:
        raise ValueError("plot_mesh needs devices_per_node with a ParallelDims layout")
    table = mesh_table(dims, devices_per_node)
    nodes = math.ceil(dims.world_size / devices_per_node)
    shown = [p for p in table if p.node < max_nodes]
    rows = min(nodes, max_nodes)
    cols = min(devices_per_node, dims.world_size)
    figure = _figure(0.45 + 0.95 * rows + 0.45)
    ax = figure.add_subplot()
    ax.set_xlim(-0.25, cols + 0.05)
    ax.set_ylim(rows + 0.05, -0.12)
    ax.axis("off")
    from matplotlib.patches import FancyBboxPatch, Rectangle

    fontsize = 8 if cols <= 8 else 6.5 if cols <= 12 else 5
    for node in range(rows):  # a node: a labelled box around its row
        ax.add_patch(FancyBboxPatch((0.0, node + 0.03), cols, 0.94, facecolor="#F4F4F4", edgecolor="#666666",
                                    linewidth=1.0, boxstyle="round,pad=0.0,rounding_size=0.06"))
        ax.text(-0.06, node + 0.5, f"node {node}", rotation=90, ha="center", va="center", fontsize=9)
    replicas = dims.dp_replicate
    for p in shown:
        c = p.coordinates
        hue = _HUES[c.get(PP_DIM, 0) % len(_HUES)]
        colour = _tint(hue, 0.55 + 0.35 * c.get(DP_REPLICATE_DIM, 0) / max(1, replicas))
        ax.add_patch(Rectangle((p.local_rank + 0.08, p.node + 0.14), 0.84, 0.72, facecolor=colour,
                               edgecolor="white", linewidth=0.8))
        parts = [f"{_SHORT[k]} {v}" for k, v in c.items()]
        lines = [" · ".join(parts[:2]), " · ".join(parts[2:])]
        ax.text(p.local_rank + 0.5, p.node + 0.36, f"rank {p.rank}", ha="center", va="center",
                fontsize=fontsize + 1, weight="bold")
        ax.text(p.local_rank + 0.5, p.node + 0.64, "\n".join(lines), ha="center", va="center", fontsize=fontsize,
                linespacing=1.3)
    # Tensor-parallel groups: consecutive ranks of a node sharing every other coordinate.
    def group_key(p: RankPlace) -> tuple:
        return (p.node, tuple(v for k, v in p.coordinates.items() if k != TP_DIM))

    for (node, _), members in itertools.groupby(shown, key=group_key):
        locals_ = [m.local_rank for m in members]
        if dims.tp > 1:
            ax.add_patch(Rectangle((min(locals_) + 0.04, node + 0.1), max(locals_) - min(locals_) + 0.92, 0.8,
                                   facecolor="none", edgecolor="#222222", linewidth=1.3))
    dims_text = _layout_text(dims.as_dict())
    more = f" (nodes 0-{rows - 1} of {nodes} shown)" if nodes > rows else ""
    figure.suptitle(f"Global ranks and their mesh coordinates: {nodes} node(s) × {devices_per_node} devices{more}",
                    fontsize=11)
    ax.set_title(f"mesh {dims_text} (the last varies fastest); outlined: tensor-parallel groups; colour: pipeline"
                 " rank, lighter for later replicas", fontsize=8.5)
    return _save(figure, path)


# ---- pipeline -------------------------------------------------------------------------------------
#: Action kinds of ``Pipeline.actions``: forward, full backward, input-gradient and weight-gradient passes.
ACTION_COLOURS = {"F": "#0072B2", "B": "#D55E00", "I": "#E69F00", "W": "#009E73"}
ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (input gradients)", "W": "backward (weight gradients)"}
IDLE_COLOUR = "#E8E8E8"


def idle_fraction(ranks: Sequence[Mapping[str, Any]]) -> float:
    """``1 - busy / step time`` averaged over the ranks of one measured step (``plot_pipeline``'s ``ranks``)."""
    fractions = []
    for r in ranks:
        busy = sum(end - start for _, _, _, start, end in r["actions"])
        fractions.append(1 - busy / (r["step_end"] - r["step_start"]))
    return sum(fractions) / len(fractions)


def plot_pipeline(runs: Sequence[Mapping[str, Any]], path: Union[str, Path], *, title: str = "") -> Path:
    """One panel per run (a schedule and micro-batch count): a row per rank, its actions coloured by kind on the
    idle background, the micro-batch index written in each (darker: a rank's later stage).

    Args:
        runs: Each ``{"schedule": name, "microbatches": m, "ranks": [{"step_start": t0, "step_end": t1,
            "actions": [[kind, stage, microbatch, start, end], ...]}, ...]}``, one rank entry per pipeline rank in
            rank order, times in seconds on one clock (``time.perf_counter`` of processes on one host).
        path: The PNG to write.
        title: Above the panels.
    """
    figure = _figure(0.6 + 1.25 * len(runs))
    axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        ranks = run["ranks"]
        origin = min(r["step_start"] for r in ranks)
        end = max(r["step_end"] for r in ranks)
        for row, r in enumerate(ranks):
            ax.broken_barh([((r["step_start"] - origin) * 1e3, (r["step_end"] - r["step_start"]) * 1e3)],
                           (row - 0.4, 0.8), facecolors=IDLE_COLOUR)
            first_stage = min((a[1] for a in r["actions"]), default=0)
            for kind, stage, microbatch, start, stop in r["actions"]:
                colour = ACTION_COLOURS[kind] if stage == first_stage else _shade(ACTION_COLOURS[kind], 0.55)
                x, width = (start - origin) * 1e3, (stop - start) * 1e3
                ax.broken_barh([(x, width)], (row - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.4)
                if width > (end - origin) * 1e3 / 90:
                    ax.text(x + width / 2, row, str(microbatch), ha="center", va="center", fontsize=6.5, color="white")
        ax.set_yticks(range(len(ranks)), [f"rank {i}" for i in range(len(ranks))], fontsize=8)
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_xlim(0, (end - origin) * 1e3)
        ax.tick_params(axis="x", labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_title(f"{run['schedule']}, {run['microbatches']} micro-batches: idle {idle_fraction(ranks):.0%} of the"
                     f" step ({(end - origin) * 1e3:.0f} ms)", fontsize=9, loc="left")
    axes[-1].set_xlabel("time in the step (ms)")
    from matplotlib.patches import Patch

    kinds = sorted({a[0] for run in runs for r in run["ranks"] for a in r["actions"]}, key="FBIW".index)
    handles = [Patch(color=ACTION_COLOURS[k], label=ACTION_NAMES[k]) for k in kinds]
    handles.append(Patch(color=IDLE_COLOUR, label="idle"))
    if any(len({a[1] for a in r["actions"]}) > 1 for run in runs for r in run["ranks"]):
        handles.append(Patch(color=_shade("#999999", 0.55), label="darker: the rank's later stage"))
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=8, frameon=False)
    if title:
        figure.suptitle(title, fontsize=10)
    return _save(figure, path)


def _shade(colour: str, amount: float) -> tuple[float, float, float]:
    """``colour`` mixed with black (``amount`` 0: unchanged, 1: black)."""
    return tuple(c * (1 - amount) for c in _tint(colour, 0.0))  # type: ignore[return-value]


# ---- losses ---------------------------------------------------------------------------------------
def read_metric(path: Union[str, Path], metric: str = "train_loss") -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one metric in a Lightning ``CSVLogger`` ``metrics.csv`` (rows without it skipped).

    Raises:
        ValueError: the file has no such column (the message lists the columns it has).
    """
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if metric not in (reader.fieldnames or []) or "step" not in (reader.fieldnames or []):
            raise ValueError(f"{path} has no {metric!r} and 'step' columns; its columns: {reader.fieldnames}")
        rows = [(int(float(row["step"])), float(row[metric])) for row in reader if row.get(metric)]
    return [s for s, _ in rows], [v for _, v in rows]


def largest_relative_difference(curves: Iterable[tuple[list[int], list[float]]]) -> Optional[float]:
    """The largest ``|a - b| / |b|`` between the first curve and each other at their common steps (None: none)."""
    curves = list(curves)
    if len(curves) < 2:
        return None
    reference = dict(zip(*curves[0]))
    worst = None
    for steps, values in curves[1:]:
        for s, v in zip(steps, values):
            if s in reference and reference[s] != 0:
                error = abs(v - reference[s]) / abs(reference[s])
                worst = error if worst is None else max(worst, error)
    return worst


def plot_losses(runs: Mapping[str, Union[str, Path]], path: Union[str, Path], *, metric: str = "train_loss",
                title: str = "") -> Path:
    """Loss curves of several runs from their ``metrics.csv``, against the step, with the largest relative
    difference from the first run's curve in the subtitle.

    Args:
        runs: Label → ``metrics.csv`` of a Lightning ``CSVLogger``.
        path: The PNG to write.
        metric: The column to plot.
        title: Above the plot.
    """
    curves = {label: read_metric(csv_path, metric) for label, csv_path in runs.items()}
    figure = _figure(4.6)
    ax = figure.add_subplot()
    styles = [dict(linewidth=2.6, alpha=0.55), dict(linewidth=1.1, linestyle="--"), dict(linewidth=1.0, linestyle=":")]
    colours = ["#0072B2", "#D55E00", "#009E73", "#CC79A7"]
    for i, (label, (steps, values)) in enumerate(curves.items()):
        ax.plot(steps, values, label=label, color=colours[i % len(colours)], **styles[min(i, len(styles) - 1)])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric.replace("_", " ") + " (nats per token)")
    ax.grid(alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=9, frameon=False)
    if title:
        figure.suptitle(title, fontsize=11)
    difference = largest_relative_difference(curves.values())
    if difference is not None:
        first = next(iter(curves))
        ax.set_title(f"largest relative difference from {first}: {difference:.1e}", fontsize=9)
    return _save(figure, path)


# ---- command line ---------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> None:
    """``python -m lightning_2d.tools.plots loss A.csv B.csv --labels A B --out loss.png``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_2d.tools.plots",
                                     description="Pictures from the tools' outputs (needs the plot extra).")
    commands = parser.add_subparsers(dest="command", required=True)
    loss = commands.add_parser("loss", help="loss curves from Lightning CSVLogger metrics.csv files")
    loss.add_argument("csv", nargs="+", type=Path, help="metrics.csv files, one per run")
    loss.add_argument("--labels", nargs="+", help="one per file (default: the files' paths)")
    loss.add_argument("--metric", default="train_loss", help="the column to plot (default: train_loss)")
    loss.add_argument("--title", default="")
    loss.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    labels = args.labels or [str(p) for p in args.csv]
    if len(labels) != len(args.csv):
        parser.error(f"{len(args.csv)} files but {len(labels)} labels")
    try:
        out = plot_losses(dict(zip(labels, args.csv)), args.out, metric=args.metric, title=args.title)
    except (PlotsUnavailable, ValueError) as err:
        raise SystemExit(f"python -m lightning_2d.tools.plots: {err}") from None
    print(out)


if __name__ == "__main__":
    main()
