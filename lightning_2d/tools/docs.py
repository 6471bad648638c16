"""The documentation's generated parts, made from the code so that they cannot drift from it.

A page of ``docs/`` marks each generated part with a pair of comments (invisible on a code host and on the site)::

    <!-- generated: options -->
    | argument | default | meaning |
    …
    <!-- end generated -->

``GENERATORS`` names what each part is made of: the strategy options' table (their fields), the registered
checks (``parallel.checks.CHECKS``), the recipe list (each recipe's header comment), the troubleshooting table
(``tools.troubleshooting.REFUSALS``) and each tool's ``--help`` (its parser, at 100 columns). The site
regenerates every part when it is built (this module is the MkDocs hook of ``mkdocs.yml``: ``on_page_markdown``);
the Markdown files keep a copy for reading on a code host, which ``tests/unit/test_docs.py`` compares::

    python -m lightning_2d.tools.docs            # list the stale parts (exit 1 if any)
    python -m lightning_2d.tools.docs --write    # rewrite them in docs/*.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from lightning_2d.integration.strategy_options import options_table  # imports every module that registers a check
from lightning_2d.parallel.checks import CHECKS, INPUT_OPTIONS
from lightning_2d.tools.cli import main as cli_main
from lightning_2d.tools.troubleshooting import REFUSALS

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RECIPES = REPO / "recipes"

#: A generated part: its name, its body, its end.
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w:-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)

#: The width ``--help`` is rendered at (argparse reads ``COLUMNS``).
HELP_COLUMNS = 100


def options() -> str:
    """The strategy options: argument, default as shown, meaning (both strategies take the same)."""
    return options_table()


def checks() -> str:
    """Every registered check: what it reads and what it refuses (its docstring's first sentence)."""
    rows = ["| check | reads | refuses |", "| --- | --- | --- |"]
    for registered in CHECKS:
        inputs = [i for i in (*registered.required, *registered.optional) if i not in INPUT_OPTIONS]
        reads = ", ".join(f"`{name}`" for name in (*registered.reads, *inputs))
        rows.append(f"| `{registered.name.removeprefix('lightning_2d.')}` | {reads or '–'} |"
                    f" {first_sentence(registered.function.__doc__)} |")
    return "\n".join(rows) + "\n"


def recipes() -> str:
    """Every recipe of ``recipes/``: its file and the first sentence of its header comment (a script's docstring)."""
    rows = ["| recipe | what it does |", "| --- | --- |"]
    for path in sorted(RECIPES.glob("*.yaml")) + sorted(RECIPES.glob("*.py")):
        rows.append(f"| `recipes/{path.name}` | {first_sentence(header(path))} |")
    return "\n".join(rows) + "\n"


def troubleshooting() -> str:
    """The refusals a user meets, one row each: what they see, the cause, what to do."""
    rows = ["| you see | cause | do |", "| --- | --- | --- |"]
    rows += [f"| {r.see} | {r.cause} | {r.do} |" for r in REFUSALS]
    return "\n".join(rows) + "\n"


def tool_help(*argv: str) -> Callable[[], str]:
    """``lightning-2d ARGV --help`` as it prints, in a ``text`` block."""

    def render() -> str:
        out = io.StringIO()
        previous = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = str(HELP_COLUMNS)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    cli_main([*argv, "--help"])
                except SystemExit as exit_:
                    if exit_.code not in (0, None):
                        raise RuntimeError(f"lightning-2d {' '.join(argv)} --help exited with {exit_.code}:"
                                           f" {out.getvalue()}") from None
        finally:
            if previous is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = previous
        text = "\n".join(line.rstrip() for line in out.getvalue().strip("\n").splitlines())
        return f"```text\n$ lightning-2d {' '.join((*argv, '--help'))}\n{text}\n```\n"

    return render


#: What each generated part is made of.
GENERATORS: dict[str, Callable[[], str]] = {
    "options": options,
    "checks": checks,
    "recipes": recipes,
    "troubleshooting": troubleshooting,
    "help": tool_help(),
    "help:plan": tool_help("plan"),
    "help:benchmark": tool_help("benchmark"),
    "help:prepare-data": tool_help("prepare-data"),
    "help:export": tool_help("export"),
}


def header(path: Path) -> str:
    """A recipe's header: a YAML file's leading comment lines, a script's module docstring."""
    text = path.read_text()
    if path.suffix == ".py":
        match = re.match(r'\s*"""(.*?)"""', text, flags=re.S)
        return match.group(1) if match else ""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def first_sentence(text: Optional[str]) -> str:
    """The first sentence of a docstring or comment, on one line, with ``|`` escaped for a table."""
    flat = " ".join((text or "").split())
    depth, end = 0, len(flat)
    for i, char in enumerate(flat):  # the first '.' or ';' followed by a space, outside brackets and quotes
        depth += char in "([{" and 1 or -(char in ")]}")
        if char in ".;" and depth <= 0 and (i + 1 == len(flat) or flat[i + 1] == " "):
            end = i
            break
    return flat[:end].replace("``", "`").replace("|", "\\|")


def render(markdown: str, generated: Optional[dict[str, str]] = None, markers: bool = True) -> str:
    """``markdown`` with each generated part made again (``generated``: parts already made, by name; ``markers``:
    keep the comments around each part, as the Markdown files do; the site's pages drop them)."""
    made = {} if generated is None else generated

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise KeyError(f"generated part {name!r} is not one of {sorted(GENERATORS)}")
        if name not in made:
            made[name] = GENERATORS[name]()
        return f"{match.group(1)}{made[name]}{match.group(4)}" if markers else made[name]

    return BLOCK.sub(replace, markdown)


def pages() -> list[Path]:
    """The Markdown files that may hold generated parts: every page of ``docs/`` and the README."""
    return sorted(DOCS.rglob("*.md")) + [REPO / "README.md"]


def stale(write: bool = False) -> list[Path]:
    """The pages whose generated parts differ from what the code makes now; ``write``: rewrite them."""
    generated: dict[str, str] = {}
    found = []
    for path in pages():
        text = path.read_text()
        fresh = render(text, generated)
        if fresh != text:
            found.append(path)
            if write:
                path.write_text(fresh)
    return found


def home_page() -> str:
    """The site's home page: the README, its links made relative to ``docs/`` (``docs/x.md`` → ``x.md``,
    ``CONTRIBUTING.md`` → ``contributing.md``, which includes it)."""
    text = (REPO / "README.md").read_text()
    text = re.sub(r"\]\(docs/", "](", text)
    return re.sub(r"\]\(CONTRIBUTING\.md", "](contributing.md", text)


def on_page_read_source(page: object, **_: object) -> Optional[str]:
    """MkDocs' hook: ``docs/index.md`` (a pointer on a code host) reads as the README on the site."""
    if page.file.src_uri == "index.md":  # type: ignore[attr-defined]
        return home_page()
    return None


def on_page_markdown(markdown: str, **_: object) -> str:
    """MkDocs' hook (``mkdocs.yml``: ``hooks``): each page's generated parts made again at build time."""
    return render(markdown, markers=False)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_2d.tools.docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale generated parts in place")
    args = parser.parse_args(argv)
    found = stale(write=args.write)
    for path in found:
        print(f"{'rewrote' if args.write else 'stale'}: {path.relative_to(REPO)}")
    if found and not args.write:
        print("run: python -m lightning_2d.tools.docs --write", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
