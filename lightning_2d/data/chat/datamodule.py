"""``ChatDataModule``: instruction fine-tuning data, rendered with the checkpoint's own chat template, the loss on
the assistant's tokens, packed without padding, data-parallel and resumable.

The Lightning face of ``formats`` (rows → conversations), ``template`` (the model's Jinja template),
``encode`` (tokens and the loss mask), ``cache`` (tokenized once) and ``packing`` (best-fit decreasing). Batches:
``input_ids``, ``labels`` (shifted: ``labels[t]`` is the token after ``input_ids[t]``, ``-100`` where nothing is
trained), ``position_ids`` when packed (each conversation's positions restart at 0: the model's document mask
keeps packed conversations apart, also under context, tensor/sequence and pipeline parallelism), and
``step_tokens``: this replica's trained tokens over the optimizer step its batch belongs to, from which the loss
is the mean over every trained token of the step, across accumulation, data and context parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_2d.data.base import DataParallelDataModule, common_problems
from lightning_2d.data.cache_folders import DEFAULT_CACHE_DIR, read_meta
from lightning_2d.data.chat.builtin import byte_chat_folder, stdlib_chat_file
from lightning_2d.data.chat.cache import (
    ChatCacheReport,
    ChatPieceEncoder,
    chat_cache_folder,
    prepare_chat_cache,
    resolve_chat_sources,
)
from lightning_2d.data.chat.encode import TRAIN_ON, ChatEncoder
from lightning_2d.data.chat.formats import check_format
from lightning_2d.data.chat.packing import OVERFLOW, Windows, pack_windows
from lightning_2d.data.chat.template import ChatTemplate, ChatTemplateError, folder_special_tokens
from lightning_2d.data.pieces import default_num_workers
from lightning_2d.data.sources import DataError, corpus_bytes
from lightning_2d.data.tokenizers import HuggingFaceTokenizer, load_tokenizer

IGNORE_INDEX = -100
#: Default of ``ChatDataModule(max_unprepared_mb=...)``: larger data sets without a cache are refused when
#: training starts, with the command that prepares them.
DEFAULT_MAX_UNPREPARED_MB = 8.0


@dataclass(frozen=True)
class PackingReport:
    """How well the conversations fill the windows.

    Args:
        windows: Windows (sequences of ``seq_len`` positions).
        conversations: Conversations in them.
        positions: ``windows × seq_len``.
        trained: Positions whose label is trained.
        masked: Positions of conversations whose label is not trained (prompts, headers, each conversation's
            last position).
        padding: Positions no conversation fills.
        truncated: Conversations cut to ``seq_len + 1`` tokens (``overflow="truncate"``).
        dropped: Conversations left out as too long (``overflow="drop"``).
    """

    windows: int
    conversations: int
    positions: int
    trained: int
    masked: int
    padding: int
    truncated: int = 0
    dropped: int = 0

    @property
    def efficiency(self) -> float:
        """The share of positions a conversation fills (trained or masked)."""
        return (self.trained + self.masked) / max(self.positions, 1)

    def lines(self) -> list[str]:
        def share(n: int) -> str:
            return f"{n:,} ({100 * n / max(self.positions, 1):.1f}%)"

        return [
            f"  windows        {self.windows:,} of {self.positions // max(self.windows, 1):,} positions,"
            f" {self.conversations:,} conversations",
            f"  trained        {share(self.trained)}",
            f"  masked         {share(self.masked)}",
            f"  padding        {share(self.padding)}",
            f"  efficiency     {100 * self.efficiency:.1f}% of positions hold a conversation"
            + (f"; {self.truncated:,} truncated" if self.truncated else "")
            + (f"; {self.dropped:,} dropped as too long" if self.dropped else ""),
        ]


class ChatWindows(Dataset):
    """Packed windows of a chat cache as ``{"input_ids", "labels"[, "position_ids"]}`` of ``seq_len`` each.

    Args:
        folder: The chat cache.
        windows: The windows (conversation indices are into ``conversations``).
        conversations: The cache's conversation numbers in this split.
        seq_len: Positions per window.
        pad_id: Token id of the padding (its labels are ``-100``).
        position_ids: Give each conversation its own positions (packed windows).
    """

    def __init__(self, folder: Path, windows: Windows, conversations: np.ndarray, seq_len: int, pad_id: int,
                 position_ids: bool) -> None:
        meta = read_meta(folder)
        assert meta is not None, f"{folder} is not a complete chat cache"
        self.folder, self.dtype = folder, np.dtype(meta["dtype"])
        self.windows, self.conversations = windows, conversations
        self.seq_len, self.pad_id, self.position_ids = seq_len, pad_id, position_ids
        self._maps: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    def __len__(self) -> int:
        return len(self.windows)

    def _open(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._maps is None:
            self._maps = (np.memmap(self.folder / "tokens.bin", dtype=self.dtype, mode="r"),
                          np.memmap(self.folder / "trained.bin", dtype=np.uint8, mode="r"),
                          np.fromfile(self.folder / "offsets.bin", dtype=np.int64))
        return self._maps

    def sequence(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Conversation ``c`` of the cache as ``(inputs, labels)`` of at most ``seq_len`` positions: its tokens but
        the last, and the next token where it is trained, else ``-100``."""
        tokens, trained, offsets = self._open()
        start, stop = int(offsets[c]), min(int(offsets[c + 1]), int(offsets[c]) + self.seq_len + 1)
        return self.as_sequence(tokens[start:stop], trained[start:stop])

    def conversation(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Conversation ``c`` of the cache whole: its token ids (int64) and which of them are trained."""
        tokens, trained, offsets = self._open()
        start, stop = int(offsets[c]), int(offsets[c + 1])
        return tokens[start:stop].astype(np.int64), np.asarray(trained[start:stop])

    @staticmethod
    def as_sequence(ids: np.ndarray, trained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens as ``(inputs, labels)``: the tokens but the last, and the next token where it is trained, else
        ``-100``."""
        ids = np.asarray(ids, dtype=np.int64)
        return ids[:-1], np.where(np.asarray(trained[1:]) > 0, ids[1:], IGNORE_INDEX).astype(np.int64)

    def window_of(self, sequences: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Sequences one after another and padding to ``seq_len``: ``input_ids``, ``labels`` and ``position_ids``
        (restarting at each sequence; the padding is a document of its own)."""
        ids = [inputs for inputs, _ in sequences]
        labels = [targets for _, targets in sequences]
        positions = [np.arange(len(inputs)) for inputs in ids]
        pad = self.seq_len - sum(map(len, ids))
        if pad:
            ids.append(np.full(pad, self.pad_id, dtype=np.int64))
            labels.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
            positions.append(np.arange(pad))
        return {"input_ids": torch.from_numpy(np.concatenate(ids)),
                "labels": torch.from_numpy(np.concatenate(labels)),
                "position_ids": torch.from_numpy(np.concatenate(positions))}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.window_of([self.sequence(int(self.conversations[item]))
                                 for item in self.windows.window(index).tolist()])
        if not self.position_ids:
            del sample["position_ids"]
        return sample

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}


class ChatCacheDataModule(DataParallelDataModule):
    """What ``ChatDataModule`` and ``PreferenceDataModule`` share: the model folder's tokenizer and chat template (or
    the built-in byte ChatML folder) and a ``ChatEncoder``, the rows' files (built-in ones for ``paths=None``), their
    cache (built once, by a pool of processes with ``prepare``; a small one when training starts, a large one
    refused without it), the splits made in ``setup`` and the stop ids checkpoints keep for ``export``.

    A subclass's ``__init__`` sets ``paths``, ``cache_dir``, ``max_unprepared_mb``, ``format``, ``fields`` and the
    training arguments, calls ``_init_chat`` and sets ``settings`` (what else keys the cache); it makes the
    splits (``_split``: the training and held-out datasets), its training loader, the file of its built-in rows
    (``_builtin_file``) and, for rows that are not one conversation each, its piece encoder (``_piece_encoder``).
    """

    paths: Union[str, list[str], None]
    cache_dir: Path
    max_unprepared_mb: Optional[float]
    format: str
    fields: dict[str, str]
    settings: dict[str, Any]
    _add_more = "rows"
    _model_fix = "or use the tokenizer the model was made for (its init_from folder)"
    #: How messages name the data.
    _data_name = "chat data"

    def _init_chat(self, tokenizer: str, chat_template: Optional[str], enable_thinking: Optional[bool],
                   tools: Optional[list[dict[str, Any]]], template_kwargs: Optional[dict[str, Any]], train_on: str,
                   train_on_eos: bool) -> dict[str, Any]:
        """Load the tokenizer and template, make ``encoder`` and ``pad_id``; returns the template's variables.
        Fails here, before any process starts: a tokenizer without offsets, a folder without a chat template."""
        if tokenizer == "byte":  # the built-in byte-level ChatML folder; checkpoints record its path (export reads it)
            tokenizer = str(byte_chat_folder(self.cache_dir))
            self.hparams["tokenizer"] = tokenizer
        self.tokenizer = load_tokenizer(tokenizer)
        if not isinstance(self.tokenizer, HuggingFaceTokenizer):
            raise DataError(
                f"{type(self).__name__} needs a Hugging Face tokenizer (a model folder with tokenizer.json and its chat"
                f" template), got {tokenizer!r} ({type(self.tokenizer).__name__}); give the model folder"
            )
        folder = Path(tokenizer).expanduser()
        folder = folder if folder.is_dir() else folder.parent
        template = ChatTemplate.from_folder(folder) if chat_template is None else _template_file(chat_template, folder)
        variables = dict(template_kwargs or {})
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        self.template = template
        self.encoder = ChatEncoder(self.tokenizer, template, train_on, train_on_eos, variables, tools)
        self.pad_id = _pad_id(self.tokenizer, folder)
        self._sources: Optional[list[Path]] = None
        return variables

    def _builtin_file(self) -> Path:
        """The rows read for ``paths=None`` (written once under ``cache_dir``)."""
        raise NotImplementedError

    def _piece_encoder(self) -> Optional[ChatPieceEncoder]:
        """What encodes a piece's rows (``None``: one conversation a row, ``ChatPieceEncoder``)."""
        return None

    def _split(self) -> tuple[Dataset, Optional[Dataset]]:
        """The training and held-out datasets (reads the cache; sets what the training loader counts)."""
        raise NotImplementedError

    @property
    def sources(self) -> list[Path]:
        if self._sources is None:
            paths = self.paths if self.paths is not None else str(self._builtin_file())
            self._sources = resolve_chat_sources(paths)
        return self._sources

    # ---- the cache ----
    @property
    def cache_folder(self) -> Path:
        return chat_cache_folder(self.sources, self.tokenizer, self.settings, self.cache_dir)

    def prepare(self, num_workers: Optional[int] = None, progress: Optional[Callable[[int, int, int], None]] = None,
                log: Optional[Callable[[str], None]] = None) -> ChatCacheReport:
        """Encode the data set into its cache with a pool of processes (a no-op once it exists); what
        ``lightning-2d prepare-data`` runs."""
        workers = default_num_workers() if num_workers is None else num_workers
        return prepare_chat_cache(self.sources, self.encoder, self.settings, self.cache_dir, self.format, self.fields,
                                  workers, progress=progress, log=log, piece_encoder=self._piece_encoder())

    def check_prepared(self) -> bool:
        """Before any process starts (the CLI calls it): a small data set is encoded now, so a bad row, a template
        that fails and a sequence over ``seq_len`` under ``overflow="error"`` are reported here; a large one
        without a cache raises ``DataError`` with the command that prepares it."""
        if read_meta(self.cache_folder) is None:
            size = corpus_bytes(self.sources)
            if self.max_unprepared_mb is not None and size > self.max_unprepared_mb * 1e6:
                raise DataError(
                    f"The {self._data_name} ({len(self.sources):,} files, {size / 1e6:,.1f} MB) has no cache in"
                    f" {self.cache_dir} and is larger than max_unprepared_mb ({self.max_unprepared_mb:g} MB): encode it"
                    " first with every core (lightning-2d prepare-data --config RECIPE), then start again"
                )
            self.prepare(num_workers=1)
        self._split()  # overflow="error" and too-small splits fail here
        return True

    def prepare_data(self) -> None:
        self.check_prepared()

    def _meta(self) -> dict[str, Any]:
        """The cache's ``meta.json``, encoding the data set first (on this process) when it has no cache."""
        meta = read_meta(self.cache_folder)
        if meta is None:
            self.prepare(num_workers=1)
            meta = read_meta(self.cache_folder)
        assert meta is not None
        return meta

    def setup(self, stage: Optional[str] = None) -> None:
        self.check_trainer_model()
        if self.train_dataset is None:
            self.train_dataset, self.val_dataset = self._split()

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints keep of the data (under the class's name, ``"ChatDataModule"``): the tokenizer folder and
        the end-of-turn ids training taught to stop at, which ``lightning-2d export`` writes as stop ids in
        ``generation_config.json``."""
        return {"tokenizer": self.hparams["tokenizer"], "end_of_turn_ids": self.end_of_turn_ids}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # the data's position is the loader's (ResumableDataLoader); these entries are for export

    @property
    def end_of_turn_ids(self) -> list[int]:
        """The end-of-turn token ids the cache's conversations end their assistant turns with (stop ids)."""
        meta = read_meta(self.cache_folder)
        return list(meta["end_of_turn"]) if meta else []


class ChatDataModule(ChatCacheDataModule):
    """Instruction fine-tuning on conversations, with the model's own chat template (a LightningCLI ``data:`` class).

    The arguments it shares with ``TextDataModule`` have the same defaults: a recipe parser whose default data
    class is ``TextDataModule`` keeps that class's values for them when a recipe names this class
    (jsonargparse carries the init arguments over a class change).

    Args:
        paths: JSONL (one row per line), JSON (a list of rows) or Parquet files, folders of them, a folder written
            by ``datasets``' ``save_to_disk`` (its Arrow files; a ``DatasetDict``'s ``train`` split), or globs.
            ``None``: questions and answers about the standard library, from its docstrings (no download).
        tokenizer: The model folder (its ``tokenizer.json``, ``tokenizer_config.json`` and chat template), e.g.
            the ``init_from`` folder. ``"byte"``: UTF-8 bytes and three ChatML tokens (ids 256-258), with a ChatML
            template (for models trained from scratch on ``TextDataModule``'s bytes, e.g. the ``debug`` preset
            with ``vocab_size: 259`` or more).
        format: ``"auto"`` (each row by its fields), ``"messages"`` (OpenAI ``[{role, content}]``),
            ``"prompt_completion"`` (strings or message lists), ``"alpaca"`` (``instruction``/``input``/``output``)
            or ``"sharegpt"`` (``conversations`` of ``from``/``value``).
        fields: The data set's names for the fields (``{"messages": "dialog", "role": "speaker"}``).
        train_on: ``"assistant"`` (every assistant turn), ``"last_assistant"``, ``"completion"`` (what follows
            the prompt) or ``"all"``.
        train_on_eos: Train each assistant turn's end-of-turn token (the model learns to stop).
        seq_len: Positions per sequence.
        batch_size: Sequences per batch on each data-parallel replica.
        pack: Pack several conversations into each sequence (best-fit decreasing), each its own document;
            ``False``: one conversation per sequence, padded.
        overflow: A conversation longer than ``seq_len + 1`` tokens: ``"truncate"`` (its first ``seq_len + 1``
            tokens), ``"drop"`` or ``"error"``.
        val_fraction: Conversations held out for validation (a seeded random choice, at least one); ``0`` for none.
        shuffle: Shuffle the training windows every epoch.
        seed: Seed of the held-out choice and the permutations.
        num_workers: DataLoader worker processes.
        cache_dir: Where the cache lives (default ``$LIGHTNING_2D_CACHE`` or ``~/.cache/lightning_2d``).
        chat_template: A ``.jinja`` file to render with instead of the tokenizer's template (e.g. one with
            ``{% generation %}`` tags).
        enable_thinking: Passed to the template (Qwen3: ``False`` renders empty think blocks); ``None``: not passed.
        tools: Tool schemas (JSON) given to every conversation's template (a row's own ``tools`` replace them).
        template_kwargs: More template variables (``date_string`` for Llama 3.1's system header, ...).
        max_unprepared_mb: Largest data set (MB of files) encoded when training starts if it has no cache; larger
            ones are refused with the command that prepares them with every core. ``None``: no limit.

    Raises:
        DataError: At construction, arguments out of range (every problem in one message) or a tokenizer that
            cannot be loaded; when the data are encoded (``check_prepared``, before ``lightning-2d fit`` launches, or
            ``setup``), rows of no known format (``ChatFormatError``, naming ``file:line``), a template that cannot
            render them (``ChatTemplateError``), conversations longer than ``seq_len`` under ``overflow="error"``,
            or a data set larger than ``max_unprepared_mb`` without its cache.

    Example:
        ```python
        from lightning_2d import ChatDataModule, LlamaLightningModule

        data = ChatDataModule("chats.jsonl", tokenizer="Meta-Llama-3-8B-Instruct/", seq_len=4096, batch_size=2,
                              train_on="assistant")
        trainer.fit(LlamaLightningModule(init_from="Meta-Llama-3-8B-Instruct/"), data)
        ```

        ``lightning-2d prepare-data --config RECIPE --preview 3`` shows how rows are rendered and which tokens train.
    """

    def __init__(
        self,
        paths: Union[str, list[str], None] = None,
        tokenizer: str = "byte",
        format: str = "auto",
        fields: Optional[dict[str, str]] = None,
        train_on: str = "assistant",
        train_on_eos: bool = True,
        seq_len: int = 512,
        batch_size: int = 8,
        pack: bool = True,
        overflow: str = "truncate",
        val_fraction: float = 0.005,
        shuffle: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
        chat_template: Optional[str] = None,
        enable_thinking: Optional[bool] = None,
        tools: Optional[list[dict[str, Any]]] = None,
        template_kwargs: Optional[dict[str, Any]] = None,
        max_unprepared_mb: Optional[float] = DEFAULT_MAX_UNPREPARED_MB,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        problems = common_problems(seq_len, batch_size, val_fraction, max_unprepared_mb)
        if train_on not in TRAIN_ON:
            problems.append(f"train_on must be one of {', '.join(map(repr, TRAIN_ON))}, got {train_on!r}")
        if overflow not in OVERFLOW:
            problems.append(f"overflow must be one of {', '.join(map(repr, OVERFLOW))}, got {overflow!r}")
        if problems:
            raise DataError("Invalid ChatDataModule arguments:\n  - " + "\n  - ".join(problems))
        check_format(format, fields)
        self.paths, self.format, self.fields = paths, format, dict(fields or {})
        self.seq_len, self.batch_size, self.pack, self.overflow = seq_len, batch_size, pack, overflow
        self.val_fraction, self.shuffle, self.seed, self.num_workers = val_fraction, shuffle, seed, num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
        self.max_unprepared_mb = max_unprepared_mb
        variables = self._init_chat(tokenizer, chat_template, enable_thinking, tools, template_kwargs, train_on,
                                    train_on_eos)
        self.settings = {"template": self.template.digest, "template_kwargs": variables, "tools": tools,
                         "format": format, "fields": self.fields, "train_on": train_on, "train_on_eos": train_on_eos}
        self.train_dataset: Optional[ChatWindows] = None
        self.val_dataset: Optional[ChatWindows] = None
        self.packing: Optional[PackingReport] = None
        self._targets: Optional[np.ndarray] = None

    #: Packed windows keep their conversations apart with position_ids (the strategies check that the model
    #: takes them).
    @property
    def document_mask(self) -> bool:
        return self.pack

    def _builtin_file(self) -> Path:
        return stdlib_chat_file(self.cache_dir)

    # ---- splits and windows ----
    def _split(self) -> tuple[ChatWindows, Optional[ChatWindows]]:
        meta = self._meta()
        folder = self.cache_folder
        offsets = np.fromfile(folder / "offsets.bin", dtype=np.int64)
        lengths = np.diff(offsets) - 1  # positions each conversation takes
        targets = np.fromfile(folder / "targets.bin", dtype=np.int64)
        too_long = np.flatnonzero(lengths > self.seq_len)
        keep = np.ones(len(lengths), dtype=bool)
        if too_long.size and self.overflow == "error":
            rows = np.fromfile(folder / "rows.bin", dtype=np.int64).reshape(-1, 2)
            shown = [f"{row_name(meta['sources'], int(rows[c, 0]), int(rows[c, 1]))} ({int(lengths[c]) + 1} tokens)"
                     for c in too_long[:5]]
            raise DataError(
                f"{too_long.size} conversation(s) are longer than seq_len + 1 ({self.seq_len + 1} tokens) under"
                f" overflow='error': {', '.join(shown)}{', …' if too_long.size > 5 else ''}; raise seq_len, or set"
                " overflow='truncate' or 'drop'"
            )
        if self.overflow == "drop":
            keep[too_long] = False
        elif too_long.size:  # truncate: their trained tokens beyond the window are not seen
            tokens = np.memmap(folder / "trained.bin", dtype=np.uint8, mode="r")
            for c in too_long.tolist():
                targets[c] = int(tokens[offsets[c] + 1 : offsets[c] + self.seq_len + 1].sum())
        positions = np.minimum(lengths, self.seq_len)
        kept = np.flatnonzero(keep & (targets > 0))
        train_convs, val_convs = held_out(kept, self.val_fraction, self.seed, "chat data", "conversation(s)")
        train_windows = pack_windows(positions[train_convs], self.seq_len, self.pack)
        val_windows = pack_windows(positions[val_convs], self.seq_len, self.pack)
        self._targets = np.add.reduceat(targets[train_convs][train_windows.items], train_windows.offsets[:-1])
        trained = int(targets[train_convs].sum())
        filled = int(positions[train_convs].sum())
        total = len(train_windows) * self.seq_len
        self.packing = PackingReport(len(train_windows), len(train_convs), total, trained, filled - trained,
                                     total - filled, truncated=int(np.sum(lengths[kept] > self.seq_len))
                                     if self.overflow == "truncate" else 0,
                                     dropped=int(too_long.size) if self.overflow == "drop" else 0)
        train = ChatWindows(folder, train_windows, train_convs, self.seq_len, self.pad_id, self.pack)
        val = (ChatWindows(folder, val_windows, val_convs, self.seq_len, self.pad_id, self.pack)
               if len(val_convs) else None)
        return train, val

    # ---- loaders ----
    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "setup() first"
        return self._loader(self.train_dataset, train=True, targets=self._targets,
                            describe=lambda n: f"packs into {n} sequence(s) of {self.seq_len}")


def held_out(kept: np.ndarray, val_fraction: float, seed: int, data: str, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """``kept`` split into training and held-out items: a ``seed``-ed random ``val_fraction`` of them (at least one
    when ``val_fraction > 0``) held out, each part in ``kept``'s order.

    Raises:
        DataError: No item would be left to train on (names the ``data`` and its ``unit``).
    """
    n_val = max(1, round(len(kept) * val_fraction)) if val_fraction > 0 else 0
    if len(kept) - n_val < 1:
        raise DataError(f"The {data} keeps {len(kept)} {unit}, too few for a training and a validation split; add rows"
                        " or set val_fraction=0")
    chosen = np.zeros(len(kept), dtype=bool)
    chosen[np.random.default_rng(seed).permutation(len(kept))[:n_val]] = True
    return kept[~chosen], kept[chosen]


def _template_file(path: str, folder: Path) -> ChatTemplate:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ChatTemplateError(f"chat_template={path!r} is not a file; give a .jinja file")
    return ChatTemplate(file.read_text(encoding="utf-8"), folder_special_tokens(folder), str(file))


def row_name(sources: list[str], file: int, row: int) -> str:
    """How messages name row ``row`` of file number ``file`` of a cache's ``meta["sources"]`` (``file:line`` for
    JSONL, else ``file row N``)."""
    path = sources[file] if file < len(sources) else f"file {file}"
    return f"{path}:{row}" if path.endswith((".jsonl", ".ndjson")) else f"{path} row {row}"


def _pad_id(tokenizer: HuggingFaceTokenizer, folder: Path) -> int:
    """The padding id: ``pad_token`` of ``tokenizer_config.json``, else the end-of-text token, else 0 (never a
    target: its labels are ``-100``)."""
    special = folder_special_tokens(folder)
    for name in ("pad_token", "eos_token"):
        if name in special and tokenizer.token_to_id(special[name]) is not None:
            return int(tokenizer.token_to_id(special[name]))
    return int(tokenizer.eos_id) if tokenizer.eos_id is not None else 0


__all__ = ["ChatDataModule", "ChatWindows", "PackingReport"]