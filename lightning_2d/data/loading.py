"""From the token cache to batches: packed windows (``TokenWindows``), a data-parallel sampler whose global
batch sequence does not depend on the number of replicas (``DataParallelSampler``), and a DataLoader that
checkpoints how far into the epoch it is and resumes there (``ResumableDataLoader``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's position in its document: ``0`` at the window's start and after every ``eos_id``.

    A packed window holds the end of one document, whole documents and the start of another, separated by
    end-of-text tokens (the end-of-text token closes its document). With these positions the model restarts
    rotary positions at each document and attends only within it (``document_causal_mask``).
    """
    length = input_ids.shape[-1]
    index = torch.arange(length)
    starts = torch.zeros(input_ids.shape, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = input_ids[..., :-1] == eos_id
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


class TokenWindows(Dataset):
    """Windows ``[i·seq_len, i·seq_len + seq_len + 1)`` of a token file, as ``{"input_ids", "labels"}``.

    With ``eos_id`` (document masking) each window also carries ``position_ids``: every token's position in
    its document (``document_positions``). The memory map is opened lazily in each process (DataLoader
    workers included).
    """

    def __init__(self, folder: Path, seq_len: int, first: int, count: int, eos_id: Optional[int] = None) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.path, self.dtype = folder / "tokens.bin", np.dtype(meta["dtype"])
        self.seq_len, self.first, self.count = seq_len, first, count
        self.eos_id = eos_id
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = (self.first + index) * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        sample = {"input_ids": window[:-1], "labels": window[1:]}
        if self.eos_id is not None:
            sample["position_ids"] = document_positions(sample["input_ids"], self.eos_id)
        return sample

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


# ---- sampling ---------------------------------------------------------------------------------
class DataParallelSampler(DistributedSampler):
    """Every epoch one seeded permutation of all samples; replica ``r`` takes positions ``r, r+R, …``.

    Step ``i``'s batches of all replicas together are positions ``[i·B·R, (i+1)·B·R)`` of the
    permutation, whatever ``R``: the global batch sequence is the same for every data-parallel
    size with the same global batch. A ``DistributedSampler``, so Lightning keeps it (and calls
    ``set_epoch``). ``resume(epoch, consumed)`` skips the first ``consumed`` positions once, when
    that epoch is iterated.
    """

    def __init__(
        self, num_samples: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0
    ) -> None:
        super().__init__(
            range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.num_positions = num_samples - num_samples % num_replicas
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, consumed: int) -> None:
        self._resume = (epoch, consumed)

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self.epoch:
            return min(self._resume[1], self.num_positions)
        return 0

    def epoch_order(self) -> torch.Tensor:
        """This epoch's order of all samples (every replica's, before the resume skip)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return torch.arange(n)

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        self._resume = None
        order = self.epoch_order()
        return iter(order[start + self.rank : self.num_positions : self.num_replicas].tolist())

    def __len__(self) -> int:
        # The whole epoch, also when resuming inside it: Lightning sizes the epoch once from this
        # and counts the batches already done (restored from the checkpoint) against it.
        return self.num_positions // self.num_replicas


class ResumableDataLoader(DataLoader):
    """A DataLoader whose ``state_dict`` records the samples of the current epoch consumed so far.

    Lightning saves it in checkpoints and restores it before iterating (its stateful data-loader
    support).

    Args:
        consumed_batches: How many batches of this epoch were trained on. Lightning fetches a batch
            ahead, so counting yielded batches would skip one on resume.
        epoch: The epoch being iterated, read when an iteration starts. Lightning's own
            ``set_epoch`` value runs one ahead after resuming from a checkpoint saved at an epoch's
            end (it passes the number of *processed* epochs), which would skip a permutation; the
            number of *completed* epochs (``trainer.current_epoch``) is right in every case.
        targets: Each sample's count of what the loss averages over (trained tokens of a chat window, pairs of a
            preference window): every batch then carries, under ``count_key``, the sum over the batches of its
            optimizer step (``_step_counts``), a float 0-dim tensor.
        accumulate: The batches one optimizer step accumulates, read when an iteration starts.
        count_key: The batch key of that sum (``"step_tokens"``; ``"step_pairs"`` for preference pairs).
    """

    def __init__(
        self,
        *args: Any,
        consumed_batches: Optional[Callable[[], int]] = None,
        epoch: Optional[Callable[[], int]] = None,
        targets: Optional[np.ndarray] = None,
        accumulate: Optional[Callable[[], int]] = None,
        count_key: str = "step_tokens",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, DataParallelSampler):
            raise TypeError("ResumableDataLoader needs a DataParallelSampler")
        self._consumed_batches = consumed_batches
        self._epoch = epoch
        self._targets, self._accumulate, self._count_key = targets, accumulate, count_key
        self._yielded = 0
        self._offset = 0  # positions skipped by a resume in the epoch being iterated

    def __iter__(self) -> Iterator[Any]:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        if self._epoch is not None:
            sampler.set_epoch(self._epoch())
        self._offset, self._yielded = sampler._start(), 0
        step_counts = self._step_counts(sampler) if self._targets is not None else None
        first = self._offset // (self.batch_size * sampler.num_replicas)
        for batch in super().__iter__():
            if step_counts is not None:
                batch[self._count_key] = torch.tensor(float(step_counts[first + self._yielded]))
            self._yielded += 1
            yield batch

    def _step_counts(self, sampler: DataParallelSampler) -> np.ndarray:
        """For each batch of this replica's epoch, the targets of all its batches that one optimizer step
        accumulates (``accumulate()`` batches from the epoch's start, the last step with what is left): what the
        loss divides by, summed over the replicas, so accumulated steps weigh every token (or pair) alike."""
        assert self._targets is not None and self.batch_size is not None
        accumulate = max(1, int(self._accumulate() if self._accumulate is not None else 1))
        mine = sampler.epoch_order()[sampler.rank : sampler.num_positions : sampler.num_replicas].numpy()
        batches = len(mine) // self.batch_size
        per_batch = self._targets[mine[: batches * self.batch_size]].reshape(batches, self.batch_size).sum(1)
        if batches == 0:
            return per_batch
        per_step = np.add.reduceat(per_batch, np.arange(0, batches, accumulate))
        return per_step[np.arange(batches) // accumulate]

    def state_dict(self) -> dict[str, Any]:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        global_batch = self.batch_size * sampler.num_replicas
        if self._consumed_batches is not None:
            consumed = self._consumed_batches() * global_batch
        else:
            consumed = self._offset + self._yielded * global_batch
        return {"epoch": sampler.epoch, "consumed_samples": consumed, "seed": sampler.seed, "shuffle": sampler.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        sampler.set_epoch(int(state["epoch"]))  # a Fabric loop continues from the sampler's epoch
        sampler.resume(int(state["epoch"]), int(state["consumed_samples"]))
