"""Text data: sources → tokens cached on disk → packed windows → data-parallel, resumable batches.

The corpus is tokenized once into a flat token file (``uint16``/``uint32``) under ``cache_dir``,
keyed by the sources (path, size, mtime), the tokenizer and the text field, and memory-mapped
afterwards: a multi-GB corpus costs neither RAM nor a second tokenization. The token stream is cut
into windows of ``seq_len + 1`` tokens that overlap by one (the last input token of a window is the
first label of the next), documents separated by the tokenizer's end-of-text token.

Batches: each data-parallel replica reads a different part of every epoch's permutation and the
ranks of a tensor-parallel group the same batch (the sampler is built from the strategy's
``distributed_sampler_kwargs``, which the 2D strategy derives from the data-parallel sub-mesh).
The training loader is stateful: checkpoints record how many samples of the current epoch were
consumed, and a resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from glob import glob
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_2d.tokenizers import Tokenizer, load_tokenizer

CACHE_FORMAT = 1
#: Text of plain files is tokenized in pieces of about this many characters (split at newlines).
TEXT_CHUNK_CHARS = 1 << 20
DEFAULT_CACHE_DIR = Path(os.environ.get("LIGHTNING_2D_CACHE", Path.home() / ".cache" / "lightning_2d"))


class DataError(ValueError):
    """Bad data input: names the file or value and what to do."""


# ---- sources ----------------------------------------------------------------------------------
def stdlib_sources() -> list[Path]:
    """The Python standard library's own ``.py`` files (tens of MB of real text on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return [p for p in sorted(root.rglob("*.py")) if not skip.intersection(p.relative_to(root).parts)]


def resolve_sources(paths: Union[str, list[str], None]) -> list[Path]:
    """Expand files, directories (every file below) and globs (``**`` allowed) into a sorted file list."""
    if paths is None:
        return stdlib_sources()
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise DataError("TextDataModule(paths=[]) names no files; give paths or globs, or None for the built-in corpus")
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob(expanded, recursive=True)) if any(c in expanded for c in "*?[") else [expanded]
        found = []
        for match in map(Path, matches):
            if match.is_dir():
                found.extend(sorted(p for p in match.rglob("*") if p.is_file()))
            elif match.is_file():
                found.append(match)
        if not found:
            raise DataError(f"No files matched {pattern!r} (relative to {Path.cwd()})")
        files.extend(found)
    return list(dict.fromkeys(p.resolve() for p in files))  # keep order, drop duplicates


def _split_text(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = text.find("\n", start + TEXT_CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def iter_documents(path: Path, text_field: str, strict: bool = True) -> Iterator[list[str]]:
    """Yield each document of ``path`` as a list of text pieces (one piece unless the text is large).

    JSONL (``.jsonl``/``.ndjson``) and Parquet (``.parquet``) give one document per record from
    ``text_field``; any other file is one UTF-8 document. ``strict=False`` skips empty and
    non-UTF-8 files instead of raising (for the built-in corpus, which has both).
    """
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            yield from _iter_jsonl(path, text_field)
        elif suffix == ".parquet":
            yield from _iter_parquet(path, text_field)
        else:
            raw = path.read_bytes()
            if not raw.strip():
                if strict:
                    raise DataError(f"{path} is empty; remove it from paths")
                return
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                if strict:
                    raise DataError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); convert or remove it") from None
                return
            yield list(_split_text(text))
    except OSError as err:
        raise DataError(f"Cannot read {path}: {err.strerror or err}") from err


def _iter_jsonl(path: Path, text_field: str) -> Iterator[list[str]]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no} is not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{line_no} has no field {text_field!r} (found {keys}); set text_field")
            yield [str(record[text_field])]


def _iter_parquet(path: Path, text_field: str) -> Iterator[list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"Reading {path} needs pyarrow: pip install pyarrow") from err
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise DataError(f"Cannot read {path} as Parquet: {err}") from err
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path} has no column {text_field!r} (columns: {columns}); set text_field")
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield [str(text)]


