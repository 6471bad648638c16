"""Digests of checkpoint items: written by our writer (sync and async), checked before a load, a changed byte
refused naming the file, the tensor and the step, ``last`` falling back to the intact one, old checkpoints
loading with a note. Single process, the real ``ShardedCheckpointWriter`` (DCP without a process group)."""

from __future__ import annotations

import io
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_2d.checkpoint import digests
from lightning_2d.checkpoint.dcp_metadata import read_dcp_metadata
from lightning_2d.checkpoint.discovery import latest_checkpoint
from lightning_2d.checkpoint.errors import CheckpointError
from lightning_2d.checkpoint.integrity import Integrity, damage
from lightning_2d.checkpoint.resolution import resolve_and_check, resolve_checkpoint
from lightning_2d.checkpoint.writer import ShardedCheckpointWriter, save_full_file

WEIGHT = "state_dict.layers.0.attention.wq.weight"


def state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {
            "layers.0.attention.wq.weight": torch.randn(64, 64, generator=generator) * 0.02,
            "norm.weight": torch.ones(64),
        },
        "optimizer_0": {"param_groups": [{"lr": 3e-4, "name": "adamw"}]},  # bytes-io items
    }


def save(folder: Path, name: str, seed: int = 0, async_save: bool = False) -> Path:
    path = folder / name
    writer = ShardedCheckpointWriter(0, lambda: None, async_save=async_save)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": on purpose
        writer.save(state(seed), {"global_step": 8, "lightning_2d": {"layout": {"world_size": 1}}}, path)
        writer.wait()
    return path


def stored(folder: Path, fqn: str, file_name: str | None = None) -> tuple[Path, int, int]:
    """(file, offset, length) of ``fqn``'s first stored item (in ``file_name``, if given), from DCP's metadata."""
    for index, info in read_dcp_metadata(folder).storage_data.items():
        if index.fqn == fqn and file_name in (None, info.relative_path):
            return folder / info.relative_path, int(info.offset), int(info.length)
    raise KeyError(fqn)


def flip_exponent_bits(folder: Path, fqn: str = WEIGHT, count: int = 100, file_name: str | None = None) -> Path:
    """Flip the top exponent bit of ``count`` fp32 values of ``fqn`` in its shard file (``file_name``, if given),
    in place (the issue's case: values up to ~1e37, the file size unchanged)."""
    file, offset, length = stored(folder, fqn, file_name)
    data = bytearray(file.read_bytes())
    blob = bytes(data[offset:offset + length])
    tensor = torch.load(io.BytesIO(blob), weights_only=True)
    start = offset + blob.find(tensor.numpy().tobytes())
    values = np.frombuffer(data, dtype=np.uint32, count=count, offset=start).copy() ^ np.uint32(1 << 30)
    data[start:start + 4 * count] = values.tobytes()
    size = file.stat().st_size
    file.write_bytes(bytes(data))
    assert file.stat().st_size == size
    return file


def one_process(path, fall_back=False, prefixes=None, warn=print, integrity=None):
    """``resolve_and_check`` as one rank sees it (world size 1); ``integrity``: its checkpoint IO's."""
    return resolve_and_check(path, 0, 1, lambda obj: obj, lambda obj: [obj], warn, fall_back=fall_back,
                             prefixes=prefixes, integrity=integrity)


def test_the_writer_records_a_digest_of_every_item_as_it_writes(tmp_path):
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    hash_name, listed = digests.read_manifest(path)
    assert hash_name == "xxh3_64"
    items = [i for i in listed if not i.whole]
    # Every other file a load reads is listed whole, at its size, with the digest of its bytes.
    whole = {i.file: i for i in listed if i.whole}
    assert sorted(whole) == [".metadata", "meta.pt", "rng/rank0.pt"]
    for name, item in whole.items():
        data = (path / name).read_bytes()
        assert (item.offset, item.length, item.digest) == (0, len(data), digests.digest_of(data)), name
    by_index = {(i.fqn, i.chunk): i for i in items}
    metadata = read_dcp_metadata(path)
    # One digest per item DCP stored, at DCP's offsets, equal to the hash of those bytes.
    assert len(items) == len(metadata.storage_data)
    for index, info in metadata.storage_data.items():
        item = by_index[(index.fqn, tuple(index.offset) if index.offset is not None else ())]
        assert (item.file, item.offset, item.length) == (info.relative_path, info.offset, info.length)
        blob = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        assert item.digest == digests.digest_of(blob)
    assert {"state_dict.norm.weight", WEIGHT, "optimizer_0.param_groups.0.name"} <= {i.fqn for i in items}
    assert digests._WRITER.rereads == 0  # hashed in the stream, not read back


