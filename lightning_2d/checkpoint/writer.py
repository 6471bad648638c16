"""Writing checkpoints that are complete or recognisably incomplete, never half-valid.

A sharded checkpoint (``ShardedCheckpointWriter``) is written by DCP into a fresh folder, each item hashed as it is
written (``digests.digesting_writer``), each rank's RNG beside its shard, and rank 0's ``meta.pt`` last, once every
shard is on disk: its presence marks the checkpoint complete (``discovery.is_complete``). A full file
(``save_full_file``) is written under a temporary name and renamed, its tensors' digests inside it.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_2d.checkpoint.digests import FULL_FILE_KEY, digesting_writer, file_digest, tensor_digests
from lightning_2d.checkpoint.names import METADATA_FILE
from lightning_2d.checkpoint.rng import rng_state, save_rng


def save_full_file(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: the file exists only once complete. The digest of every
    tensor goes in with them (``lightning_2d.digests``), checked before the file is loaded."""
    tmp = path.with_name(f".{path.name}.incomplete")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    ours = {**checkpoint.get("lightning_2d", {}), FULL_FILE_KEY: tensor_digests(checkpoint)}
    torch.save({**checkpoint, "lightning_2d": ours}, tmp)
    os.replace(tmp, path)


class ShardedCheckpointWriter:
    """Writes sharded checkpoints with DCP, synchronously or in a background thread.

    Async: ``dcp.async_save`` first copies the state to its own CPU buffers (so the next optimizer
    step cannot change what is written), then writes in a thread; its collectives run on a
    dedicated gloo group so they never interleave with training collectives. ``meta.pt`` (the
    completeness mark) is written by rank 0 only when every rank's shard is on disk. At most one
    save is in flight: the next save, a checkpoint removal, or the end of training waits for it.

    Args:
        global_rank: This process's rank.
        barrier: The strategy's barrier.
        async_save: Write in the background.
        process_group: Group for the background collectives (a gloo group) when ``async_save``.
    """

    def __init__(
        self,
        global_rank: int,
        barrier: Callable[[], None],
        async_save: bool = False,
        process_group: Any = None,
    ) -> None:
        self.global_rank = global_rank
        self.barrier = barrier
        self.async_save = async_save
        self.process_group = process_group
        self._pending: Optional[Future] = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on disk; re-raise its error here."""
        with self._lock:
            future, self._pending = self._pending, None
        if future is not None:
            future.result()

    def save(self, state: dict[str, Any], metadata: dict[str, Any], path: Path) -> None:
        """Write ``state`` (tensors, sharded) and ``metadata`` (rank 0's ``meta.pt``) into folder ``path``."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        if self.global_rank == 0:
            # Never leave an old .metadata/meta.pt beside new shards: the folder would look complete.
            remove_path(path)
            path.mkdir(parents=True)
        self.barrier()
        whole_files = save_rng(path, self.global_rank)
        # Serialize now: the objects behind the metadata may change while a background save runs.
        buffer = io.BytesIO()
        if self.global_rank == 0:
            torch.save(metadata, buffer)
            whole_files[METADATA_FILE] = file_digest(buffer.getvalue())  # listed before it is written, last

        def finish() -> None:
            if self.global_rank == 0:
                tmp = path / f".{METADATA_FILE}.incomplete"
                tmp.write_bytes(buffer.getvalue())
                os.replace(tmp, path / METADATA_FILE)  # the completeness mark, last

        # The writer hashes each item as it writes it and writes digests.json (with every rank's whole files and
        # DCP's .metadata) after .metadata, before meta.pt.
        writer = digesting_writer(path, whole_files)
        if not self.async_save:
            dcp.save(state, checkpoint_id=path, storage_writer=writer)
            finish()
            self.barrier()
            return
        upload = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=self.process_group)
        if not isinstance(upload, Future):  # an AsyncSaveResponse (non-blocking staging)
            upload = upload.upload_completion
        done: Future = Future()

        def on_upload(f: Future) -> None:
            # Runs in the writer thread: rank 0's upload completes only after every rank's shard and
            # DCP's .metadata are written, so the mark can follow at once.
            try:
                f.result()
                finish()
                done.set_result(path)
            except BaseException as err:  # noqa: BLE001 - handed to wait() on the training thread
                done.set_exception(err)

        upload.add_done_callback(on_upload)
        with self._lock:
            self._pending = done


def make_writer(global_rank: int, barrier: Callable[[], None], sharded: bool, async_save: bool) -> ShardedCheckpointWriter:
    """The strategies' checkpoint writer; call on every rank after the process group exists.

    Background writes get their own gloo group: their collectives must never interleave with the
    training collectives on the default group.
    """
    import torch.distributed as dist

    group = dist.new_group(backend="gloo") if async_save and sharded else None
    return ShardedCheckpointWriter(global_rank, barrier, async_save=group is not None, process_group=group)


def save_full_checkpoint(checkpoint: dict[str, Any], path: Path, global_rank: int, world_size: int,
                         barrier: Callable[[], None]) -> None:
    """A full single-file checkpoint (tensors already gathered): every rank's RNG in it, written by rank 0."""
    import torch.distributed as dist

    rng: list[Any] = [None] * world_size
    dist.all_gather_object(rng, rng_state())
    checkpoint.setdefault("lightning_2d", {})["rng"] = rng
    if global_rank == 0:
        save_full_file(checkpoint, path)
    barrier()


def remove_path(path: Path) -> None:
    """Delete a checkpoint (a file, a link, or a folder with all it holds); nothing if it is gone."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
