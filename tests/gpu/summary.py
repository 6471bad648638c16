"""Print the GPU lane's reports as one table: ``python tests/gpu/summary.py REPORT.json ...``.

Each judged check is shown against its bound; the MFU measurement against the issue's target.
The verdicts are pytest's; this only lays the numbers out (it exits 0 unless no report exists).

``python tests/gpu/summary.py --verdict RC [--partial REASON]... JUNIT.xml ...`` is the lane's last word
(``run.sh``): the tests pytest skipped, listed as NOT RUN from its JUnit reports, then one line — ``PASSED`` only
when ``RC`` (the steps' status) is 0, every test ran and the run was not partial (exit 0); ``NOT RUN`` when
everything that ran passed but some tests were skipped or left out (``--partial``: parts not selected, tests
filtered; exit 3: a skip proves nothing); ``FAILED`` otherwise (exit 1).

``python tests/gpu/summary.py --short LANE.json`` prints the run in a few lines of Markdown (``summary.md``: what a
session pastes into its closing note): the commit, the device, the verdict, each part's time against its limit,
the checks against their bounds, MFU, and every test that failed or did not run.
"""

from __future__ import annotations

import json
import math
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


def verdict(status: int, junit_paths: list[Path], partial: list[str] = ()) -> tuple[list[str], int]:
    """The lines to print and the lane's exit status (see the module docstring).

    Args:
        status: The steps' own status (``run.sh``'s ``rc``: 0 when every step passed in time).
        junit_paths: The JUnit XML reports of the pytest steps; a missing one means outcomes unknown.
        partial: What the run left out on purpose (parts not selected, a ``-k`` filter): NOT RUN at best.
    """
    lines, skipped, missing = [], [], []
    for path in junit_paths:
        if path.is_file():
            skipped += skipped_tests(path)
        else:
            missing.append(str(path))
    lines += [f"NOT RUN {entry}" for entry in skipped]
    lines += [f"NOT RUN {reason}" for reason in partial]
    if status != 0:
        lines.append("FAILED")
        return lines, 1
    if missing:
        lines.append(f"FAILED: no JUnit report at {', '.join(missing)} (which tests ran is unknown)")
        return lines, 1
    if skipped or partial:
        left_out = f"{len(skipped)} test(s) skipped"
        if partial:
            left_out += f", the run partial ({len(partial)} reason(s))"
        lines.append(f"NOT RUN: {left_out} (listed above); what ran passed, the lane did not")
        return lines, NOT_RUN_EXIT
    lines.append("PASSED")
    return lines, 0


def _ratio(check: dict[str, Any]) -> float | None:
    value, bound = check.get("value"), check.get("bound")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (value, bound))
    if not numbers:
        return None
    if bound == 0:  # held to exact equality
        return 0.0 if value == 0 else math.inf
    return value / bound


