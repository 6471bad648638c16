"""The GPU lane's pure parts, without a GPU: a ranks-agree check needs two ranks; ``run.sh`` calls a lane with
skipped tests NOT RUN (exit 3), never PASSED; the time budget (every part limited, none eating the time of the parts
after it, the whole within 8 minutes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu import budget
from tests.gpu.summary import NOT_RUN_EXIT, verdict
from tests.gpu.test_parity import assert_ranks_agree

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "tests" / "gpu"
#: The first GPU session's reports (one H200, 2026-12-04): the budget's estimates are read from them.
FIRST_RESULTS = GPU / "results" / "2026-12-04_h200"


def runs(*losses: list[float]) -> dict:
    return {"bf16": [{"losses": list(curve)} for curve in losses]}


def test_ranks_agree_needs_a_second_rank():
    with pytest.raises(AssertionError, match="1 rank"):
        assert_ranks_agree(runs([5.0, 4.0]), "bf16")  # rank 0 against itself proves nothing


def test_ranks_agree_compares_every_rank_with_rank_0():
    assert_ranks_agree(runs([5.0, 4.0], [5.0, 4.0]), "bf16")
    with pytest.raises(AssertionError, match="rank 1 saw other losses"):
        assert_ranks_agree(runs([5.0, 4.0], [5.0, 4.1]), "bf16")


SAMPLE_TESTS = """
import pytest

def test_ran():
    pass

def test_needs_two_gpus():
    pytest.skip("1 process(es): no second rank")
"""


@pytest.fixture(scope="module")
def junit_reports(tmp_path_factory) -> dict[str, Path]:
    """Real pytest JUnit reports (the format run.sh reads): one with a skipped test, one without."""
    root = tmp_path_factory.mktemp("junit")
    (root / "test_sample.py").write_text(SAMPLE_TESTS)
    reports = {}
    for name, select in (("skipped", []), ("all_ran", ["-k", "test_ran"])):
        reports[name] = root / f"{name}.xml"
        done = subprocess.run([sys.executable, "-m", "pytest", str(root / "test_sample.py"), "-q", "-p",
                               "no:cacheprovider", f"--junitxml={reports[name]}", "--rootdir", str(root), *select],
                              capture_output=True, text=True, cwd=root, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    return reports


def test_verdict_is_passed_only_when_every_test_ran(junit_reports, tmp_path):
    lines, code = verdict(0, [junit_reports["all_ran"]])
    assert (lines, code) == (["PASSED"], 0)
    lines, code = verdict(0, [junit_reports["all_ran"], junit_reports["skipped"]])
    assert code == NOT_RUN_EXIT == 3
    assert lines[0].startswith("NOT RUN ") and "test_needs_two_gpus: 1 process(es): no second rank" in lines[0]
    assert lines[-1].startswith("NOT RUN: 1 test(s) skipped") and "PASSED" not in "\n".join(lines)
    assert verdict(1, [junit_reports["all_ran"]]) == (["FAILED"], 1)
    lines, code = verdict(0, [junit_reports["all_ran"], tmp_path / "junit_mfu.xml"])  # a step killed early
    assert code == 1 and lines[-1].startswith("FAILED: no JUnit report at")


def test_run_sh_reports_skipped_tests_as_not_run(junit_reports, tmp_path):
    """run.sh end to end on CPU, its environment check and two pytest steps replaced by a stub: both steps
    pass and leave a JUnit report with a skipped test (the lane printed PASSED before)."""
    stub = tmp_path / "python"
    stub.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [ "$1" = "-" ]; then cat >/dev/null; echo "environment check skipped by the test"; exit 0; fi
        if [ "$1 $2" = "-m pytest" ]; then
            for arg in "$@"; do
                case $arg in --junitxml=*) cp "{junit_reports["skipped"]}" "${{arg#--junitxml=}}";; esac
            done
            exit 0
        fi
        exec "{sys.executable}" "$@"
        """))
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "LIGHTNING_2D_GPU_WORK": str(tmp_path / "work"),
           "LIGHTNING_2D_GPU_SKIP_INSTALL": "1"}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "run.sh")], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    out = done.stdout.strip().splitlines()
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert out[-1].startswith("NOT RUN: 2 test(s) skipped"), out[-5:]  # one per step
    assert sum(line.startswith("NOT RUN tests") or "test_needs_two_gpus" in line for line in out) == 2
    assert not any("PASSED" in line for line in out), out


