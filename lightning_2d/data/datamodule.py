"""``TextDataModule``: a corpus tokenized once, cached, packed into windows, data-parallel and resumable.

The Lightning face of ``sources``, ``cache`` and ``loading``: it checks its arguments and the model's
vocabulary, builds a small corpus's cache at start-up and refuses a large one with the command that
prepares it (``prepare_command``, ``prepare_python``), splits the windows into training and validation,
and gives each data-parallel replica its sampler.
"""

from __future__ import annotations

import inspect
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from torch.utils.data import DataLoader

from lightning_2d.data.base import DataParallelDataModule, common_problems
from lightning_2d.data.cache import CacheReport, cache_folder, prepare_token_cache
from lightning_2d.data.cache_folders import DEFAULT_CACHE_DIR
from lightning_2d.data.loading import TokenWindows
from lightning_2d.data.pieces import default_num_workers
from lightning_2d.data.sources import DataError, corpus_bytes, resolve_sources
from lightning_2d.data.tokenizers import load_tokenizer
from lightning_2d.models.llama.tokenizer import BOS_CANDIDATES

#: Default of ``TextDataModule(max_unprepared_mb=...)``: larger corpora without a cache are refused
#: when training starts (tokenizing them inline would keep every other rank waiting).
DEFAULT_MAX_UNPREPARED_MB = 8.0


