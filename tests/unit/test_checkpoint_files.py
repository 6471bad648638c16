"""Checkpoint completeness and fall-back logic on plain folders (no process group)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_2d.checkpoint.digests import digesting_writer
from lightning_2d.checkpoint.discovery import (
    checkpoints_in,
    incomplete_checkpoints,
    is_checkpoint,
    is_complete,
    latest_checkpoint,
    newest_complete_checkpoint,
)
from lightning_2d.checkpoint.names import checkpoint_step
from lightning_2d.checkpoint.resolution import resolve_checkpoint
from lightning_2d.checkpoint.rng import rng_state, set_rng_state
from lightning_2d.checkpoint.writer import save_full_file


def sharded(folder, name, complete=True):
    """A sharded checkpoint as the strategies write it (a real DCP save, then ``meta.pt``); an
    incomplete one has its shard but neither ``.metadata`` nor ``meta.pt``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = folder / name
    (path / "rng").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": on purpose
        # With its digests, as the strategies write it (lightning_2d.checkpoint.digests).
        dcp.save({"state_dict": {"w": torch.arange(64.0)}}, checkpoint_id=path, storage_writer=digesting_writer(path),
                 no_dist=True)
    if complete:
        torch.save({"lightning_2d": {"layout": {"world_size": 1}}}, path / "meta.pt")
    else:
        (path / ".metadata").unlink()
    return path


def full_file(folder, name):
    """A full checkpoint as the strategies write it (it carries the ``lightning_2d`` entry)."""
    path = folder / name
    save_full_file({"state_dict": {"w": torch.ones(2)}, "lightning_2d": {"layout": {"world_size": 2}}}, path)
    return path


def age(path, seconds_ago):
    """Set ``path``'s modification time ``seconds_ago`` seconds in the past."""
    import time

    stamp = time.time() - seconds_ago
    os.utime(path, (stamp, stamp))


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
    assert resolve_checkpoint(broken, warnings.append, fall_back=True) == tmp_path / "epoch=0-step=10.ckpt"
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
        resolve_checkpoint(broken, print, fall_back=True)
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt does not exist"):
        resolve_checkpoint(tmp_path / "missing.ckpt", print, fall_back=True)
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


# ---- naming schemes: Trainer and Fabric checkpoints alike ---------------------------------------
@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("epoch=1-step=12.ckpt", 12),
        ("end-epoch=0-step=3.ckpt", 3),
        ("step=7.ckpt", 7),
        ("step-000003", 3),
        ("step_42.pt", 42),
        ("step10.pth", 10),
        ("global_step5", 5),
        ("STEP-8", 8),
        ("last.ckpt", None),
        ("timestep5", None),  # "step" inside a word is not a step
        ("final", None),
    ],
)
def test_step_numbers_from_common_naming_schemes(tmp_path, name, step):
    assert checkpoint_step(tmp_path / name) == step


def test_fabric_folders_fall_back_to_the_newest_complete_one_and_name_the_lost_save(tmp_path):
    sharded(tmp_path, "step-000001")
    sharded(tmp_path, "step-000002")
    broken = sharded(tmp_path, "step-000003", complete=False)
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "step-000002"
    assert incomplete_checkpoints(tmp_path) == [broken]
    warned: list[str] = []
    # "latest": the newest complete one, naming the interrupted save after it.
    assert latest_checkpoint(tmp_path, warned.append) == tmp_path / "step-000002"
    assert len(warned) == 1 and "step-000003 is incomplete" in warned[0]
    warnings: list[str] = []
    assert resolve_checkpoint(broken, warnings.append, fall_back=True) == tmp_path / "step-000002"
    assert warnings == [
        f"Checkpoint {broken} is incomplete (an interrupted save); resuming from the newest complete checkpoint"
        f" instead: {tmp_path / 'step-000002'}"
    ]
    # Asking for an older complete one works, and says which newer save was lost.
    warnings.clear()
    assert resolve_checkpoint(tmp_path / "step-000001", warnings.append) == tmp_path / "step-000001"
    assert len(warnings) == 1 and "step-000003 is incomplete" in warnings[0]


