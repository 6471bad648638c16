"""A preference pair as two encoded conversations, the prompt shared and truncated as TRL truncates; an unpaired
example as one.

``PreferenceEncoder.encode`` renders ``prompt + chosen`` and ``prompt + rejected`` with a ``ChatEncoder`` whose
``train_on`` is ``"completion"``: the completion's tokens are the trained ones (with its end-of-turn token when
``train_on_eos``), everything before the first trained token is the prompt (the assistant's header included).
Both must have the same prompt tokens: a template or tokenizer that writes the prompt differently depending on the
answer after it (a token merging the prompt's end with the completion's start) is refused naming the row.

Truncation, both optional (``None``: no limit):

- ``max_prompt_length``: the prompt's tokens beyond it are dropped from its start (the end, nearest the answer,
  stays).
- ``max_length``: tokens of each sequence (prompt and completion). ``truncation_mode="keep_end"`` drops the prompt's
  start first (the same tokens from both sequences, as many as the longer one needs: the two answers keep one
  context), then cuts a completion's end if it alone is still too long; ``"keep_start"`` keeps the prompt and cuts
  each completion's end.

An unpaired example (``encode_example``: ``prompt + completion``) is truncated by the same rules, alone; TRL's
``KTOTrainer`` cuts ``max_length`` from the end (``truncation_mode="keep_start"``) and has no ``max_prompt_length``.

A pair where either completion keeps no trained token is dropped, and so is an example without one (the piece
encoder counts them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import numpy as np

from lightning_2d.data.chat.cache import ChatPieceEncoder, PieceResult
from lightning_2d.data.chat.encode import ChatEncoder, EncodedChat
from lightning_2d.data.preference.formats import PreferencePair, UnpairedExample, to_example
from lightning_2d.data.sources import DataError

TRUNCATION_MODES = ("keep_end", "keep_start")


class PreferenceEncodingError(DataError):
    """A pair whose two sequences do not share their prompt's tokens."""


@dataclass
class EncodedPair:
    """One pair's two sequences, truncated.

    Args:
        chosen: ``prompt + chosen``'s tokens (``text`` and ``spans`` are the rendering's, before truncation).
        rejected: ``prompt + rejected``'s.
        prompt_tokens: Tokens of the (truncated) prompt, the same in both.
        prompt_truncated: The prompt lost tokens (``max_prompt_length`` or ``max_length`` under ``"keep_end"``).
        completions_truncated: Completions (0, 1 or 2) whose end was cut by ``max_length``.
    """

    chosen: EncodedChat
    rejected: EncodedChat
    prompt_tokens: int
    prompt_truncated: bool = False
    completions_truncated: int = 0

    @property
    def trained(self) -> bool:
        """Both completions keep a token to train on."""
        return self.chosen.num_targets > 0 and self.rejected.num_targets > 0


@dataclass
class EncodedExample:
    """One unpaired example's sequence, truncated.

    Args:
        sequence: ``prompt + completion``'s tokens (``text`` and ``spans`` are the rendering's, before truncation).
        desirable: The example's label.
        prompt_tokens: Tokens of the (truncated) prompt.
        prompt_truncated: The prompt lost tokens.
        completion_truncated: ``max_length`` cut the completion's end.
    """

    sequence: EncodedChat
    desirable: bool
    prompt_tokens: int
    prompt_truncated: bool = False
    completion_truncated: bool = False

    @property
    def trained(self) -> bool:
        """The completion keeps a token to train on."""
        return self.sequence.num_targets > 0


@dataclass(frozen=True)
class Truncation:
    """The truncation settings (see the module docstring), as data a dataset can carry (KTO's KL sequences are cut
    by them when a window is read).

    Args:
        max_prompt_length: Most prompt tokens kept (from its end); ``None``: all.
        max_length: Most tokens of each sequence; ``None``: all.
        mode: ``"keep_end"`` or ``"keep_start"`` (what ``max_length`` cuts first).
    """

    max_prompt_length: Optional[int] = None
    max_length: Optional[int] = None
    mode: str = "keep_end"

    def bounds(self, longest: int, prompt: int) -> tuple[int, Optional[int]]:
        """For sequences sharing their first ``prompt`` tokens, the longest ``longest`` tokens: the prompt tokens to
        drop from the start of each, and the completion tokens each keeps (``None``: all)."""
        drop = 0
        if self.max_prompt_length is not None:
            drop = max(0, prompt - self.max_prompt_length)
        keep = None
        if self.max_length is not None:
            if self.mode == "keep_end":
                drop += min(prompt - drop, max(0, longest - drop - self.max_length))
            keep = max(0, self.max_length - (prompt - drop))
        return drop, keep


