"""``PreferenceDataModule``: preference pairs (a prompt, a chosen and a rejected completion) for DPO and its kin,
or unpaired examples (a prompt, a completion and its label) for KTO, rendered with the model's own chat template,
packed pair by pair (example by example), data-parallel and resumable.

Built on the chat data's machinery: rows → pairs (``formats``), each pair → two ``EncodedChat`` trained on their
completion (``encode``), the chat cache (conversations ``2k`` and ``2k + 1`` are pair ``k``'s chosen and rejected),
best-fit decreasing packing (a pair is one unit: it is never split across windows).

A window (``seq_len`` positions) holds whole pairs, each its chosen sequence right before its rejected one, then
padding. Each sample is a dict of ``(seq_len,)`` long tensors and one 0-dim tensor:

- ``input_ids``, ``labels``: as ``ChatDataModule``'s (``labels[t]`` is the token after ``input_ids[t]`` where it is a
  trained completion token, else ``-100``);
- ``position_ids``: restarting at 0 at each sequence (chosen and rejected are separate documents) and at the
  padding, packed or not;
- ``sequence_ids``: ``2p`` on pair ``p``'s chosen sequence, ``2p + 1`` on its rejected one (``p``: the pair's index
  in the window, from 0), ``-1`` on padding;
- ``pairs``: the number of pairs in the window (0-dim; ``(B,)`` in a batch);
- ``sequence_numbers``: each position's sequence as the cache numbers it (pair ``k``'s chosen ``2k``, its
  rejected ``2k + 1``), ``-1`` on padding: what ``precompute_reference`` keys its values by;
- ``reference_logps`` (float, once a reference pass set them: ``set_reference_log_probs``): each sequence's reference
  log-probability at its first position, 0 elsewhere, so that a sequence's sum over its positions is its value.

Training batches also carry ``step_pairs`` (a float 0-dim tensor): this replica's pairs over the optimizer step the
batch belongs to (every batch it accumulates), from which a loss is the mean over every pair of the step.

Unpaired examples (TRL's KTO format, ``format="unpaired"``; the cache holds one conversation an example, its label in
``labels.bin``) fill windows the same way, each example with its **KL sequence**: KTO's reference point is an
estimate of KL(trained ‖ reference) from mismatched completions, which TRL's ``KTOTrainer`` builds per batch by
rotating the completions by one, ``(x_i, y_{i-1})``. Here the rotation is over a window's examples, in the data
set's order: example ``e``'s KL sequence is its (truncated) prompt followed by the completion of the window's previous
example (the last one's for the first), cut by ``max_length`` as an example is. The window's completions are then the
KL sequences' completions too, so an example and its KL sequence together take twice the example's positions (what
packing reserves); a window of one example has no KL sequence (its own completion would not be a mismatched one).
Samples hold ``input_ids``, ``labels`` (the examples' completions and the KL sequences' completions: scored, and
trained only through the examples), ``position_ids`` as above, and

- ``sequence_ids``: ``2e`` on example ``e``, ``2e + 1`` on its KL sequence, ``-1`` on padding;
- ``examples``: the number of examples in the window (0-dim);
- ``desirable``: ``(seq_len // 2,)`` bool, example ``e``'s label at ``e`` (``False`` past the window's examples: an
  example and its KL sequence take at least two positions);

and training batches ``step_examples`` (this replica's examples over the optimizer step).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_2d.data.base import common_problems
from lightning_2d.data.cache_folders import DEFAULT_CACHE_DIR, read_meta
from lightning_2d.data.chat.cache import ChatPieceEncoder, plan_chat_pieces, read_rows
from lightning_2d.data.chat.datamodule import (
    DEFAULT_MAX_UNPREPARED_MB,
    ChatCacheDataModule,
    ChatWindows,
    PackingReport,
    held_out,
    row_name,
)
from lightning_2d.data.chat.packing import Windows, pack_windows
from lightning_2d.data.preference.builtin import stdlib_preference_file
from lightning_2d.data.preference.encode import (
    PreferenceEncoder,
    PreferencePieceEncoder,
    Truncation,
    truncation_problems,
)
from lightning_2d.data.preference.formats import check_preference_format, is_unpaired_row
from lightning_2d.data.sources import DataError

#: What a pair longer than ``seq_len`` positions does (shortening a pair is ``max_length``'s job).
PAIR_OVERFLOW = ("drop", "error")
#: The padding's ``sequence_ids``.
NO_SEQUENCE = -1
#: What a preference data set's rows are (``PreferenceDataModule.preference_units``): pairs (DPO and its kin) or
#: unpaired examples (KTO).
PREFERENCE_UNITS = ("pairs", "examples")


def truncation_line(prompts: int, completions: int, no_target: int, unit: str) -> str:
    """The packing report's line of what encoding the whole data set cut or dropped (``unit``: pair, example)."""
    return (f"  truncated      {prompts:,} prompt(s), {completions:,} completion(s) of the data set; {no_target:,}"
            f" {unit}(s) dropped without a trained token")