@pytest.mark.parametrize(
    "trace",
    [
        lambda p: (p / "__1_0.distcp").write_bytes(b"half a shard"),  # killed while writing its shard
        lambda p: (p / ".metadata").write_bytes(b"m"),  # every shard and DCP's .metadata, no meta.pt
        lambda p: ((p / "rng").mkdir(), (p / "rng" / "rank0.pt").write_bytes(b"r")),  # before any shard
    ],
    ids=["shard", "dcp-metadata", "rng-only"],
)
def test_a_folder_counts_as_a_started_save_by_its_traces_whatever_its_name(tmp_path, trace):
    sharded(tmp_path, "run-a")
    started = tmp_path / "run-b"
    started.mkdir()
    trace(started)
    assert is_checkpoint(started) and not is_complete(started)
    assert incomplete_checkpoints(tmp_path) == [started]
    assert resolve_checkpoint(started, lambda _: None, fall_back=True) == tmp_path / "run-a"


def test_mixed_schemes_order_by_step_then_time(tmp_path):
    # Created newest-step first: the step in the name decides, not the clock or the name's order.
    step10 = full_file(tmp_path, "step10.pth")
    step7 = full_file(tmp_path, "step_7.pt")
    step5 = sharded(tmp_path, "step-000005")
    step2 = sharded(tmp_path, "epoch=0-step=2.ckpt")
    unnumbered = full_file(tmp_path, "final.ckpt")  # newest on disk, but no step: ranks below numbered ones
    assert checkpoints_in(tmp_path) == [unnumbered, step2, step5, step7, step10]
    assert newest_complete_checkpoint(tmp_path) == step10
    assert newest_complete_checkpoint(tmp_path, exclude=step10) == step7


def test_without_step_numbers_the_newest_on_disk_wins(tmp_path):
    older, newer = sharded(tmp_path, "b-run"), sharded(tmp_path, "a-run")
    age(older, 60)
    age(newer, 10)
    broken = sharded(tmp_path, "c-run", complete=False)
    warnings: list[str] = []
    assert resolve_checkpoint(broken, warnings.append, fall_back=True) == newer
    assert f"instead: {newer}" in warnings[0]


def test_unrelated_entries_are_never_checkpoints(tmp_path):
    good = sharded(tmp_path, "step-000002")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "version_0.csv").write_text("step,loss\n")
    (tmp_path / "step-000009").mkdir()  # an empty folder: nothing of a save in it
    (tmp_path / "config.yaml").write_text("max_steps: 10\n")
    (tmp_path / "step-000011.txt").write_text("notes")
    torch.save({"w": torch.ones(2)}, tmp_path / "step-000012.pt")  # a tensor dump, not a checkpoint
    (tmp_path / "step-000013.pth").write_bytes(b"not even an archive")
    (tmp_path / ".step-000014.pt.incomplete").write_bytes(b"half")  # save_full_file's temporary name
    hidden = tmp_path / ".step-000015"
    hidden.mkdir()
    (hidden / "__0_0.distcp").write_bytes(b"shard")
    os.symlink("nowhere", tmp_path / "step-000016.ckpt")  # a dangling link
    assert checkpoints_in(tmp_path) == [good]
    assert latest_checkpoint(tmp_path) == good
    assert incomplete_checkpoints(tmp_path) == []
    # Inside a checkpoint, meta.pt and rng/ are parts, not checkpoints.
    full_file(good, "meta.pt")
    assert checkpoints_in(good) == [] and checkpoints_in(good / "rng") == []