# The budget.

def test_the_guarantees_and_the_reserve_fill_the_deadline_under_8_minutes():
    assert budget.DEADLINE_S < 8 * 60
    assert sum(p.guaranteed_s for p in budget.PARTS) + budget.RESERVE_S == budget.DEADLINE_S
    for part in budget.PARTS:  # room for the machine's noise, the H100's slower memory, the code added since
        assert part.guaranteed_s >= 1.15 * part.estimate_s, part
    assert sum(p.estimate_s for p in budget.PARTS) <= 0.8 * budget.DEADLINE_S


def test_every_gpu_test_module_is_in_exactly_one_part():
    modules = sorted(str(p.relative_to(REPO)) for p in GPU.glob("test_*.py"))
    in_parts = sorted(t for p in budget.PARTS for t in p.tests)
    assert in_parts == modules


def test_the_estimates_cover_the_first_sessions_recorded_job_times():
    """The jobs each part launches took this long on the H200 (the parity part's reference and eager jobs at their
    latest, with LoRA and QLoRA); each estimate adds the part's pytest start (~10 s) to them."""
    jobs = {}
    for name in ("report_correctness.json", "report_lora.json", "report_mfu.json"):  # later reports win
        jobs.update({job: entry["seconds"] for job, entry in
                     json.loads((FIRST_RESULTS / name).read_text())["jobs"].items()})
    launched = {"parity": ("reference", "eager", "compile", "float8"), "resume": ("checkpoint", "resume"),
                "mfu": ("mfu",)}
    for part, names in launched.items():
        assert budget.BY_NAME[part].estimate_s >= sum(jobs[n] for n in names) + 5, (part, jobs)


def test_a_part_gets_its_guarantee_plus_what_earlier_parts_left():
    selected = budget.selected_parts()
    elapsed = 0.0
    for name in selected:  # every part uses its whole limit: each gets exactly its guarantee
        limit, grace = budget.allot(name, elapsed, selected)
        assert limit == budget.BY_NAME[name].guaranteed_s and 1 <= grace <= budget.KILL_GRACE_S
        elapsed += limit
    assert elapsed + budget.RESERVE_S == budget.DEADLINE_S
    # setup took 20 of its 60 s and moe 5 of its 45: attention may use the 80 s they left
    assert budget.allot("attention", 25, selected)[0] == 75 + 40 + 40


@pytest.mark.parametrize("elapsed", [0, 3.5, 61, 200, 399.9, 455])
def test_no_part_takes_the_time_guaranteed_to_the_parts_after_it(elapsed):
    selected = budget.selected_parts()
    for i, name in enumerate(selected):
        limit, _ = budget.allot(name, elapsed, selected)
        later = sum(budget.BY_NAME[n].guaranteed_s for n in selected[i + 1:])
        assert elapsed + limit + later + budget.RESERVE_S <= budget.DEADLINE_S or limit == 0


def test_a_part_left_no_time_is_not_started():
    selected = budget.selected_parts()
    later = sum(budget.BY_NAME[n].guaranteed_s for n in selected[2:])  # attention's to parity's
    assert budget.allot("moe", 470 - 10 - later - 1.5, selected) == (0, 0)  # 1.5 s left: less than MIN_PART_S
    assert budget.allot("parity", 470, selected) == (0, 0)


def test_the_budget_scales_with_the_deadline_and_the_parts_selected():
    selected = budget.selected_parts("parity, moe")
    assert selected == ["setup", "moe", "parity"]  # the lane's order, setup always
    assert budget.allot("setup", 0, selected, deadline=47) == (math.floor(47 - 1 - 4.5 - 15), 5)
    assert budget.allot("parity", 0, selected) == (460, 5)  # alone after setup and moe: every second left
    plan = budget.plan(selected, deadline=940)
    assert [p["guaranteed_s"] for p in plan["parts"]] == [120, 90, 300] and plan["reserve_s"] == 20
    with pytest.raises(ValueError, match="no part parityy; the parts are moe, attention"):
        budget.selected_parts("parityy")
