"""A preference pair as two encoded conversations, the prompt shared and truncated as TRL truncates.

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

A pair where either completion keeps no trained token is dropped (the piece encoder counts it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import numpy as np

from lightning_2d.data.chat.cache import ChatPieceEncoder, PieceResult
from lightning_2d.data.chat.encode import ChatEncoder, EncodedChat
from lightning_2d.data.preference.formats import PreferencePair, to_pair
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
        return self._truncated(chosen, rejected, prompt)

    def _truncated(self, chosen: EncodedChat, rejected: EncodedChat, prompt: int) -> EncodedPair:
        drop = 0  # prompt tokens dropped from its start, the same in both sequences
        if self.max_prompt_length is not None:
            drop = max(0, prompt - self.max_prompt_length)
        keep = None  # completion tokens kept of each
        if self.max_length is not None:
            longest = prompt - drop + max(len(chosen.ids), len(rejected.ids)) - prompt  # the longer sequence now
            if self.truncation_mode == "keep_end":
                drop += min(prompt - drop, max(0, longest - self.max_length))
            keep = max(0, self.max_length - (prompt - drop))
        cut = 0
        sequences = []
        for encoded in (chosen, rejected):
            stop = len(encoded.ids) if keep is None else min(len(encoded.ids), prompt + keep)
            cut += stop < len(encoded.ids)
            sequences.append(encoded if (drop, stop) == (0, len(encoded.ids)) else
                             replace(encoded, ids=encoded.ids[drop:stop], trained=encoded.trained[drop:stop]))
        return EncodedPair(sequences[0], sequences[1], prompt - drop, drop > 0, cut)


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
    pairs) and, as ``no_target``, the pairs dropped because a completion keeps no trained token."""

    data_name = "preference data"

    def __init__(self, encoder: PreferenceEncoder, format: str, fields: Optional[Mapping[str, str]]) -> None:
        super().__init__(encoder.encoder, format, fields)
        self.pairs = encoder

    def add_row(self, record: Any, where: str, row: int, out: PieceResult) -> None:
        encoded = self.pairs.encode(to_pair(record, self.format, self.fields, where), where)
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
        return (f"No pair of the preference data ({rows} row(s)) keeps a token to train on in both completions"
                f" ({no_target} without one): check the completions' roles"
                + (f" and the truncation ({limits}, truncation_mode={self.pairs.truncation_mode!r})" if limits else ""))
