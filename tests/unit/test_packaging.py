"""What the distribution ships and says about itself: one version, the license, the type hints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_and_read_without_importing_the_package(monkeypatch):
    from setuptools.config.expand import read_attr

    import lightning_2d

    config = pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "lightning_2d.__version__"
    monkeypatch.setitem(sys.modules, "lightning_2d", None)  # an import (of torch, at build time) would fail
    assert read_attr(attr, root_dir=ROOT) == lightning_2d.__version__


def test_the_license_and_the_type_hints_ship():
    config = pyproject()
    assert config["project"]["license"] == "Apache-2.0" and config["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for part in ("1. Definitions.", "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                 "APPENDIX: How to apply the Apache License to your work."):
        assert part in text
    assert (ROOT / "lightning_2d" / "py.typed").is_file()
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["lightning_2d"]