@dataclass(frozen=True)
class PreferencePackingReport(PackingReport):
    """How well the pairs fill the windows (``conversations``: their sequences, two a pair; ``dropped``: pairs
    longer than ``seq_len`` under ``overflow="drop"``), and what encoding the whole data set cut or dropped.

    Args:
        pairs: Pairs in the windows.
        prompts_truncated: Kept pairs of the data set whose prompt lost tokens (``max_prompt_length``, or
            ``max_length`` under ``truncation_mode="keep_end"``).
        completions_truncated: Completions of kept pairs whose end ``max_length`` cut.
        no_target: Pairs of the data set dropped because a completion kept no trained token.
    """

    pairs: int = 0
    prompts_truncated: int = 0
    completions_truncated: int = 0
    no_target: int = 0

    def lines(self) -> list[str]:
        lines = super().lines()
        lines[0] = (f"  windows        {self.windows:,} of {self.positions // max(self.windows, 1):,} positions,"
                    f" {self.pairs:,} pairs ({self.conversations:,} sequences)")
        lines[-1] = (f"  efficiency     {100 * self.efficiency:.1f}% of positions hold a sequence"
                     + (f"; {self.dropped:,} pair(s) dropped as longer than the window" if self.dropped else ""))
        lines.append(truncation_line(self.prompts_truncated, self.completions_truncated, self.no_target, "pair"))
        return lines


@dataclass(frozen=True)
class UnpairedPackingReport(PackingReport):
    """How well the unpaired examples and their KL sequences fill the windows (``conversations``: the examples;
    ``masked``: their untrained positions and, at most, their KL sequences'; ``dropped``: examples longer than half
    a window under ``overflow="drop"``), and what encoding the whole data set cut or dropped.

    Args:
        examples: Examples in the windows.
        desirable: Those labelled desirable.
        alone: Examples alone in their window (no KL sequence: every other window's examples each have one).
        prompts_truncated: Kept examples of the data set whose prompt lost tokens.
        completions_truncated: Kept examples whose completion's end ``max_length`` cut.
        no_target: Examples of the data set dropped because their completion kept no trained token.
    """

    examples: int = 0
    desirable: int = 0
    alone: int = 0
    prompts_truncated: int = 0
    completions_truncated: int = 0
    no_target: int = 0

    def lines(self) -> list[str]:
        lines = super().lines()
        lines[0] = (f"  windows        {self.windows:,} of {self.positions // max(self.windows, 1):,} positions,"
                    f" {self.examples:,} examples ({self.desirable:,} desirable, {self.examples - self.desirable:,}"
                    f" undesirable), {self.examples - self.alone:,} KL sequences")
        lines[-1] = (f"  efficiency     {100 * self.efficiency:.1f}% of positions hold an example or its KL sequence"
                     + (f"; {self.dropped:,} example(s) dropped as longer than half the window" if self.dropped
                        else ""))
        if self.alone:
            lines.append(f"  alone          {self.alone:,} example(s) alone in a window: no KL sequence (raise seq_len,"
                         " or shorten the examples with max_length, to pack more in a window)")
        lines.append(truncation_line(self.prompts_truncated, self.completions_truncated, self.no_target, "example"))
        return lines


