"""The GPU lane's parts and its time budget: which tests each part runs, how long it is expected to take on one
H100/H200, and how many seconds ``run.sh`` gives it. Standard library only: ``run.sh`` asks it before every part,
without importing torch.

The whole lane must end within ``DEADLINE_S`` (under 8 minutes), so that a session lent a device for 15 minutes
(the machine's start included) spends them on one call and a rerun of a part. Each part has a *guaranteed* time,
and the guarantees plus ``RESERVE_S`` (summary, tarball, verdict) add up to the deadline. A part may take its
guarantee plus whatever the parts before it left unused (``allot``), never time the parts after it are guaranteed:
a part that hangs is killed at its limit and the others still run, and the lane exits by the deadline whatever
happens. Every figure scales with the deadline (``LIGHTNING_2D_GPU_DEADLINE``), for the CPU smoke mode
(a longer one) and the unit tests (a shorter one).

The estimates come from the first GPU session's recorded times (one H200, torch 2.11, 2026-12-04,
``results/2026-12-04_h200/``, README "Measured"); each ``basis`` says which numbers. The H100 has the H200's bf16
peak and less memory bandwidth; the parts are dominated by process start-up, compilation and launch-bound small
steps (the same 16 CPU cores), so the same estimates are used for both.

``python tests/gpu/budget.py`` commands (what ``run.sh`` calls):

- ``parts``: the parts to run, in order, ``setup`` first (``LIGHTNING_2D_GPU_PARTS`` selects the others);
- ``tests PART``: the pytest paths of a part;
- ``allot PART ELAPSED``: ``LIMIT GRACE``: the part's hard limit in seconds from now (``0``: no time left, skip it)
  and the seconds between ``timeout``'s SIGTERM and SIGKILL within it;
- ``left-out``: the parts ``LIGHTNING_2D_GPU_PARTS`` leaves out (the verdict is then NOT RUN at best);
- ``plan``: the budget as JSON (recorded in ``lane.json``); ``table``: as a table (printed at the start of the log).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

DEADLINE_ENV = "LIGHTNING_2D_GPU_DEADLINE"
PARTS_ENV = "LIGHTNING_2D_GPU_PARTS"

#: The whole of ``run.sh``, setup to verdict, in seconds: 7:50, under the 8 minutes a session's one call may take.
DEADLINE_S = 470.0
#: Kept after the last part for the summary table, the tarball of the job logs and the verdict (~3 s measured).
RESERVE_S = 10.0
#: ``timeout -k``: SIGTERM this long before the part's limit, SIGKILL at it (pytest then leaves no JUnit report).
KILL_GRACE_S = 5.0
#: A part left fewer seconds than this is not started (recorded as not run for lack of time).
MIN_PART_S = 2.0


@dataclass(frozen=True)
class Part:
    """One time-limited step of the lane.

    Args:
        name: What the log, the manifest and ``LIGHTNING_2D_GPU_PARTS`` call it.
        tests: The pytest paths it runs (none for ``setup``, which is ``setup.sh``).
        estimate_s: Expected seconds on one H100/H200, start-up included.
        guaranteed_s: Seconds it may always take, at the default deadline.
        basis: Where the estimate comes from.
    """

    name: str
    tests: tuple[str, ...]
    estimate_s: float
    guaranteed_s: float
    basis: str


#: In the order ``run.sh`` runs them. The MoE part, never run on a GPU, goes first so that a session cut short
#: still learns whether ``grouped_mm`` works; parity, the longest and the one whose model code changed most
#: since the recorded run (SwiGLU, MoE blocks), goes last, where the slack of every earlier part reaches it.
PARTS: tuple[Part, ...] = (
    Part("setup", (), 44.0, 60.0,
         "307 s in all - correctness step 217 s - MFU step 46 s = 44 s: pip installs (torchao wheel, editable"
         " package), nvidia-smi, the version check, summary"),
    Part("moe", ("tests/gpu/test_moe.py",), 25.0, 45.0,
         "never run on a GPU: pytest start ~10 s (the MFU step's 46 s less its job's 36 s), 4 debug-moe steps in"
         " fp32 on the CPU (9 CPU-s on a loaded 2-core machine), a few bf16 kernels"),
    Part("attention", ("tests/gpu/test_attention.py",), 61.0, 75.0,
         "correctness step 217 s - its six jobs 156 s = 61 s: the FlexAttention tests (first compile ~24 s) and"
         " pytest start"),
    Part("mfu", ("tests/gpu/test_mfu.py",), 46.0, 55.0,
         "MFU step 46 s (job 36.2 s: compile of the 1B block, 25 steps of ~0.3 s)"),
    Part("resume", ("tests/gpu/test_resume.py",), 61.0, 75.0,
         "jobs checkpoint 26.8 s + resume 24.6 s + pytest start and corpus ~10 s"),
    Part("parity", ("tests/gpu/test_parity.py",), 128.0, 150.0,
         "jobs reference 27.4 s + eager 28.8 s (with LoRA and QLoRA, report_lora.json) + compile 38.0 s +"
         " float8 23.4 s + pytest start and corpus ~10 s"),
)

BY_NAME = {part.name: part for part in PARTS}


def selected_parts(spec: str | None = None) -> list[str]:
    """``setup`` and the parts ``spec`` names (space- or comma-separated; all when empty), in the lane's order.

    Raises:
        ValueError: ``spec`` names a part that does not exist.
    """
    names = [n for n in (spec or "").replace(",", " ").split() if n != "setup"]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"{PARTS_ENV}: no part {', '.join(unknown)}; the parts are"
                         f" {', '.join(p.name for p in PARTS if p.name != 'setup')}")
    return [p.name for p in PARTS if p.name == "setup" or not names or p.name in names]


def scale(deadline: float) -> float:
    """The factor every guarantee and the reserve are multiplied by at ``deadline``."""
    return deadline / DEADLINE_S


def allot(part: str, elapsed: float, selected: Sequence[str], deadline: float = DEADLINE_S) -> tuple[int, int]:
    """The hard limit of ``part`` in whole seconds from ``elapsed`` (seconds since the lane started), and the kill
    grace within it.

    The limit is what is left before the deadline, less the reserve and the guarantees of the selected parts after
    this one: the part's own guarantee plus the time earlier parts did not use. ``(0, 0)`` when less than
    ``MIN_PART_S`` is left: the part is not started.
    """
    if part not in selected:
        raise ValueError(f"{part} is not among the selected parts {list(selected)}")
    factor = scale(deadline)
    later = selected[list(selected).index(part) + 1:]
    left = deadline - RESERVE_S * factor - elapsed - sum(BY_NAME[n].guaranteed_s * factor for n in later)
    limit = math.floor(left)
    if limit < MIN_PART_S:
        return 0, 0
    return limit, max(1, min(int(KILL_GRACE_S), limit // 4))


def plan(selected: Sequence[str], deadline: float = DEADLINE_S) -> dict:
    """The budget as data (recorded in the manifest): deadline, reserve and each selected part's figures."""
    factor = scale(deadline)
    return {
        "deadline_s": deadline,
        "reserve_s": round(RESERVE_S * factor, 1),
        "parts": [{"name": n, "tests": list(BY_NAME[n].tests), "estimate_s": BY_NAME[n].estimate_s,
                   "guaranteed_s": round(BY_NAME[n].guaranteed_s * factor, 1), "basis": BY_NAME[n].basis}
                  for n in selected],
    }


