"""The GPU lane's record of one run (``lane.json``), tied to the source it ran on. Standard library only.

``run.sh`` writes the manifest as it goes, so a run killed at any point leaves what it finished:

- ``start MANIFEST``: the commit (``git rev-parse HEAD`` where the tree has a ``.git``; else the value given in
  ``LIGHTNING_2D_GPU_COMMIT``; else none), whether the tree differed from it, a digest of the sources that ran
  (``source_digest``: the device's copy of the tree usually has no ``.git``, and the session can recompute the digest
  from its own checkout), the mode and the budget. Prints the commit (``unknown`` when there is none).
- ``environment MANIFEST JSON``: the versions and device ``setup.sh`` found.
- ``part MANIFEST NAME --rc RC --seconds S --limit L [--report JSON] [--junit XML]``: a part's outcome, its report
  (every measured number) and each test's outcome from pytest's JUnit report.
- ``finish MANIFEST --rc RC --verdict-exit CODE --seconds S``: the verdict.

The session that ran it files the results: ``python tests/gpu/record.py save FILES_AT [--commit HASH]`` copies
``lane.json`` and ``summary.md`` into ``tests/gpu/results/<date>_<gpu>_<commit>/``, filling in the commit (given,
or this checkout's ``HEAD``) when the device could not read one, and recording whether the digest of this checkout's
sources equals the one that ran.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

COMMIT_ENV = "LIGHTNING_2D_GPU_COMMIT"
FORMAT = 1
REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
#: The sources a run depends on (what ``source_digest`` covers): the package, every test module (the lane imports
#: ``tests.unit`` helpers), the project file.
DIGESTED = ("lightning_2d", "tests", "pyproject.toml")
#: Never digested: the lane's own saved results (filed after the run) and what running writes into the tree.
NOT_DIGESTED_DIRS = {"__pycache__", ".pytest_cache", "lightning_logs"}
RESULTS_PREFIX = "tests/gpu/results/"
VERDICTS = {0: "PASSED", 3: "NOT RUN"}


def _git(root: Path, *args: str) -> str | None:
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _digested(name: str) -> bool:
    path = Path(name)
    if name.startswith(RESULTS_PREFIX) or path.suffix == ".pyc":
        return False
    return not any(part in NOT_DIGESTED_DIRS or part.endswith(".egg-info") for part in path.parts[:-1])


def source_files(root: Path) -> list[str]:
    """The files ``source_digest`` covers, relative to ``root``, sorted: what git would send (tracked, and untracked
    but not ignored) where ``root`` is a checkout, else every file found under ``DIGESTED``."""
    listed = _git(root, "ls-files", "-co", "--exclude-standard", "-z", "--", *DIGESTED)
    if listed is not None:
        names = [n for n in listed.split("\0") if n and (root / n).is_file()]
    else:
        names = []
        for top in DIGESTED:
            start = root / top
            if start.is_file():
                names.append(top)
            for dirpath, dirnames, filenames in os.walk(start):
                dirnames[:] = [d for d in dirnames if d not in NOT_DIGESTED_DIRS and not d.endswith(".egg-info")]
                names += [str(Path(dirpath, f).relative_to(root)) for f in filenames]
    return sorted(n for n in names if _digested(n))


def source_digest(root: Path) -> str:
    """``sha256:`` of every covered file's path and bytes (``source_files``): equal where the sources are."""
    digest = hashlib.sha256()
    for name in source_files(root):
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((root / name).read_bytes()).digest())
    return "sha256:" + digest.hexdigest()


def commit_digest(root: Path, commit: str) -> str | None:
    """``source_digest`` of ``commit``'s own tree (its tracked files, from ``git archive``), ``None`` where ``root``
    has no git or no such commit: what a clean checkout of ``commit`` sends to the device."""
    if not (root / ".git").exists():
        return None
    try:
        archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", commit, "--", *DIGESTED],
                                 capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if archive.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        return source_digest(Path(tmp))


