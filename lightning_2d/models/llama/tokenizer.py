"""The Llama family's tokenizer files, as data: which file a model folder's tokenizer is, Meta's tiktoken
``tokenizer.model`` (Llama 3) and its special tokens, the usual names of the beginning/end-of-text tokens.

No tokenizing here (``lightning_2d.data.tokenizers`` loads the files, ``lightning_2d.checkpoint.hf.tokenizer``
copies them into an export): both read these constants, so the two agree on what a file is and which ids
its special tokens have.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Optional

#: End-of-text tokens tried, in order, when a tokenizer does not say which is its EOS.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
#: Beginning-of-text tokens tried, in order, when a tokenizer does not say which is its BOS.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")

#: The files of a model folder's tokenizer, in the order one is picked for tokenizing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

#: Llama 3's pre-tokenizer split (Meta's ``llama/tokenizer.py``, the same in 3.0-3.3).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
#: Special tokens Meta's tokenizer reserves after the BPE ranks (ids ``len(ranks) + i``).
LLAMA3_NUM_RESERVED_SPECIAL_TOKENS = 256
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} [0-9]+$")


def llama3_special_tokens(num_ranks: int) -> dict[str, int]:
    """Meta's Llama 3.1 special tokens and their ids, after ``num_ranks`` BPE ranks (256 in all, as its
    ``tokenizer.py``: the named ones first, the rest ``<|reserved_special_token_N|>``). Llama 3.0 named fewer
    of them, at the same ids for the ones both name (``<|begin_of_text|>``, ``<|end_of_text|>``, the header
    tokens, ``<|eot_id|>``)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_RESERVED_SPECIAL_TOKENS - len(named))]
    return {token: num_ranks + i for i, token in enumerate(named + reserved)}


def is_tiktoken_file(path: Path) -> bool:
    """Whether ``path`` is a tiktoken BPE file (lines of ``base64-token rank``, Meta's Llama 3
    ``tokenizer.model``) rather than a SentencePiece model (a binary protobuf) of the same name."""
    with open(path, "rb") as f:
        head = f.read(4096)
    lines = head.split(b"\n")[:-1] or head.split(b"\n")  # the last line may be cut at 4 KiB
    return bool(lines) and bool(lines[0]) and all(_TIKTOKEN_LINE.match(line) for line in lines if line)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file (what ``tiktoken.load.load_tiktoken_bpe`` reads, without its download
    cache): ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:
            continue
        token, _, rank = line.partition(b" ")
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:
            raise ValueError(f"{path}:{number} is not a tiktoken line ('base64-token rank'): {line[:60]!r}") from err
    return ranks


def model_folder_tokenizer(folder: Path) -> Optional[Path]:
    """The tokenizer file of a model folder: ``tokenizer.json``, else ``tokenizer.model``; ``None`` if neither."""
    return next((folder / name for name in TOKENIZER_FILES if (folder / name).is_file()), None)


def vocabulary_digest(path: Path) -> str:
    """A digest of which token each id of the tokenizer file ``path`` stands for: of ``tokenizer.json``'s model
    vocabulary and added tokens (not its normalizer, padding or truncation settings, which map no id), of a tiktoken
    ``tokenizer.model``'s ranks, else of the file's bytes. Two tokenizers with equal digests give the same ids the same
    meaning (what a distillation teacher and its student must share)."""
    data = Path(path).read_bytes()
    if Path(path).name == "tokenizer.json":
        spec = json.loads(data)
        model = spec.get("model") or {}
        added = sorted((t.get("id"), t.get("content")) for t in spec.get("added_tokens") or [])
        data = json.dumps({"vocab": model.get("vocab"), "added": added}, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map: how a byte-level BPE's ``tokenizer.json`` spells each byte (read by the
    data's built-in chat tokenizer and by the export of byte and tiktoken tokenizers)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