def _short_message(text: str, limit: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _grouped_by_reason(skipped: list[dict[str, str]]) -> list[str]:
    """One line per skip reason: the test, or how many tests (their names without the file) when several share it."""
    by_reason: dict[str, list[str]] = {}
    for test in skipped:
        by_reason.setdefault(test["message"], []).append(test["test"])
    lines = []
    for reason, names in by_reason.items():
        if len(names) == 1:
            lines.append(f"`{names[0]}`: {_short_message(reason)}")
        else:
            shown = ", ".join(f"`{n.rpartition('::')[2]}`" for n in names)
            lines.append(f"{len(names)} tests ({shown}): {_short_message(reason)}")
    return lines


def short_summary(manifest: dict[str, Any]) -> str:
    """A run's manifest (``lane.json``, ``tests/gpu/record.py``) in a few lines of Markdown."""
    env = manifest.get("environment") or {}
    commit = manifest.get("commit")
    where = (f"`{commit[:10]}` ({manifest.get('commit_source')}"
             + (", tree differed from it" if manifest.get("tree_differs_from_commit") else "")
             + f"; sources {(manifest.get('source_digest') or '?')[:19]})") if commit else (
        f"an unrecorded commit (sources {(manifest.get('source_digest') or '?')[:19]})")
    device = env.get("device_name") or "no GPU"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "nccl", "torchao") if env.get(k))
    budget = manifest.get("budget") or {}
    seconds = manifest.get("total_seconds")
    took = f"{seconds:.0f} s" if seconds is not None else "unfinished"
    head = (f"**GPU lane** ({manifest.get('mode')}) at {where} on {device}" + (f" ({versions})" if versions else "")
            + f": **{manifest.get('verdict') or 'NO VERDICT'}** (exit {manifest.get('exit')}), {took} of the"
            f" {budget.get('deadline_s', 0):.0f} s budget.")
    lines = [head, "", "| part | status | seconds | limit (guaranteed) | passed / failed / skipped |",
             "| --- | --- | ---: | ---: | --- |"]
    checks: dict[str, dict[str, Any]] = {}
    failed, not_run, skipped = [], [], []
    parts = manifest.get("parts") or {}
    for planned in budget.get("parts", []):
        name = planned["name"]
        part = parts.get(name)
        if part is None:
            lines.append(f"| {name} | not reached | | ({planned['guaranteed_s']:.0f}) | |")
            not_run.append(f"part `{name}`: not reached (the run stopped before it)")
            continue
        tests = part.get("tests")
        if tests is None:
            counts = "no JUnit report" if planned.get("tests") else "—"
            if planned.get("tests") and part["status"] != "not run":
                failed.append(f"part `{name}` ({part['status']}): no JUnit report, its tests' outcomes are unknown")
        else:
            count = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
            counts = f"{count['passed']} / {count['failed'] + count['error']} / {count['skipped']}"
            failed += [f"`{t['test']}`: {_short_message(t['message'])}" for t in tests
                       if t["outcome"] in ("failed", "error")]
            skipped += [t for t in tests if t["outcome"] == "skipped"]
        if part["status"] == "not run":
            not_run.append(f"part `{name}`: no time left in the budget")
        elif part["status"] != "passed" and name == "setup":
            failed.append(f"part `setup` {part['status']} (rc {part['rc']}): see run.log")
        lines.append(f"| {name} | {part['status']} | {part['seconds']:.0f} | {part['limit_s']}"
                     f" ({part.get('guaranteed_s') or 0:.0f}) | {counts} |")
        checks.update((part.get("report") or {}).get("checks", {}))
    not_run += _grouped_by_reason(skipped) + list(manifest.get("partial") or [])
    judged = {name: r for name, c in checks.items() if (r := _ratio(c)) is not None}
    if checks:
        outside = sorted(name for name, r in judged.items() if r > 1)
        line = f"Checks: {len(judged) - len(outside)} within their bounds, {len(outside)} outside"
        if outside:
            line += " (" + ", ".join(f"`{n}` {checks[n]['value']:.2e} > {checks[n]['bound']:.0e}"
                                     for n in outside) + ")"
        inside = [n for n in judged if judged[n] <= 1]
        if inside:
            worst = max(inside, key=judged.get)
            line += (f"; closest to its bound: `{worst}` {checks[worst]['value']:.2e} of {checks[worst]['bound']:.0e}"
                     f" ({1 / judged[worst]:.1f}x headroom)" if judged[worst] > 0 else "; every judged error is 0")
        lines += ["", line + "."]
    mfu = checks.get("mfu_percent")
    if mfu is not None:
        shown = "n/a" if mfu["value"] is None else f"{mfu['value']:.1f} %"
        peak = mfu.get("peak_memory_gib")
        peak = f"{peak:.1f}" if isinstance(peak, (int, float)) else "n/a"
        lines.append(f"MFU {shown} (target {mfu.get('target_percent', 0):.0f} %): {mfu.get('tflops_per_device', 0):.1f}"
                     f" TFLOP/s, {mfu.get('tokens_per_sec_per_device', 0):,.0f} tokens/s per device, peak"
                     f" {peak} GiB, micro batch {mfu.get('micro_batch')} x {mfu.get('seq_len')}.")
    if failed:
        lines += ["", "Failed:"] + [f"- {f}" for f in failed]
    if not_run:
        lines += ["", "Not run:"] + [f"- {n}" for n in not_run]
    return "\n".join(lines)


