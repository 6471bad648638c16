"""The chat templates of the families we import, rendered and tokenized as transformers' ``apply_chat_template`` does,
and the tokens each one trains.

The templates are the real ones (``tests/fixtures/chat_templates/``, copied from the model repositories; README
there), each in a model folder made here with the family's special tokens (``tests/chat_tokenizers.py``): the ids
are this folder's, the structure (template text, special tokens, added tokens, a SentencePiece-style pre-tokenizer
for Mistral) is the model's.
"""

from __future__ import annotations

import pytest

from lightning_2d.data.chat import (
    ChatEncoder,
    ChatTemplate,
    TemplateRewritesHistoryError,
    to_conversation,
)
from lightning_2d.data.tokenizers import load_tokenizer
from tests.chat_tokenizers import FAMILIES, family_folder

pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You answer questions about Python in one sentence."}
TURNS = [
    {"role": "user", "content": "What does json.dumps do?"},
    {"role": "assistant", "content": "It serializes an object to a JSON formatted str."},
    {"role": "user", "content": "And textwrap.dedent?"},
    {"role": "assistant", "content": "It removes common leading whitespace from every line."},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_source", "description": "The source code of a standard library module.",
    "parameters": {"type": "object", "properties": {"module": {"type": "string", "description": "Its name."}},
                   "required": ["module"]}}}]
#: Template arguments that make a rendering the same on any day (Llama 3.x writes today's date otherwise).
FIXED = {"date_string": "26 Jul 2024"}