def test_async_saves_write_the_same_manifest(tmp_path):
    sync_items = digests.read_manifest(save(tmp_path, "sync"))[1]
    async_items = digests.read_manifest(save(tmp_path, "async", async_save=True))[1]
    # The items alike; the whole files the same ones (DCP's .metadata records the folder's name and a save id).
    assert [i for i in sync_items if not i.whole] == [i for i in async_items if not i.whole]
    assert [i.file for i in sync_items if i.whole] == [i.file for i in async_items if i.whole]
    assert digests._WRITER.rereads == 0


def test_flipped_exponent_bits_are_refused_naming_file_tensor_and_step(tmp_path):
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    file = flip_exponent_bits(path)
    assert damage(path) == []  # sizes and metadata intact: before digests, this loaded and trained
    for check in (lambda: resolve_checkpoint(path, print, check_digests=True), lambda: one_process(path)):
        with pytest.raises(CheckpointError) as err:
            check()
        message = str(err.value)
        assert "\n" not in message
        changed = f"Checkpoint {path} is damaged: its bytes changed after it was saved at step 8"
        assert f"{changed} ({file.name}: {WEIGHT}" in message
        assert "Not resuming from another checkpoint" in message


def test_a_changed_non_tensor_item_is_refused(tmp_path):
    path = save(tmp_path, "step-000008")
    file, offset, length = stored(path, "optimizer_0.param_groups.0.name")
    data = file.read_bytes()
    at = data.index(b"adamw", offset, offset + length)
    file.write_bytes(data[:at] + b"adamW" + data[at + 5:])
    refused = r"at step 8 \(__0_0\.distcp: optimizer_0\.param_groups\.0\.name reads as"
    with pytest.raises(CheckpointError, match=refused):
        one_process(path)
    # A load of the weights only does not read that item, and is not refused.
    assert one_process(path, prefixes=("state_dict.",)) == path


def test_last_falls_back_to_the_newest_intact_checkpoint_and_says_why(tmp_path):
    older = save(tmp_path, "epoch=0-step=4.ckpt", seed=1)
    last = save(tmp_path, "last.ckpt")
    flip_exponent_bits(last)
    warned: list[str] = []
    assert one_process(last, fall_back=True, warn=warned.append) == older
    assert len(warned) == 1
    assert f"Checkpoint {last} is damaged: its bytes changed after it was saved at step 8" in warned[0]
    assert warned[0].endswith(f"resuming from the newest complete checkpoint instead: {older}")
    # The Fabric recipe's `--resume latest` too.
    fabric_dir = tmp_path / "fabric"
    fabric_dir.mkdir()
    shutil.copytree(older, fabric_dir / "step-000004")
    shutil.copytree(last, fabric_dir / "step-000008")
    warned.clear()
    assert latest_checkpoint(fabric_dir, warned.append) == fabric_dir / "step-000004"
    assert "step-000008 is damaged: its bytes changed after it was saved at step 8" in warned[0]


def test_checkpoints_without_digests_load_with_one_note(tmp_path):
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    (path / digests.MANIFEST_FILE).unlink()  # as saved before digests
    warned: list[str] = []
    integrity = Integrity()  # one checkpoint IO's: it warns once
    for _ in range(2):
        assert one_process(path, warn=warned.append, integrity=integrity) == path
    assert len(warned) == 1 and "carries no digests" in warned[0]


def test_full_files_carry_their_digests(tmp_path):
    path = tmp_path / "epoch=0-step=8.ckpt"
    save_full_file({**state(), "global_step": 8, "lightning_2d": {"layout": {"world_size": 1}}}, path)
    assert resolve_checkpoint(path, print) == path
    data = bytearray(path.read_bytes())
    values = state()["state_dict"]["layers.0.attention.wq.weight"].numpy()
    start = bytes(data).index(values.tobytes())
    flipped = np.frombuffer(data, dtype=np.uint32, count=100, offset=start).copy() ^ np.uint32(1 << 30)
    data[start:start + 400] = flipped.tobytes()
    path.write_bytes(bytes(data))
    assert damage(path) == []
    with pytest.raises(CheckpointError, match=rf"at step 8 \({path.name}: {WEIGHT} reads as"):
        resolve_checkpoint(path, print)
    old = tmp_path / "old.ckpt"
    torch.save({**state(), "lightning_2d": {"layout": {"world_size": 1}}}, old)  # written before digests
    warned: list[str] = []
    assert resolve_checkpoint(old, warned.append) == old and "carries no digests" in warned[0]


