"""The checkpoint part of the 2D strategies: a Lightning ``CheckpointIO`` that every rank calls.

Lightning's ``ModelParallelStrategy`` writes its sharded checkpoints beside its ``CheckpointIO``; ours go
through one, ``DistributedCheckpointIO``, so the job has Lightning's extension point and can be tested
alone. Unlike a plain ``CheckpointIO`` (called on rank 0), each of its methods is called on every rank:

- ``save_checkpoint`` (Lightning's checkpoint dict) and ``save`` (tensors and metadata, as Fabric splits
  them) write a sharded folder (DCP, optionally in the background) or a full file, complete or recognisably
  incomplete (``checkpoint.writer``);
- ``resolve`` picks what to load (falling back from an incomplete or changed "last" checkpoint,
  ``checkpoint.resolution``), has the ranks check its digests together before anything is read (its
  ``integrity``: what was read whole is not read again), then reads its non-tensor part weights-only (a
  pickled callable is refused there, in one line, before any tensor is read), ``check_fits``
  refuses a checkpoint of another model before anything is loaded, ``restore_random_state`` follows a
  load at the same layout;
- ``remove_checkpoint`` and ``teardown`` wait for the write in flight.

Under LoRA a checkpoint holds part of the model (``trained_subset``: the adapters, their record), which the strategy
sets once it converted the model (``parallel.converters``): ``save_checkpoint`` and ``state_dicts`` keep that part,
``adapters_to_load`` checks a checkpoint's record against it before anything is read and ``load_trained`` reads the
part a checkpoint holds, for the Trainer's and Fabric's save and resume alike.

Every state-dict path, save and load, of both strategies runs through ``state_dict_call`` (Fabric's save state
through ``state_dicts``), the one place that enters the FSDP backend's ``state_access()``: torch's state-dict APIs
``getattr`` down to every parameter, and a backend whose parameters are gathered on use would gather there.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_2d._compat import is_stateful
from lightning_2d.checkpoint.dcp_metadata import shape_mismatches, stored_shapes
from lightning_2d.checkpoint.errors import CheckpointError
from lightning_2d.checkpoint.integrity import Integrity
from lightning_2d.checkpoint.names import METADATA_FILE
from lightning_2d.checkpoint.resolution import may_fall_back, resolve_and_check
from lightning_2d.checkpoint.rng import restore_random_state
from lightning_2d.checkpoint.safe_load import check_weights_only, load_checkpoint_file
from lightning_2d.checkpoint.subset import (
    ADAPTERS_KEY,
    TrainedSubset,
    adapter_record,
    check_adapter_record,
    load_trained_subset,
)
from lightning_2d.checkpoint.writer import make_writer, remove_path, save_full_checkpoint
from lightning_2d.parallel.modules import canonical_name

T = TypeVar("T")


class DistributedCheckpointIO(CheckpointIO):
    """Sharded or full checkpoints of a 2D-parallel model; create on every rank once the process group exists.

    Args:
        global_rank, world_size: This process's place in the job.
        barrier, broadcast: The strategy's collectives (``broadcast(obj)`` from rank 0).
        sharded: One shard per rank (DCP) or a full file assembled on rank 0.
        async_save: Write sharded checkpoints in a background thread.
        layout: What a checkpoint records of the current layout (``checkpoint.rng.layout_of``).
        integrity: The digest checks of checkpoints made so far and kept making (the strategy's
            ``checkpoint_integrity``, which the CLI's check of ``--ckpt_path`` fills); ``None``: its own.
        state_access: The FSDP backend's ``state_access`` (``FSDPBackend``): entered around every state-dict path.
    """

    def __init__(
        self,
        global_rank: int,
        world_size: int,
        barrier: Callable[[], None],
        broadcast: Callable[[Any], Any],
        sharded: bool,
        async_save: bool,
        layout: dict[str, Any],
        integrity: Optional[Integrity] = None,
        state_access: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.global_rank, self.world_size = global_rank, world_size
        self.state_access = state_access
        self.integrity = integrity if integrity is not None else Integrity()
        self.barrier, self.broadcast = barrier, broadcast
        self.sharded, self.layout = sharded, layout
        self.writer = make_writer(global_rank, barrier, sharded, async_save)
        #: What a checkpoint of the model holds when not all of it (LoRA's adapters and their record:
        #: ``checkpoint.subset.TrainedSubset``), set by the strategy once the model is converted; ``None``: all of it.
        self.trained_subset: Optional[TrainedSubset] = None

    # ---- the model's and optimizers' state ----------------------------------------------------------
    def state_dict_call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, a state-dict path (torch's state-dict APIs, or Lightning's strategy methods and
        loaders over them), with every parameter read as a module attribute the stored shard (the FSDP backend's
        ``state_access``), never a gather: a collective the ranks would not all join in the same order."""
        with self.state_access():
            return fn(*args, **kwargs)

    def state_dicts(self, state: dict[str, Any], module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        """Fabric's save state split as ``save`` takes it: the tensors (``module``'s state dict under its key, each
        optimizer's over ``module`` under its own; sharded, or full on rank 0, on CPU) and the metadata (every other
        object's ``state_dict()``, or the object). Under ``trained_subset`` the module's tensors are that part and the
        metadata holds its record."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.optim import Optimizer

        options = StateDictOptions(full_state_dict=not self.sharded, cpu_offload=True)

        def split() -> tuple[dict[str, Any], dict[str, Any]]:
            tensors: dict[str, Any] = {}
            metadata: dict[str, Any] = {}
            for key, obj in state.items():
                if isinstance(obj, nn.Module):
                    tensors[key] = get_model_state_dict(obj, options=options)
                    if self.trained_subset is not None:
                        tensors[key] = self.trained_subset.state_dict(tensors[key])
                        metadata[ADAPTERS_KEY] = self.trained_subset.record
                elif isinstance(obj, Optimizer):
                    tensors[key] = get_optimizer_state_dict(module, obj, options=options)
                else:
                    metadata[key] = obj.state_dict() if is_stateful(obj) else obj
            return tensors, metadata

        return self.state_dict_call(split)

    # ---- save -------------------------------------------------------------------------------------
    def path_to_save(self, path: Any, storage_options: Optional[Any] = None) -> Path:
        """Rank 0's path (every rank writes into one folder); refuses Lightning's cloud options."""
        if storage_options is not None:
            raise TypeError("save_checkpoint(..., storage_options=...) is not supported by the 2D strategies")
        return Path(self.broadcast(str(path)))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's checkpoint dict: ``state_dict`` and ``optimizer_states`` are the tensors, the rest metadata
        (under ``trained_subset``: that part of the model's state, and its record)."""
        path = self.path_to_save(path, storage_options)
        if self.trained_subset is not None:
            self.trained_subset.apply(checkpoint, "state_dict")
        if not self.sharded:
            self.save(checkpoint, {}, path)
            return
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{idx}"] = optim_state
        self.save(tensors, checkpoint, path)

    def save(self, tensors: dict[str, Any], metadata: dict[str, Any], path: Path) -> None:
        """``tensors`` (state dicts, sharded or already full) and ``metadata`` into ``path``, with the layout."""
        metadata.setdefault("lightning_2d", {})["layout"] = self.layout
        if self.sharded:
            self.writer.save(tensors, metadata, path)
            return
        self.writer.wait()
        save_full_checkpoint({**tensors, **metadata}, path, self.global_rank, self.world_size, self.barrier)

    def wait(self) -> None:
        """Until the write in flight (if any) is complete on disk; its error is raised here."""
        self.writer.wait()

    # ---- load -------------------------------------------------------------------------------------
    def resolve(self, path: Any, prefixes: Optional[tuple[str, ...]] = None) -> Path:
        """``path`` if complete and intact, its digests checked by all ranks together (``prefixes``: only the
        items the load reads), else an error naming it; only a "last" checkpoint (``ckpt_path="last"`` resolves
        to ``last*.ckpt``) falls back to the newest intact one."""
        self.wait()
        chosen = resolve_and_check(
            path, self.global_rank, self.world_size, self.broadcast, self._all_gather, rank_zero_warn,
            fall_back=may_fall_back(path), prefixes=prefixes, integrity=self.integrity,
        )
        self.read_metadata(chosen)  # every rank raises the same one-line refusal for a file that would run code
        return chosen

    def read_metadata(self, path: Path) -> dict[str, Any]:
        """The non-tensor part of checkpoint ``path`` (a folder's ``meta.pt``; a full file, its tensors mapped, not
        read), weights-only (``load_checkpoint_file``).

        Raises:
            UnsafeCheckpointError: the file holds a pickled object that could run code; nothing in it was built.
        """
        path = Path(path)
        if path.is_dir():
            return load_checkpoint_file(path / METADATA_FILE)
        return load_checkpoint_file(path, mmap=True)

    def _all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return [obj]
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, obj)
        return parts

    @override
    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The non-tensor part of a checkpoint (a sharded folder's ``meta.pt``, or a whole full file); the
        strategies load tensors in place (DCP), into the model and optimizers they hold."""
        check_weights_only(weights_only, path)
        return self.read_metadata(self.resolve(path))

    def adapters_to_load(self, path: Path, record: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        """The adapters record of the checkpoint at ``path`` (a sharded folder's, or ``record`` when given: a full
        file's), ``None`` for a checkpoint of the whole model; a record of adapters that do not belong to this run
        (other settings, another base, or no adapters here: ``trained_subset``) is refused now, on every rank, before
        any tensor is read."""
        if record is None:
            record = adapter_record(path) if Path(path).is_dir() else None
        if record is not None:
            check_adapter_record(record, self.trained_subset, path)
        return record

    def load_trained(self, path: Path, key: str, module: nn.Module, optimizers: dict[str, Any]) -> dict[str, Any]:
        """Load a sharded checkpoint of part of ``module`` (LoRA's adapters, ``adapters_to_load``): the tensors it holds
        under ``key`` and each optimizer's state under its own key (``checkpoint.subset.load_trained_subset``); return
        its metadata."""
        return self.state_dict_call(load_trained_subset, path, key, module, optimizers)

    def check_fits(self, path: Path, key: str, module: nn.Module, strict: bool = True, pipelined: bool = False,
                   trained_only: bool = False) -> None:
        """Refuse, on every rank and before anything is loaded, a checkpoint whose tensors under ``key``
        do not fit ``module`` (another model size, fewer layers): quoting both shapes. Rank 0 reads the
        metadata; every rank raises the same error. ``pipelined``: each rank holds some stages, the model
        is the union of every rank's tensors. ``trained_only``: the checkpoint holds the parameters that require
        gradients (LoRA's adapters), checked against those."""
        problems: Any = None
        expected: dict[str, tuple[int, ...]] = {}
        if self.global_rank == 0 or pipelined:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            # The names DCP saved under (wrapper prefixes of AC/compile removed); DTensors give full shapes.
            state = self.state_dict_call(get_model_state_dict, module)
            expected = {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}
            if trained_only:
                trained = {canonical_name(n) for n, p in module.named_parameters() if p.requires_grad}
                expected = {name: shape for name, shape in expected.items() if name in trained}
        if pipelined:
            import torch.distributed as dist

            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(parts, expected)
            expected = {name: shape for part in parts for name, shape in part.items()}
        if self.global_rank == 0:
            try:
                problems = shape_mismatches(stored_shapes(path, key), expected, strict=strict)
            except Exception as err:  # metadata unreadable: resolve() reported damage already
                problems = [f"its metadata cannot be read ({type(err).__name__}: {err})"]
        problems = self.broadcast(problems)
        if problems:
            raise CheckpointError(
                f"Checkpoint {path} does not fit the model {type(module).__name__} ({len(problems)} problem(s)):\n  - "
                + "\n  - ".join(problems[:12]) + ("\n  - …" if len(problems) > 12 else "")
                + "\nLoad it into the model it was saved from (its model args/config are in the checkpoint)."
            )

    def restore_random_state(self, path: Path, saved: Optional[dict[str, Any]]) -> None:
        """After a load: this rank's RNG if the layout is the one saved, else a note that it is not restored."""
        restore_random_state(path, saved or {}, self.layout, self.global_rank, rank_zero_info)

    # ---- remove, teardown -------------------------------------------------------------------------
    @override
    def remove_checkpoint(self, path: Any) -> None:
        """``ModelCheckpoint`` removes an older checkpoint right after saving a newer one: never before the
        newer one is complete on disk (rank 0's write completes after every rank's)."""
        self.wait()
        if self.global_rank == 0:
            remove_path(Path(path))

    @override
    def teardown(self) -> None:
        self.wait()