def table(selected: Sequence[str], deadline: float = DEADLINE_S) -> str:
    budget = plan(selected, deadline)
    lines = [f"budget: {deadline:.0f} s in all; each part its guaranteed seconds plus what earlier parts left;"
             f" {budget['reserve_s']:.0f} s kept for the summary",
             f"  {'part':<10} {'estimate':>9} {'guaranteed':>11}"]
    lines += [f"  {p['name']:<10} {p['estimate_s']:>8.0f}s {p['guaranteed_s']:>10.0f}s" for p in budget["parts"]]
    estimate = sum(p["estimate_s"] for p in budget["parts"])
    lines.append(f"  {'total':<10} {estimate:>8.0f}s {deadline - budget['reserve_s']:>10.0f}s")
    return "\n".join(lines)


def deadline_from_env() -> float:
    value = os.environ.get(DEADLINE_ENV)
    return float(value) if value else DEADLINE_S


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    try:
        selected = selected_parts(os.environ.get(PARTS_ENV))
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if command == "parts":
        print(" ".join(selected))
    elif command == "tests" and len(args) == 1:
        print(" ".join(BY_NAME[args[0]].tests))
    elif command == "allot" and len(args) == 2:
        print(*allot(args[0], float(args[1]), selected, deadline_from_env()))
    elif command == "left-out":
        print(" ".join(p.name for p in PARTS if p.name not in selected))
    elif command == "plan":
        print(json.dumps(plan(selected, deadline_from_env())))
    elif command == "table":
        print(table(selected, deadline_from_env()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
