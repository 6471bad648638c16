"""The package's layers, read from its folders: each imports only the layers below it, and no module takes
part in an import circle. A failure names the offending import (file, line, both layers). Dependencies stay in
plain sight: no module imports another one's private name, and a function-local import of the package says why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_2d"

#: Bottom to top. A module may import its own layer (no circles) and any layer below; ``checkpoint`` and
#: ``data`` are peers that do not import each other. The top holds the public front doors.
LAYERS: list[tuple[str, ...]] = [
    ("_compat", "errors"),
    ("ops",),
    ("parallel",),
    ("models",),
    ("checkpoint", "data"),
    ("integration",),
    ("tools",),
    ("__init__", "__main__", "hf", "fabric"),
]


def layer_of(module: str) -> tuple[int, str]:
    """``lightning_2d.parallel.fsdp`` → (index of its layer, ``"parallel"``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index, top
    raise AssertionError(f"{module} is in no layer: add lightning_2d/{top} to LAYERS in {__file__}")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """Every ``lightning_2d`` module ``name`` imports (also inside functions and ``TYPE_CHECKING``), with lines."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` imports the submodule; `from pkg import name` the package.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        found += [(t, node.lineno) for t in targets if t == "lightning_2d" or t.startswith("lightning_2d.")]
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def upward_imports() -> list[str]:
    problems = []
    for name, targets in graph().items():
        here, here_name = layer_of(name)
        for target, line in targets:
            there, there_name = layer_of(target)
            if there > here or (there == here and there_name != here_name):
                problems.append(
                    f"{modules()[name].relative_to(PACKAGE.parent)}:{line} imports {target}: layer {there_name!r}"
                    f" is {'above' if there > here else 'a peer of'} {here_name!r}"
                )
    return problems


def circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = {name: sorted({t for t, _ in targets if t != name}) for name, targets in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_layer():
    for name in modules():
        layer_of(name)


def test_imports_only_go_down_the_layers():
    problems = upward_imports()
    assert not problems, "imports that run upward or sideways:\n  " + "\n  ".join(problems)


def test_no_import_circles():
    found = circles()
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_the_model_files_do_not_import_torch_distributed():
    for path in (PACKAGE / "models" / "llama" / "model.py", PACKAGE / "ops" / "linear_cross_entropy.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.startswith("torch.distributed")], path


@pytest.mark.parametrize("bad", ["upward", "circle"])
def test_the_checks_catch_what_they_name(tmp_path, monkeypatch, bad):
    """The checks themselves fail on a planted upward import and a planted circle."""
    fake = tmp_path / "lightning_2d"
    for folder in ("parallel", "tools"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    if bad == "upward":
        (fake / "parallel" / "mesh.py").write_text("from lightning_2d.tools import cli\n")
        (fake / "tools" / "cli.py").write_text("")
        monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", fake)
        assert any("parallel/mesh.py:1 imports lightning_2d.tools.cli" in p for p in upward_imports())
    else:
        (fake / "parallel" / "a.py").write_text("import lightning_2d.parallel.b\n")
        (fake / "parallel" / "b.py").write_text("def f():\n    from lightning_2d.parallel import a\n")
        monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", fake)
        assert circles() == [["lightning_2d.parallel.a", "lightning_2d.parallel.b"]]


def test_the_mechanics_know_nothing_of_lightning():
    """``ops``, ``parallel`` and ``models`` import no Lightning module (also inside functions): how a warning is shown
    on which rank, or what a Trainer does, is ``integration``'s to decide (``errors.Lightning2DWarning``)."""
    found = []
    for layer in ("ops", "parallel", "models"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")]
    assert not found, "Lightning imported below integration/:\n  " + "\n  ".join(found)


# ---- dependencies in plain sight (#43) ----------------------------------------------------------------------------
#: Private names imported from another module, (importing module, imported name): none (#43); add none.
ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str]] = set()

