"""Rows of chat data sets as conversations: OpenAI messages, prompt/completion, Alpaca, ShareGPT.

``to_conversation(record, format, fields, where)`` turns one row into a ``Conversation`` (its messages and
where its completion starts), or raises ``ChatFormatError`` naming the row (``file:line``) and the fix:
a row without any chat format's fields, an unknown role, content that is not a string.

With ``format="auto"`` each row is read by the fields it has (``messages``; ``prompt`` + ``completion``;
``instruction`` + ``output``; ``conversations`` of ``from``/``value`` or ``role``/``content``). ``fields``
renames: ``{"messages": "dialog", "role": "speaker", "content": "text"}`` reads a data set that calls them so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lightning_2d.data.sources import DataError

FORMATS = ("auto", "messages", "prompt_completion", "alpaca", "sharegpt")
#: The names ``fields`` may rename (the canonical name → the data set's).
FIELD_NAMES = ("messages", "role", "content", "prompt", "completion", "instruction", "input", "output", "system",
               "conversations", "from", "value", "tools")
ROLES = ("system", "user", "assistant", "tool")
#: ShareGPT's speakers (``from``) and the roles they are.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "tool": "tool",
                  "function_call": "assistant", "observation": "tool", "function": "tool"}


class ChatFormatError(DataError):
    """A row that is not a conversation of the configured format."""


@dataclass(frozen=True)
class Conversation:
    """One row as messages.

    Args:
        messages: ``[{"role", "content", ...}]`` (other keys, e.g. ``tool_calls`` or ``reasoning_content``, kept).
        completion_start: Index of the first message of the completion (``train_on="completion"``): the
            completion of a prompt/completion row; else everything after the last user message.
        tools: The row's own tool schemas, if it has some.
    """

    messages: tuple[Mapping[str, Any], ...]
    completion_start: int
    tools: Optional[tuple[Any, ...]] = None


def check_format(format: str, fields: Optional[Mapping[str, str]]) -> None:
    """Refuse an unknown format or field name (at construction, before anything is read)."""
    problems = []
    if format not in FORMATS:
        problems.append(f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
    unknown = sorted(set(fields or {}) - set(FIELD_NAMES))
    if unknown:
        problems.append(f"fields renames {unknown}, which are not chat fields; the names it may rename:"
                        f" {', '.join(FIELD_NAMES)}")
    if problems:
        raise ChatFormatError("Invalid chat data format:\n  - " + "\n  - ".join(problems))


def _detect(record: Mapping[str, Any], name: Mapping[str, str]) -> Optional[str]:
    if name["messages"] in record:
        return "messages"
    if name["prompt"] in record and name["completion"] in record:
        return "prompt_completion"
    if name["instruction"] in record and name["output"] in record:
        return "alpaca"
    if name["conversations"] in record:
        return "sharegpt"
    return None


def to_conversation(
    record: Any, format: str = "auto", fields: Optional[Mapping[str, str]] = None, where: str = "row"
) -> Conversation:
    """One row as a ``Conversation``.

    Args:
        record: The row (a JSON object / Parquet row as a dict).
        format: One of ``FORMATS``.
        fields: Renamed fields (canonical name → the data set's name).
        where: The row's place for messages (``path:line``).

    Raises:
        ChatFormatError: The row is not a conversation of ``format``; the message names ``where`` and the fix.
    """
    name = {f: (fields or {}).get(f, f) for f in FIELD_NAMES}
    if not isinstance(record, Mapping):
        raise ChatFormatError(f"{where} is a {type(record).__name__}, not an object with a conversation's fields")
    kind = _detect(record, name) if format == "auto" else format
    if kind is None:
        raise ChatFormatError(
            f"{where} has none of the fields of a chat format (found {sorted(record)[:12]}): expected"
            f" {name['messages']!r} (OpenAI messages), {name['prompt']!r} + {name['completion']!r},"
            f" {name['instruction']!r} + {name['output']!r} (Alpaca) or {name['conversations']!r} (ShareGPT);"
            " rename the data set's fields with fields={...} or fix the row"
        )
    tools = record.get(name["tools"])
    tools = tuple(tools) if isinstance(tools, (list, tuple)) and tools else None
    if kind == "messages":
        messages = as_messages(field_value(record, name["messages"], where), name, where, name["messages"])
        return Conversation(messages, _after_last_user(messages), tools)
    if kind == "prompt_completion":
        prompt = as_turns(field_value(record, name["prompt"], where), "user", name, where, name["prompt"])
        completion = as_turns(field_value(record, name["completion"], where), "assistant", name, where,
                              name["completion"])
        return Conversation(prompt + completion, len(prompt), tools)
    if kind == "alpaca":
        instruction = text_value(field_value(record, name["instruction"], where), where, name["instruction"])
        extra = record.get(name["input"])
        if extra is not None:
            extra = text_value(extra, where, name["input"])
        output = text_value(field_value(record, name["output"], where), where, name["output"])
        system = record.get(name["system"])
        messages = ([{"role": "system", "content": text_value(system, where, name["system"])}] if system else [])
        messages += [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction},
                     {"role": "assistant", "content": output}]
        return Conversation(tuple(messages), len(messages) - 1, tools)
    turns = field_value(record, name["conversations"], where)
    messages = _sharegpt(turns, name, where)
    return Conversation(messages, _after_last_user(messages), tools)


def field_value(record: Mapping[str, Any], key: str, where: str) -> Any:
    """``record[key]``, or ``ChatFormatError`` naming the row and the fields it has."""
    if key not in record:
        raise ChatFormatError(f"{where} has no field {key!r} (found {sorted(record)[:12]}); fix the row, or name the"
                              " field with fields={...}")
    return record[key]


def text_value(value: Any, where: str, what: str) -> str:
    """``value`` when it is a string, else ``ChatFormatError`` naming the row and the field (``what``)."""
    if not isinstance(value, str):
        shown = "null" if value is None else type(value).__name__
        raise ChatFormatError(f"{where}: {what} is {shown}, not a string; fix or drop the row")
    return value


def as_turns(value: Any, role: str, name: Mapping[str, str], where: str, what: str) -> tuple[Mapping[str, Any], ...]:
    """A prompt or completion: a string (one ``role`` message) or a list of messages (``as_messages``)."""
    if isinstance(value, str):
        return ({"role": role, "content": value},)
    return as_messages(value, name, where, what)


def as_messages(value: Any, name: Mapping[str, str], where: str, what: str) -> tuple[Mapping[str, Any], ...]:
    """A non-empty list of OpenAI messages (roles ``ROLES``, string content) read with ``name``'s ``role`` and
    ``content`` fields, as messages with those keys; else ``ChatFormatError`` naming the row and the message."""
    if not isinstance(value, (list, tuple)) or not value:
        shown = "an empty list" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ChatFormatError(f"{where}: {what} is {shown}, not a list of messages; fix or drop the row")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ChatFormatError(f"{where}: {what}[{i}] is a {type(message).__name__}, not a message object")
        role = message.get(name["role"])
        if role not in ROLES:
            raise ChatFormatError(
                f"{where}: {what}[{i}] has role {role!r}; a role is one of {', '.join(ROLES)} (rename the field"
                f" with fields={{'role': ...}}, or map the data set's roles before training)"
            )
        content = message.get(name["content"])
        if content is None and not message.get("tool_calls"):
            raise ChatFormatError(f"{where}: {what}[{i}] ({role}) has no {name['content']!r}; fix or drop the row")
        if content is not None and not isinstance(content, str):
            raise ChatFormatError(
                f"{where}: {what}[{i}] ({role}): {name['content']!r} is a {type(content).__name__}, not a string"
                " (content blocks and media are not read); fix or drop the row"
            )
        rest = {k: v for k, v in message.items() if k not in (name["role"], name["content"])}
        out.append({"role": role, **({"content": content} if content is not None else {}), **rest})
    return tuple(out)


def _sharegpt(value: Any, name: Mapping[str, str], where: str) -> tuple[Mapping[str, Any], ...]:
    what = name["conversations"]
    if not isinstance(value, (list, tuple)) or not value:
        raise ChatFormatError(f"{where}: {what} is not a non-empty list of turns; fix or drop the row")
    if all(isinstance(t, Mapping) and name["role"] in t for t in value):  # conversations in OpenAI's shape
        return as_messages(value, name, where, what)
    out = []
    for i, turn in enumerate(value):
        speaker = turn.get(name["from"]) if isinstance(turn, Mapping) else None
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise ChatFormatError(
                f"{where}: {what}[{i}] is from {speaker!r}; ShareGPT speakers are {', '.join(SHAREGPT_ROLES)}"
            )
        content = text_value(turn.get(name["value"]), where, f"{what}[{i}].{name['value']}")
        out.append({"role": role, "content": content})
    return tuple(out)


def _after_last_user(messages: tuple[Mapping[str, Any], ...]) -> int:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] + 1 if users else 0
