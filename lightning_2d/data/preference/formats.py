"""Rows of preference data sets as pairs or unpaired examples, with TRL's field names: a prompt and the chosen and
the rejected completion, or a prompt, one completion and its label.

- ``"explicit"``: ``prompt``, ``chosen`` and ``rejected``, each a string (the prompt one user message, a completion
  one assistant message) or a list of OpenAI messages (``role``/``content``).
- ``"implicit"`` (the prompt implicit): ``chosen`` and ``rejected`` are whole conversations (message lists) that
  share their start; the prompt is their longest common prefix of messages, which must be non-empty and end right
  before an assistant turn of both.
- ``"unpaired"`` (TRL's KTO format): ``prompt`` and ``completion`` (each a string or a list of messages) and
  ``label``, ``true`` when the completion is desirable, ``false`` when not; each row is one example.
- ``"auto"``: unpaired when the row has a ``completion`` and a ``label`` (and no ``chosen``), else explicit when it
  has a ``prompt``, else implicit. A data set is all pairs or all unpaired examples (``PreferenceDataModule``
  refuses a mix).

``fields`` renames as ``ChatDataModule``'s does (``{"chosen": "preferred", "content": "text"}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from lightning_2d.data.chat.formats import ChatFormatError, Conversation, as_messages, as_turns, field_value

PREFERENCE_FORMATS = ("auto", "explicit", "implicit", "unpaired")
#: The names ``fields`` may rename (the canonical name → the data set's).
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected", "role", "content", "tools", "completion", "label")


class PreferenceFormatError(ChatFormatError):
    """A row that is not a preference pair or unpaired example of the configured format."""


@dataclass(frozen=True)
class PreferencePair:
    """One row as a prompt and two completions of it.

    Args:
        prompt: The messages before the completions (non-empty).
        chosen: The preferred completion's messages (the first an assistant message).
        rejected: The dispreferred completion's messages (the first an assistant message).
        tools: The row's own tool schemas, if it has some.
    """

    prompt: tuple[Mapping[str, Any], ...]
    chosen: tuple[Mapping[str, Any], ...]
    rejected: tuple[Mapping[str, Any], ...]
    tools: Optional[tuple[Any, ...]] = None

    def conversations(self) -> tuple[Conversation, Conversation]:
        """``(prompt + chosen, prompt + rejected)``, each trained from the completion on (``train_on="completion"``)."""
        start = len(self.prompt)
        return (Conversation(self.prompt + self.chosen, start, self.tools),
                Conversation(self.prompt + self.rejected, start, self.tools))


@dataclass(frozen=True)
class UnpairedExample:
    """One row of unpaired preference data (TRL's KTO format): a prompt, a completion and whether it is desirable.

    Args:
        prompt: The messages before the completion (non-empty).
        completion: The completion's messages (the first an assistant message).
        desirable: The row's ``label``: the completion is one to learn from (``True``) or to move away from.
        tools: The row's own tool schemas, if it has some.
    """

    prompt: tuple[Mapping[str, Any], ...]
    completion: tuple[Mapping[str, Any], ...]
    desirable: bool
    tools: Optional[tuple[Any, ...]] = None

    def conversation(self) -> Conversation:
        """``prompt + completion``, trained from the completion on (``train_on="completion"``)."""
        return Conversation(self.prompt + self.completion, len(self.prompt), self.tools)


def check_preference_format(format: str, fields: Optional[Mapping[str, str]]) -> None:
    """Refuse an unknown format or field name (at construction, before anything is read)."""
    problems = []
    if format not in PREFERENCE_FORMATS:
        problems.append(f"format must be one of {', '.join(map(repr, PREFERENCE_FORMATS))}, got {format!r}")
    unknown = sorted(set(fields or {}) - set(PREFERENCE_FIELDS))
    if unknown:
        problems.append(f"fields renames {unknown}, which are not preference fields; the names it may rename:"
                        f" {', '.join(PREFERENCE_FIELDS)}")
    if problems:
        raise PreferenceFormatError("Invalid preference data format:\n  - " + "\n  - ".join(problems))


def to_pair(record: Any, format: str = "auto", fields: Optional[Mapping[str, str]] = None,
            where: str = "row") -> PreferencePair:
    """One row as a ``PreferencePair``.

    Args:
        record: The row (a JSON object / Parquet row as a dict).
        format: One of ``PREFERENCE_FORMATS``.
        fields: Renamed fields (canonical name → the data set's name).
        where: The row's place for messages (``path:line``).

    Raises:
        PreferenceFormatError: The row is not a pair of ``format``; the message names ``where`` and the fix.
    """
    name = _names(fields)
    if not isinstance(record, Mapping):
        raise PreferenceFormatError(f"{where} is a {type(record).__name__}, not an object with a preference pair's"
                                    " fields")
    if _is_unpaired(record, name):
        raise PreferenceFormatError(
            f"{where} is an unpaired row ({name['prompt']!r}, {name['completion']!r}, {name['label']!r}: TRL's KTO"
            f" format), not a pair{f' of format={format!r}' if format != 'auto' else ''}; read it as an unpaired"
            f" example (format='unpaired' or 'auto', to_example) for KTO, or give each row {name['chosen']!r} and"
            f" {name['rejected']!r} completions of one prompt"
        )
    if name["chosen"] not in record or name["rejected"] not in record:
        raise PreferenceFormatError(
            f"{where} has no {name['chosen'] if name['chosen'] not in record else name['rejected']!r} (found"
            f" {sorted(record)[:12]}): a preference row has {name['chosen']!r} and {name['rejected']!r} (and"
            f" {name['prompt']!r} unless both are whole conversations); rename the data set's fields with"
            " fields={...} or fix the row"
        )
    kind = ("explicit" if name["prompt"] in record else "implicit") if format == "auto" else format
    tools = record.get(name["tools"])
    tools = tuple(tools) if isinstance(tools, (list, tuple)) and tools else None
    if kind == "explicit":
        prompt = as_turns(field_value(record, name["prompt"], where), "user", name, where, name["prompt"])
        chosen = as_turns(record[name["chosen"]], "assistant", name, where, name["chosen"])
        rejected = as_turns(record[name["rejected"]], "assistant", name, where, name["rejected"])
        for what, completion in ((name["chosen"], chosen), (name["rejected"], rejected)):
            if completion[0]["role"] != "assistant":
                raise PreferenceFormatError(
                    f"{where}: {what} starts with a {completion[0]['role']} message; a completion starts with the"
                    f" assistant's answer (put the turns before it in {name['prompt']!r})"
                )
        return PreferencePair(prompt, chosen, rejected, tools)
    return _implicit(record, name, where, tools)


def to_example(record: Any, format: str = "auto", fields: Optional[Mapping[str, str]] = None,
               where: str = "row") -> "PreferencePair | UnpairedExample":
    """One row as a ``PreferencePair`` or, for an unpaired row (``format="unpaired"``, or ``"auto"`` and a row with
    a ``completion`` and a ``label``), an ``UnpairedExample``; arguments as ``to_pair``'s.

    Raises:
        PreferenceFormatError: The row is neither of ``format``; the message names ``where`` and the fix.
    """
    name = _names(fields)
    unpaired = format == "unpaired" or (format == "auto" and isinstance(record, Mapping) and _is_unpaired(record, name))
    if not unpaired:
        return to_pair(record, format, fields, where)
    if not isinstance(record, Mapping):
        raise PreferenceFormatError(f"{where} is a {type(record).__name__}, not an object with an unpaired example's"
                                    " fields")
    if name["chosen"] in record:
        raise PreferenceFormatError(
            f"{where} is a pair ({name['chosen']!r}, {name['rejected']!r}), but format='unpaired' reads one"
            f" {name['completion']!r} and its {name['label']!r} a row; use format='auto' (or 'explicit') for pairs, or"
            f" write each completion as its own row (lightning_2d.data.preference.unpaired_rows)"
        )
    tools = record.get(name["tools"])
    tools = tuple(tools) if isinstance(tools, (list, tuple)) and tools else None
    prompt = as_turns(field_value(record, name["prompt"], where), "user", name, where, name["prompt"])
    completion = as_turns(field_value(record, name["completion"], where), "assistant", name, where,
                          name["completion"])
    if completion[0]["role"] != "assistant":
        raise PreferenceFormatError(
            f"{where}: {name['completion']} starts with a {completion[0]['role']} message; a completion starts with the"
            f" assistant's answer (put the turns before it in {name['prompt']!r})"
        )
    label = field_value(record, name["label"], where)
    if not (isinstance(label, (bool, np.bool_)) or (isinstance(label, (int, np.integer)) and label in (0, 1))):
        raise PreferenceFormatError(
            f"{where}: {name['label']} is {label!r}; an unpaired example's label is true (the completion is desirable)"
            " or false (undesirable); fix or drop the row"
        )
    return UnpairedExample(prompt, completion, bool(label), tools)


def unpaired_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Explicit pair rows (``prompt``, ``chosen``, ``rejected``) as unpaired rows, TRL's ``unpair_preference_dataset``:
    every chosen completion a desirable example, then every rejected one an undesirable example, in the rows' order
    (a prompt's two examples far apart: KTO's KL sequences pair a prompt with its window's neighbour's completion)."""
    rows = list(rows)
    return ([{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
            + [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in rows])


def _names(fields: Optional[Mapping[str, str]]) -> dict[str, str]:
    """Each preference field's name in the data set (``fields`` renames them)."""
    return {f: (fields or {}).get(f, f) for f in PREFERENCE_FIELDS}


def _is_unpaired(record: Mapping[str, Any], name: Mapping[str, str]) -> bool:
    """A row of TRL's unpaired (KTO) format: a completion and its label, no chosen one."""
    return name["chosen"] not in record and name["completion"] in record and name["label"] in record


def is_unpaired_row(record: Any, fields: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``format="auto"`` reads ``record`` as an unpaired example (a ``completion`` and a ``label``, no
    ``chosen``)."""
    return isinstance(record, Mapping) and _is_unpaired(record, _names(fields))


def _implicit(record: Mapping[str, Any], name: Mapping[str, str], where: str,
              tools: Optional[tuple[Any, ...]]) -> PreferencePair:
    """The pair of two conversations sharing their start: the prompt is their longest common prefix of messages."""
    for key in ("chosen", "rejected"):
        if isinstance(record[name[key]], str):
            raise PreferenceFormatError(
                f"{where}: {name[key]} is a string and the row has no {name['prompt']!r}: with an implicit prompt"
                f" {name['chosen']!r} and {name['rejected']!r} are whole conversations (lists of messages);"
                f" give the row a {name['prompt']!r}, or both completions as conversations"
            )
    chosen = as_messages(record[name["chosen"]], name, where, name["chosen"])
    rejected = as_messages(record[name["rejected"]], name, where, name["rejected"])
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    fix = (f"give the row an explicit {name['prompt']!r} (format='explicit'), or make {name['chosen']!r} and"
           f" {name['rejected']!r} the same conversation up to the assistant turn where they differ")
    if shared == 0:
        raise PreferenceFormatError(
            f"{where}: {name['chosen']} and {name['rejected']} share no first message, so there is no prompt"
            f" (implicit prompt: their longest common prefix of messages); {fix}"
        )
    if shared == len(chosen) or shared == len(rejected):
        which = (f"{name['chosen']} and {name['rejected']} are the same conversation" if len(chosen) == len(rejected)
                 else f"{name['chosen'] if shared == len(chosen) else name['rejected']} is all of the other's start")
        raise PreferenceFormatError(f"{where}: {which}, so one of them has no completion after the shared prompt;"
                                    f" {fix}")
    roles = (chosen[shared]["role"], rejected[shared]["role"])
    if roles != ("assistant", "assistant"):
        raise PreferenceFormatError(
            f"{where}: {name['chosen']} and {name['rejected']} first differ at message {shared} ({roles[0]} /"
            f" {roles[1]}), not at an assistant turn: the shared prompt must end right before the assistant's"
            f" answer; {fix}"
        )
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:], tools)
