"""A conversation as token ids and a loss mask: which tokens the model learns to write.

``ChatEncoder.encode`` renders the conversation with the checkpoint's template (``template``), tokenizes the
text once as transformers' ``apply_chat_template(tokenize=True)`` does (no special tokens added: the template
writes them), and marks the tokens to train on:

- ``train_on="assistant"`` (default): every assistant turn; ``"last_assistant"``: the last one;
  ``"completion"``: what follows the prompt (a prompt/completion row's completion, else everything after the
  last user message); ``"all"``: every token.
- Where the template has ``{% generation %}`` blocks, the assistant's text is what they enclose, exactly as
  ``return_assistant_tokens_mask`` finds it. Otherwise each assistant turn is found by rendering growing prefixes:
  the conversation up to the turn with the assistant's header (``add_generation_prompt``), then with the turn.
  That is only right when each prefix is a prefix of the whole rendering; a template that rewrites earlier turns
  when more follow (Qwen3 drops earlier reasoning) is refused naming the row and the turn.
- A token is trained when its characters overlap the assistant's text. In each turn the last special token (the
  end-of-turn token: ``<|eot_id|>``, ``<|im_end|>``, ``</s>``) is trained when ``train_on_eos`` (else not), and
  what follows it in the turn (the newline before the next header) is not.
- An empty think block (``<think>\\n\\n</think>``, which a thinking template writes for a turn without reasoning)
  is not trained: the model would learn to skip thinking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from lightning_2d.data.chat.formats import Conversation
from lightning_2d.data.chat.template import ChatTemplate, ChatTemplateError
from lightning_2d.data.sources import DataError

TRAIN_ON = ("assistant", "last_assistant", "completion", "all")
EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")


class TemplateRewritesHistoryError(DataError):
    """A template whose rendering of a conversation's start changes when more turns follow (prefix masks would be
    wrong)."""


@dataclass
class EncodedChat:
    """One conversation's tokens.

    Args:
        ids: Token ids ``(L,)``.
        trained: ``(L,)``: token ``j`` is a target (the model learns to write it after ``ids[:j]``).
        text: The rendered text.
        spans: The trained character spans.
        end_of_turn: The ids of the end-of-turn tokens found in the trained turns.
    """

    ids: np.ndarray
    trained: np.ndarray
    text: str
    spans: list[tuple[int, int]]
    end_of_turn: set[int] = field(default_factory=set)

    @property
    def num_targets(self) -> int:
        """Tokens the loss reads (the first token is never a target: nothing comes before it)."""
        return int(self.trained[1:].sum())


class ChatEncoder:
    """Conversations → ``EncodedChat`` with one tokenizer, template and masking rule.

    Args:
        tokenizer: A tokenizer with ``encode_with_offsets`` and ``special_ids`` (``HuggingFaceTokenizer``).
        template: The chat template.
        train_on: One of ``TRAIN_ON``.
        train_on_eos: Train each assistant turn's end-of-turn token.
        template_kwargs: Variables for the template (``enable_thinking``, ``date_string``, ...).
        tools: Tool schemas given to every conversation (a row's own ``tools`` replace them).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate,
        train_on: str = "assistant",
        train_on_eos: bool = True,
        template_kwargs: Optional[Mapping[str, Any]] = None,
        tools: Optional[Sequence[Any]] = None,
    ) -> None:
        if train_on not in TRAIN_ON:
            raise DataError(f"train_on must be one of {', '.join(map(repr, TRAIN_ON))}, got {train_on!r}")
        self.tokenizer, self.template = tokenizer, template
        self.train_on, self.train_on_eos = train_on, train_on_eos
        self.template_kwargs = dict(template_kwargs or {})
        self.tools = list(tools) if tools else None
        self.special_ids = tokenizer.special_ids

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Any, prompt: bool = False) -> Any:
        return self.template.render(messages, add_generation_prompt=prompt, tools=tools, **self.template_kwargs)

    def spans(self, conversation: Conversation, where: str = "row") -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans to train on (before the end-of-turn rule)."""
        tools = list(conversation.tools) if conversation.tools else self.tools
        messages = list(conversation.messages)
        try:
            full = self._render(messages, tools)
        except ChatTemplateError as err:
            raise ChatTemplateError(f"{where}: {err}") from None
        text = full.text
        if self.train_on == "all":
            return text, [(0, len(text))]
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if self.train_on in ("assistant", "last_assistant") and self.template.has_generation_tags:
            spans = list(full.generation)
            if len(spans) != len(assistants):
                raise ChatTemplateError(
                    f"{where}: the template's {{% generation %}} blocks mark {len(spans)} span(s) for"
                    f" {len(assistants)} assistant message(s); fix the template's generation tags"
                )
            return text, spans[-1:] if self.train_on == "last_assistant" else spans
        if self.train_on == "completion":
            turns = [(conversation.completion_start, len(messages))]
        else:
            chosen = assistants[-1:] if self.train_on == "last_assistant" else assistants
            turns = [(i, i + 1) for i in chosen]
        spans = []
        for start, stop in turns:
            try:
                before = self._render(messages[:start], tools, prompt=True).text if start else ""
                upto = self._render(messages[:stop], tools).text
            except ChatTemplateError as err:
                raise ChatTemplateError(f"{where}, turn {start}: rendering the conversation up to it: {err}") from None
            if not (upto.startswith(before) and text.startswith(upto)):
                what = "its prompt" if not upto.startswith(before) else "the whole conversation"
                raise TemplateRewritesHistoryError(
                    f"{where}, turn {start} ({messages[start].get('role') if start < len(messages) else 'end'}): the"
                    f" chat template renders the conversation up to this turn differently from how {what} renders"
                    " it (it rewrites earlier turns when more follow, as Qwen3's drops earlier reasoning), so the"
                    " turn's tokens cannot be found by rendering prefixes. Use a template with {% generation %}"
                    " tags around the assistant's text (chat_template=PATH; docs/fine-tuning/chat.md shows how), or"
                    " train_on='last_assistant'"
                )
            spans.append((len(before), len(upto)))
        return text, spans

    def encode(self, conversation: Conversation, where: str = "row") -> EncodedChat:
        """The conversation's ids and trained tokens (see the module docstring)."""
        text, turns = self.spans(conversation, where)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        ids = np.asarray(ids, dtype=np.int64)
        starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
        ends = np.fromiter((o[1] for o in offsets), dtype=np.int64, count=len(offsets))
        trained = np.zeros(len(ids), dtype=bool)
        end_of_turn: set[int] = set()
        kept: list[tuple[int, int]] = []
        for turn in turns:
            pieces = _without_empty_think(text, turn) if self.train_on != "all" else [turn]
            kept += pieces
            mask = np.zeros(len(ids), dtype=bool)
            for begin, end in pieces:
                mask |= (ends > begin) & (starts < end)  # overlap, as return_assistant_tokens_mask decides
            if self.train_on != "all":
                # The turn's last special token ends it: trained only with train_on_eos, nothing after it.
                inside = np.flatnonzero(mask)
                special = [j for j in inside.tolist() if int(ids[j]) in self.special_ids]
                if special:
                    last = special[-1]
                    end_of_turn.add(int(ids[last]))
                    mask[inside[inside > last]] = False
                    mask[last] = self.train_on_eos
            trained |= mask
        return EncodedChat(ids, trained, text, kept, end_of_turn)


def _without_empty_think(text: str, span: tuple[int, int]) -> list[tuple[int, int]]:
    """``span`` without the empty think blocks in it."""
    begin, end = span
    out = []
    for match in EMPTY_THINK.finditer(text, begin, end):
        if match.start() > begin:
            out.append((begin, match.start()))
        begin = match.end()
    if end > begin:
        out.append((begin, end))
    return out
