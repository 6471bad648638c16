"""What ``ChatDataModule`` trains on without a download: a byte-level chat tokenizer and conversations about the
standard library, made from the docstrings on every machine.

- ``tokenizer="byte"``: UTF-8 bytes as ids 0-255 (the ids of ``TextDataModule``'s ``"byte"``) and three ChatML
  tokens after them, ``<|endoftext|>`` (256, padding), ``<|im_start|>`` (257) and ``<|im_end|>`` (258, the end of a
  turn), with a ChatML template whose ``{% generation %}`` tags mark the assistant's text. Written once as a model
  folder (``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) under the cache directory, so it
  is exported and read by transformers like any downloaded tokenizer.
- ``paths=None``: questions and answers about the standard library's public functions and classes, from their
  docstrings (``ast``, nothing imported): "What does ``textwrap.dedent`` do?" → the docstring's first paragraph,
  and for some a second turn about the signature. Written once as JSONL under the cache directory.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

from lightning_2d.data.sources import stdlib_sources
from lightning_2d.models.llama.tokenizer import bytes_to_unicode

#: The version of the built-in folder and corpus (part of their names: a change makes new ones).
BUILTIN_VERSION = 1
BYTE_CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: ChatML, the assistant's text and its end-of-turn token inside {% generation %} tags.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: Packages the built-in corpus leaves out (tests, tools, platform-specific and generated code).
SKIPPED_PACKAGES = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data", "distutils",
                    "msilib", "venv", "encodings", "ctypes", "curses", "dbm", "multiprocessing", "asyncio",
                    "concurrent", "xmlrpc", "wsgiref", "sqlite3", "unittest", "this", "antigravity", "turtle")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a file of this process, renamed into place (never seen half written)."""
    partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def byte_chat_folder(cache_dir: Path) -> Path:
    """The built-in byte-level ChatML model folder (written once under ``cache_dir``)."""
    folder = Path(cache_dir).expanduser() / f"byte-chatml-v{BUILTIN_VERSION}"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_CHAT_SPECIAL])
    write_atomically(folder / "tokenizer.json", tok.to_str())
    write_atomically(folder / "generation_config.json", json.dumps({"eos_token_id": [258], "pad_token_id": 256}))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False, "model_max_length": 4096, "chat_template": CHATML_TEMPLATE}
    write_atomically(folder / "tokenizer_config.json", json.dumps(config, indent=1))  # last: marks it complete
    return folder


def _first_paragraph(doc: str) -> str:
    paragraph = doc.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", paragraph).strip()


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if node.args.vararg:
        args.append("*" + node.args.vararg.arg)
    args += [a.arg for a in node.args.kwonlyargs]
    if node.args.kwarg:
        args.append("**" + node.args.kwarg.arg)
    return f"{name}({', '.join(args)})"


@lru_cache(maxsize=1)
def _stdlib_conversations() -> tuple[str, ...]:
    return tuple(json.dumps(row) for row in _conversations())


def stdlib_conversations() -> list[dict]:
    """The built-in corpus's rows (``{"messages": [...]}``), in a fixed order (parsed once per process: ~3 s)."""
    return [json.loads(row) for row in _stdlib_conversations()]


def _conversations() -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for path in stdlib_sources():
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in SKIPPED_PACKAGES or any(p.startswith("_") and p != "__init__" for p in parts):
            continue
        module = ".".join(p for p in parts if p != "__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        nodes = [(f"{module}.{n.name}", n) for n in tree.body if isinstance(n, defined)]
        nodes += [(f"{module}.{c.name}.{m.name}", m) for c in tree.body if isinstance(c, ast.ClassDef)
                  and not c.name.startswith("_") for m in c.body if isinstance(m, defined)]
        for name, node in nodes:
            doc = ast.get_docstring(node)
            if node.name.startswith("_") or not doc or len(_first_paragraph(doc)) < 20:
                continue
            kind = "class" if isinstance(node, ast.ClassDef) else "method" if name.count(".") > module.count(
                ".") + 1 else "function"
            answer = _first_paragraph(doc)[:600]
            messages = [{"role": "user", "content": f"What does the {kind} `{name}` do?"},
                        {"role": "assistant", "content": answer}]
            if kind != "class" and len(rows) % 3 == 0:
                messages += [{"role": "user", "content": "How do I call it?"},
                             {"role": "assistant", "content": f"`{_signature(node, name)}`"}]
            rows.append({"messages": messages})
    return rows


def stdlib_chat_file(cache_dir: Path) -> Path:
    """The built-in corpus as JSONL under ``cache_dir`` (written once)."""
    folder = Path(cache_dir).expanduser()
    path = folder / f"stdlib-chats-v{BUILTIN_VERSION}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, "".join(json.dumps(row) + "\n" for row in stdlib_conversations()))
    return path