def test_ranks_share_the_check_each_item_once_in_contiguous_runs(tmp_path):
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    items = digests.read_manifest(path)[1]
    for world_size in (1, 2, 3, 4, 8):
        shares = [digests.share_of(items, rank, world_size) for rank in range(world_size)]
        shared = sorted((i.file, i.offset) for share in shares for i in share)
        assert shared == sorted((i.file, i.offset) for i in items)
        order = [(i.file, i.offset) for share in shares for i in share]
        assert order == sorted(order)  # rank r's items all come before rank r+1's
    # A changed item is found by exactly the rank whose share holds it.
    file = flip_exponent_bits(path)
    found = [digests.check_items(path, digests.share_of(items, rank, 4)) for rank in range(4)]
    assert sum(len(f) for f in found) == 1 and [i.fqn for f in found for i in f] == [WEIGHT]
    assert next(i for f in found for i in f).file == file.name


def test_the_step_comes_from_the_checkpoint_when_its_name_has_none(tmp_path):
    path = save(tmp_path, "final")
    flip_exponent_bits(path)
    with pytest.raises(CheckpointError, match=r"its bytes changed after it was saved at step 8 \(__0_0\.distcp"):
        one_process(path)


def test_the_hashing_stream_looks_like_the_file_it_writes(tmp_path):
    """Code that looks at DCP's stream (the Fabric crash test finds its folder by ``stream.name``) sees the file."""
    fs = digests._file_system_class()()
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        assert stream.name == str(tmp_path / "__0_0.distcp")
        assert stream.tell() == 0 and stream.write(b"abc") == 3 and stream.tell() == 3
    assert fs.segments["__0_0.distcp"] == {(0, 3): digests.digest_of(b"abc")}


def test_only_the_launching_process_reads_the_checkpoint_before_the_ranks_start(tmp_path, monkeypatch):
    """`check_ckpt_path` runs in every launched process too: only the launcher (or torchrun's rank 0) reads the
    digests there; the ranks check together when they load (``resolve_and_check``)."""
    from lightning_2d.checkpoint import check_ckpt_path

    path = save(tmp_path, "epoch=0-step=8.ckpt")
    flip_exponent_bits(path)
    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert check_ckpt_path(str(path)) == path
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(CheckpointError, match="its bytes changed after it was saved at step 8"):
        check_ckpt_path(str(path))


# ---- the whole checkpoint: meta.pt, RNG, DCP's .metadata, the manifest itself (#42) ------------------------------
def change_byte(file: Path, at: int = -20) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["meta.pt", "rng/rank0.pt", ".metadata"])
@pytest.mark.parametrize("how", ["changed", "appended"])
def test_every_file_a_load_reads_is_checked_before_it_is_unpickled(name, how, tmp_path, monkeypatch):
    """Before #42 only the shards' items were digested: a ``meta.pt`` re-saved with one more key resumed and
    trained. Now a byte changed in (or added to) ``meta.pt``, an RNG file or DCP's ``.metadata`` is refused naming
    the file, and nothing unpickles it first."""
    from lightning_2d.checkpoint import integrity

    path = save(tmp_path, "epoch=0-step=8.ckpt")
    file = path / name
    if how == "changed":
        change_byte(file)
    else:
        file.write_bytes(file.read_bytes() + b"\0")
    unpickled: list[str] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: unpickled.append(str(f)) or real_load(f, *a, **k))
    monkeypatch.setattr(integrity, "read_dcp_metadata", lambda folder: unpickled.append(".metadata"))
    with pytest.raises(CheckpointError) as err:
        one_process(path)
    message = str(err.value)
    assert "\n" not in message and "Not resuming from another checkpoint" in message
    if name == "rng/rank0.pt":  # found by the ranks' check, after the (intact) .metadata was read for the sizes
        assert f"its bytes changed after it was saved at step 8 ({name}: the whole file " in message, message
        assert unpickled == [".metadata"], unpickled
    else:  # found by rank 0 before anything is read
        assert f"is damaged ({name} changed after it was saved: it " in message, message
        assert unpickled == [], unpickled


