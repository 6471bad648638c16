"""The private torch/Lightning APIs lightning_2d relies on: all listed in ``lightning_2d._compat``, all still
present in the installed versions, and used nowhere else in the package."""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

import pytest
import torch

from lightning_2d import _compat
from lightning_2d._compat import INSTANCE_ATTRIBUTES, PRIVATE_APIS

PACKAGE = Path(_compat.__file__).parent


def _instance_of(owner: str):
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies import ModelParallelStrategy

    return {"ModelParallelStrategy": ModelParallelStrategy, "Strategy": ModelParallelStrategy,
            "LightningModule": LightningModule, "Module": torch.nn.Module}[owner]()


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: f"{api.module}:{api.name}")
def test_each_private_api_still_exists(api):
    """An upgrade that removes one fails here, naming it and what replaces it."""
    owner, _, attribute = api.name.rpartition(".")
    if api.name in INSTANCE_ATTRIBUTES:
        assert hasattr(_instance_of(owner), attribute), f"{api.name} is gone: {api.replacement}"
        return
    try:
        api.resolve()
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{api.module}.{api.name} is gone ({err}); it was used for {api.used_for}. Fix: {api.replacement}")


#: Token types that are text, not code (f-string parts are tokens of their own from Python 3.12).
NOT_CODE = {tokenize.STRING, tokenize.COMMENT, tokenize.ENCODING} | {
    getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, name)
}


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of ``path`` with their strings and comments removed (messages may name private APIs)."""
    lines: dict[int, list[str]] = {}
    with path.open("rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type in NOT_CODE:
                continue
            lines.setdefault(token.start[0], []).append(token.string)
    return [(number, " ".join(parts)) for number, parts in sorted(lines.items())]


#: A private module or name of torch/Lightning imported or reached through a module path (``nn``: ``torch.nn`` as
#: the package imports it).
PRIVATE_PATH = re.compile(
    r"\b(torch|lightning|nn)( \. \w+)* \. _[A-Za-z]|\bfrom (torch|lightning)( \. \w+)* import .*\b_[A-Za-z]"
)


def private_uses_outside_compat() -> list[str]:
    called = {api.name.rpartition(".")[2] for api in PRIVATE_APIS if api.kind == "call"}
    attribute = re.compile(r"\. (" + "|".join(sorted(called)) + r")\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for number, line in _code_lines(path):
            if PRIVATE_PATH.search(line) or attribute.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    return found


def test_no_module_but_compat_reaches_for_a_private_api():
    found = private_uses_outside_compat()
    assert not found, "private torch/Lightning APIs used outside lightning_2d/_compat.py:\n  " + "\n  ".join(found)


def test_the_scan_finds_a_planted_private_use(tmp_path, monkeypatch):
    fake = tmp_path / "lightning_2d"
    fake.mkdir()
    (fake / "_compat.py").write_text("")
    (fake / "mesh.py").write_text('"""torch._docstrings_are_fine"""\nflat = mesh._flatten("dp")  # torch._fine\n')
    (fake / "load.py").write_text("from torch.distributed.tensor._utils import x\n")
    (fake / "ac.py").write_text("ok = isinstance(m, nn.Dropout)\nbad = isinstance(m, nn.modules.dropout._DropoutNd)\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", fake)
    assert [f.split(":")[0:2] for f in private_uses_outside_compat()] == [
        ["lightning_2d/ac.py", "2"], ["lightning_2d/load.py", "1"], ["lightning_2d/mesh.py", "2"]]


def test_the_public_dropout_list_covers_every_torch_dropout_module():
    """``activation_checkpoint.DROPOUT_MODULES`` replaces an ``isinstance`` check against torch's private
    ``_DropoutNd``: a dropout class a torch release adds must join the list (or recomputation would draw new masks)."""
    import torch.nn.modules.dropout as dropout

    from lightning_2d.parallel.activation_checkpoint import DROPOUT_MODULES

    def subclasses(cls: type) -> set[type]:
        return {sub for direct in cls.__subclasses__() for sub in {direct} | subclasses(direct)}

    torch_own = {c for c in subclasses(dropout._DropoutNd) if c.__module__.startswith("torch.")}
    missed = [f"{c.__module__}.{c.__name__}" for c in torch_own if not issubclass(c, DROPOUT_MODULES)]
    assert len(torch_own) >= 6 and not missed, missed


def test_every_entry_says_why_and_what_replaces_it():
    for api in PRIVATE_APIS:
        assert api.used_for and api.replacement and api.kind in ("call", "override", "subclass"), api
    assert len({(a.module, a.name) for a in PRIVATE_APIS}) == len(PRIVATE_APIS)
