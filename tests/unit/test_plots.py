"""The pictures of ``lightning_2d.tools.plots``: each written as a PNG from real inputs (a plan of the ``debug``
preset, a mesh built by ``ParallelDims.build_mesh``, a pipeline stage's timed passes, CSVLogger files), the data
they draw checked against the library, and the missing-extra error."""

from __future__ import annotations

import builtins
import importlib
import struct
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("matplotlib", reason="the plot extra: pip install 'lightning-2d[plot]'")

from lightning_2d.parallel.config import ParallelConfig  # noqa: E402
from lightning_2d.parallel.dims import ParallelDims  # noqa: E402
from lightning_2d.tools import plots  # noqa: E402
from lightning_2d.tools.planner import plan_run  # noqa: E402
from lightning_2d.tools.planner.world import fake_world  # noqa: E402


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, read from its header (fails on anything else)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def pipeline_plan():
    """The debug preset on 2 pipeline ranks × 2 tensor-parallel ranks (a real plan, well under a second)."""
    config = ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1)
    return plan_run("debug", num_nodes=1, devices=4, config=config, seq_len=64, device_memory_gib=1.0)


def test_memory_bars_add_up_to_each_pipeline_ranks_total_and_the_picture_is_written(pipeline_plan, tmp_path):
    bars = plots.memory_bars(pipeline_plan)
    assert len(bars) == 2  # one per pipeline rank
    for bar, rank in zip(bars, pipeline_plan.pipeline):
        assert sum(bar.parts.values()) == rank["total_bytes"] == bar.total_bytes
        assert bar.parts["activations"] == rank["activation_bytes"] > 0
        assert f"pp rank {rank['pipeline_rank']}" in bar.label
    assert "embedding" in bars[0].label and "head" in bars[1].label
    assert max(b.total_bytes for b in bars) == pipeline_plan.total_bytes  # the fullest rank is the report's

    out = plots.plot_memory(pipeline_plan, tmp_path / "sub" / "memory.png")
    width, height = png_size(out)
    assert width == 900 and 300 < height < 700


def test_memory_without_a_pipeline_is_one_bar_of_the_report(tmp_path):
    report = plan_run("debug", num_nodes=1, devices=2, config=ParallelConfig(tensor_parallel_size=2), seq_len=64)
    (bar,) = plots.memory_bars(report)
    assert sum(bar.parts.values()) == report.total_bytes
    assert bar.parts["optimizer state"] == report.optimizer_bytes
    png_size(plots.plot_memory(report, tmp_path / "memory.png"))


def test_mesh_table_is_the_strategys_mesh_rank_by_rank(tmp_path):
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    table = plots.mesh_table(dims, devices_per_node=4)
    assert [p.rank for p in table] == list(range(16))
    names = ("pipeline_parallel", "data_parallel_replicate", "data_parallel_shard", "tensor_parallel")
    # Each rank's own coordinates, as the strategy sees them in its process (the mesh built as that rank).
    for rank in (0, 5, 11, 14):
        with fake_world(dims.world_size, rank), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            mesh = dims.build_mesh("cpu").root
            # The root has the size-1 context dimension too; the table keeps the layout's (``dims.as_dict()``).
            assert tuple(n for n in mesh.mesh_dim_names if n in dims.as_dict()) == names == tuple(dims.as_dict())
            coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
            assert coordinate["context_parallel"] == 0
            assert tuple(table[rank].coordinates.values()) == tuple(coordinate[n] for n in names)
            assert table[rank].coordinates["tensor_parallel"] == mesh["tensor_parallel"].get_local_rank()
    assert table[13].coordinates == {names[0]: 1, names[1]: 1, names[2]: 0, names[3]: 1}
    assert (table[13].node, table[13].local_rank) == (3, 1)

    out = plots.plot_mesh(dims, tmp_path / "mesh.png", devices_per_node=4)
    assert png_size(out)[0] == 900


def test_mesh_of_a_plan_uses_its_layout_and_nodes(pipeline_plan, tmp_path):
    assert plots.dims_of(pipeline_plan) == ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=2)
    png_size(plots.plot_mesh(pipeline_plan, tmp_path / "mesh.png"))
    with pytest.raises(ValueError, match="devices_per_node"):
        plots.plot_mesh(ParallelDims(1, 2, 2), tmp_path / "x.png")


def test_timed_stage_records_each_pass_with_its_kind_and_micro_batch(monkeypatch):
    """What the pipeline picture draws: ``Pipeline.actions`` from the timed stage's passes."""
    from torch.distributed import pipelining

    from lightning_2d.parallel.pipeline import timed_stage_class

    calls = []
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        monkeypatch.setattr(pipelining.PipelineStage, name,
                            lambda self, chunk, *a, _n=name, **k: calls.append((_n, chunk, a, k)) or _n)
    cls = timed_stage_class()
    stage = cls.__new__(cls)  # the passes only: no process group needed
    stage.stage_index, stage.timer = 3, SimpleNamespace(busy_s=0.0, actions=[])
    assert stage.forward_one_chunk(0, ("x",), {}) == "forward_one_chunk"
    stage.backward_one_chunk(0, loss=None, last_backward=False)
    stage.backward_one_chunk(1, loss=None, full_backward=False, last_backward=False)
    stage.backward_one_chunk(2, None, False)
    stage.backward_weight_one_chunk(1, last_backward=True)
    assert [a[:3] for a in stage.timer.actions] == [("F", 3, 0), ("B", 3, 0), ("I", 3, 1), ("I", 3, 2), ("W", 3, 1)]
    assert all(start <= end for *_, start, end in stage.timer.actions)
    assert stage.timer.busy_s == pytest.approx(sum(end - start for *_, start, end in stage.timer.actions))
    assert calls[0] == ("forward_one_chunk", 0, (("x",), {}), {})  # the arguments reach torch's method unchanged
    assert calls[2] == ("backward_one_chunk", 1, (), {"loss": None, "full_backward": False, "last_backward": False})


