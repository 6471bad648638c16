"""Checkpoint completeness and fall-back logic on plain folders (no process group)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_2d.checkpoint import (
    is_complete,
    newest_complete_checkpoint,
    resolve_checkpoint,
    rng_state,
    save_full_file,
    set_rng_state,
)


def sharded(folder, name, complete=True):
    path = folder / name
    (path / "rng").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (path / ".metadata").write_bytes(b"m")
        (path / "meta.pt").write_bytes(b"m")
    return path


def test_completeness_needs_both_marks(tmp_path):
    assert is_complete(sharded(tmp_path, "a.ckpt"))
    partial = sharded(tmp_path, "b.ckpt", complete=False)
    assert not is_complete(partial)
    (partial / ".metadata").write_bytes(b"m")  # DCP finished, meta.pt (written last) missing
    assert not is_complete(partial)


def test_fall_back_to_the_newest_complete_checkpoint_and_say_so(tmp_path):
    sharded(tmp_path, "epoch=0-step=2.ckpt")
    sharded(tmp_path, "epoch=0-step=10.ckpt")  # newest by step, not by name order
    broken = sharded(tmp_path, "epoch=0-step=12.ckpt", complete=False)
    warnings: list[str] = []
    assert resolve_checkpoint(broken, warnings.append) == tmp_path / "epoch=0-step=10.ckpt"
    assert warnings == [
        f"Checkpoint {broken} is incomplete (an interrupted save); resuming from the newest complete checkpoint"
        f" instead: {tmp_path / 'epoch=0-step=10.ckpt'}"
    ]


def test_resuming_an_older_checkpoint_names_newer_interrupted_saves(tmp_path):
    good = sharded(tmp_path, "epoch=0-step=2.ckpt")
    os.symlink(good.name, tmp_path / "last.ckpt")
    sharded(tmp_path, "epoch=0-step=4.ckpt", complete=False)
    warnings: list[str] = []
    assert resolve_checkpoint(tmp_path / "last.ckpt", warnings.append) == tmp_path / "last.ckpt"
    assert len(warnings) == 1 and "epoch=0-step=4.ckpt is incomplete" in warnings[0]


def test_no_complete_checkpoint_is_an_error(tmp_path):
    broken = sharded(tmp_path, "x.ckpt", complete=False)
    with pytest.raises(FileNotFoundError, match=r"x\.ckpt is incomplete .* holds no complete checkpoint"):
        resolve_checkpoint(broken, print)
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt does not exist"):
        resolve_checkpoint(tmp_path / "missing.ckpt", print)
    assert newest_complete_checkpoint(tmp_path) is None


def test_full_file_appears_only_complete(tmp_path):
    path = tmp_path / "sub" / "full.ckpt"
    save_full_file({"x": torch.ones(2)}, path)
    assert is_complete(path) and not (tmp_path / "sub" / ".full.ckpt.incomplete").exists()
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(2))


def test_rng_state_round_trips_and_loads_weights_only(tmp_path):
    import random

    import numpy as np

    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]
