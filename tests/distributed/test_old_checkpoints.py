"""Training resumes from checkpoints written by lightning_2d 0.1.0 (``tests/fixtures/checkpoints_v0_1``): the
weights, optimizer and schedule come back, so steps 3 and 4 give the losses the original run had."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import launch

pytestmark = pytest.mark.distributed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_a_run_resumed_from_version_0_1_checkpoints_continues_exactly(tmp_path):
    # make_checkpoints.py --resume, on one process forked from the fork server (worker.py's old_checkpoints).
    done = launch("old_checkpoints", {}, tmp_path, nprocs=1)
    assert done.ok, done.describe()
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    original = json.loads((FIXTURES / "checkpoints_v0_1" / "losses.json").read_text())["steps_3_4"]
    for name in ("sharded.ckpt", "full.ckpt"):
        assert resumed[name]["weights_equal"], f"{name}: the weights loaded differ from those saved"
        assert resumed[name]["losses"] == pytest.approx(original, rel=1e-6), name