class PreferenceWindows(ChatWindows):
    """Windows of whole pairs of a preference cache (see the module docstring for each sample's tensors).

    Args:
        folder: The cache (pair ``k``: conversations ``2k``, chosen, and ``2k + 1``, rejected).
        windows: The windows (pair indices are into ``pairs``).
        pairs: The cache's pair numbers in this split.
        seq_len: Positions per window.
        pad_id: Token id of the padding (its labels are ``-100``).
    """

    def __init__(self, folder: Path, windows: Windows, pairs: np.ndarray, seq_len: int, pad_id: int) -> None:
        super().__init__(folder, windows, pairs, seq_len, pad_id, position_ids=True)
        #: Each cache sequence's reference log-probability (``PreferenceDataModule.set_reference_log_probs``).
        self.reference_logps: Optional[np.ndarray] = None

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pairs = [int(self.conversations[item]) for item in self.windows.window(index).tolist()]
        cached = [2 * pair + side for pair in pairs for side in (0, 1)]
        sequences = [self.sequence(number) for number in cached]
        sample = self.window_of(sequences)
        lengths = [len(inputs) for inputs, _ in sequences]
        pad = self.seq_len - sum(lengths)
        runs = lengths + [pad]  # each sequence's positions, then the padding's
        sample["sequence_ids"] = torch.from_numpy(np.repeat(np.append(np.arange(len(lengths)), NO_SEQUENCE), runs))
        sample["pairs"] = torch.tensor(len(pairs), dtype=torch.long)
        sample["sequence_numbers"] = torch.from_numpy(np.repeat(np.array(cached + [NO_SEQUENCE], dtype=np.int64),
                                                                runs))
        if self.reference_logps is not None:
            values = np.zeros(self.seq_len, dtype=np.float32)
            starts = np.cumsum([0] + lengths[:-1])
            values[starts] = self.reference_logps[cached]
            sample["reference_logps"] = torch.from_numpy(values)
        return sample