def describe_source(root: Path, given: str | None) -> dict[str, Any]:
    """Which commit the tree at ``root`` is: git's ``HEAD`` where there is a ``.git`` (and whether the tree differed
    from it), else ``given`` (``$LIGHTNING_2D_GPU_COMMIT``, set by the session that sent the tree), else none."""
    given = (given or "").strip() or None
    head = _git(root, "rev-parse", "HEAD")
    info: dict[str, Any] = {"commit": None, "commit_source": None, "tree_differs_from_commit": None,
                            "source_digest": source_digest(root)}
    if head:
        status = _git(root, "status", "--porcelain")
        info.update(commit=head.strip(), commit_source="git",
                    tree_differs_from_commit=None if status is None else bool(status.strip()))
        if given and given != info["commit"]:
            info["given_commit"] = given  # kept, not trusted over git
    elif given:
        info.update(commit=given, commit_source="given")
    return info


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def dump(path: Path, manifest: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)  # a run killed mid-write leaves the previous manifest, never half of one


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def start(path: Path, mode: str, budget: dict[str, Any], root: Path = REPO, given: str | None = None) -> dict:
    """A fresh manifest for a run in ``mode`` (``cuda``, ``cpu-smoke`` or ``dry-run``) under ``budget``."""
    manifest = {"format": FORMAT, **describe_source(root, given), "mode": mode, "started_at": _now(),
                "host": os.uname().nodename, "budget": budget, "environment": None, "parts": {},
                "total_seconds": None, "verdict": None, "exit": None}
    dump(path, manifest)
    return manifest


def junit_outcomes(junit: Path) -> list[dict[str, str]]:
    """Each test of a pytest JUnit report: ``{"test", "outcome" (passed/failed/error/skipped), "message"}``."""
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        where = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (found.get("message") or "").strip()
                break
        tests.append({"test": f"{where}::{case.get('name')}", "outcome": outcome, "message": message[:500]})
    return tests


def part_status(rc: int, limit: int) -> str:
    """``passed`` (rc 0), ``timeout`` (``timeout``'s 124, or 137 after SIGKILL), ``not run`` (no time left:
    limit 0), else ``failed``."""
    if limit <= 0:
        return "not run"
    if rc in (124, 137):
        return "timeout"
    return "passed" if rc == 0 else "failed"


def record_part(path: Path, name: str, rc: int, seconds: float, limit: int, report: Path | None = None,
                junit: Path | None = None) -> dict[str, Any]:
    """Add part ``name``'s outcome to the manifest at ``path``: status, seconds against its limit, its report and
    its tests' outcomes (``tests`` is ``None`` when pytest left no JUnit report: killed, or never started)."""
    manifest = load(path)
    entry: dict[str, Any] = {"status": part_status(rc, limit), "rc": rc, "seconds": round(seconds, 1),
                             "limit_s": limit}
    guaranteed = {p["name"]: p["guaranteed_s"] for p in manifest["budget"]["parts"]}.get(name)
    entry["guaranteed_s"] = guaranteed
    if report is not None and report.is_file():
        entry["report"] = json.loads(report.read_text())
    entry["tests"] = junit_outcomes(junit) if junit is not None and junit.is_file() else None
    manifest["parts"][name] = entry
    dump(path, manifest)
    return entry


def finish(path: Path, rc: int, verdict_exit: int, seconds: float, partial: list[str] = ()) -> dict[str, Any]:
    """The run's end: its parts' status ``rc``, the verdict's exit status (``summary.py --verdict``), the seconds it
    took, and what it left out on purpose (``partial``: parts not selected, a test filter, not a GPU)."""
    manifest = load(path)
    manifest.update(total_seconds=round(seconds, 1), finished_at=_now(), steps_rc=rc, exit=verdict_exit,
                    verdict=VERDICTS.get(verdict_exit, "FAILED"), partial=list(partial))
    dump(path, manifest)
    return manifest


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def results_folder_name(manifest: dict[str, Any]) -> str:
    """``<date>_<gpu>_<commit10>``, e.g. ``2026-12-20_h100_1a2b3c4d5e`` (a dry run's ends in ``_dry-run``, the
    performance pass's in ``_perf``)."""
    date = (manifest.get("started_at") or _now())[:10]
    device = (manifest.get("environment") or {}).get("device_name") or manifest.get("mode") or "unknown"
    device = re.sub(r"^nvidia-", "", _slug(device))
    gpu = next((g for g in ("h100", "h200", "a100", "b200") if g in device), device[:20] or "unknown")
    name = f"{date}_{gpu}_{(manifest.get('commit') or 'unknown')[:10]}"
    name += "_perf" if manifest.get("kind") == "perf" else ""  # the performance pass, beside the lane's run
    return name + ("_dry-run" if manifest.get("mode") == "dry-run" else "")