def _num(value: Any, fmt: str, suffix: str = "") -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:{fmt}}{suffix}"


def _perf_row(name: str, entry: dict[str, Any]) -> str:
    if entry.get("status") != "measured":
        return f"| {name} | {entry.get('status')} | {_short_message(str(entry.get('error') or ''), 80)} | | | | |"
    return (f"| {name} | measured | {_num(entry.get('tokens_per_sec'), ',.0f')} | {_num(entry.get('tflops'), '.1f')}"
            f" | {_num(entry.get('mfu_percent'), '.1f', ' %')} | {_num(entry.get('peak_memory_gib'), '.1f')}"
            f" | {entry.get('seconds')} / {entry.get('limit_s')} |")


def perf_summary(manifest: dict[str, Any]) -> str:
    """The performance pass's manifest (``perf.json``, ``tests/gpu/perf.py``) in Markdown: one row per configuration
    (tokens/s, TFLOP/s, MFU, peak GiB, seconds against the limit), the best re-measured, LoRA / QLoRA, grouped_mm."""
    env = manifest.get("environment") or {}
    commit = (manifest.get("commit") or "unknown")[:10]
    seconds = manifest.get("total_seconds")
    sweep = manifest.get("sweep") or {}
    configs = sweep.get("configs") or []
    measured = sum(c.get("status") == "measured" for c in configs)
    lines = [f"**GPU performance pass** ({manifest.get('mode')}) at `{commit}` on {env.get('device_name') or 'no GPU'}"
             f" (torch {env.get('torch')}, CUDA {env.get('cuda')}): {_num(seconds, '.0f', ' s')} of"
             f" {(manifest.get('budget') or {}).get('deadline_s')} s; sweep {measured} of {sweep.get('planned')}"
             f" configurations measured, {len(configs)} tried.",
             "", "| configuration | status | tokens/s | TFLOP/s | MFU | peak GiB | s / limit |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [_perf_row(f"{c.get('axis')}={c.get('value')} (`{c.get('name')}`)", c) for c in configs]
    best = manifest.get("best") or {}
    if best:
        lines.append(_perf_row(f"**best, re-measured** (`{best.get('name')}`)", best))
    for kind in ("lora", "qlora"):
        for attempt in (manifest.get(kind) or {}).get("attempts") or []:
            lines.append(_perf_row(f"8B {kind} `{attempt.get('name')}` (micro batch {attempt.get('micro_batch')}; MFU"
                                   f" at 4N_base + 6N_adapters)", attempt))
    target = manifest.get("target_mfu_percent")
    if best.get("status") == "measured" and isinstance(best.get("mfu_percent"), (int, float)):
        lines += ["", f"Best ~1B MFU {best['mfu_percent']:.1f} % against the {target:.0f} % goal"
                      f" ({'met' if best['mfu_percent'] >= target else 'not met'})."]
    g = manifest.get("grouped_mm") or {}
    if g.get("status") == "measured":
        lines += ["", f"grouped_mm ({g['layout']['num_experts']} experts, top {g['layout']['top_k']}, dim"
                      f" {g['layout']['dim']}, hidden {g['layout']['hidden']}, {g['layout']['rows']} routed rows):"
                      f" {g['grouped_ms']:.2f} ms forward+backward ({g['grouped_tflops']:.1f} TFLOP/s) vs the"
                      f" per-expert loop {g['loop_ms']:.2f} ms: {g['speedup']:.2f}x."]
    elif g:
        lines += ["", f"grouped_mm: {g.get('status')} ({_short_message(str(g.get('error') or ''))})"]
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    if paths[:1] == ["--verdict"]:
        rest, partial = paths[2:], []
        while rest[:1] == ["--partial"]:
            partial.append(rest[1])
            rest = rest[2:]
        lines, code = verdict(int(paths[1]), [Path(p) for p in rest], partial)
        print("\n".join(lines))
        return code
    if paths[:1] == ["--short"]:
        manifest = json.loads(Path(paths[1]).read_text())
        print(perf_summary(manifest) if manifest.get("kind") == "perf" else short_summary(manifest))
        return 0
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
