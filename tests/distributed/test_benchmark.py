"""``lightning-2d benchmark --compare`` on a tiny model: all three variants run on every rank and train the
same thing; the printed ratios are those of the reported medians. Speed itself is never asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO, launch

pytestmark = pytest.mark.distributed

VARIANTS = ["lightning_2d", "lightning", "plain"]
TINY = ["--compare", "--accelerator", "cpu", "--dim", "64", "--vocab-size", "256", "--seq-len", "32",
        "--steps", "2", "--warmup", "1", "--rounds", "1"]


def check_report(report: dict, stdout: str, world: int = 4, variants: list[str] = VARIANTS) -> None:
    """The report of ``world`` ranks: (dp, tp) = (2, 2) with 4, (2, 1) with 2."""
    ranks = list(range(world))
    assert list(report["variants"]) == variants
    assert [run["variant"] for run in report["runs"]] == variants  # one round, in order
    for run in report["runs"]:
        assert sorted(rank["rank"] for rank in run["ranks"]) == ranks, run["variant"]
        for rank in run["ranks"]:
            assert len(rank["step_times"]) == len(rank["losses"]) == 3
            assert all(t > 0 for t in rank["step_times"])
    for variant, summary in report["variants"].items():
        assert summary["median_step_s"] > 0 and summary["ranks"] == ranks
        # The table shows the medians of the JSON.
        row = re.search(rf"^{variant} +([0-9,.]+) ", stdout, re.MULTILINE)
        assert row is not None and row.group(1) == f"{summary['median_step_s'] * 1e3:,.2f}", variant

    printed = dict(re.findall(r"^ours / (\w+) = ([0-9.]+)x step time", stdout, re.MULTILINE))
    assert set(printed) == {"lightning", "plain"}
    medians = {v: s["median_step_s"] for v, s in report["variants"].items()}
    for other, text in printed.items():
        assert float(text) == pytest.approx(medians["lightning_2d"] / medians[other], abs=5e-4)
        assert report["ratios"][other] == pytest.approx(medians["lightning_2d"] / medians[other], rel=1e-12)

    # The same seeded weights and tokens: equal first losses prove the variants train the same thing.
    first = {v: s["first_loss"] for v, s in report["variants"].items()}
    assert max(first.values()) - min(first.values()) <= 1e-5, first
    # Tokens split by data-parallel rank: a tensor-parallel group (ranks 0, 1) sees one batch, the
    # other replica (2, 3) another; without tensor parallelism each rank its own.
    plain = next(run for run in report["runs"] if run["variant"] == "plain")
    losses = {rank["rank"]: rank["losses"][0] for rank in plain["ranks"]}
    if world == 4:
        assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]
    else:
        assert losses[0] != losses[1]


def test_compare_spawns_each_variant_and_reports_ratios(tmp_path):
    # 2 ranks, (dp, tp) = (2, 1): what is tested here is the spawning of each variant (fresh interpreters, so the
    # job costs their start-up); the (2, 2) report is the in-place test's, below.
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_2d.tools.benchmark", *TINY, "--devices", "2", "--tensor-parallel-size", "1",
         "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("[benchmark] round 1/1:") == 3
    check_report(json.loads(out.read_text()), proc.stdout, world=2)


def test_compare_runs_in_place_under_an_external_launcher(tmp_path):
    """As under torchrun: the four ranks already exist (forked from the test fork server with torchrun's variables,
    each running ``python -m lightning_2d.tools.benchmark`` as ``__main__``: worker.script), each runs the three
    variants one after the other."""
    out = tmp_path / "report.json"
    job = launch("script", {"module": "lightning_2d.tools.benchmark",
                            "args": [*TINY, "--compare-backends", "--compare-lora", "4", "--collectives", "--json",
                                     str(out)],
                            "cwd": str(REPO)},
                 tmp_path / "job", nprocs=4, timeout=600)
    assert job.ok, job.describe()
    assert "(in place)" in job.logs[0]
    assert all("ours / " not in log for log in job.logs[1:])  # only rank 0 reports
    report = json.loads(out.read_text())
    check_report(report, job.logs[0], variants=["lightning_2d", "simple_fsdp", "lora", "lightning", "plain"])
    # --compare-lora: the adapters start at zero (first losses equal, checked above); only units holding adapters
    # reduce gradients (the embedding's and the head's units are frozen whole), and the ratios are printed.
    lora = report["variants"]["lora"]["collectives_per_step"]
    full = report["variants"]["lightning_2d"]["collectives_per_step"]
    assert 0 < lora["reduce_scatter"] < full["reduce_scatter"], (lora, full)
    printed_lora = re.search(r"^lora \(rank 4\) / lightning_2d \(full fine-tuning\) = ([0-9.]+)x step time",
                             job.logs[0], re.MULTILINE)
    assert printed_lora is not None and float(printed_lora.group(1)) == pytest.approx(report["lora"]["step_time"],
                                                                                        abs=5e-4)
    # --compare-backends: SimpleFSDP ran beside fully_shard (equal first losses, checked above), its ratios printed
    # as reported, and each backend's collectives of one step counted: every one of the tiny model's 21 parameters
    # (2 blocks of 9, the embedding, final norm and head) reduces its own gradient under SimpleFSDP, once per FSDP2
    # unit under fully_shard.
    backends = report["backends"]
    printed = re.search(r"^simple_fsdp / lightning_2d \(fully_shard\) = ([0-9.]+)x step time, ([0-9.]+)x peak memory",
                        job.logs[0], re.MULTILINE)
    assert printed is not None, job.logs[0][-3000:]
    assert float(printed.group(1)) == pytest.approx(backends["step_time"], abs=5e-4)
    assert float(printed.group(2)) == pytest.approx(backends["peak_memory"], abs=5e-4)
    simple = report["variants"]["simple_fsdp"]["collectives_per_step"]
    fsdp2 = report["variants"]["lightning_2d"]["collectives_per_step"]
    print(f"collectives of one step at (2, 2): simple_fsdp {simple}, fully_shard {fsdp2}")
    assert simple["reduce_scatter"] >= 21 and simple["all_gather"] >= 21
    assert 0 < fsdp2["reduce_scatter"] < simple["reduce_scatter"] and fsdp2["all_gather"] > 0
    assert simple["other"] == fsdp2["other"]  # the same few (no bookkeeping op counted as a collective)
    # Every variant's collectives counted, the hand-written ones too (the same plan under Lightning and in the plain
    # loop: the same collectives), and under --collectives each one's issuer: every counted collective has one.
    variants = report["variants"]
    assert variants["plain"]["collectives_per_step"] == variants["lightning"]["collectives_per_step"]
    for variant, summary in variants.items():
        issuers = summary["collectives_by_issuer"]
        assert sum(row["count"] for row in issuers) == sum(summary["collectives_per_step"].values()), variant
        fsdp = "SimpleFSDP all-gather" if variant == "simple_fsdp" else "FSDP2 all-gather (unit layers.0)"
        assert any(row["issuer"] == fsdp for row in issuers), (variant, issuers)
        assert re.search(rf"^collectives of {variant} by issuer \(\d+ in", job.logs[0], re.MULTILINE), variant
    assert any(row["issuer"] == "vocab-parallel loss statistics (parallel/loss.py)"
               for row in variants["lightning_2d"]["collectives_by_issuer"])
    print("\n".join(line for line in job.logs[0].splitlines() if "by issuer" in line or "  " in line))