#: The reasons a function-local import of the package's own modules may give, on its lines or the line above:
#: ``# cycle: <the module that imports this one>``, ``# optional: <the optional or heavy dependency it keeps out>``,
#: ``# lazy: <why it must not load at import>``. Anything else belongs at the module's top.
LOCAL_IMPORT_REASON = re.compile(r"#\s*(cycle|optional|lazy):\s*\S")


def import_base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from … import`` of module ``name`` (file ``path``) reads from."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def private_imports() -> set[tuple[str, str, int]]:
    """``(module, imported name, line)`` of every private name (``_x``, not a module) a module of the package
    imports from another one of its modules."""
    known, found = modules(), set()
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = import_base(name, path, node)
            if base == name or not (base == "lightning_2d" or base.startswith("lightning_2d.")):
                continue
            found |= {(name, f"{base}.{a.name}", node.lineno) for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and f"{base}.{a.name}" not in known}
    return found


def local_imports_without_a_reason() -> list[str]:
    """``file:line`` of each function-local import of a ``lightning_2d`` module whose lines and the line above give
    no ``LOCAL_IMPORT_REASON``."""
    problems = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        functions = [n for n in ast.walk(ast.parse(path.read_text(), str(path)))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        for node in sorted({id(n): n for f in functions for n in ast.walk(f) if hasattr(n, "lineno")}.values(),
                           key=lambda n: n.lineno):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [import_base(name, path, node)]
            else:
                continue
            if not any(t == "lightning_2d" or t.startswith("lightning_2d.") for t in targets):
                continue
            around = lines[max(0, node.lineno - 2) : node.end_lineno]
            if not any(LOCAL_IMPORT_REASON.search(line) for line in around):
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {', '.join(targets)}")
    return problems


def test_no_module_imports_another_modules_private_name():
    """A name another module needs is part of its home's interface: public there, or the code moves."""
    found = private_imports()
    new = sorted(f"{modules()[m].relative_to(PACKAGE.parent)}:{line} imports {n}" for m, n, line in found
                 if (m, n) not in ALLOWED_PRIVATE_IMPORTS)
    assert not new, "private names imported from another module (make them public there):\n  " + "\n  ".join(new)
    gone = sorted(ALLOWED_PRIVATE_IMPORTS - {(m, n) for m, n, _ in found})
    assert not gone, f"no longer imported, remove from ALLOWED_PRIVATE_IMPORTS in {__file__}: {gone}"


def test_function_local_imports_of_the_package_say_why():
    """Imports at the top show a module's dependencies; one inside a function is there for a reason (a cycle, an
    optional dependency, import time) that its comment names: ``# cycle:``, ``# optional:`` or ``# lazy:``."""
    problems = local_imports_without_a_reason()
    assert not problems, ("function-local imports of the package without a reason (move them to the top, or say"
                          " why on the line or the line above: '# cycle: <the module importing this one>',"
                          " '# optional: <dependency>', '# lazy: <why>'):\n  " + "\n  ".join(problems))


@pytest.mark.parametrize("bad", ["private", "local"])
def test_the_dependency_checks_catch_what_they_name(tmp_path, monkeypatch, bad):
    fake = tmp_path / "lightning_2d"
    (fake / "data").mkdir(parents=True)
    for file in ("__init__.py", "data/__init__.py", "data/sources.py"):
        (fake / file).write_text("_stat = 1\n")
    if bad == "private":
        (fake / "data" / "cache.py").write_text("from lightning_2d.data.sources import _stat\nfrom . import sources\n")
    else:
        (fake / "data" / "cache.py").write_text(
            "def f():\n    from lightning_2d.data import sources  # a comment, not a reason\n\n\n"
            "def g():\n    # cycle: lightning_2d.data.sources imports this module\n    from .sources import _stat\n\n\n"
            "def h():\n    import lightning_2d.data.sources  # lazy: start-up time\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", fake)
    if bad == "private":  # the private name, not the module imported by name
        found = {(m, n) for m, n, _ in private_imports()}
        assert found == {("lightning_2d.data.cache", "lightning_2d.data.sources._stat")}
    else:  # the import without a reason, not those giving one
        assert local_imports_without_a_reason() == ["lightning_2d/data/cache.py:2 imports lightning_2d.data"]