def test_a_link_and_its_target_count_once(tmp_path):
    target = sharded(tmp_path, "step-000004")
    os.symlink(target.name, tmp_path / "latest")
    assert checkpoints_in(tmp_path) == [target]
    assert checkpoint_step(tmp_path / "latest") == 4  # a link is ordered by its target's name
    broken = sharded(tmp_path, "step-000006", complete=False)
    os.symlink(broken.name, tmp_path / "last.ckpt")
    assert incomplete_checkpoints(tmp_path) == [broken]
    warnings: list[str] = []
    assert resolve_checkpoint(tmp_path / "last.ckpt", warnings.append, fall_back=True) == target
    assert warnings[0].startswith(f"Checkpoint {tmp_path / 'last.ckpt'} is incomplete")


def test_full_files_of_ours_count_under_any_torch_suffix(tmp_path):
    full = full_file(tmp_path, "step-000003.pt")
    assert is_checkpoint(full) and is_complete(full)
    sharded(tmp_path, "step-000004", complete=False)
    warnings: list[str] = []
    assert resolve_checkpoint(tmp_path / "step-000004", warnings.append, fall_back=True) == full
    assert latest_checkpoint(tmp_path) == full


def test_a_full_file_without_suffix_counts_when_it_is_ours(tmp_path):
    # The Fabric recipe's names with save_distributed_checkpoint=False: one full file "step-000003".
    ours = full_file(tmp_path, "step-000003")
    torch.save({"w": torch.ones(2)}, tmp_path / "step-000004")
    assert checkpoints_in(tmp_path) == [ours]


def test_no_checkpoint_at_all(tmp_path):
    assert latest_checkpoint(tmp_path) is None and checkpoints_in(tmp_path / "missing") == []


def test_an_explicit_checkpoint_loads_exactly_or_fails_naming_it(tmp_path):
    """Only "last" may stand in for another checkpoint: a mistyped or interrupted explicit path is an
    error naming it and the newest complete alternative, never a silent resume from another step."""
    from lightning_2d.checkpoint.errors import CheckpointError

    good = sharded(tmp_path, "step-000002")
    broken = sharded(tmp_path, "step-000003", complete=False)
    with pytest.raises(CheckpointError, match=r"step-000003 is incomplete \(an interrupted save\)\. Not resuming from"
                       r" another checkpoint, since this one was asked for; the newest complete one there is .*step-000002"):
        resolve_checkpoint(broken, print)
    with pytest.raises(CheckpointError, match=r"step-00002 does not exist\. Not resuming"):
        resolve_checkpoint(tmp_path / "step-00002", print)  # a typo
    assert resolve_checkpoint(good, print) == good


def test_a_damaged_checkpoint_is_named_with_its_file_and_skipped_only_for_last(tmp_path):
    from lightning_2d.checkpoint.errors import CheckpointError
    from lightning_2d.checkpoint.integrity import damage

    older = sharded(tmp_path, "step-000002")
    newer = sharded(tmp_path, "step-000004")
    assert damage(newer) == []
    shard = newer / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # cut short after the save completed
    assert is_complete(newer) and damage(newer) == [
        f"__0_0.distcp: 100 bytes, but the metadata places data up to byte {older.joinpath('__0_0.distcp').stat().st_size:,}"
    ]
    with pytest.raises(CheckpointError, match=r"step-000004 is damaged \(__0_0\.distcp: 100 bytes, but the metadata"):
        resolve_checkpoint(newer, print)
    warnings: list[str] = []
    assert resolve_checkpoint(newer, warnings.append, fall_back=True) == older
    (older / "meta.pt").write_bytes(b"garbage")
    assert damage(older)[0].startswith("meta.pt: not a readable torch archive")
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint to resume from instead"):
        resolve_checkpoint(newer, print, fall_back=True)  # a damaged one is no fall-back either
    full = full_file(tmp_path, "step-000009.pt")
    full.write_bytes(full.read_bytes()[:50])
    assert damage(full)[0].startswith("not a readable torch archive")
