"""The README's first screen and its links: what it is, the install line, a complete script, the two commands and a
table of the guides that reaches every page of the site; every ``#anchor`` and relative file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
#: The README outside its code blocks (a ``#`` there is a comment, not a heading).
PROSE = re.sub(r"```.*?```", "", README, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but ``-`` and ``_``), spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def nav_pages(entries: object) -> list[str]:
    """Every page ``mkdocs.yml``'s nav lists, in order."""
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, dict):
        return [p for value in entries.values() for p in nav_pages(value)]
    return [p for entry in entries for p in nav_pages(entry)]


def test_the_first_screen_says_what_it_is_how_to_install_and_run_it():
    lines = README.splitlines()
    first = "\n".join(lines[:100])
    assert lines[0] == "# lightning_2d"
    assert first.index("pip install") < first.index("if __name__") < first.index("## The two commands")
    assert ".ci/setup && .venv/bin/lightning-2d prepare-data --config recipes/debug_cpu.yaml" in first
    assert ".ci/setup && .venv/bin/python -m pytest" in first


def test_the_readme_is_short_and_its_table_reaches_every_guide():
    assert len(README.splitlines()) <= 250, "the README is the front page: move the detail into a guide of docs/"
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    linked = {target.removeprefix("docs/") for target in re.findall(r"\]\((docs/[^)#]+\.md)\)", PROSE)}
    for page in nav_pages(nav):
        # the home page is the README; CONTRIBUTING.md is linked; the API reference by its overview page
        if page not in ("index.md", "contributing.md") and not page.startswith("reference/") or page == "reference/index.md":
            assert page in linked, f"the README's table of guides does not link docs/{page}"
    assert "CONTRIBUTING.md" in re.findall(r"\]\(([^)#]+)\)", PROSE)


def test_every_anchor_and_file_the_readme_links_exists():
    anchors = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", PROSE, flags=re.M)}
    assert "the-two-commands" in anchors
    for target in re.findall(r"\]\(#([^)]+)\)", PROSE):
        assert target in anchors, f"README links #{target}, which no heading has"
    files = [t for t in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", PROSE)]
    assert "docs/loss_2x2_vs_one_device.png" in files and "docs/getting-started.md" in files
    for target in files:
        assert (REPO / target).exists(), f"README links {target}, which does not exist"