class UnpairedWindows(ChatWindows):
    """Windows of unpaired examples and their KL sequences (see the module docstring for each sample's tensors).

    Args:
        folder: The cache (one conversation an example, its label in ``labels.bin``).
        windows: The windows (example indices are into ``examples``).
        examples: The cache's conversation numbers in this split, in the data set's order.
        seq_len: Positions per window.
        pad_id: Token id of the padding (its labels are ``-100``).
        truncation: What cuts a KL sequence (the examples' own truncation).
    """

    def __init__(self, folder: Path, windows: Windows, examples: np.ndarray, seq_len: int, pad_id: int,
                 truncation: Truncation) -> None:
        super().__init__(folder, windows, examples, seq_len, pad_id, position_ids=True)
        self.truncation = truncation
        self._labels: Optional[np.ndarray] = None

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # The data set's order within the window: the KL rotation is TRL's on a batch of these rows.
        numbers = [int(self.conversations[item]) for item in np.sort(self.windows.window(index)).tolist()]
        examples = [self.conversation(c) for c in numbers]
        prompts = [int(np.argmax(trained)) for _, trained in examples]  # each has a trained token (the cache's)
        sequences, slots = [], []
        for e, (ids, trained) in enumerate(examples):
            sequences.append(self.as_sequence(ids, trained))
            slots.append(2 * e)
            if len(examples) > 1:
                sequences.append(self.as_sequence(*self.kl_sequence(examples[e], prompts[e], examples[e - 1],
                                                                    prompts[e - 1])))
                slots.append(2 * e + 1)
        sample = self.window_of(sequences)
        ids = [np.full(len(inputs), slot, dtype=np.int64) for slot, (inputs, _) in zip(slots, sequences)]
        ids.append(np.full(self.seq_len - sum(map(len, ids)), NO_SEQUENCE, dtype=np.int64))
        sample["sequence_ids"] = torch.from_numpy(np.concatenate(ids))
        sample["examples"] = torch.tensor(len(examples), dtype=torch.long)
        desirable = torch.zeros(self.seq_len // 2, dtype=torch.bool)
        desirable[: len(numbers)] = torch.from_numpy(self._open_labels()[numbers] > 0)
        sample["desirable"] = desirable
        return sample

    def kl_sequence(self, example: tuple[np.ndarray, np.ndarray], prompt: int, other: tuple[np.ndarray, np.ndarray],
                    other_prompt: int) -> tuple[np.ndarray, np.ndarray]:
        """``example``'s prompt (its first ``prompt`` tokens) followed by ``other``'s completion, as ``(ids,
        trained)``, cut by ``max_length`` as an example is (``Truncation.bounds``)."""
        ids = np.concatenate([example[0][:prompt], other[0][other_prompt:]])
        trained = np.concatenate([np.zeros(prompt, dtype=other[1].dtype), other[1][other_prompt:]])
        drop, keep = self.truncation.bounds(len(ids), prompt)
        stop = len(ids) if keep is None else min(len(ids), prompt + keep)
        return ids[drop:stop], trained[drop:stop]

    def _open_labels(self) -> np.ndarray:
        if self._labels is None:
            self._labels = np.fromfile(self.folder / "labels.bin", dtype=np.uint8)
        return self._labels

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_labels": None}


class PreferenceDataModule(ChatCacheDataModule):
    """Preference pairs for DPO-style training, or unpaired examples for KTO, with the model's own chat template (a
    LightningCLI ``data:`` class).

    The arguments it shares with ``ChatDataModule`` mean the same and have the same defaults (but ``overflow``).

    Args:
        paths: JSONL, JSON or Parquet files, folders of them, a ``datasets`` ``save_to_disk`` folder, or globs, of
            rows with TRL's fields. ``None``: pairs about the standard library (a docstring's answer chosen, an
            evasive one rejected; no download); with ``format="unpaired"`` the same pairs as unpaired examples (each
            answer desirable, each evasive one undesirable).
        tokenizer: The model folder (tokenizer and chat template), e.g. the ``init_from`` folder; ``"byte"``: the
            built-in byte-level ChatML tokenizer (ids 0-258).
        format: ``"auto"`` (unpaired when the row has a ``completion`` and a ``label``, explicit when it has a
            ``prompt``), ``"explicit"`` (``prompt``, ``chosen``, ``rejected``: strings or message lists),
            ``"implicit"`` (``chosen`` and ``rejected`` whole conversations; the prompt their longest common prefix of
            messages, ending before an assistant turn) or ``"unpaired"`` (TRL's KTO format: ``prompt``,
            ``completion``, ``label``, true when desirable; each example packed with its KL sequence, see the module
            docstring).
        fields: The data set's names for the fields (``{"chosen": "preferred", "rejected": "dispreferred"}``).
        train_on_eos: Train each completion's end-of-turn token.
        max_prompt_length: Most prompt tokens (its start dropped beyond); ``None``: no limit.
        max_length: Most tokens of each sequence, prompt and completion; ``None``: no limit.
        truncation_mode: What ``max_length`` cuts: ``"keep_end"`` (the prompt's start first, the same tokens for both
            completions, then a completion's end) or ``"keep_start"`` (each completion's end; TRL's ``KTOTrainer``
            truncates so).
        seq_len: Positions per window (a pair takes its two sequences' tokens less one each).
        batch_size: Windows per batch on each data-parallel replica.
        pack: Pack several pairs into each window (best-fit decreasing, never splitting a pair); ``False``: one pair
            per window, padded. Unpaired examples are always packed (a window's examples make each other's KL
            sequences).
        overflow: A pair longer than ``seq_len`` positions: ``"drop"`` (counted in the packing report) or
            ``"error"`` (names the rows). Shorten pairs with ``max_length``.
        val_fraction: Pairs held out for validation (a seeded random choice, at least one); ``0`` for none.
        shuffle: Shuffle the training windows every epoch.
        seed: Seed of the held-out choice and the permutations.
        num_workers: DataLoader worker processes.
        cache_dir: Where the cache lives (default ``$LIGHTNING_2D_CACHE`` or ``~/.cache/lightning_2d``).
        chat_template: A ``.jinja`` file to render with instead of the tokenizer's template.
        enable_thinking: Passed to the template; ``None``: not passed.
        tools: Tool schemas (JSON) given to every pair's template (a row's own ``tools`` replace them).
        template_kwargs: More template variables (``date_string``, ...).
        max_unprepared_mb: Largest data set (MB of files) encoded when training starts if it has no cache; larger
            ones are refused with the command that prepares them with every core. ``None``: no limit.

    Raises:
        DataError: At construction, arguments out of range (every problem in one message) or a tokenizer that
            cannot be loaded; when the data are encoded (``check_prepared``, before ``lightning-2d fit`` launches, or
            ``setup``), rows of no known format (``PreferenceFormatError``, naming ``file:line``), pairs that the
            template cannot render as one prompt with two completions (``PreferenceEncodingError``), pairs longer
            than ``seq_len`` under ``overflow="error"``, or a data set larger than ``max_unprepared_mb`` without its
            cache.

    Example:
        ```python
        from lightning_2d import LlamaLightningModule, PreferenceDataModule, PreferenceLoss

        data = PreferenceDataModule("pairs.jsonl", tokenizer="Llama-3.1-8B-Instruct/", seq_len=2048, batch_size=4)
        module = LlamaLightningModule(init_from="Llama-3.1-8B-Instruct/", preference=PreferenceLoss(beta=0.1))  # DPO
        trainer.fit(module, data)
        ```
    """

    _data_name = "preference data"

    def __init__(
        self,
        paths: Union[str, list[str], None] = None,
        tokenizer: str = "byte",
        format: str = "auto",
        fields: Optional[dict[str, str]] = None,
        train_on_eos: bool = True,
        max_prompt_length: Optional[int] = None,
        max_length: Optional[int] = None,
        truncation_mode: str = "keep_end",
        seq_len: int = 512,
        batch_size: int = 8,
        pack: bool = True,
        overflow: str = "drop",
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
        problems += truncation_problems(max_prompt_length, max_length, truncation_mode)
        if overflow not in PAIR_OVERFLOW:
            problems.append(f"overflow must be one of {', '.join(map(repr, PAIR_OVERFLOW))}, got {overflow!r}"
                            + (" (a pair is shortened by max_length, not cut by the window)"
                               if overflow == "truncate" else ""))
        if format == "unpaired" and not pack:
            problems.append(_ALONE)
        if problems:
            raise DataError("Invalid PreferenceDataModule arguments:\n  - " + "\n  - ".join(problems))
        check_preference_format(format, fields)
        self.paths, self.format, self.fields = paths, format, dict(fields or {})
        self.seq_len, self.batch_size, self.pack, self.overflow = seq_len, batch_size, pack, overflow
        self.val_fraction, self.shuffle, self.seed, self.num_workers = val_fraction, shuffle, seed, num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
        self.max_unprepared_mb = max_unprepared_mb
        variables = self._init_chat(tokenizer, chat_template, enable_thinking, tools, template_kwargs, "completion",
                                    train_on_eos)
        self.pair_encoder = PreferenceEncoder(self.encoder, max_prompt_length, max_length, truncation_mode)
        self.settings = {"kind": "preference", "template": self.template.digest, "template_kwargs": variables,
                         "tools": tools, "format": format, "fields": self.fields, "train_on_eos": train_on_eos,
                         "max_prompt_length": max_prompt_length, "max_length": max_length,
                         "truncation_mode": truncation_mode}
        self.train_dataset: Optional[Union[PreferenceWindows, UnpairedWindows]] = None
        self.val_dataset: Optional[Union[PreferenceWindows, UnpairedWindows]] = None
        self.packing: Optional[Union[PreferencePackingReport, UnpairedPackingReport]] = None
        self._window_units: Optional[np.ndarray] = None

    #: Chosen and rejected are separate documents of a window, also unpacked: the model must take position_ids
    #: (the strategies check it).
    @property
    def document_mask(self) -> bool:
        return True

    @property
    def preference_units(self) -> Optional[str]:
        """What the rows are, ``"pairs"`` or ``"examples"`` (unpaired, KTO's), which the preference loss checks
        before training: the format's, else (``"auto"``) the cache's when built, else the first row's (``None``: a
        first row that cannot be read, reported when the data is encoded)."""
        if self.format != "auto" or self.paths is None:
            return "examples" if self.format == "unpaired" else "pairs"
        meta = read_meta(self.cache_folder)
        if meta is not None:
            return "examples" if meta.get("counts", {}).get("examples") else "pairs"
        try:
            for piece in plan_chat_pieces(self.sources[:1], 1 << 16)[:1]:
                for _, record, error in read_rows(piece):
                    return None if error else ("examples" if is_unpaired_row(record, self.fields) else "pairs")
        except (DataError, OSError):
            pass
        return None

    def _builtin_file(self) -> Path:
        return stdlib_preference_file(self.cache_dir, unpaired=self.format == "unpaired")

    def _piece_encoder(self) -> ChatPieceEncoder:
        return PreferencePieceEncoder(self.pair_encoder, self.format, self.fields)

    # ---- splits and windows ----
    def _split(self) -> tuple[Union[PreferenceWindows, UnpairedWindows],
                              Optional[Union[PreferenceWindows, UnpairedWindows]]]:
        meta = self._meta()
        counts = meta.get("counts", {})
        if counts.get("examples") and counts.get("pairs"):
            raise DataError(
                f"The preference data ({len(self.sources):,} file(s)) mixes {counts['pairs']:,} pair(s) (chosen and"
                f" rejected) and {counts['examples']:,} unpaired example(s) (completion and label); a data set is one"
                " or the other (DPO and its kin train on pairs, KTO on examples): split the files, or read only one"
                " kind with format='explicit' or 'unpaired'"
            )
        if counts.get("examples"):
            return self._split_unpaired(meta)
        folder = self.cache_folder
        lengths = np.diff(np.fromfile(folder / "offsets.bin", dtype=np.int64)) - 1  # positions of each sequence
        targets = np.fromfile(folder / "targets.bin", dtype=np.int64)
        positions = lengths[0::2] + lengths[1::2]  # of each pair: chosen's and rejected's
        too_long, train_pairs, val_pairs = self._fitting(
            meta, positions, lambda p: 2 * p, "pair", " (chosen and rejected together, one less than the tokens of each)")
        train_windows = pack_windows(positions[train_pairs], self.seq_len, self.pack)
        val_windows = pack_windows(positions[val_pairs], self.seq_len, self.pack)
        self._window_units = np.diff(train_windows.offsets)
        trained = int(targets[2 * train_pairs].sum() + targets[2 * train_pairs + 1].sum())
        filled = int(positions[train_pairs].sum())
        total = len(train_windows) * self.seq_len
        self.packing = PreferencePackingReport(
            len(train_windows), 2 * len(train_pairs), total, trained, filled - trained, total - filled,
            dropped=int(too_long.size), pairs=len(train_pairs),
            prompts_truncated=int(counts.get("prompts_truncated", 0)),
            completions_truncated=int(counts.get("completions_truncated", 0)), no_target=int(meta["no_target"]),
        )
        train = PreferenceWindows(folder, train_windows, train_pairs, self.seq_len, self.pad_id)
        val = PreferenceWindows(folder, val_windows, val_pairs, self.seq_len, self.pad_id) if len(val_pairs) else None
        return train, val

    def _fitting(self, meta: dict[str, Any], positions: np.ndarray, conversation: Callable[[int], int], unit: str,
                 measure: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(too_long, training, held_out)``: the units (pairs, unpaired examples) longer than ``seq_len`` positions
        (``measure`` says how a unit's are counted; named by row under ``overflow='error'``, else dropped) and the
        others split as ``val_fraction`` says. ``conversation(u)``: unit ``u``'s first conversation in the cache."""
        too_long = np.flatnonzero(positions > self.seq_len)
        if too_long.size and self.overflow == "error":
            rows = np.fromfile(self.cache_folder / "rows.bin", dtype=np.int64).reshape(-1, 2)
            shown = [f"{row_name(meta['sources'], *map(int, rows[conversation(int(u))]))} ({int(positions[u])}"
                     " positions)" for u in too_long[:5]]
            raise DataError(
                f"{too_long.size} {unit}(s) take more than seq_len ({self.seq_len}) positions{measure} under"
                f" overflow='error': {', '.join(shown)}{', …' if too_long.size > 5 else ''}; raise seq_len, shorten"
                f" the {unit}s with max_length, or set overflow='drop'"
            )
        keep = np.ones(len(positions), dtype=bool)
        keep[too_long] = False
        training, held = held_out(np.flatnonzero(keep), self.val_fraction, self.seed, "preference data", f"{unit}(s)")
        return too_long, training, held

    def _split_unpaired(self, meta: dict[str, Any]) -> tuple[UnpairedWindows, Optional[UnpairedWindows]]:
        """The splits of unpaired examples, each example packed with its KL sequence (the module docstring)."""
        if not self.pack:
            raise DataError(_ALONE)
        folder = self.cache_folder
        lengths = np.diff(np.fromfile(folder / "offsets.bin", dtype=np.int64)) - 1  # positions of each example
        targets = np.fromfile(folder / "targets.bin", dtype=np.int64)
        labels = np.fromfile(folder / "labels.bin", dtype=np.uint8)
        positions = 2 * lengths  # the example's and, in all, its KL sequence's: the window's completions rotated
        too_long, train_examples, val_examples = self._fitting(
            meta, positions, lambda e: e, "example",
            " with their KL sequence (twice an example's positions, one less than its tokens)")
        train_windows = pack_windows(positions[train_examples], self.seq_len, True)
        val_windows = pack_windows(positions[val_examples], self.seq_len, True)
        per_window = np.diff(train_windows.offsets)
        self._window_units = per_window
        trained = int(targets[train_examples].sum())
        filled = int(positions[train_examples].sum())
        total = len(train_windows) * self.seq_len
        counts = meta.get("counts", {})
        self.packing = UnpairedPackingReport(
            len(train_windows), len(train_examples), total, trained, filled - trained, total - filled,
            dropped=int(too_long.size), examples=len(train_examples),
            desirable=int((labels[train_examples] > 0).sum()), alone=int((per_window == 1).sum()),
            prompts_truncated=int(counts.get("prompts_truncated", 0)),
            completions_truncated=int(counts.get("completions_truncated", 0)), no_target=int(meta["no_target"]),
        )
        truncation = self.pair_encoder.truncation
        train = UnpairedWindows(folder, train_windows, train_examples, self.seq_len, self.pad_id, truncation)
        val = (UnpairedWindows(folder, val_windows, val_examples, self.seq_len, self.pad_id, truncation)
               if len(val_examples) else None)
        return train, val

    # ---- loaders ----
    def train_dataloader(self) -> DataLoader:
        """Batches counting the pairs (the unpaired examples) of their optimizer step (``step_pairs``,
        ``step_examples``), what a preference loss averages over."""
        assert self.train_dataset is not None, "setup() first"
        count_key = "step_examples" if isinstance(self.train_dataset, UnpairedWindows) else "step_pairs"
        return self._loader(self.train_dataset, train=True, targets=self._window_units,
                            describe=lambda n: f"packs into {n} window(s) of {self.seq_len}", count_key=count_key)

    # ---- a reference model's log-probabilities, computed once (``PreferenceLoss(precompute_reference=True)``) ----
    @property
    def sequence_count(self) -> int:
        """The cache's sequences (two a pair), what ``set_reference_log_probs`` gives a value each."""
        return len(np.fromfile(self.cache_folder / "offsets.bin", dtype=np.int64)) - 1

    def reference_loaders(self) -> list[DataLoader]:
        """Every window of the training and held-out splits once over the data-parallel replicas, in even batches
        (``ReferenceCover``), for the pass that computes the reference's log-probabilities."""
        assert self.train_dataset is not None, "setup() first"
        replicas, rank = self._replicas()
        splits = [self.train_dataset] + ([self.val_dataset] if self.val_dataset is not None else [])
        return [DataLoader(ReferenceCover(split, replicas, rank, self.batch_size), batch_size=self.batch_size,
                           num_workers=self.num_workers) for split in splits]

    def reference_file(self, key: str) -> Path:
        """Where the reference log-probabilities of the reference ``key`` (a digest of its weights) live: in the
        cache, beside the data they score."""
        return self.cache_folder / "reference" / f"{key}.npy"

    def load_reference_log_probs(self, key: str) -> Optional[np.ndarray]:
        """The values a pass saved for reference ``key``, else ``None`` (read as plain numbers: no pickle)."""
        path = self.reference_file(key)
        if not path.is_file():
            return None
        values = np.load(path, allow_pickle=False)
        if values.shape != (self.sequence_count,) or values.dtype != np.float32:
            raise DataError(f"{path} holds {values.dtype} values of shape {values.shape}, not one float32 per"
                            f" sequence of the cache ({self.sequence_count}); delete it to compute them again")
        return values

    def save_reference_log_probs(self, key: str, values: np.ndarray, identity: dict[str, Any]) -> Path:
        """Write ``values`` (one per cache sequence) for reference ``key`` whole or not at all, ``identity`` (what
        the key digests) beside them as JSON for people."""
        path = self.reference_file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
        np.save(partial, np.asarray(values, dtype=np.float32), allow_pickle=False)
        path.with_suffix(".json").write_text(json.dumps(identity, indent=1, sort_keys=True, default=str) + "\n")
        os.replace(partial, path)
        return path

    def set_reference_log_probs(self, values: np.ndarray) -> None:
        """Give every window of both splits its sequences' reference log-probabilities (``reference_logps``)."""
        if values.shape != (self.sequence_count,):
            raise DataError(f"reference log-probabilities of shape {values.shape} for a cache of"
                            f" {self.sequence_count} sequences")
        for split in (self.train_dataset, self.val_dataset):
            if split is not None:
                split.reference_logps = np.asarray(values, dtype=np.float32)


class ReferenceCover(Dataset):
    """Every window of ``windows`` once over ``replicas`` data-parallel replicas, each in the same number of
    ``batch_size`` batches (the reference's forwards hold collectives every rank must join): replica ``rank`` takes
    windows ``rank, rank + replicas, …``, then padding windows whose ``sequence_numbers`` are all ``-1`` (scored,
    counted for nothing)."""

    def __init__(self, windows: PreferenceWindows, replicas: int, rank: int, batch_size: int) -> None:
        per_replica = math.ceil(len(windows) / (replicas * batch_size)) * batch_size
        self.windows = windows
        self.indices = [index if index < len(windows) else -1
                        for index in range(rank, per_replica * replicas, replicas)]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        index = self.indices[item]
        sample = self.windows[max(index, 0)]
        if index < 0:
            sample["sequence_numbers"] = torch.full_like(sample["sequence_numbers"], NO_SEQUENCE)
        return sample


#: Why unpaired examples are always packed.
_ALONE = ("pack=False puts one unpaired example in each window, and KTO's KL reference point pairs each example's"
          " prompt with another example's completion of its window; use pack=True (or format='explicit' for pairs)")
