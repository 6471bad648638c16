"""Print the GPU lane's reports as one table: ``python tests/gpu/summary.py REPORT.json ...``.

Each judged check is shown against its bound; the MFU measurement against the issue's target.
The verdicts are pytest's; this only lays the numbers out (it exits 0 unless no report exists).

``python tests/gpu/summary.py --verdict RC JUNIT.xml ...`` is the lane's last word (``run.sh``): the
tests pytest skipped, listed as NOT RUN from its JUnit reports, then one line — ``PASSED`` only when
``RC`` (the steps' status) is 0 and every test ran (exit 0); ``NOT RUN`` when everything that ran
passed but some tests were skipped (exit 3: a skip proves nothing); ``FAILED`` otherwise (exit 1).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3e}"
    return str(value)


def _within(value: Any, bound: Any) -> str:
    if isinstance(value, (int, float)) and isinstance(bound, (int, float)) and not isinstance(value, bool):
        return "yes" if value <= bound else "NO"
    return "-"


def summarize(reports: list[dict[str, Any]]) -> str:
    """The table for ``reports`` (parsed report JSON files)."""
    lines = []
    for report in reports:
        lane, meta = report.get("lane", {}), report.get("meta", {})
        lines.append(f"lane: {lane.get('mode')} x {lane.get('nprocs')} process(es); {meta}")
        for name, job in report.get("jobs", {}).items():
            status = "ok" if job["ok"] else "FAILED"
            lines.append(f"  job {name:<12} {job['seconds']:>7.1f}s  {status}  runs {job['runs']}")
        lines.append(f"  {'check':<40} {'value':>12} {'bound':>12}  within")
        for name, check in report.get("checks", {}).items():
            lines.append(f"  {name:<40} {_fmt(check['value']):>12} {_fmt(check['bound']):>12}  "
                         f"{_within(check['value'], check['bound'])}")
            if name == "mfu_percent":
                mfu, target = check["value"], check.get("target_percent")
                verdict = "n/a" if mfu is None else ("met" if mfu >= target else "NOT met")
                shown = "n/a" if mfu is None else f"{mfu:.1f} %"
                lines.append(
                    f"  MFU {shown} against the {target:.0f} % target: {verdict}"
                    f" ({check['num_params'] / 1e9:.2f}B params, {check.get('device_name')},"
                    f" micro batch {check.get('micro_batch')} x {check.get('seq_len')} tokens,"
                    f" {check['tokens_per_sec_per_device']:,.0f} tokens/s/device,"
                    f" {check['tflops_per_device']:.1f} TFLOP/s/device,"
                    f" peak memory {_fmt(check.get('peak_memory_gib'))} GiB)"
                )
    return "\n".join(lines)


#: ``run.sh``'s exit status when everything that ran passed but some tests were skipped.
NOT_RUN_EXIT = 3


def skipped_tests(junit: Path) -> list[str]:
    """``"file::test: reason"`` for each test a pytest JUnit XML report lists as skipped."""
    entries = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            where = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            entries.append(f"{where}::{case.get('name')}: {skipped.get('message', '').strip()}")
    return entries


def verdict(status: int, junit_paths: list[Path]) -> tuple[list[str], int]:
    """The lines to print and the lane's exit status (see the module docstring).

    Args:
        status: The steps' own status (``run.sh``'s ``rc``: 0 when every step passed in time).
        junit_paths: The JUnit XML reports of the pytest steps; a missing one means outcomes unknown.
    """
    lines, skipped, missing = [], [], []
    for path in junit_paths:
        if path.is_file():
            skipped += skipped_tests(path)
        else:
            missing.append(str(path))
    lines += [f"NOT RUN {entry}" for entry in skipped]
    if status != 0:
        lines.append("FAILED")
        return lines, 1
    if missing:
        lines.append(f"FAILED: no JUnit report at {', '.join(missing)} (which tests ran is unknown)")
        return lines, 1
    if skipped:
        lines.append(f"NOT RUN: {len(skipped)} test(s) skipped (listed above); what ran passed, the lane did not")
        return lines, NOT_RUN_EXIT
    lines.append("PASSED")
    return lines, 0


def main(paths: list[str]) -> int:
    if paths[:1] == ["--verdict"]:
        lines, code = verdict(int(paths[1]), [Path(p) for p in paths[2:]])
        print("\n".join(lines))
        return code
    reports = []
    for path in map(Path, paths):
        if path.is_file():
            reports.append(json.loads(path.read_text()))
        else:
            print(f"(no report at {path}: that step did not start or was killed before its first job)")
    if not reports:
        return 1
    print(summarize(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
