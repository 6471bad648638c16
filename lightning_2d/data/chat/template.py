"""A checkpoint's own chat template, rendered as transformers' ``apply_chat_template`` renders it.

A model folder keeps its template as ``chat_template.jinja`` (transformers >= 4.43 writes it there), or as the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates: ``default``, and
``tool_use`` when tools are given), or in ``chat_template.json``. The template is Jinja code from the model's
authors, run in Jinja's immutable sandbox with what transformers gives it (so the text, and then the token ids,
are the ones the model saw in its own fine-tuning):

- ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``);
- ``raise_exception(message)``, ``strftime_now(format)``, a ``tojson`` filter that keeps non-ASCII characters
  and HTML as they are, ``dict`` and a ``namespace`` that refuses underscore names;
- the tokenizer's special tokens as variables (``bos_token``, ``eos_token``, ...), overridden by the caller's
  template arguments (``enable_thinking``, ``date_string``, ...);
- messages as plain data, keys whose value is ``None`` dropped, a message's reasoning under each name
  templates read (``reasoning_content``, ``thinking``);
- ``{% generation %} ... {% endgeneration %}`` blocks, whose character spans are returned: where a template
  marks the assistant's text, that is what the loss mask is made of (``return_assistant_tokens_mask``).

Nothing here tokenizes; ``encode`` turns a rendering into token ids and a loss mask.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lightning_2d.data.sources import DataError

#: The special-token entries of ``tokenizer_config.json`` a template sees as variables (transformers'
#: ``special_tokens_map``).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: Names a message's reasoning is passed under; templates read the first (Qwen3) or the second (gpt-oss).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(DataError):
    """A chat template that cannot be found, compiled or rendered (the template's own ``raise_exception``)."""


@dataclass(frozen=True)
class RenderedChat:
    """A conversation as the template writes it.

    Args:
        text: The rendered text.
        generation: The ``(start, end)`` character spans of its ``{% generation %}`` blocks, in order.
    """

    text: str
    generation: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it is rendered with.

    Args:
        source: The template's text (or, for a folder with named templates, the ``default`` one).
        special_tokens: ``bos_token``, ``eos_token``, ... as the tokenizer names them.
        origin: Where it was read (for messages).
        named: Other named templates of the folder (``tool_use``), chosen when tools are given.
    """

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    origin: str = "<string>"
    named: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTemplate":
        """The template of a model folder (``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, else ``chat_template.json``). Raises ``ChatTemplateError`` when it has none."""
        folder = Path(folder).expanduser()
        config = _read_json(folder / "tokenizer_config.json")
        special = folder_special_tokens(folder)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), special, str(jinja))
        template = config.get("chat_template")
        origin = folder / "tokenizer_config.json"
        if template is None and (folder / "chat_template.json").is_file():
            template = _read_json(folder / "chat_template.json").get("chat_template")
            origin = folder / "chat_template.json"
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
            if "default" not in named:
                raise ChatTemplateError(
                    f"{origin} has named chat templates {sorted(named)} but no 'default' one; name the one to use"
                    " with chat_template=PATH (a .jinja file)"
                )
            return cls(named["default"], special, f"{origin} (default)", named)
        if not isinstance(template, str):
            raise ChatTemplateError(
                f"The tokenizer in {folder} has no chat template (no chat_template.jinja, no chat_template in"
                " tokenizer_config.json or chat_template.json); give one with chat_template=PATH (a .jinja file,"
                " e.g. the instruct model's), or use TextDataModule for raw text"
            )
        return cls(template, special, str(origin))

    @property
    def has_generation_tags(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}`` blocks."""
        return bool(_GENERATION_TAG.search(self.source))

    @property
    def digest(self) -> str:
        """What the template renders depends on: its text and special tokens (part of the token cache's key)."""
        payload = json.dumps([self.source, dict(sorted(self.special_tokens.items())), dict(self.named)])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def source_for(self, tools: Optional[Sequence[Any]]) -> str:
        """The template used for a call: ``tool_use`` when tools are given and the folder has one."""
        return self.named.get("tool_use", self.source) if tools else self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Optional[Sequence[Any]] = None,
        documents: Optional[Sequence[Any]] = None,
        **kwargs: Any,
    ) -> RenderedChat:
        """Render a conversation (``apply_chat_template(tokenize=False)``), with its generation spans.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: End with the header of an assistant turn (what generation starts from).
            tools: JSON schemas of the tools the model may call.
            documents: Documents for retrieval-augmented templates.
            kwargs: Template variables (``enable_thinking``, ``date_string``, ...); they override the special
                tokens of the same name.

        Raises:
            ChatTemplateError: The template raised (``raise_exception``) or failed; the message says which.
        """
        import jinja2

        compiled = _compile(self.source_for(tools))
        variables = {**self.special_tokens, **_plain(kwargs)}
        chat = [_message(m) for m in _plain(list(messages))]
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in compiled.generate(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                           add_generation_prompt=add_generation_prompt, **variables):
                blocks.append(block)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"The chat template ({self.origin}) refused the conversation: {err}") from None
        except Exception as err:  # a template bug: an undefined attribute, a type error in its expressions
            raise ChatTemplateError(
                f"The chat template ({self.origin}) failed to render: {type(err).__name__}: {err}"
            ) from None
        finally:
            _TRACKING.reset(token)
        return RenderedChat("".join(blocks), tuple(spans))


# ---- the sandbox ---------------------------------------------------------------------------------
#: While a rendering runs: its blocks so far and the generation spans found (the extension appends to them).
_TRACKING: ContextVar[Optional[tuple[list[str], list[tuple[int, int]]]]] = ContextVar("chat_spans", default=None)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(jinja2.ext.Extension):
        """``{% generation %}body{% endgeneration %}`` renders its body and records where it lands."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    class Namespace(jinja2.utils.Namespace):
        # A namespace attribute named with an underscore could reach Python's internals.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for name in values:
                Namespace._refuse_private(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _refuse_private(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own filter escapes HTML characters, which no model was trained on.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"The chat template does not compile (line {err.lineno}): {err.message}") from None


def _plain(value: Any) -> Any:
    """What a template may see: JSON data only (the sandbox knows nothing of other objects' methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message  # the template decides (most raise); formats.py refuses these earlier
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ChatTemplateError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def folder_special_tokens(folder: Path) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as a model folder's ``tokenizer_config.json`` names them."""
    config = _read_json(Path(folder) / "tokenizer_config.json")
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            out[key] = value
    return out