def test_pipeline_timeline_idle_fraction_and_picture(tmp_path):
    # Rank 0: F0 F1 then B1 B0 with a gap; rank 1 waits 2 units first. Times in seconds.
    ranks = [
        {"step_start": 10.0, "step_end": 18.0, "actions": [["F", 0, 0, 10, 11], ["F", 0, 1, 11, 12],
                                                          ["B", 0, 1, 15, 16], ["B", 0, 0, 17, 18]]},
        {"step_start": 10.0, "step_end": 18.0, "actions": [["F", 1, 0, 11, 12], ["I", 1, 0, 12, 13],
                                                          ["F", 1, 1, 13, 14], ["W", 1, 0, 14, 15]]},
    ]
    assert plots.idle_fraction(ranks) == pytest.approx(0.5)  # each rank is busy 4 of 8
    runs = [{"schedule": "1F1B", "microbatches": 2, "ranks": ranks}, {"schedule": "GPipe", "microbatches": 2,
                                                                      "ranks": ranks}]
    width, height = png_size(plots.plot_pipeline(runs, tmp_path / "pipeline.png", title="two"))
    assert width == 900 and height > 250


def write_metrics(path: Path, losses: dict[int, float]) -> Path:
    """A CSVLogger file as Lightning writes it: a row per logging step, other metrics in other rows."""
    rows = ["epoch,global_tokens,step,train_loss,val_loss"]
    rows += [f"0,4096.0,{step},{loss},," for step, loss in losses.items()]
    rows.append("0,,9,,2.5")  # a validation row: no train_loss
    path.write_text("\n".join(rows) + "\n")
    return path


def test_loss_curves_from_csv_logs_and_their_difference(tmp_path):
    a = write_metrics(tmp_path / "a.csv", {0: 6.0, 1: 5.0, 2: 4.0})
    b = write_metrics(tmp_path / "b.csv", {0: 6.0, 1: 5.5, 2: 4.0})
    assert plots.read_metric(a) == ([0, 1, 2], [6.0, 5.0, 4.0])
    assert plots.read_metric(a, "val_loss") == ([9], [2.5])
    assert plots.largest_relative_difference([plots.read_metric(a), plots.read_metric(b)]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no 'perplexity'"):
        plots.read_metric(a, "perplexity")

    out = tmp_path / "loss.png"
    plots.main(["loss", str(a), str(b), "--labels", "2 x 2", "one device", "--out", str(out)])
    assert png_size(out)[0] == 900
    with pytest.raises(SystemExit):
        plots.main(["loss", str(a), str(b), "--labels", "only one", "--out", str(out)])


def test_plan_command_draws_both_pictures(tmp_path, capsys):
    from lightning_2d.tools.planner.cli import main

    memory, mesh = tmp_path / "memory.png", tmp_path / "mesh.png"
    main(["--model", "debug", "--devices", "4", "--tensor-parallel-size", "2", "--seq-len", "64", "--json",
          "--plot", str(memory), "--plot-mesh", str(mesh)])
    out = capsys.readouterr()
    assert out.out.lstrip().startswith("{")  # the JSON report alone on stdout
    assert png_size(memory)[0] == png_size(mesh)[0] == 900


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path, pipeline_plan, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    importlib.reload(plots)  # the module itself imports without matplotlib (only drawing needs it)
    with pytest.raises(plots.PlotsUnavailable, match=r"pip install 'lightning-2d\[plot\]'"):
        plots.plot_memory(pipeline_plan, tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()

    from lightning_2d.tools.planner.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "debug", "--devices", "2", "--seq-len", "64", "--plot", str(tmp_path / "m.png")])
    assert exit_info.value.code == 2
    assert "lightning-2d[plot]" in capsys.readouterr().err


def test_the_picture_script_plans_with_flags_the_planner_accepts():
    """``docs/make_pictures.sh`` regenerates the docs' pictures: its ``plan`` commands parse (a renamed flag
    fails here, not after minutes of benchmark and fits)."""
    import shlex

    from lightning_2d.tools.planner.cli import build_parser

    script = (Path(__file__).resolve().parents[2] / "docs" / "make_pictures.sh").read_text().replace("\\\n", " ")
    commands = [shlex.split(line.split(">")[0])[2:] for line in script.splitlines() if line.startswith('"$L2D" plan')]
    assert len(commands) == 2
    parsed = [build_parser().parse_args(c) for c in commands]
    assert parsed[0].plot == "docs/plan_memory.png" and parsed[1].plot_mesh == "docs/mesh.png"
