"""What ``TextDataModule`` and ``ChatDataModule`` share: their common arguments' checks, the model's vocabulary
check, each data-parallel replica's sampler, a resumable training loader and the held-out loaders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_2d.data.loading import DataParallelSampler, ResumableDataLoader
from lightning_2d.data.sources import DataError


def common_problems(seq_len: int, batch_size: int, val_fraction: float,
                    max_unprepared_mb: Optional[float]) -> list[str]:
    """The problems of the arguments every data module here takes (each names the value)."""
    problems = []
    if seq_len < 1:
        problems.append(f"seq_len must be a positive integer, got {seq_len}")
    if batch_size < 1:
        problems.append(f"batch_size must be a positive integer, got {batch_size}")
    if not 0 <= val_fraction < 1:
        problems.append(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_unprepared_mb is not None and not max_unprepared_mb >= 0:
        problems.append(f"max_unprepared_mb must be >= 0 or None (no limit), got {max_unprepared_mb}")
    return problems


class DataParallelDataModule(L.LightningDataModule):
    """A data module whose replicas read different parts of every epoch's permutation and resume mid-epoch.

    A subclass sets ``batch_size``, ``seed``, ``shuffle``, ``num_workers``, ``train_dataset``, ``val_dataset`` and
    ``tokenizer``, and names what a too-small split lacks (``_add_more``: ``"text"``, ``"rows"``).
    """

    batch_size: int
    seed: int
    shuffle: bool
    num_workers: int
    train_dataset: Optional[Dataset]
    val_dataset: Optional[Dataset]
    _add_more = "text"
    _model_fix = "or use the tokenizer the model was made for"

    def __init__(self) -> None:
        super().__init__()
        self._data_parallel: Optional[tuple[int, int]] = None
        self.accumulate_grad_batches: Optional[int] = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size  # type: ignore[attr-defined]

    def check_trainer_model(self) -> None:
        """``check_model`` of the Trainer's LightningModule, when it says its vocabulary (``CausalLMModule``)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        vocab_size = getattr(module, "vocab_size", None)
        if isinstance(vocab_size, int):
            self.check_model(vocab_size)

    def check_model(self, model_vocab_size: int) -> None:
        """Refuse a model whose embedding cannot hold every token id."""
        vocab_size = self.vocab_size
        if model_vocab_size < vocab_size:
            raise DataError(
                f"The model's vocab_size ({model_vocab_size}) is smaller than the tokenizer's ({vocab_size});"
                f" set the model's vocab_size to at least {vocab_size} (e.g. model_overrides:"
                f" {{vocab_size: {vocab_size}}}) {self._model_fix}"
            )

    def set_data_parallel(self, num_replicas: int, rank: int, accumulate_grad_batches: int = 1) -> None:
        """Outside a Trainer (Fabric): this process's data-parallel replica (and the batches per optimizer step),
        e.g. ``data.set_data_parallel(**fabric.strategy.distributed_sampler_kwargs)``."""
        self._data_parallel = (int(num_replicas), int(rank))
        self.accumulate_grad_batches = int(accumulate_grad_batches)

    def _replicas(self) -> tuple[int, int]:
        if self._data_parallel is not None:
            return self._data_parallel
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _accumulate(self) -> int:
        if self.trainer is not None:
            return int(self.trainer.accumulate_grad_batches)
        return int(self.accumulate_grad_batches or 1)

    def _loader(self, dataset: Dataset, train: bool, targets: Optional[np.ndarray] = None,
                describe: Callable[[int], str] = lambda n: f"has {n} sequence(s)",
                count_key: str = "step_tokens") -> DataLoader:
        """``dataset``'s loader on this replica: resumable for training (with ``targets``, each sample's count of
        what the loss averages over: batches carry its sum over their optimizer step as ``count_key``,
        ``step_tokens`` for trained tokens), plain for the held-out splits."""
        replicas, rank = self._replicas()
        if len(dataset) < replicas * self.batch_size:  # type: ignore[arg-type]
            split = "training" if train else "validation"
            raise DataError(
                f"The {split} split {describe(len(dataset))}, fewer than one global batch"  # type: ignore[arg-type]
                f" ({replicas} data-parallel replica(s) × batch_size {self.batch_size}); add {self._add_more}, lower"
                f" seq_len or batch_size{', or raise val_fraction' if not train else ''}"
            )
        sampler = DataParallelSampler(len(dataset), replicas, rank, shuffle=self.shuffle and train,  # type: ignore[arg-type]
                                      seed=self.seed)
        kwargs: dict[str, Any] = dict(
            batch_size=self.batch_size,
            sampler=sampler,
            # Its own generator: creating an iterator would otherwise draw from the global RNG and
            # shift the model's random stream (dropout) between a run and its resumption.
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        if not train:  # only training needs to resume mid-epoch
            return DataLoader(dataset, **kwargs)
        consumed = epoch = None
        if self.trainer is not None:
            trainer = self.trainer
            # Batches of this epoch whose training step ran, and completed epochs: both restored from
            # the checkpoint on resume.
            consumed = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed  # noqa: E731
            epoch = lambda: trainer.current_epoch  # noqa: E731
        return ResumableDataLoader(dataset, consumed_batches=consumed, epoch=epoch, targets=targets,
                                   accumulate=self._accumulate if targets is not None else None, count_key=count_key,
                                   **kwargs)

    def _eval_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            raise DataError("val_fraction=0 leaves no held-out split; set val_fraction > 0 to validate or test")
        return self._loader(self.val_dataset, train=False)

    def val_dataloader(self) -> Any:
        return self._eval_dataloader() if self.val_dataset is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_dataloader()
