"""The README's first screen and its links: what it is, the install line, a complete script, the two commands and a
table of contents that reaches every section; every ``#anchor`` and relative file (the pictures) it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
#: The README outside its code blocks (a ``#`` there is a comment, not a heading).
PROSE = re.sub(r"```.*?```", "", README, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but ``-`` and ``_``), spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(level: str) -> list[str]:
    return re.findall(rf"^{level} (.+)$", PROSE, flags=re.M)


def section(title: str) -> str:
    start = PROSE.index(f"## {title}\n")
    end = PROSE.find("\n## ", start + 1)
    return PROSE[start:end]


def test_the_first_screen_says_what_it_is_how_to_install_and_run_it():
    lines = README.splitlines()
    first = "\n".join(lines[:100])
    assert lines[0] == "# lightning_2d"
    assert first.index("pip install") < first.index("if __name__") < first.index("## The two commands")
    assert first.index("## The two commands") < first.index("## Contents")
    assert ".ci/setup && .venv/bin/lightning-2d prepare-data --config recipes/debug_cpu.yaml" in first
    assert ".ci/setup && .venv/bin/python -m pytest" in first


def test_the_contents_reach_every_section():
    contents = section("Contents")
    linked = set(re.findall(r"\]\(#([^)]+)\)", contents))
    for heading in headings("##") + headings("###"):
        if heading != "Contents":
            assert slug(heading) in linked, f"## {heading} is not in the README's Contents"


def test_every_anchor_and_file_the_readme_links_exists():
    anchors = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", PROSE, flags=re.M)}
    assert "the-two-commands" in anchors and "long-context-context-parallelism" in anchors
    for target in re.findall(r"\]\(#([^)]+)\)", PROSE):
        assert target in anchors, f"README links #{target}, which no heading has"
    files = [t for t in re.findall(r"\]\(([^)#:]+)\)", PROSE)]
    assert "docs/loss_2x2_vs_one_device.png" in files and "docs/mesh.png" in files
    for target in files:
        assert (REPO / target).exists(), f"README links {target}, which does not exist"