def test_a_meta_pt_saved_again_with_another_key_is_refused(tmp_path):
    """The issue's case: ``meta.pt`` re-saved with one added key used to resume and train (exit 0)."""
    from lightning_2d.checkpoint.safe_load import load_checkpoint_file

    path = save(tmp_path, "epoch=0-step=8.ckpt")
    torch.save({**load_checkpoint_file(path / "meta.pt"), "added": 1}, path / "meta.pt")
    with pytest.raises(CheckpointError, match=r"is damaged \(meta\.pt changed after it was saved: it is [\d,]+ bytes"):
        one_process(path)


def test_a_damaged_manifest_is_refused_as_such_and_last_falls_back(tmp_path):
    older = save(tmp_path, "epoch=0-step=4.ckpt", seed=1)
    path = save(tmp_path, "last.ckpt")
    manifest = path / digests.MANIFEST_FILE
    intact = manifest.read_bytes()
    manifest.write_bytes(intact[: len(intact) // 2])  # cut short
    with pytest.raises(CheckpointError, match=r"is damaged \(digests\.json is unreadable \(JSONDecodeError: .*\): cut"
                                              r" short or overwritten, so it cannot vouch for the checkpoint's files\)"):
        one_process(path)
    # Parseable but not as written (one digest's hex digit changed): the manifest's own digest tells.
    first = json.loads(intact)["whole"]["meta.pt"][1]
    manifest.write_bytes(intact.replace(first.encode(), (first[:-1] + ("0" if first[-1] != "0" else "1")).encode()))
    with pytest.raises(CheckpointError, match=r"digests\.json is damaged: its content does not match its own digest"):
        one_process(path)
    warned: list[str] = []
    assert one_process(path, fall_back=True, warn=warned.append) == older
    assert "digests.json is damaged" in warned[0] and warned[0].endswith(f"instead: {older}")


def test_a_manifest_of_the_first_format_is_still_read(tmp_path):
    """Checkpoints of 0.x wrote ``lightning_2d.digests/1`` (items only, no whole files, no digest of itself)."""
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    manifest = json.loads((path / digests.MANIFEST_FILE).read_text())
    old = {"format": "lightning_2d.digests/1", "hash": manifest["hash"], "files": manifest["files"]}
    (path / digests.MANIFEST_FILE).write_text(json.dumps(old))
    assert one_process(path) == path
    flip_exponent_bits(path)
    with pytest.raises(CheckpointError, match="its bytes changed after it was saved at step 8"):
        one_process(path)


def test_a_shard_changed_after_the_launchers_check_is_checked_again_by_the_ranks(tmp_path, monkeypatch):
    """The launcher (``check_ckpt_path``) reads a checkpoint whole and the ranks skip what it checked; a shard written
    after that check (here: bits flipped in place, the manifest untouched) must not be skipped."""
    from lightning_2d.checkpoint import check_ckpt_path

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("NODE_RANK", raising=False)
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    launcher = Integrity()  # handed to the strategy whose rank 0 runs in the launching process
    assert check_ckpt_path(str(path), launcher) == path and launcher.checked_whole(path)
    flip_exponent_bits(path)
    assert not launcher.checked_whole(path)
    with pytest.raises(CheckpointError, match="its bytes changed after it was saved at step 8"):
        one_process(path, integrity=launcher)


def test_a_checkpoint_the_launcher_read_whole_is_not_read_again_by_the_ranks(tmp_path, monkeypatch):
    """The launcher's check (``check_ckpt_path``) and the load share one ``Integrity`` (the CLI hands its own to the
    strategy): the load re-reads none of the items the launcher read whole; another owner's load reads them all."""
    from lightning_2d.checkpoint import check_ckpt_path

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("NODE_RANK", raising=False)
    path = save(tmp_path, "epoch=0-step=8.ckpt")
    launcher = Integrity()
    assert check_ckpt_path(str(path), launcher) == path
    read: list[str] = []
    real_check = digests.check_items
    monkeypatch.setattr(digests, "check_items", lambda folder, items, *a: real_check(
        folder, [read.append(i.fqn) or i for i in items], *a))
    assert one_process(path, integrity=launcher) == path
    assert [name for name in read if name not in (".metadata", "meta.pt")] == []  # damage() reads those two only
    assert one_process(path) == path  # a load that was not handed the launcher's check
    assert WEIGHT in read
