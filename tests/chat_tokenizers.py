"""Model folders for the chat tests, made here (no download): a small BPE ``tokenizer.json`` trained on the standard
library's source, the family's special tokens, a ``tokenizer_config.json`` with a chat template.

``FAMILIES`` lists, per family we import, its real template file (``tests/fixtures/chat_templates/``, copied
verbatim from the model repositories) and its tokenizer's special tokens, so that a folder made here renders and
tokenizes as the downloaded model's folder would (the ids differ, the structure does not).
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: ChatML with the assistant's text (and its end-of-turn token) inside {% generation %} tags, as TRL's and
#: transformers' docs write it.
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """A model family's tokenizer as the chat tests build it.

    Args:
        template: The template file under ``TEMPLATES``.
        special: Its special tokens (added, ``special=True``).
        added: Added tokens that are not special (Qwen3's ``<think>``).
        config: ``tokenizer_config.json`` entries (``bos_token``, ``eos_token``, ``pad_token``).
        metaspace: A SentencePiece-style pre-tokenizer (``▁`` for spaces: Mistral), else byte-level.
        end_of_turn: The token that ends an assistant turn.
    """

    template: str
    special: tuple[str, ...]
    config: dict = field(default_factory=dict)
    added: tuple[str, ...] = ()
    metaspace: bool = False
    end_of_turn: str = ""


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
FAMILIES = {
    "llama3.1": Family("llama3.1.jinja", LLAMA3_SPECIAL, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                       end_of_turn="<|eot_id|>"),
    "llama3.2": Family("llama3.2.jinja", LLAMA3_SPECIAL, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                       end_of_turn="<|eot_id|>"),
    "qwen2.5": Family("qwen2.5.jinja", QWEN_SPECIAL, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                      QWEN_ADDED, end_of_turn="<|im_end|>"),
    "qwen3": Family("qwen3.jinja", QWEN_SPECIAL, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    QWEN_ADDED, end_of_turn="<|im_end|>"),
    "mistral": Family("mistral.jinja", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                        "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
                      {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, metaspace=True,
                      end_of_turn="</s>"),
    "smollm": Family("smollm.jinja", QWEN_SPECIAL, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                                    "pad_token": "<|im_end|>"}, end_of_turn="<|im_end|>"),
}


@lru_cache(maxsize=None)
def _training_text() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple((root / name).read_text() for name in ("json/__init__.py", "textwrap.py", "string.py"))


def make_tokenizer_folder(folder: Path, template: Optional[str], special: tuple[str, ...] = QWEN_SPECIAL,
                          config: Optional[dict] = None, added: tuple[str, ...] = (), metaspace: bool = False,
                          vocab_size: int = 1000) -> Path:
    """A model folder: ``tokenizer.json`` (BPE trained on a few standard-library files) and ``tokenizer_config.json``
    (``config`` and, unless ``None``, the ``chat_template``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in special else None))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = sorted(set("".join(_training_text())) | set("▁"))
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.normalizer = normalizers.NFC()
    tok.train_from_iterator(list(_training_text()), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special), initial_alphabet=alphabet, show_progress=False))
    if added:
        tok.add_tokens(list(added))
    tok.save(str(folder / "tokenizer.json"))
    values = {"tokenizer_class": "PreTrainedTokenizerFast", **(config or {})}
    if template is not None:
        values["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(values, indent=1))
    return folder


def family_folder(folder: Path, name: str) -> Path:
    """The model folder of a family of ``FAMILIES`` with its real chat template."""
    family = FAMILIES[name]
    template = (TEMPLATES / family.template).read_text(encoding="utf-8")
    return make_tokenizer_folder(folder, template, family.special, family.config, family.added, family.metaspace)


#: The ids a uint16 token cache can hold: a vocabulary larger than this (Llama 3's 128,256, Qwen's 151,665) is cached
#: as uint32.
UINT16_IDS = 65_536


def wide_vocabulary_folder(folder: Path, texts: list[str]) -> Path:
    """A ChatML model folder whose vocabulary needs uint32 ids, made in well under a second (no BPE training): a
    word-level ``tokenizer.json`` with the roles and punctuation at low ids, reserved fillers up to id 65,535, every
    other word of ``texts`` above it, and the three ChatML tokens after them."""
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers

    low = ["<unk>", "system", "user", "assistant", "?", ".", ":", "+"]
    words = sorted({w for text in texts for w in re.findall(r"\w+|[^\w\s]+", text)} - set(low))
    vocab = {word: i for i, word in enumerate(low)}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(low), UINT16_IDS)})
    vocab.update({word: UINT16_IDS + i for i, word in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+|[^\w\s]+: ChatML's newlines fall between tokens
    tok.add_special_tokens(list(QWEN_SPECIAL))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML}, indent=1))
    return folder