# ---- token cache ------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def cache_key(sources: list[Path], tokenizer: Tokenizer, text_field: str) -> str:
    h = hashlib.sha256(f"v{CACHE_FORMAT}|{tokenizer.fingerprint}|{text_field}".encode())
    for path in sources:
        stat = path.stat()
        h.update(f"|{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def build_token_cache(
    sources: list[Path], tokenizer: Tokenizer, cache_dir: Path, text_field: str = "text", strict: bool = True
) -> Path:
    """Tokenize ``sources`` into ``cache_dir/<key>/tokens.bin`` unless that cache exists; return its folder.

    The token file and then ``meta.json`` are written under temporary names and renamed into
    place, so an interrupted run never leaves a cache that looks complete.
    """
    folder = Path(cache_dir).expanduser() / cache_key(sources, tokenizer, text_field)
    if (folder / "meta.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = folder / f"tokens.bin.tmp-{os.getpid()}"
    n_tokens = n_docs = 0
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    with tmp.open("wb") as out:
        for path in sources:
            for pieces in iter_documents(path, text_field, strict=strict):
                ids = [i for piece_ids in tokenizer.encode_batch(pieces) for i in piece_ids] + eos
                np.asarray(ids, dtype=dtype).tofile(out)
                n_tokens += len(ids)
                n_docs += 1
    os.replace(tmp, folder / "tokens.bin")
    meta = {
        "format": CACHE_FORMAT,
        "num_tokens": n_tokens,
        "num_documents": n_docs,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.fingerprint,
        "text_field": text_field,
        "sources": [str(p) for p in sources[:1000]],
        "num_sources": len(sources),
    }
    tmp_meta = folder / f"meta.json.tmp-{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, folder / "meta.json")
    return folder


class TokenWindows(Dataset):
    """Windows ``[i·seq_len, i·seq_len + seq_len + 1)`` of a token file, as ``{"input_ids", "labels"}``.

    The memory map is opened lazily in each process (DataLoader workers included).
    """

    def __init__(self, folder: Path, seq_len: int, first: int, count: int) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.path, self.dtype = folder / "tokens.bin", np.dtype(meta["dtype"])
        self.seq_len, self.first, self.count = seq_len, first, count
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = (self.first + index) * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

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

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.num_positions = num_samples - num_samples % num_replicas
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, consumed: int) -> None:
        self._resume = (epoch, consumed)

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self.epoch:
            return min(self._resume[1], self.num_positions)
        return 0

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        self._resume = None
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(n)
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
    """

    def __init__(
        self,
        *args: Any,
        consumed_batches: Optional[Callable[[], int]] = None,
        epoch: Optional[Callable[[], int]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, DataParallelSampler):
            raise TypeError("ResumableDataLoader needs a DataParallelSampler")
        self._consumed_batches = consumed_batches
        self._epoch = epoch
        self._yielded = 0
        self._offset = 0  # positions skipped by a resume in the epoch being iterated

    def __iter__(self) -> Iterator[Any]:
        sampler: DataParallelSampler = self.sampler  # type: ignore[assignment]
        if self._epoch is not None:
            sampler.set_epoch(self._epoch())
        self._offset, self._yielded = sampler._start(), 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

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


# ---- the data module --------------------------------------------------------------------------
class TextDataModule(L.LightningDataModule):
    """Real text for ``LlamaLightningModule``: tokenized once, cached, packed, data-parallel and resumable.

    Args:
        paths: Text files, directories and globs; ``.jsonl``/``.ndjson`` and ``.parquet`` files are
            read record by record from ``text_field``. ``None``: the Python standard library's
            source files (no download).
        tokenizer: ``"byte"`` (UTF-8 bytes, vocabulary 256), a Hugging Face ``tokenizer.json``, or a
            SentencePiece ``.model``.
        eos_token: End-of-text token of a Hugging Face tokenizer, when it is not a common one.
        text_field: Field/column holding the text in JSONL/Parquet files.
        seq_len: Tokens per training sequence.
        batch_size: Sequences per batch on each data-parallel replica.
        val_fraction: Fraction of the windows held out (from the end of the corpus) for validation
            (also used by ``test`` and ``predict``); ``0`` for none.
        shuffle: Shuffle training windows (a new seeded permutation every epoch).
        seed: Seed of the permutations.
        num_workers: DataLoader worker processes.
        cache_dir: Where the token cache lives (default ``$LIGHTNING_2D_CACHE`` or
            ``~/.cache/lightning_2d``).
    """

    def __init__(
        self,
        paths: Union[str, list[str], None] = None,
        tokenizer: str = "byte",
        eos_token: Optional[str] = None,
        text_field: str = "text",
        seq_len: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.005,
        shuffle: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        problems = []
        if seq_len < 1:
            problems.append(f"seq_len must be a positive integer, got {seq_len}")
        if batch_size < 1:
            problems.append(f"batch_size must be a positive integer, got {batch_size}")
        if not 0 <= val_fraction < 1:
            problems.append(f"val_fraction must be in [0, 1), got {val_fraction}")
        if problems:
            raise DataError("Invalid TextDataModule arguments:\n  - " + "\n  - ".join(problems))
        self.paths, self.text_field = paths, text_field
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
        self.tokenizer = load_tokenizer(tokenizer, eos_token)  # fails here, before any process starts
        self._sources: list[Path] | None = None
        self._folder: Path | None = None
        self._data_parallel: tuple[int, int] | None = None
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: TokenWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def sources(self) -> list[Path]:
        if self._sources is None:
            self._sources = resolve_sources(self.paths)
        return self._sources

    def check_model(self, model_vocab_size: int) -> None:
        """Refuse a model whose embedding cannot hold every token id."""
        if model_vocab_size < self.vocab_size:
            raise DataError(
                f"The model's vocab_size ({model_vocab_size}) is smaller than the tokenizer's ({self.vocab_size});"
                f" set the model's vocab_size to at least {self.vocab_size} (e.g. model_overrides:"
                f" {{vocab_size: {self.vocab_size}}}) or use the tokenizer the model was made for"
            )

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node, then makes the others wait.
        build_token_cache(self.sources, self.tokenizer, self.cache_dir, self.text_field, strict=self.paths is not None)

    def setup(self, stage: str | None = None) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        model_args = getattr(module, "model_args", None)
        if model_args is not None:
            self.check_model(model_args.vocab_size)
        if self.train_dataset is not None:
            return
        self._folder = build_token_cache(
            self.sources, self.tokenizer, self.cache_dir, self.text_field, strict=self.paths is not None
        )
        meta = json.loads((self._folder / "meta.json").read_text())
        windows = (meta["num_tokens"] - 1) // self.seq_len
        if windows < 1:
            raise DataError(
                f"The corpus has {meta['num_tokens']} tokens, fewer than one sequence needs ({self.seq_len + 1});"
                f" add text or lower seq_len"
            )
        n_val = max(1, round(windows * self.val_fraction)) if self.val_fraction > 0 else 0
        if windows - n_val < 1:
            raise DataError(
                f"The corpus gives {windows} sequence(s) of {self.seq_len} tokens, too few for a training split and a"
                f" validation split; add text, lower seq_len or set val_fraction=0"
            )
        self.train_dataset = TokenWindows(self._folder, self.seq_len, 0, windows - n_val)
        self.val_dataset = TokenWindows(self._folder, self.seq_len, windows - n_val, n_val) if n_val else None

    def set_data_parallel(self, num_replicas: int, rank: int) -> None:
        """Outside a Trainer (Fabric): this process's data-parallel replica, e.g.
        ``data.set_data_parallel(**fabric.strategy.distributed_sampler_kwargs)``."""
        self._data_parallel = (int(num_replicas), int(rank))

    def _replicas(self) -> tuple[int, int]:
        if self._data_parallel is not None:
            return self._data_parallel
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _loader(self, dataset: TokenWindows, shuffle: bool) -> DataLoader:
        replicas, rank = self._replicas()
        if len(dataset) < replicas * self.batch_size:
            split = "training" if dataset is self.train_dataset else "validation"
            raise DataError(
                f"The {split} split has {len(dataset)} sequence(s), fewer than one global batch"
                f" ({replicas} data-parallel replica(s) × batch_size {self.batch_size}); add text, lower seq_len or"
                f" batch_size{', or raise val_fraction' if split == 'validation' else ''}"
            )
        sampler = DataParallelSampler(len(dataset), replicas, rank, shuffle=shuffle, seed=self.seed)
        kwargs = dict(
            batch_size=self.batch_size,
            sampler=sampler,
            # Its own generator: creating an iterator would otherwise draw from the global RNG and
            # shift the model's random stream (dropout) between a run and its resumption.
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        if dataset is not self.train_dataset:  # only training needs to resume mid-epoch
            return DataLoader(dataset, **kwargs)
        consumed = epoch = None
        if self.trainer is not None:
            trainer = self.trainer
            # Batches of this epoch whose training step ran, and completed epochs: both restored from
            # the checkpoint on resume.
            consumed = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed  # noqa: E731
            epoch = lambda: trainer.current_epoch  # noqa: E731
        return ResumableDataLoader(dataset, consumed_batches=consumed, epoch=epoch, **kwargs)

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "setup() first"
        return self._loader(self.train_dataset, self.shuffle)

    def _eval_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            raise DataError("val_fraction=0 leaves no held-out split; set val_fraction > 0 to validate or test")
        return self._loader(self.val_dataset, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader() if self.val_dataset is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_dataloader()
