"""The GPU lane's pure parts, without a GPU: a ranks-agree check needs two ranks; ``run.sh`` calls a lane with
skipped tests NOT RUN (exit 3), never PASSED; the time budget (every part limited, none eating the time of the parts
after it, the whole within 8 minutes); the record of a run against its commit; the summary a session pastes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu import budget, record
from tests.gpu.summary import NOT_RUN_EXIT, short_summary, verdict
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

def test_fails():
    assert 1 == 2, "the loss diverged"
"""


@pytest.fixture(scope="module")
def junit_reports(tmp_path_factory) -> dict[str, Path]:
    """Real pytest JUnit reports (the format run.sh reads): one with a skipped test, one without, one with a
    failure."""
    root = tmp_path_factory.mktemp("junit")
    (root / "test_sample.py").write_text(SAMPLE_TESTS)
    reports = {}
    for name, select, rc in (("skipped", ["-k", "not test_fails"], 0), ("all_ran", ["-k", "test_ran"], 0),
                             ("failed", [], 1)):
        reports[name] = root / f"{name}.xml"
        done = subprocess.run([sys.executable, "-m", "pytest", str(root / "test_sample.py"), "-q", "-p",
                               "no:cacheprovider", f"--junitxml={reports[name]}", "--rootdir", str(root), *select],
                              capture_output=True, text=True, cwd=root, check=False)
        assert done.returncode == rc, done.stdout + done.stderr
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


def test_a_partial_run_is_not_run_at_best(junit_reports):
    lines, code = verdict(0, [junit_reports["all_ran"]], ["parts left out by LIGHTNING_2D_GPU_PARTS: mfu"])
    assert code == NOT_RUN_EXIT and lines[0] == "NOT RUN parts left out by LIGHTNING_2D_GPU_PARTS: mfu"
    assert lines[-1].startswith("NOT RUN: 0 test(s) skipped, the run partial (1 reason(s))")


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


# The record of a run, and its summary.

def test_a_tree_without_git_takes_the_commit_it_is_given_and_digests_like_the_checkout(tmp_path):
    """The device's copy of the tree has no .git: the commit is the one the session passed, and the digest of the
    copy (pytest's caches in it) equals the checkout's, which is how the session checks what ran."""
    for top in ("lightning_2d", "tests"):
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("results"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "tests" / "gpu" / "results" / "old").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "results" / "old" / "lane.json").write_text("{}")
    (tmp_path / "lightning_2d" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "lightning_2d" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"compiled")
    given = record.describe_source(tmp_path, "a" * 40)
    assert given["commit"] == "a" * 40 and given["commit_source"] == "given"
    assert given["source_digest"] == record.source_digest(REPO)
    assert record.describe_source(tmp_path, None)["commit"] is None
    (tmp_path / "lightning_2d" / "__init__.py").write_text("changed = True\n")
    assert record.source_digest(tmp_path) != record.source_digest(REPO)


def test_a_part_records_its_status_time_limit_report_and_tests(junit_reports, tmp_path):
    manifest = tmp_path / "lane.json"
    record.start(manifest, "cuda", budget.plan(budget.selected_parts()), root=REPO)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"checks": {"moe_error": {"value": 1e-3, "bound": 2e-2}}}))
    entry = record.record_part(manifest, "moe", 1, 12.3, 105, report, junit_reports["failed"])
    assert entry["status"] == "failed" and entry["guaranteed_s"] == 45 and entry["report"]["checks"]
    outcomes = {t["test"].rpartition("::")[2]: (t["outcome"], t["message"]) for t in entry["tests"]}
    assert outcomes["test_ran"] == ("passed", "")
    assert outcomes["test_needs_two_gpus"] == ("skipped", "1 process(es): no second rank")
    assert outcomes["test_fails"][0] == "failed" and "the loss diverged" in outcomes["test_fails"][1]
    assert record.part_status(124, 60) == record.part_status(137, 60) == "timeout"
    assert record.part_status(0, 60) == "passed" and record.part_status(1, 0) == "not run"
    record.finish(manifest, 1, 1, 300.04, ["parts left out by LIGHTNING_2D_GPU_PARTS: mfu"])
    done = json.loads(manifest.read_text())
    assert done["verdict"] == "FAILED" and done["total_seconds"] == 300.0 and list(done["parts"]) == ["moe"]