def save(files_at: Path, commit: str | None = None, root: Path = REPO, results: Path = RESULTS,
         allow_dry_run: bool = False) -> Path:
    """File a run's ``lane.json`` and ``summary.md`` (from ``files_at``, what came back from the device) under
    ``results``, against its commit; or the performance pass's ``perf.json`` and ``perf.md`` (``tests/gpu/perf.py``).

    The commit is the manifest's where the device read one; else ``commit``; else ``root``'s ``HEAD``. A manifest
    whose commit differs from ``commit`` is refused (the results would be filed against the wrong source). The
    filed manifest says where its commit came from and whether the sources that ran had the digest of that commit's
    tree (``same_sources_as_commit``; ``None`` where this checkout lacks the commit) and of this working tree.

    Raises:
        ValueError: no manifest, a dry run (unless ``allow_dry_run``), or a commit that contradicts the manifest's.
    """
    source = files_at / "lane.json"
    if not source.is_file() and (files_at / "perf.json").is_file():
        source = files_at / "perf.json"  # the performance pass (tests/gpu/perf.py, `run.sh perf`)
    if not source.is_file():
        raise ValueError(f"no lane.json or perf.json in {files_at}: not the output of tests/gpu/run.sh")
    manifest = load(source)
    if manifest.get("mode") == "dry-run" and not allow_dry_run:
        raise ValueError("a dry run measured nothing on a GPU: not filed under tests/gpu/results")
    if manifest.get("commit") and commit and manifest["commit"] != commit:
        raise ValueError(f"lane.json ran on {manifest['commit']}, not {commit}: filing it against {commit} would"
                         " tie the numbers to the wrong source")
    if not manifest.get("commit"):
        given = commit or (_git(root, "rev-parse", "HEAD") or "").strip() or None
        if given is None:
            raise ValueError("lane.json has no commit and none was given (--commit), nor is there a HEAD here")
        manifest.update(commit=given, commit_source="given at filing" if commit else "HEAD at filing")
    ran = manifest.get("source_digest")
    of_commit = commit_digest(root, manifest["commit"])
    manifest["filed"] = {"at": _now(), "same_sources_as_commit": None if of_commit is None else of_commit == ran,
                         "same_sources_as_working_tree": source_digest(root) == ran}
    folder = results / results_folder_name(manifest)
    folder.mkdir(parents=True, exist_ok=True)
    dump(folder / source.name, manifest)
    try:
        from tests.gpu.summary import perf_summary, short_summary
    except ImportError:  # run as a script from anywhere: its folder is on sys.path
        from summary import perf_summary, short_summary

    if manifest.get("kind") == "perf":
        (folder / "perf.md").write_text(perf_summary(manifest) + "\n")
    else:
        (folder / "summary.md").write_text(short_summary(manifest) + "\n")
    return folder


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="record.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start")
    p.add_argument("manifest", type=Path)
    p.add_argument("--mode", required=True, choices=["cuda", "cpu-smoke", "dry-run"])
    p.add_argument("--budget", required=True, help="JSON of budget.plan")
    p = sub.add_parser("environment")
    p.add_argument("manifest", type=Path)
    p.add_argument("environment", type=Path)
    p = sub.add_parser("part")
    p.add_argument("manifest", type=Path)
    p.add_argument("name")
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--report", type=Path)
    p.add_argument("--junit", type=Path)
    p = sub.add_parser("finish")
    p.add_argument("manifest", type=Path)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--verdict-exit", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--partial", action="append", default=[])
    p = sub.add_parser("save")
    p.add_argument("files_at", type=Path)
    p.add_argument("--commit")
    p.add_argument("--allow-dry-run", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "start":
        manifest = start(args.manifest, args.mode, json.loads(args.budget), given=os.environ.get(COMMIT_ENV))
        print(manifest["commit"] or "unknown")
    elif args.command == "environment":
        manifest = load(args.manifest)
        if args.environment.is_file():
            manifest["environment"] = json.loads(args.environment.read_text())
        dump(args.manifest, manifest)
    elif args.command == "part":
        record_part(args.manifest, args.name, args.rc, args.seconds, args.limit, args.report, args.junit)
    elif args.command == "finish":
        finish(args.manifest, args.rc, args.verdict_exit, args.seconds, args.partial)
    elif args.command == "save":
        try:
            print(save(args.files_at, args.commit, allow_dry_run=args.allow_dry_run))
        except ValueError as error:
            print(f"record.py save: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
