"""The documentation site (``mkdocs.yml``, ``docs/``): it builds strictly, its generated parts are what the code
makes now, and what the build makes of them is on the pages (the README as the home page, the options table, the
API reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_2d.tools import docs

REPO = Path(__file__).resolve().parents[2]


class _Loader(yaml.SafeLoader):
    """``mkdocs.yml`` may hold ``!!python/name:`` tags (Material's extensions): read them as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def test_the_build_is_strict():
    """A broken link, an anchor no heading has, a page outside the nav or an unknown API object fails the build."""
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)
    assert config["strict"] is True
    assert {config["validation"][k] for k in ("anchors", "omitted_files", "unrecognized_links")} == {"warn"}
    assert config["hooks"] == ["lightning_2d/tools/docs.py"]


@pytest.fixture(scope="module")
def site(tmp_path_factory, monkeypatch_module) -> Path:
    """``mkdocs build --strict`` of the checkout, in this process (torch and Lightning, which the hook's generators
    import, are loaded already): a warning aborts it, as on the command line."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    monkeypatch_module.chdir(REPO)
    monkeypatch_module.setenv("NO_MKDOCS_2_WARNING", "1")
    build(load_config(str(REPO / "mkdocs.yml"), strict=True, site_dir=str(out)))
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_site_builds_and_shows_the_generated_parts(site):
    home = (site / "index.html").read_text()
    assert "The two commands" in home and "getting-started/" in home  # the README, its links made the site's
    strategy = (site / "strategy" / "index.html").read_text()
    assert "<code>tensor_parallel_size</code>" in strategy and "generated: options" not in strategy
    recipes = (site / "recipes" / "index.html").read_text()
    assert "recipes/debug_cpu.yaml" in recipes and "recipes/moe_cpu.yaml" in recipes  # the generated recipe list
    assert "$ lightning-2d plan --help" in (site / "reference" / "cli" / "index.html").read_text()
    reference = "".join(p.read_text() for p in (site / "reference").rglob("*.html"))
    assert 'id="lightning_2d.ModelParallel2DStrategy"' in reference  # mkdocstrings rendered the object
    contributing = (site / "contributing" / "index.html").read_text()  # CONTRIBUTING.md, included whole
    assert 'id="map"' in contributing and 'id="private-apis-we-rely-on"' in contributing


def test_the_generated_parts_are_fresh():
    """Every ``<!-- generated: … -->`` part of the Markdown is what the code makes now (the site makes them again
    when built; this keeps the copy a code host shows)."""
    assert not docs.stale(), "run: python -m lightning_2d.tools.docs --write"


def test_a_generated_part_is_made_again_and_an_unknown_one_refused():
    page = "intro\n<!-- generated: recipes -->\nstale\n<!-- end generated -->\nafter\n"
    made = docs.render(page)
    assert "stale" not in made and "| `recipes/debug_cpu.yaml` |" in made and made.endswith("after\n")
    with pytest.raises(KeyError, match="'nope' is not one of"):
        docs.render("<!-- generated: nope -->\n<!-- end generated -->")


def test_first_sentence_keeps_brackets_whole():
    assert docs.first_sentence("The base (its init; or a folder). More.") == "The base (its init; or a folder)"
    assert docs.first_sentence("a | b; c") == "a \\| b"