class PreferenceEncoder:
    """Pairs → ``EncodedPair`` with one ``ChatEncoder`` and the truncation settings (see the module docstring).

    Args:
        encoder: The tokenizer and template; its ``train_on`` must be ``"completion"``.
        max_prompt_length: Most prompt tokens kept (from its end); ``None``: all.
        max_length: Most tokens of each sequence; ``None``: all.
        truncation_mode: ``"keep_end"`` or ``"keep_start"`` (what ``max_length`` cuts first).
    """

    def __init__(self, encoder: ChatEncoder, max_prompt_length: Optional[int] = None,
                 max_length: Optional[int] = None, truncation_mode: str = "keep_end") -> None:
        problems = truncation_problems(max_prompt_length, max_length, truncation_mode)
        if encoder.train_on != "completion":
            problems.append(f"the chat encoder trains on {encoder.train_on!r}; a preference pair trains on its"
                            " completions (train_on='completion')")
        if problems:
            raise DataError("Invalid preference encoding:\n  - " + "\n  - ".join(problems))
        self.encoder = encoder
        self.max_prompt_length, self.max_length, self.truncation_mode = max_prompt_length, max_length, truncation_mode
        self.truncation = Truncation(max_prompt_length, max_length, truncation_mode)

    def encode(self, pair: PreferencePair, where: str = "row") -> EncodedPair:
        """The pair's two sequences, their shared prompt checked, truncated.

        Raises:
            PreferenceEncodingError: The two sequences' tokens before their first trained token differ.
        """
        chosen, rejected = (self.encoder.encode(c, where) for c in pair.conversations())
        if not (chosen.trained.any() and rejected.trained.any()):
            return EncodedPair(chosen, rejected, 0)  # nothing to train on: dropped, no prompt to compare
        prompt = int(np.argmax(chosen.trained))
        other = int(np.argmax(rejected.trained))
        if prompt != other or not np.array_equal(chosen.ids[:prompt], rejected.ids[:other]):
            differ = next((i for i in range(min(prompt, other)) if chosen.ids[i] != rejected.ids[i]),
                          min(prompt, other))
            raise PreferenceEncodingError(
                f"{where}: the prompt is {prompt} token(s) before the chosen completion and {other} before the"
                f" rejected one, differing from token {differ} on: the chat template or tokenizer writes the prompt"
                " differently depending on the answer after it (a token joining the prompt's end and the answer's"
                " start); start both completions alike (e.g. without leading whitespace), or fix the template"
            )
        (chosen, rejected), drop, cut = self.truncated((chosen, rejected), prompt)
        return EncodedPair(chosen, rejected, prompt - drop, drop > 0, cut)

    def encode_example(self, example: UnpairedExample, where: str = "row") -> EncodedExample:
        """An unpaired example's sequence, truncated as a pair's (alone)."""
        encoded = self.encoder.encode(example.conversation(), where)
        if not encoded.trained.any():
            return EncodedExample(encoded, example.desirable, 0)  # nothing to train on: dropped
        prompt = int(np.argmax(encoded.trained))
        (sequence,), drop, cut = self.truncated((encoded,), prompt)
        return EncodedExample(sequence, example.desirable, prompt - drop, drop > 0, cut > 0)

    def truncated(self, sequences: tuple[EncodedChat, ...],
                  prompt: int) -> tuple[tuple[EncodedChat, ...], int, int]:
        """``sequences`` (sharing their first ``prompt`` tokens) cut by the truncation settings (the module docstring),
        the same prompt tokens dropped from each; with the number of prompt tokens dropped and of completions cut."""
        drop, keep = self.truncation.bounds(max(len(encoded.ids) for encoded in sequences), prompt)
        cut = 0
        out = []
        for encoded in sequences:
            stop = len(encoded.ids) if keep is None else min(len(encoded.ids), prompt + keep)
            cut += stop < len(encoded.ids)
            out.append(encoded if (drop, stop) == (0, len(encoded.ids)) else
                       replace(encoded, ids=encoded.ids[drop:stop], trained=encoded.trained[drop:stop]))
        return tuple(out), drop, cut


def truncation_problems(max_prompt_length: Optional[int], max_length: Optional[int],
                        truncation_mode: str) -> list[str]:
    """The problems of the truncation settings (each names the value)."""
    problems = []
    for label, value in (("max_prompt_length", max_prompt_length), ("max_length", max_length)):
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"{label} must be a positive integer or None (no limit), got {value!r}")
    if truncation_mode not in TRUNCATION_MODES:
        problems.append(f"truncation_mode must be one of {', '.join(map(repr, TRUNCATION_MODES))}, got"
                        f" {truncation_mode!r}")
    return problems


class PreferencePieceEncoder(ChatPieceEncoder):
    """A piece's rows as pairs: pair ``k`` of the cache is its conversations ``2k`` (chosen) and ``2k + 1``
    (rejected), both of the row; counts ``pairs``, ``prompts_truncated`` and ``completions_truncated`` (of the kept
    pairs) and, as ``no_target``, the pairs dropped because a completion keeps no trained token. An unpaired row is
    one conversation, its label the cache's (1: desirable), counted as ``examples`` (and ``desirable``)."""

    data_name = "preference data"

    def __init__(self, encoder: PreferenceEncoder, format: str, fields: Optional[Mapping[str, str]]) -> None:
        super().__init__(encoder.encoder, format, fields)
        self.pairs = encoder

    def add_row(self, record: Any, where: str, row: int, out: PieceResult) -> None:
        unit = to_example(record, self.format, self.fields, where)
        if isinstance(unit, UnpairedExample):
            example = self.pairs.encode_example(unit, where)
            if not example.trained:
                out.no_target += 1
                return
            out.add(example.sequence, row, label=int(example.desirable))
            out.counts.update(Counter(examples=1, desirable=int(example.desirable),
                                      prompts_truncated=int(example.prompt_truncated),
                                      completions_truncated=int(example.completion_truncated)))
            return
        encoded = self.pairs.encode(unit, where)
        if not encoded.trained:
            out.no_target += 1
            return
        out.add(encoded.chosen, row)
        out.add(encoded.rejected, row)
        out.counts.update(Counter(pairs=1, prompts_truncated=int(encoded.prompt_truncated),
                                  completions_truncated=encoded.completions_truncated))

    def nothing_kept(self, rows: int, no_target: int) -> str:
        limits = ", ".join(f"{k}={v}" for k, v in (("max_prompt_length", self.pairs.max_prompt_length),
                                                     ("max_length", self.pairs.max_length)) if v is not None)
        return (f"No pair or example of the preference data ({rows} row(s)) keeps a token to train on in its"
                f" completions ({no_target} without one): check the completions' roles"
                + (f" and the truncation ({limits}, truncation_mode={self.pairs.truncation_mode!r})" if limits else ""))
