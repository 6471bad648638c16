"""The troubleshooting table (``lightning_2d/tools/troubleshooting.py``, shown in ``docs/troubleshooting.md``) quotes
the messages the library raises, as they are raised.

Every code span of a row's ``see`` is a quote of a message, read as literal pieces (``QUOTE_PIECES``: split on
``…`` and on the placeholders ``N``, ``K``, ``DIR``, ``FILE``, ``TENSOR``), after an optional ``SomeError: `` (the
exception's class) or ``lightning-2d COMMAND: error: `` (the command-line tool's line). A row that names cases of
``test_misconfigurations.CASES`` runs them: each quote's pieces are in one of their messages, in order (lines and
list bullets read as spaces), its class among the raised exception's classes, and each case is quoted. A row that
names none (a refusal met while a job runs) and the quotes of ``SOURCE_ONLY`` are checked against the library's
string literals instead: the class defined, the command one of the tool's, and each piece, cut at numbers (values
the source formats), in one literal. Every case is quoted by a row unless ``UNQUOTED`` says why not. A message
changed without its row fails here.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from lightning_2d.tools.troubleshooting import REFUSALS, Refusal
from tests.unit.test_misconfigurations import CASES, _hf_available

if not _hf_available():
    pytest.skip("the table quotes the Hugging Face cases, which CASES has with transformers only",
                allow_module_level=True)

LIBRARY = Path(__file__).resolve().parents[2] / "lightning_2d"
TABLE = LIBRARY / "tools" / "troubleshooting.py"

#: A Markdown code span (one or more backticks, the same number closing it).
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
#: What a quote is split at: an elision, and the placeholders that stand for a value of the user's.
QUOTE_PIECES = re.compile(r"…|\b(?:N|K|DIR|FILE|TENSOR)\b")
ERROR_CLASS = re.compile(r"[A-Z]\w*(?:Error|Exception)")
ERROR_PREFIX = re.compile(rf"(?P<error>{ERROR_CLASS.pattern}): ")
CLI_PREFIX = re.compile(r"lightning-2d (?P<command>[\w-]+): error: ")

#: Quotes of rows with cases that no case raises, checked in the source: the quote, and why there is no case.
SOURCE_ONLY: dict[str, str] = {}

#: Cases of CASES no row quotes: the case, and why.
UNQUOTED: dict[str, str] = {
    "LoRA target misspelled, HF": "the message of 'LoRA target misspelled' for a Hugging Face model (its names)",
}


@dataclass(frozen=True)
class Quote:
    """One quoted message of a row: its text, the exception class or tool command it names, its literal pieces."""

    text: str
    error: Optional[str]
    command: Optional[str]
    pieces: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> Quote:
        if ERROR_CLASS.fullmatch(text):  # an exception's name alone
            return cls(text, text, None, ())
        rest, error, command = text, None, None
        if match := ERROR_PREFIX.match(rest):
            error, rest = match["error"], rest[match.end():]
        elif match := CLI_PREFIX.match(rest):
            command, rest = match["command"], rest[match.end():]
        pieces = (flat(p).strip() for p in QUOTE_PIECES.split(rest))
        return cls(text, error, command, tuple(p for p in pieces if re.search(r"\w", p)))


def quotes(see: str) -> list[Quote]:
    """The quotes of a ``see`` column: its code spans (CommonMark strips one space each side of a padded span)."""
    spans = [m.group(2) for m in CODE_SPAN.finditer(see)]
    return [Quote.of(s[1:-1] if len(s) > 2 and s[0] == s[-1] == " " else s) for s in spans]


def flat(text: str) -> str:
    """``text`` on one line: a list's bullets (``\\n  - ``) and every run of white space read as one space."""
    return " ".join(re.sub(r"\n\s*- ", " ", text).split())


def in_order(pieces: tuple[str, ...], text: str) -> bool:
    at = 0
    for piece in pieces:
        found = text.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


@dataclass(frozen=True)
class Raised:
    message: str  #: one line (``flat``); a command-line tool's: what it printed on stderr too
    classes: frozenset[str]  #: the names of the exception's classes


@pytest.fixture(scope="module")
def raised(tmp_path_factory) -> dict[str, Raised]:
    """Each case of CASES run once, as ``test_each_misconfiguration_is_refused_clearly`` runs it."""
    named = {case for refusal in REFUSALS for case in refusal.cases}
    found = {}
    for name, run, error, _ in CASES:
        if name not in named:
            continue
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(error) as caught:
            run(tmp_path_factory.mktemp("case"))
        message = str(caught.value) + (f"\n{stderr.getvalue()}" if error is SystemExit else "")
        found[name] = Raised(flat(message), frozenset(c.__name__ for c in type(caught.value).__mro__))
    return found