def _first_session_manifest(commit: str | None = "c0ffee" * 6 + "beef") -> dict:
    """The first GPU session (2026-12-04) as the lane now records a run: its reports, its job times as parts."""
    reports = {n: json.loads((FIRST_RESULTS / f"report_{n}.json").read_text()) for n in ("correctness", "mfu")}
    parts = {
        "setup": {"status": "passed", "rc": 0, "seconds": 44, "limit_s": 60, "guaranteed_s": 60, "tests": None},
        "parity": {"status": "passed", "rc": 0, "seconds": 217, "limit_s": 300, "guaranteed_s": 150,
                   "report": reports["correctness"],
                   "tests": [{"test": "tests/gpu/test_parity.py::test_reference_learns", "outcome": "passed",
                              "message": ""},
                             {"test": "tests/gpu/test_parity.py::test_Nx1_matches_single_device", "outcome": "skipped",
                              "message": "(N, 1) is the same layout as (1, N) with one GPU"}]},
        "mfu": {"status": "passed", "rc": 0, "seconds": 46, "limit_s": 55, "guaranteed_s": 55,
                "report": reports["mfu"], "tests": [{"test": "tests/gpu/test_mfu.py::test_mfu_of_a_1b_llama",
                                                     "outcome": "passed", "message": ""}]},
    }
    return {"format": 1, "commit": commit, "commit_source": "given", "tree_differs_from_commit": None,
            "source_digest": "sha256:" + "0" * 64, "mode": "cuda", "started_at": "2026-12-04T10:00:00+00:00",
            "environment": {"device_name": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.9"},
            "budget": budget.plan(["setup", "parity", "mfu"]), "parts": parts, "total_seconds": 307.0,
            "verdict": "NOT RUN", "exit": 3, "partial": []}


def test_the_summary_names_the_commit_the_parts_the_checks_and_what_did_not_run():
    text = short_summary(_first_session_manifest())
    assert text.startswith("**GPU lane** (cuda) at `c0ffeec0ff` (given; sources sha256:000000000000) on NVIDIA H200"
                           " (torch 2.11.0+cu130, cuda 13.0, nccl 2.28.9): **NOT RUN** (exit 3), 307 s of the 470 s")
    assert "| parity | passed | 217 | 300 (150) | 1 / 0 / 1 |" in text
    assert "| mfu | passed | 46 | 55 (55) | 1 / 0 / 0 |" in text
    assert "Checks: 31 within their bounds, 0 outside; closest to its bound: `flex_document_grad_k_max_abs`" in text
    assert "MFU 43.9 % (target 45 %): 433.7 TFLOP/s, 55,476 tokens/s per device, peak 43.2 GiB" in text
    assert "`tests/gpu/test_parity.py::test_Nx1_matches_single_device`: (N, 1) is the same layout" in text
    assert len(text.splitlines()) < 20


def test_the_summary_lists_a_check_outside_its_bound_and_a_part_killed_without_a_report():
    manifest = _first_session_manifest(commit=None)
    manifest["parts"]["parity"]["report"]["checks"]["compile_vs_eager"]["value"] = 0.5
    manifest["parts"]["mfu"].update(status="timeout", rc=124, tests=None)
    text = short_summary(manifest)
    assert "at an unrecorded commit" in text
    assert "1 outside (`compile_vs_eager` 5.00e-01 > 1e-02)" in text
    assert "- part `mfu` (timeout): no JUnit report, its tests' outcomes are unknown" in text


def test_saving_files_a_run_against_its_commit(tmp_path):
    files_at, results = tmp_path / "files", tmp_path / "results"
    files_at.mkdir()
    manifest = _first_session_manifest(commit=None)
    manifest["source_digest"] = record.source_digest(REPO)
    (files_at / "lane.json").write_text(json.dumps(manifest))
    folder = record.save(files_at, commit="1234567890abcdef", results=results)
    assert folder == results / "2026-12-04_h200_1234567890"
    filed = json.loads((folder / "lane.json").read_text())
    assert filed["commit"] == "1234567890abcdef" and filed["commit_source"] == "given at filing"
    assert filed["filed"] == {"at": filed["filed"]["at"], "same_sources_as_commit": None,  # no such commit here
                              "same_sources_as_working_tree": True}
    assert (folder / "summary.md").read_text().startswith("**GPU lane** (cuda) at `1234567890` (given at filing")
    with pytest.raises(ValueError, match="ran on 1234567890abcdef, not ffff"):  # the device's commit wins
        (files_at / "lane.json").write_text(json.dumps(filed))
        record.save(files_at, commit="ffff", results=results)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (files_at / "lane.json").write_text(json.dumps({**manifest, "source_digest": record.commit_digest(REPO, head)}))
    filed = json.loads((record.save(files_at, commit=head, results=results) / "lane.json").read_text())
    assert filed["filed"]["same_sources_as_commit"] is True  # what a clean checkout of HEAD sends
    (files_at / "lane.json").write_text(json.dumps({**manifest, "mode": "dry-run"}))
    with pytest.raises(ValueError, match="dry run measured nothing"):
        record.save(files_at, commit="1234567890abcdef", results=results)


# run.sh end to end, on CPU.

def _stub_python(tmp_path: Path, junit: Path, hang: str | None = None) -> Path:
    """A ``$PYTHON`` for run.sh: the environment check and every pytest part replaced (each part copies ``junit``;
    part ``hang`` sleeps until it is killed); the lane's own scripts run on the real interpreter."""
    stub = tmp_path / "python"
    stub.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [ "$1" = "-" ]; then cat >/dev/null; echo "environment check skipped by the test"; exit 0; fi
        if [ "$1 $2" = "-m pytest" ]; then
            case " $* " in *"tests/gpu/test_{hang}.py "*) sleep 600;; esac
            for arg in "$@"; do
                case $arg in --junitxml=*) cp "{junit}" "${{arg#--junitxml=}}";; esac
            done
            exit 0
        fi
        exec "{sys.executable}" "$@"
        """))
    stub.chmod(0o755)
    return stub


def _run_lane(tmp_path: Path, stub: Path, **env_vars: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHON": str(stub), "LIGHTNING_2D_GPU_WORK": str(tmp_path / "work"),
           "LIGHTNING_2D_GPU_SKIP_INSTALL": "1", "OUT": str(tmp_path / "out"), **env_vars}
    for name in (budget.PARTS_ENV, record.COMMIT_ENV, "LIGHTNING_2D_GPU_PYTEST_ARGS", "LIGHTNING_2D_GPU_DRY_RUN"):
        if name not in env_vars:
            env.pop(name, None)
    (tmp_path / "out").mkdir()
    done = subprocess.run(["bash", str(GPU / "run.sh")], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    return done, json.loads((tmp_path / "out" / "lane.json").read_text())


@pytest.mark.distributed  # run.sh end to end: it launches the lane's parts as jobs of their own
def test_run_sh_reports_skipped_tests_as_not_run(junit_reports, tmp_path):
    """run.sh end to end on CPU, its environment check and the pytest parts replaced by a stub: every part passes
    and leaves a JUnit report with a skipped test (the lane printed PASSED before). What comes back from the device
    ($OUT) is at most 8 files; the manifest records the checkout's commit and every part."""
    done, manifest = _run_lane(tmp_path, _stub_python(tmp_path, junit_reports["skipped"]))
    out = done.stdout.strip().splitlines()
    parts = [p.name for p in budget.PARTS if p.tests]
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert out[-1].startswith(f"NOT RUN: {len(parts)} test(s) skipped"), out[-5:]  # one per part
    assert sum(line.startswith("NOT RUN ") and "test_needs_two_gpus" in line for line in out) == len(parts)
    assert not any("PASSED" in line for line in out), out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["job_logs.tar.gz", "lane.json", "run.log",
                                                                    "summary.md"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert manifest["commit"] == head.strip() and manifest["commit_source"] == "git"
    assert manifest["source_digest"] == record.source_digest(REPO)
    assert list(manifest["parts"]) == ["setup", *parts]
    assert all(p["status"] == "passed" for p in manifest["parts"].values()), manifest["parts"]
    assert manifest["verdict"] == "NOT RUN" and manifest["exit"] == 3
    assert manifest["total_seconds"] <= budget.DEADLINE_S
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith(f"**GPU lane** (cuda) at `{head[:10]}` (git") and "**NOT RUN** (exit 3)" in summary
    assert f"{len(parts)} tests (`test_needs_two_gpus`" in summary


@pytest.mark.distributed  # run.sh end to end: it launches the lane's parts as jobs of their own
def test_run_sh_kills_a_hanging_part_at_its_limit_and_runs_the_others(junit_reports, tmp_path):
    """A 30-second lane (every limit scaled down) whose MoE part hangs: it is killed at its limit, the parts after
    it still run with their own time, the lane ends within its deadline and says FAILED, and the session's commit
    (the device's tree has no .git there) is recorded even though this checkout's git would say the same."""
    deadline = 30
    done, manifest = _run_lane(tmp_path, _stub_python(tmp_path, junit_reports["all_ran"], hang="moe"),
                               **{budget.DEADLINE_ENV: str(deadline), record.COMMIT_ENV: "f" * 40})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    moe = manifest["parts"]["moe"]
    assert moe["status"] == "timeout" and moe["rc"] in (124, 137) and moe["tests"] is None
    assert moe["seconds"] <= moe["limit_s"] + 1
    assert all(manifest["parts"][p]["status"] == "passed" for p in ("attention", "mfu", "resume", "parity"))
    assert manifest["total_seconds"] <= deadline
    assert manifest["commit"] == subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                                text=True).stdout.strip()
    assert manifest["given_commit"] == "f" * 40  # kept beside git's, not trusted over it
    assert "part `moe` (timeout): no JUnit report" in (tmp_path / "out" / "summary.md").read_text()
    assert done.stdout.strip().splitlines()[-1] == "FAILED"


def test_run_sh_and_setup_sh_parse():
    for script in ("run.sh", "setup.sh"):
        done = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