#: (family, variant) → (messages, template arguments, add_generation_prompt, tools)
CASES = {
    ("llama3.1", "multi-turn, system"): ([SYSTEM, *TURNS], FIXED, False, None),
    ("llama3.1", "generation prompt, tools"): ([SYSTEM, TURNS[0]], FIXED, True, TOOLS),
    ("llama3.2", "multi-turn, system"): ([SYSTEM, *TURNS], FIXED, False, None),
    ("llama3.2", "generation prompt, tools"): ([TURNS[0]], FIXED, True, TOOLS),
    ("qwen2.5", "multi-turn, default system"): (TURNS, {}, False, None),
    ("qwen2.5", "generation prompt, tools"): ([SYSTEM, TURNS[0]], {}, True, TOOLS),
    ("qwen3", "multi-turn, thinking"): ([SYSTEM, *TURNS], {}, False, None),
    ("qwen3", "reasoning kept in the last turn"): (
        [*TURNS[:3], {**TURNS[3], "reasoning_content": "dedent looks for the common prefix."}], {}, False, None),
    ("qwen3", "generation prompt, no thinking"): ([SYSTEM, TURNS[0]], {"enable_thinking": False}, True, None),
    ("qwen3", "generation prompt, thinking, tools"): ([TURNS[0]], {"enable_thinking": True}, True, TOOLS),
    ("mistral", "multi-turn"): (TURNS, {}, False, None),
    ("mistral", "system and tools"): ([SYSTEM, TURNS[0]], {}, False, TOOLS),
    ("smollm", "multi-turn, default system"): (TURNS, {}, False, None),
    ("smollm", "generation prompt"): ([SYSTEM, TURNS[0]], {}, True, None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: family_folder(tmp_path_factory.mktemp(name.replace(".", "_")), name) for name in FAMILIES}


@pytest.mark.parametrize("family, variant", list(CASES), ids=[f"{f}: {v}" for f, v in CASES])
def test_our_ids_are_transformers_apply_chat_template(folders, family, variant):
    from transformers import AutoTokenizer

    messages, kwargs, prompt, tools = CASES[family, variant]
    folder = folders[family]
    theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tools=tools, add_generation_prompt=prompt, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    template = ChatTemplate.from_folder(folder)
    rendered = template.render(messages, add_generation_prompt=prompt, tools=tools, **kwargs)
    ours, _ = load_tokenizer(str(folder)).encode_with_offsets(rendered.text)
    assert ours == theirs
    assert len(ours) > 20 and any(i in load_tokenizer(str(folder)).special_ids for i in ours)


def trained_runs(folder, encoded) -> list[tuple[str, list[int]]]:
    """Each run of consecutive trained tokens: the characters of the rendering its tokens cover, exactly (no decoding,
    which drops a SentencePiece token's leading space, and no strip), and its ids."""
    _, offsets = load_tokenizer(str(folder)).encode_with_offsets(encoded.text)
    runs, run = [], []
    for j, trained in enumerate(encoded.trained.tolist() + [False]):
        if trained:
            run.append(j)
        elif run:
            runs.append((encoded.text[offsets[run[0]][0]:offsets[run[-1]][1]], [encoded.ids[i].item() for i in run]))
            run = []
    return runs


def answers(folder, family: str, *contents: str) -> list[tuple[str, list[int]]]:
    """What each assistant turn should train: its text as the family's template writes it after the turn's header,
    through the end-of-turn token (Mistral v3 writes ``" " + content|trim + eos_token`` after ``[/INST]``; the others
    the content right after the header), nothing before or after it, and that text's tokens."""
    tokenizer = load_tokenizer(str(folder))
    texts = [(" " if family == "mistral" else "") + content + FAMILIES[family].end_of_turn for content in contents]
    return [(text, tokenizer.encode_with_offsets(text)[0]) for text in texts]


#: Families whose template renders a conversation's start the same whatever follows (without a system message for
#: Mistral, which moves it to the last user turn), so every assistant turn is found by rendering prefixes.
PREFIX_STABLE = ["llama3.1", "llama3.2", "qwen2.5", "mistral", "smollm"]


@pytest.mark.parametrize("family", PREFIX_STABLE)
def test_each_assistant_turn_and_its_end_of_turn_token_are_trained(folders, family):
    folder = folders[family]
    encoder = ChatEncoder(load_tokenizer(str(folder)), ChatTemplate.from_folder(folder), template_kwargs=FIXED)
    encoded = encoder.encode(to_conversation({"messages": TURNS}))
    end = FAMILIES[family].end_of_turn
    assert trained_runs(folder, encoded) == answers(folder, family, TURNS[1]["content"], TURNS[3]["content"])
    assert encoded.end_of_turn == {load_tokenizer(str(folder)).token_to_id(end)}


def test_qwen3s_template_rewrites_earlier_turns_so_prefix_masks_are_refused(folders):
    """Qwen3 drops the reasoning (and writes no empty think block) of assistant turns before the last user turn: the
    conversation up to turn 1 renders otherwise alone than followed by more turns. The refusal names the row and
    turn; the last turn alone is found, its empty think block not trained."""
    folder = folders["qwen3"]
    tokenizer, template = load_tokenizer(str(folder)), ChatTemplate.from_folder(folder)
    conversation = to_conversation({"messages": TURNS})
    with pytest.raises(TemplateRewritesHistoryError, match=r"chats\.jsonl:4, turn 1 \(assistant\)"):
        ChatEncoder(tokenizer, template).encode(conversation, where="chats.jsonl:4")
    last = ChatEncoder(tokenizer, template, train_on="last_assistant").encode(conversation)
    assert "<think>\n\n</think>\n\n" + TURNS[3]["content"] in last.text
    assert trained_runs(folder, last) == answers(folder, "qwen3", TURNS[3]["content"])
    # With enable_thinking=False the empty think block is the generation prompt's: in the prompt, not trained.
    quiet = ChatEncoder(tokenizer, template, train_on="last_assistant", template_kwargs={"enable_thinking": False})
    assert trained_runs(folder, quiet.encode(conversation)) == answers(folder, "qwen3", TURNS[3]["content"])


def test_mistral_writes_the_system_message_only_into_a_last_user_turn_so_prefix_masks_are_refused(folders):
    """Mistral's v3 template puts the system message before the user turn that ends the conversation: a prompt
    ending in a user turn carries it, the same prompt followed by the answer does not (the template drops it). Every
    assistant turn after a system message is refused, the last one too; without one each turn is found."""
    folder = folders["mistral"]
    encoder = ChatEncoder(load_tokenizer(str(folder)), ChatTemplate.from_folder(folder))
    for messages, turn in (([SYSTEM, *TURNS], 2), ([SYSTEM, *TURNS[:2]], 2)):
        with pytest.raises(TemplateRewritesHistoryError, match=rf"row, turn {turn} \(assistant\)"):
            encoder.encode(to_conversation({"messages": messages}))
    assert SYSTEM["content"] not in encoder.template.render([SYSTEM, *TURNS[:2]]).text
