"""The GPU lane's pure parts, without a GPU: a ranks-agree check needs two ranks, and ``run.sh`` calls a lane
with skipped tests NOT RUN (exit 3), never PASSED."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu.summary import NOT_RUN_EXIT, verdict
from tests.gpu.test_parity import assert_ranks_agree

REPO = Path(__file__).resolve().parents[2]


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
