"""Tokenizers: byte-level (no files), Hugging Face ``tokenizer.json``, SentencePiece ``.model``, Meta's
tiktoken ``tokenizer.model`` (Llama 3); or a model folder holding one of them.

All expose the same small interface (``vocab_size``, ``eos_id``, ``bos_id``, ``encode_batch``,
``fingerprint``); the fingerprint keys the on-disk token cache. They pickle (the file's content
travels, not its path), so tokenizing processes can be spawned as well as forked.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np

from lightning_2d.data.sources import DataError, DataFileNotFoundError
from lightning_2d.models.llama.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    LLAMA3_BOS,
    LLAMA3_EOS,
    LLAMA3_SPLIT_PATTERN,
    TOKENIZER_FILES,
    is_tiktoken_file,
    llama3_special_tokens,
    model_folder_tokenizer,
    read_tiktoken_ranks,
)

__all__ = ["EOS_CANDIDATES", "ByteTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "TiktokenTokenizer",
           "Tokenizer", "load_tokenizer", "resolve_tokenizer_path"]


class Tokenizer(Protocol):
    """What the token cache needs of a tokenizer.

    A tokenizer may also have ``encode_arrays(texts) -> list[np.ndarray]`` (the same ids as
    ``encode_batch``, as arrays): the cache builder then uses it instead of Python lists of ints.
    """

    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    fingerprint: str

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files. Byte 0 (NUL, absent from text) ends a document."""

    vocab_size = 256
    eos_id = 0
    bos_id = None  # every byte value is text (but NUL): there is no beginning-of-text token
    fingerprint = "byte-utf8-v1"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """``encode_batch`` as ``uint8`` arrays over the UTF-8 bytes: no Python int per byte."""
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _configured_token(folder: Path, key: str) -> Optional[str]:
    """``bos_token``/``eos_token`` as a model folder's ``tokenizer_config.json`` names it (a string or
    ``{"content": ...}``), if it does."""
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (Llama 3, Mistral, GPT-2 …)."""

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"Loading the Hugging Face tokenizer {path} needs the `tokenizers` package: pip install tokenizers"
            ) from err
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:
            raise DataError(f"Could not load the Hugging Face tokenizer {path}: {err}") from err
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        self.eos_id = next((i for i in ids if i is not None), None)
        if eos_token and self.eos_id is None:
            raise DataError(f"eos_token {eos_token!r} is not in the vocabulary of {path}")
        # The BOS: as the model folder's tokenizer_config.json names it, else a usual name. Not part of the
        # fingerprint: only add_bos puts it in the cache, and that is part of the cache key.
        configured = _configured_token(path.parent, "bos_token") if path.name == "tokenizer.json" else None
        bos_names = [name for name in (configured,) if name] + list(BOS_CANDIDATES)
        self.bos_id = next((i for i in map(self._tok.token_to_id, bos_names) if i is not None), None)
        self.fingerprint = f"hf-{_file_digest(path)}-eos{self.eos_id}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": self._tok.to_str()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.__dict__.update({**state, "_tok": HFTokenizer.from_str(state["_tok"])})

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20): the same ids without character offsets, ~25% less time.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [enc.ids for enc in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def decode_keep_special(self, ids: list[int]) -> str:
        """``decode`` with the special tokens written out (previews of chat data)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` (no special tokens added; those written in it are matched) and each one's
        ``(start, end)`` characters: what a chat's loss mask is cut from."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (``<|eot_id|>``, ``<|im_end|>``, ``</s>``)."""
        return frozenset(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (Llama 2)."""

    def __init__(self, path: Path) -> None:
        try:
            import sentencepiece as spm
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"Loading the SentencePiece model {path} needs the `sentencepiece` package: pip install sentencepiece"
            ) from err
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as err:
            raise DataError(f"Could not load the SentencePiece model {path}: {err}") from err
        self.vocab_size = self._sp.get_piece_size()
        eos, bos = self._sp.eos_id(), self._sp.bos_id()
        self.eos_id = eos if eos >= 0 else None
        self.bos_id = bos if bos >= 0 else None
        self.fingerprint = f"spm-{_file_digest(path)}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sp": self._sp.serialized_model_proto()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import sentencepiece as spm

        self.__dict__.update({**state, "_sp": spm.SentencePieceProcessor(model_proto=state["_sp"])})

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


class TiktokenTokenizer:
    """Meta's original Llama 3 ``tokenizer.model``: a tiktoken BPE file (lines of ``base64-token rank``), read
    with the ``tiktoken`` package, with Llama 3's split pattern and its 256 special tokens after the ranks
    (``<|begin_of_text|>`` the BOS, ``<|end_of_text|>`` the EOS unless ``eos_token`` names another)."""

    #: Meta's limits (its ``tokenizer.py``): tiktoken's regex is slow or overflows on longer strings and
    #: on longer runs of only whitespace or only non-whitespace (tiktoken issue #195).
    MAX_ENCODE_CHARS = 400_000
    MAX_RUN_CHARS = 25_000

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        try:
            import tiktoken  # noqa: F401
        except ImportError as err:
            raise ImportError(
                f"{path} is a tiktoken BPE file (Meta's Llama 3 tokenizer.model), which needs the `tiktoken` package:"
                " pip install 'lightning-2d[tiktoken]' (or give the model's Hugging Face tokenizer.json instead)"
            ) from err
        try:
            self._ranks = read_tiktoken_ranks(path)
        except (OSError, ValueError) as err:
            raise DataError(f"Could not load the tiktoken BPE file {path}: {err}") from err
        self.special_tokens = llama3_special_tokens(len(self._ranks))
        self.vocab_size = len(self._ranks) + len(self.special_tokens)
        eos = eos_token or LLAMA3_EOS
        if eos not in self.special_tokens:
            raise DataError(f"eos_token {eos_token!r} is not one of the special tokens of {path} (e.g. {LLAMA3_EOS!r},"
                             " '<|eot_id|>')")
        self.eos_id, self.bos_id = self.special_tokens[eos], self.special_tokens[LLAMA3_BOS]
        self.fingerprint = f"tiktoken-{_file_digest(path)}-eos{self.eos_id}"
        self._build()

    def _build(self) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=self._ranks,
                                      special_tokens=self.special_tokens)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_enc"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build()

    def _substrings(self, text: str) -> list[str]:
        # As Meta's encode: pieces of at most MAX_ENCODE_CHARS, each cut inside any run of whitespace or of
        # non-whitespace every MAX_RUN_CHARS characters (such runs are pathological: minified files, padding).
        long_run = re.compile(rf"\s{{{self.MAX_RUN_CHARS + 1},}}|\S{{{self.MAX_RUN_CHARS + 1},}}")
        out = []
        for start in range(0, len(text), self.MAX_ENCODE_CHARS):
            chunk, begin = text[start : start + self.MAX_ENCODE_CHARS], 0
            for run in long_run.finditer(chunk):
                for cut in range(run.start() + self.MAX_RUN_CHARS, run.end(), self.MAX_RUN_CHARS):
                    out.append(chunk[begin:cut])
                    begin = cut
            out.append(chunk[begin:])
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_ordinary: special tokens' text in a document is text, as add_special_tokens=False elsewhere.
        # One text at a time, not encode_ordinary_batch: that starts a pool of 8 threads per call, and the cache
        # builder already runs one tokenizing process per core.
        encode = self._enc.encode_ordinary
        return [encode(t) if len(t) <= self.MAX_RUN_CHARS else [i for part in self._substrings(t) for i in encode(part)]
                for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def resolve_tokenizer_path(spec: str) -> Path:
    """The tokenizer file ``spec`` names: the file itself, or a model folder's ``tokenizer.json``, else its
    ``tokenizer.model``. Raises ``FileNotFoundError`` naming what it looked for."""
    path = Path(spec).expanduser()
    if path.is_dir():
        found = model_folder_tokenizer(path)
        if found is None:
            raise DataFileNotFoundError(
                f"Tokenizer folder {spec!r} has none of {', '.join(TOKENIZER_FILES)}; give a model folder that"
                " holds one, or the tokenizer file itself"
            )
        return found
    if not path.is_file():
        raise DataFileNotFoundError(
            f"Tokenizer {spec!r} is neither 'byte' nor an existing file or folder; give a Hugging Face tokenizer.json,"
            " a SentencePiece or tiktoken tokenizer.model, or a model folder holding one"
        )
    return path


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """``"byte"``, a Hugging Face ``tokenizer.json``, a SentencePiece ``.model``, a tiktoken ``tokenizer.model``
    (Meta's Llama 3 file, told apart by its content), or a model folder (its ``tokenizer.json``, else its
    ``tokenizer.model``)."""
    if spec == "byte":
        return ByteTokenizer()
    path = resolve_tokenizer_path(spec)
    if path.suffix == ".json":
        return HuggingFaceTokenizer(path, eos_token)
    if path.suffix == ".model":
        if is_tiktoken_file(path):
            return TiktokenTokenizer(path, eos_token)
        return SentencePieceTokenizer(path)
    raise DataError(
        f"Tokenizer file {path} has an unknown kind ({path.suffix!r}); use a Hugging Face tokenizer.json, a"
        " SentencePiece or tiktoken .model, or a model folder"
    )
