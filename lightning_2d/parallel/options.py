"""Options written once: dataclass fields whose docstrings are the documentation everywhere else.

An option is a field of an options dataclass (``ParallelConfig``, the strategies' ``StrategyOptions``)
with its type, its default, its place in the strategies' signature and, right below it, its docstring (one
paragraph, reST inline markup)::

    sequence_parallel: bool = option(True, position=8)
    \"\"\"Shard norms and residual activations along the sequence ...\"\"\"

``option()`` records the option's ``position`` among the strategies' parameters (the positional order of
0.1.0: fields of two dataclasses interleave there) and, where the docs show something else than the
default's value, what it shows (``shown``). ``options_of(cls)`` reads it all back as ``Option`` records: the
strategies' constructors are generated from them (``lightning_2d.integration.strategy_options.takes_options``: signature,
annotations, defaults and docstring, what LightningCLI/jsonargparse reads for ``--help`` and ``--print_config``),
and a unit test compares the docs' table with them. Which checks report an option's problems is not written
here but read from the checks' registry (``Option.checks``, ``lightning_2d.parallel.checks``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from functools import lru_cache
from typing import Any, Optional


@dataclass(frozen=True)
class Option:
    """One option: what the signature, the docstrings, the CLI and the docs' table are made of."""

    #: The argument's name (the dataclass field's).
    name: str
    #: Its type, resolved (``typing.Literal[...]``, not a string).
    annotation: Any
    #: Its default value.
    default: Any
    #: What it means: the field's docstring as one paragraph, with the source's reST inline markup.
    doc: str
    #: Its place among the strategies' parameters (``None``: not a strategy parameter).
    position: Optional[int] = None
    #: How the docs show the default when not as its value (e.g. "from the module"), else ``None``.
    shown: Optional[str] = None
    #: The registered checks that report its problems, as dotted names (``lightning_2d.parallel.dims.replica_groups``),
    #: filled in from the checks' registry (``lightning_2d.parallel.checks.checks_reading``) by
    #: ``lightning_2d.integration.strategy_options.strategy_options``; empty when any value is accepted.
    checks: tuple[str, ...] = ()

    @property
    def shown_default(self) -> str:
        """The default as the docs show it (markdown)."""
        return markdown(self.shown) if self.shown is not None else show_value(self.default)


def option(default: Any, *, position: int, shown: Optional[str] = None) -> Any:
    """A dataclass field that is an option (its docstring goes right below it).

    Args:
        default: The default value (immutable: options are plain values).
        position: Its place among the strategies' parameters, from 0 (a new option takes the next free one,
            so that positional calls written for an older version keep working).
        shown: How the docs show the default, when not as its value (reST inline markup).
    """
    return field(default=default, metadata={"position": position, "shown": shown})


@lru_cache(maxsize=None)
def attribute_docstrings(cls: type) -> dict[str, str]:
    """``name → docstring`` of the annotated class attributes followed by a string literal, read from the
    class's source (the ``attribute docstrings`` Sphinx and IDEs show), each cleaned to one paragraph."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen or zipped install): the options stay undocumented
        return {}
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def options_of(cls: type) -> list[Option]:
    """The options a dataclass declares, in field order: type, default, docstring and position of each."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
    found = []
    for f in fields(cls):
        if f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: every option has one")
        found.append(Option(
            name=f.name, annotation=hints[f.name], default=f.default, doc=docs.get(f.name, ""),
            position=f.metadata.get("position"), shown=f.metadata.get("shown"),
        ))
    return found


def args_section(options: Sequence[Option], width: int = 100) -> str:
    """A Google-style ``Args:`` section documenting ``options`` (what docstring-parser, and so
    jsonargparse's ``--help``, reads)."""
    lines = ["Args:"]
    for opt in options:
        lines += textwrap.wrap(
            f"{opt.name}: {opt.doc}", width=width, initial_indent="    ", subsequent_indent="        ",
            break_long_words=False, break_on_hyphens=False,
        )
    return "\n".join(lines)


def documented(cls: type) -> type:
    """Class decorator: append an ``Args:`` section built from the options' docstrings to the class's
    docstring, so ``help()`` and docstring readers see every option without a second copy in the source."""
    intro = inspect.cleandoc(cls.__doc__ or "")
    cls.__doc__ = f"{intro}\n\n{args_section(options_of(cls))}\n"
    return cls


def markdown(text: str) -> str:
    """reST inline markup as markdown for a table cell: ````code```` → ```code```, ``|`` escaped."""
    return text.replace("``", "`").replace("|", "\\|")


def show_value(value: Any) -> str:
    """A default as the docs show it: ```"auto"```, ```1```, ```None```; a timedelta as ``30 min``."""
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"
