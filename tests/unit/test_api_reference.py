"""The API reference (``docs/reference/*.md``, rendered by mkdocstrings) covers the public names: every name of
``lightning_2d.__all__`` is one ``::: target`` directive (``lightning_2d.NAME`` or the path of the module that
defines it), and every directive names an object that imports. Pure: reads the pages, imports the package.

Broken when a name joins ``__all__`` without its entry (add ``::: lightning_2d.NAME`` to the page of its group), or
a page documents it twice, or a directive names something moved or removed (``mkdocs build --strict`` would fail on
it too, but only where the docs are built).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

import lightning_2d

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"
#: ``::: dotted.path`` at the start of a line (mkdocstrings' autodoc syntax).
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def directives(folder: Path = REFERENCE) -> list[tuple[str, str]]:
    """Every ``:::`` directive of the reference pages: (page, target)."""
    return [(page.name, target) for page in sorted(folder.glob("*.md")) for target in DIRECTIVE.findall(page.read_text())]


def resolve(target: str) -> Any:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"no module in {target!r}")


def documented(name: str, found: list[tuple[str, str]]) -> list[str]:
    """The directives that document ``lightning_2d.NAME``: by that path, or by any path to the same object."""
    public = getattr(lightning_2d, name)
    hits = []
    for page, target in found:
        if target == f"lightning_2d.{name}":
            hits.append(f"{page}: {target}")
        elif target.rsplit(".", 1)[-1] == name:
            try:
                if resolve(target) is public:
                    hits.append(f"{page}: {target}")
            except (ImportError, AttributeError):
                pass  # reported by the test of the targets
    return hits


def test_the_reference_pages_exist():
    assert (REFERENCE / "index.md").is_file()
    assert directives(), f"no ::: directive under {REFERENCE}"


@pytest.mark.parametrize("name", sorted(lightning_2d.__all__))
def test_every_public_name_has_one_reference_entry(name):
    hits = documented(name, directives())
    assert len(hits) == 1, (
        f"lightning_2d.{name} is documented by {len(hits)} ::: directives in docs/reference/*.md"
        f" ({hits or 'none'}): it needs exactly one, `::: lightning_2d.{name}` on the page of its group"
    )


def test_every_directive_names_an_object():
    problems = []
    for page, target in directives():
        try:
            resolve(target)
        except (ImportError, AttributeError) as err:
            problems.append(f"{page}: ::: {target} ({type(err).__name__}: {err})")
    assert not problems, "reference entries that name nothing:\n" + "\n".join(problems)


def test_no_target_is_documented_twice():
    seen: dict[str, str] = {}
    twice = []
    for page, target in directives():
        if target in seen:
            twice.append(f"{target}: {seen[target]} and {page}")
        seen.setdefault(target, page)
    assert not twice, "documented twice (mkdocstrings would give one anchor two pages):\n" + "\n".join(twice)


def test_a_name_added_to_all_without_an_entry_fails(tmp_path, monkeypatch):
    """The check itself: a page set without one public name's entry is caught, as is a target that moved."""
    name = "TokenThroughputMonitor"
    for page in REFERENCE.glob("*.md"):
        (tmp_path / page.name).write_text(page.read_text().replace(f"::: lightning_2d.{name}\n", ""))
    assert documented(name, directives(tmp_path)) == []
    with pytest.raises(AttributeError):
        resolve("lightning_2d.NoSuchName")