@functools.cache
def sources() -> dict[Path, str]:
    """The library's modules, but this table's own (whose quotes would find themselves)."""
    return {path: path.read_text() for path in sorted(LIBRARY.rglob("*.py")) if path != TABLE}


@functools.cache
def literals(path: Path) -> tuple[str, ...]:
    """The string literals of a module but its docstrings (which quote messages too), each on one line: an
    f-string's holes as ``\\0``, except a module constant's (its value)."""
    tree = ast.parse(sources()[path])
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, (str, int))}

    def hole(value: ast.FormattedValue) -> str:
        name = value.value
        if isinstance(name, ast.Name) and name.id in constants and value.format_spec is None:
            return str(constants[name.id])
        return "\0"

    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if id(node) in docstrings:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(flat(node.value))
        elif isinstance(node, ast.JoinedStr):
            found.append(flat("".join(v.value if isinstance(v, ast.Constant) else hole(v) for v in node.values)))
    return tuple(found)


def in_a_literal(piece: str) -> bool:
    """Whether ``piece`` is in a string literal of the library (parsing only the modules that hold its longest
    word)."""
    word = max(re.findall(r"\w+", piece), key=len)
    return any(piece in literal for path, text in sources().items() if word in text for literal in literals(path))


def commands() -> set[str]:
    """The subcommands of ``lightning-2d`` (``tools.cli.COMMANDS``, read without importing the tool)."""
    tree = ast.parse(sources()[LIBRARY / "tools" / "cli.py"])
    return next({key.value for key in node.value.keys} for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in node.targets))


def source_parts(quote: Quote) -> list[str]:
    """What of a quote the source holds as written: its pieces cut at numbers too (values, formatted from holes),
    without the punctuation at their ends (next to a hole in the source)."""
    parts = (re.sub(r"^\W+|\W+$", "", part) for piece in quote.pieces for part in re.split(r"\d+", piece))
    return [part for part in parts if part]


def check_in_source(quote: Quote) -> None:
    """A quote no case raises: its class is the library's, its command the tool's, its longest piece in a literal."""
    if quote.error is not None:
        assert any(re.search(rf"^class {quote.error}\b", text, re.M) for text in sources().values()), (
            f"{quote.text!r}: no class {quote.error} in lightning_2d")
    if quote.command is not None:
        assert quote.command in commands(), f"{quote.text!r}: lightning-2d has no command {quote.command!r}"
    for part in source_parts(quote):
        assert in_a_literal(part), f"{quote.text!r}: {part!r} is in no string literal of lightning_2d"


def row_id(refusal: Refusal) -> str:
    return quotes(refusal.see)[0].text[:60]


def test_every_row_quotes_a_message_and_names_known_cases():
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)), "case ids of test_misconfigurations.CASES repeat"
    for refusal in REFUSALS:
        assert quotes(refusal.see), f"{refusal.see!r} quotes no message"
        assert refusal.cause and refusal.do, refusal
        unknown = [case for case in refusal.cases if case not in ids]
        assert not unknown, f"{row_id(refusal)!r} names cases test_misconfigurations.CASES does not have: {unknown}"
    named = [q.text for r in REFUSALS if r.cases for q in quotes(r.see)]
    assert not set(SOURCE_ONLY) - set(named), "SOURCE_ONLY lists quotes no row with cases has"


@pytest.mark.parametrize("refusal", REFUSALS, ids=row_id)
def test_each_row_quotes_what_its_cases_raise(refusal: Refusal, raised: dict[str, Raised]):
    described = set()
    for quote in quotes(refusal.see):
        if not refusal.cases or quote.text in SOURCE_ONLY:
            check_in_source(quote)
            continue
        matches = [case for case in refusal.cases if in_order(quote.pieces, raised[case].message)
                   and (quote.error is None or quote.error in raised[case].classes)]
        assert matches, f"{quote.text!r} (pieces {list(quote.pieces)}, class {quote.error}) is raised by none of " + \
            "; ".join(f"{case!r}: {raised[case].message!r} ({sorted(raised[case].classes)})" for case in refusal.cases)
        if quote.command is not None:
            check_in_source(Quote(quote.text, None, quote.command, ()))
        described.update(matches)
    assert not set(refusal.cases) - described, f"cases no quote of {row_id(refusal)!r} describes: " + \
        "; ".join(f"{case!r}: {raised[case].message!r}" for case in set(refusal.cases) - described)


def test_every_case_has_its_row():
    quoted = {case for refusal in REFUSALS for case in refusal.cases}
    missing = [case[0] for case in CASES if case[0] not in quoted and case[0] not in UNQUOTED]
    assert not missing, f"cases of test_misconfigurations no row of tools/troubleshooting.py quotes: {missing}"
    assert not quoted & set(UNQUOTED), "UNQUOTED lists cases a row quotes"