class TextDataModule(DataParallelDataModule):
    """Real text for ``LlamaLightningModule``: tokenized once, cached, packed, data-parallel and resumable.

    Args:
        paths: Text files, directories and globs; ``.jsonl``/``.ndjson`` and ``.parquet`` files are
            read record by record from ``text_field``. A directory contributes its ``.txt``, ``.text``,
            ``.jsonl``, ``.ndjson``, ``.parquet`` and ``.py`` files, not hidden ones, ``__pycache__`` or
            metadata such as a dataset card ``README.md`` (``FOLDER_SUFFIXES``); name other files or a glob.
            ``None``: the Python standard library's source files (no download).
        tokenizer: ``"byte"`` (UTF-8 bytes, vocabulary 256), a Hugging Face ``tokenizer.json``, a SentencePiece
            ``.model``, Meta's tiktoken ``tokenizer.model`` (Llama 3; needs ``pip install 'lightning-2d[tiktoken]'``),
            or a model folder (its ``tokenizer.json``, else its ``tokenizer.model``: what ``init_from`` takes).
        eos_token: End-of-text token of a Hugging Face or tiktoken tokenizer, when it is not a common one.
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
        max_unprepared_mb: Largest corpus (in MB, 10^6 bytes of source files) tokenized when
            training starts if it has no cache: on one process per node while the other ranks wait.
            A larger corpus without a cache raises ``DataError`` before anything is tokenized, with
            the command that prepares it with every local core (``lightning-2d prepare-data``, or
            ``prepare()``). ``None``: no limit.
        document_mask: Keep the documents packed into a window apart: each batch carries ``position_ids`` (every
            token's position in its document, restarting after each end-of-text token), from which the model
            restarts its rotary positions at each document and attends only within it. ``False``: every token
            attends to the earlier documents of its window too, with positions running on across them (the
            cheaper, common pre-training default). Needs a tokenizer with an end-of-text token.
        add_bos: Start every document with the tokenizer's beginning-of-text token (``<|begin_of_text|>``,
            ``<s>``), as Llama 3 and Llama 2 were pre-trained; the cache is then another one. With
            ``document_mask`` the token is its document's first (position 0). Needs a tokenizer with one (not
            ``"byte"``).

    Raises:
        DataError: At construction, arguments out of range (every problem in one message), a tokenizer that cannot
            be loaded or that lacks the end-of-text (``document_mask``) or beginning-of-text (``add_bos``) token it
            needs; before training (``check_prepared``, which ``lightning-2d fit`` calls before launching), a corpus
            larger than ``max_unprepared_mb`` without its token cache; at ``setup``, files that cannot be read
            (``DataFileNotFoundError``, also a ``FileNotFoundError``) or too few tokens for one batch.

    Example:
        ```python
        from lightning_2d import TextDataModule

        data = TextDataModule(["corpus/", "extra/*.jsonl"], tokenizer="Meta-Llama-3-8B/", seq_len=8192, batch_size=1)
        data.prepare()  # optional: tokenize with every local core now (`lightning-2d prepare-data`)
        trainer.fit(module, data)
        ```
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
        max_unprepared_mb: Optional[float] = DEFAULT_MAX_UNPREPARED_MB,
        document_mask: bool = False,
        add_bos: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        problems = common_problems(seq_len, batch_size, val_fraction, max_unprepared_mb)
        if problems:
            raise DataError("Invalid TextDataModule arguments:\n  - " + "\n  - ".join(problems))
        self.paths, self.text_field = paths, text_field
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
        self.max_unprepared_mb = max_unprepared_mb
        self.tokenizer = load_tokenizer(tokenizer, eos_token)  # fails here, before any process starts
        if document_mask and self.tokenizer.eos_id is None:
            raise DataError(
                f"document_mask=True needs an end-of-text token to find where the packed documents start, but the"
                f" tokenizer {tokenizer!r} has none; name it with eos_token=... (e.g. '<|end_of_text|>', '</s>'),"
                " or set document_mask=False"
            )
        if add_bos and getattr(self.tokenizer, "bos_id", None) is None:
            raise DataError(
                f"add_bos=True needs a beginning-of-text token, but the tokenizer {tokenizer!r} has none (looked for"
                f" the tokenizer_config.json's bos_token and {', '.join(BOS_CANDIDATES)}); use a tokenizer that has"
                " one, or set add_bos=False"
            )
        self.document_mask, self.add_bos = document_mask, add_bos
        self._sources: list[Path] | None = None
        self._folder: Path | None = None
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: TokenWindows | None = None

    @property
    def sources(self) -> list[Path]:
        if self._sources is None:
            self._sources = resolve_sources(self.paths)
        return self._sources

    # ---- the token cache ----
    def prepare(
        self,
        num_workers: Optional[int] = None,
        progress: Optional[Callable[[int, int, int], None]] = None,
        log: Optional[Callable[[str], None]] = None,
    ) -> CacheReport:
        """Build the token cache with a pool of processes, whatever the corpus size (a no-op once it exists).

        What ``lightning-2d prepare-data`` runs. Call it before training; processes of one machine
        that call it together take turns on a file lock (no collective, so no timeout): the first
        tokenizes, the others then find its cache.

        Args:
            num_workers: Tokenizing processes (default: every core this process may use).
            progress: Called after each task with (bytes done, bytes in all, tokens so far).
            log: Called with a line of text for events worth telling (waiting for another builder).

        Returns:
            The ``CacheReport`` (files, bytes, tokens, seconds; ``built=False`` if it already existed).
        """
        workers = default_num_workers() if num_workers is None else num_workers
        return prepare_token_cache(self.sources, self.tokenizer, self.cache_dir, self.text_field,
                                   strict=self.paths is not None, num_workers=workers, progress=progress, log=log,
                                   add_bos=self.add_bos)

    @property
    def cache_folder(self) -> Path:
        """This corpus's cache folder (complete once ``meta.json`` exists in it)."""
        return cache_folder(self.sources, self.tokenizer, self.cache_dir, self.text_field, add_bos=self.add_bos)

    def check_prepared(self) -> bool:
        """Whether the cache is complete; raise ``DataError`` when it is not and training may not build it.

        Training builds a missing cache itself (one process per node, the other ranks waiting)
        only for a corpus of at most ``max_unprepared_mb``. Every rank can call this before a
        barrier: all of them fail with the same message instead of some waiting for the others.
        """
        if (self.cache_folder / "meta.json").is_file():
            return True
        if self.max_unprepared_mb is not None:
            size = corpus_bytes(self.sources)
            if size > self.max_unprepared_mb * 1e6:
                raise DataError(self._unprepared_message(size))
        return False

    def _unprepared_message(self, size: int) -> str:
        mb = size / 1e6
        return (
            f"The corpus ({len(self.sources):,} files, {mb:,.1f} MB) has no token cache in {self.cache_dir} and is"
            f" larger than max_unprepared_mb ({self.max_unprepared_mb:g} MB): it is not tokenized here, on one process"
            f" while every other rank waits. Tokenize it first with every local core, then start training again:\n"
            f"    {prepare_command(self)}\n"
            f"or in Python:\n"
            f"    {prepare_python(self)}\n"
            f"(To tokenize at start-up anyway, raise max_unprepared_mb above {mb:,.1f} or set it to null.)"
        )

    def _ensure_cache(self) -> Path:
        if not self.check_prepared():
            # A small corpus: tokenized here, in this process, as before prepare-data existed.
            return prepare_token_cache(self.sources, self.tokenizer, self.cache_dir, self.text_field,
                                       strict=self.paths is not None, add_bos=self.add_bos).folder
        return self.cache_folder

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node, then makes the others wait (in a barrier
        # without timeout): only a small corpus may be tokenized here (``check_prepared``).
        self._ensure_cache()

    def setup(self, stage: str | None = None) -> None:
        self.check_trainer_model()
        if self.train_dataset is not None:
            return
        self._folder = self._ensure_cache()
        meta = json.loads((self._folder / "meta.json").read_text())
        expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        if (self._folder / "tokens.bin").stat().st_size != expected:
            raise DataError(
                f"The token cache {self._folder} is damaged (tokens.bin is not {expected} bytes); delete that folder"
                f" and prepare the corpus again"
            )
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
        eos_id = self.tokenizer.eos_id if self.document_mask else None
        self.train_dataset = TokenWindows(self._folder, self.seq_len, 0, windows - n_val, eos_id=eos_id)
        self.val_dataset = TokenWindows(self._folder, self.seq_len, windows - n_val, n_val, eos_id=eos_id) if n_val else None

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "setup() first"
        return self._loader(self.train_dataset, train=True)


# ---- the commands that prepare a data module's cache (for messages) ---------------------------
#: The data module's arguments that decide its cache (the others do not change the tokens).
_CACHE_ARGS = ("paths", "tokenizer", "eos_token", "text_field", "cache_dir", "add_bos")
_TRAINER_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _non_default_cache_args(data: TextDataModule) -> dict[str, Any]:
    defaults = inspect.signature(TextDataModule.__init__).parameters
    hparams = dict(data.hparams)
    return {k: hparams[k] for k in _CACHE_ARGS if k in hparams and hparams[k] != defaults[k].default}


def prepare_command(data: TextDataModule, argv: Optional[list[str]] = None) -> str:
    """The shell command that builds ``data``'s cache.

    Started from ``lightning-2d fit|validate|test|predict ...`` (``argv``, default ``sys.argv``):
    the same ``--config`` files and ``--data*`` options after ``lightning-2d prepare-data``.
    Otherwise the data module's own arguments as ``--data.*`` options.
    """
    argv = sys.argv if argv is None else argv
    if len(argv) > 1 and argv[1] in _TRAINER_SUBCOMMANDS:
        program = "python -m lightning_2d" if argv[0].endswith("__main__.py") else "lightning-2d"
        kept, rest, i = [], argv[2:], 0
        while i < len(rest):
            option = rest[i]
            takes_value = "=" not in option and i + 1 < len(rest) and not rest[i + 1].startswith("--")
            name = option.split("=", 1)[0]
            if name in ("-c", "--config", "--data") or name.startswith("--data."):
                kept += rest[i : i + 1 + takes_value]
            i += 1 + takes_value
        return " ".join([program, "prepare-data", *map(shlex.quote, kept)])
    options = []
    for key, value in _non_default_cache_args(data).items():
        text = value if isinstance(value, str) else json.dumps(value)
        options.append(shlex.quote(f"--data.{key}={text}"))
    return " ".join(["lightning-2d", "prepare-data", *options])


def prepare_python(data: TextDataModule) -> str:
    """The Python statement that builds ``data``'s cache."""
    args = ", ".join(f"{k}={v!r}" for k, v in _non_default_cache_args(data).items())
    return f"TextDataModule({args}).prepare()  # from lightning_2d import TextDataModule"
