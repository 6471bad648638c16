"""Every strategy option is written once (a field of ``ParallelConfig`` or ``StrategyOptions`` with its docstring
and its position) and everything else agrees with it: the Trainer and Fabric strategies' signatures (generated from
the fields, and compared here parameter by parameter with them) and docstrings (what LightningCLI/jsonargparse
reads), the "Strategy options" table of ``docs/strategy.md``, and the checks listed for it (read from the checks' registry). A
failure names the option that drifted and how."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

import docstring_parser
import pytest

import lightning_2d
import lightning_2d.fabric
from lightning_2d.integration import strategy_options as options_module
from lightning_2d.integration.strategy_options import OPTIONS, PARAMETER_ORDER, StrategyOptions, init_stub, options_table
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.options import Option, markdown, option, options_of
from lightning_2d.parallel.schedules import ScheduleName
from lightning_2d.tools.docs import BLOCK
from lightning_2d.tools.options_table import PACKAGE, PAGE, STUB_FILES, stub_span

TRAINER = lightning_2d.ModelParallel2DStrategy
FABRIC = lightning_2d.fabric.ModelParallel2DStrategy
#: Constructor arguments of one strategy that are not options.
OWN_ARGUMENTS = {FABRIC: {"parallelize_fn"}}
SOURCE = {opt.name: opt for opt in OPTIONS}


def normalized(text: str) -> str:
    return " ".join(text.split())


def written_table() -> str:
    """The options table as ``docs/strategy.md`` holds it (its generated part ``options``)."""
    parts = [m.group("body") for m in BLOCK.finditer(PAGE.read_text()) if m.group("name") == "options"]
    assert len(parts) == 1, f"{PAGE} holds {len(parts)} generated options tables, not 1"
    return parts[0]


def readme_rows() -> dict[str, tuple[str, str]]:
    """``name → (default cell, meaning cell)`` of the docs' options table."""
    rows = {}
    for line in written_table().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 3, f"{PAGE.name}: a row without 3 cells: {line!r}"
        rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def signature_problems(cls: type, opt: Option) -> list[str]:
    where = f"{cls.__module__}.{cls.__qualname__}"
    param = inspect.signature(cls).parameters.get(opt.name)
    if param is None:
        return [f"not a parameter of {where}"]
    problems = []
    if type(param.default) is not type(opt.default) or param.default != opt.default:
        problems.append(f"{where} defaults to {param.default!r}, the source to {opt.default!r}")
    annotation = param.annotation
    if isinstance(annotation, str):  # a hand-written signature under `from __future__ import annotations`
        module = importlib.import_module(cls.__init__.__module__)
        annotation = eval(annotation, {**vars(typing), **vars(module)})  # noqa: S307 - our own source
    if annotation != opt.annotation:
        problems.append(f"{where} annotates {annotation!r}, the source {opt.annotation!r}")
    docs = {p.arg_name: p.description for p in docstring_parser.parse(cls.__init__.__doc__ or "").params}
    if normalized(docs.get(opt.name) or "") != opt.doc:
        problems.append(f"{where}.__init__'s docstring says {docs.get(opt.name)!r}, the source {opt.doc!r}")
    return problems


def resolve(dotted: str) -> object:
    """``"pkg.module.Class.method"`` → the object (the longest importable prefix, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(dotted)


def check_problems(opt: Option) -> list[str]:
    """Each function named in ``checks`` exists and mentions the option (a stale reference fails)."""
    problems = []
    for dotted in opt.checks:
        try:
            check = resolve(dotted)
        except (ImportError, AttributeError):
            problems.append(f"its check {dotted} does not exist")
            continue
        if opt.name not in inspect.getsource(check):  # type: ignore[arg-type]
            problems.append(f"its check {dotted} never mentions it")
    return problems


def drift(name: str) -> list[str]:
    """Everything about option ``name`` that disagrees with its one source."""
    opt = SOURCE.get(name)
    if opt is None:
        return ["not a field of ParallelConfig or StrategyOptions (the one source), yet documented or accepted"]
    problems = []
    if not opt.doc:
        problems.append("its field has no docstring")
    for cls in (TRAINER, FABRIC):
        problems += signature_problems(cls, opt)
    row = readme_rows().get(name)
    if row is None:
        problems.append(f"no row in {PAGE.name}'s options table")
    else:
        if row[0] != opt.shown_default:
            problems.append(f"the docs show the default {row[0]!r}, the source {opt.shown_default!r}")
        if row[1] != markdown(opt.doc):
            problems.append(f"the docs say {row[1]!r}, the source {markdown(opt.doc)!r}")
    return problems + check_problems(opt)


def every_name() -> list[str]:
    found = set(SOURCE) | set(readme_rows())
    for cls in (TRAINER, FABRIC):
        found |= set(inspect.signature(cls).parameters) - OWN_ARGUMENTS.get(cls, set())
    return sorted(found)


@pytest.mark.parametrize("name", every_name())
def test_the_option_agrees_with_its_one_source(name):
    problems = drift(name)
    assert not problems, (
        f"strategy option {name!r} drifted:\n  - " + "\n  - ".join(problems)
        + "\nEdit its field (ParallelConfig or StrategyOptions), then regenerate the docs' table:"
        " python -m lightning_2d.tools.docs --write"
    )


def test_the_docs_table_is_the_generated_one():
    written, generated = written_table().splitlines(), options_table().splitlines()
    for line, expected in zip(written, generated):
        assert line == expected, (
            f"{PAGE.name} row {line[:60]!r}… differs from the generated {expected[:60]!r}…: run"
            " python -m lightning_2d.tools.docs --write"
        )
    assert len(written) == len(generated), "run python -m lightning_2d.tools.docs --write"


def test_the_signatures_keep_the_positional_order():
    assert list(inspect.signature(TRAINER).parameters) == list(PARAMETER_ORDER)
    assert list(inspect.signature(FABRIC).parameters) == [*PARAMETER_ORDER, "parallelize_fn"]
    assert inspect.signature(FABRIC).parameters["parallelize_fn"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_signatures_are_the_source_s_own():
    """What ``inspect`` (and so jsonargparse) reads is the generated ``__init__``'s own signature (a real function,
    as ``dataclasses`` makes one): no ``__signature__`` replaces it."""
    for cls in (TRAINER, FABRIC):
        assert not hasattr(cls.__init__, "__signature__"), f"{cls.__qualname__}.__init__ has a __signature__ override"
        own = inspect.signature(cls.__init__, follow_wrapped=False)
        assert list(own.parameters)[1:] == list(inspect.signature(cls).parameters)


def test_arguments_reach_the_option_dataclasses_and_bad_calls_fail_as_python_would():
    strategy = FABRIC(2, 2, 1, 1, "GPipe", init_seed=7, compile=True)
    assert (strategy.parallel_config.data_parallel_size, strategy.parallel_config.pipeline_schedule) == (2, "GPipe")
    assert strategy.parallel_config.compile and strategy.strategy_options.init_seed == 7
    with pytest.raises(TypeError, match=r"^ModelParallel2DBase.__init__\(\) got an unexpected keyword argument 'x'$"):
        TRAINER(x=1)
    with pytest.raises(TypeError, match=r"takes from 1 to 34 positional arguments but 35 were given$"):
        TRAINER(*[None] * 34)
    with pytest.raises(TypeError, match=r"got multiple values for argument 'data_parallel_size'$"):
        TRAINER(2, data_parallel_size=2)


def test_a_new_field_without_a_place_in_the_order_is_refused():
    @dataclass
    class NewOptions:
        unplaced: int = 1
        twice: int = option(2, position=29)  # context_parallel_size's

    with pytest.raises(TypeError, match=r"without a position \['unplaced'\], positions taken twice \[29\]"):
        options_module.strategy_options((ParallelConfig, StrategyOptions, NewOptions))
    drop = dataclass(type("Shorter", (), {"__annotations__": {"x": int}, "x": option(0, position=34)}))
    with pytest.raises(TypeError, match=r"numbering them 0 … 33"):  # 33 taken by none: a gap
        options_module.strategy_options((ParallelConfig, StrategyOptions, drop))


def test_the_generated_signature_is_the_fields():
    """Each strategy's ``__init__`` is generated from the fields: the same names in ``position`` order, the same
    default objects, the fields' annotations (resolved), every option positional-or-keyword; nothing hand-written
    in between can drift."""
    fields_in_order = sorted(
        (opt for cls in (ParallelConfig, StrategyOptions) for opt in options_of(cls)), key=lambda o: o.position
    )
    assert [o.position for o in fields_in_order] == list(range(len(fields_in_order)))
    hints = {**typing.get_type_hints(ParallelConfig), **typing.get_type_hints(StrategyOptions)}
    defaults = {f.name: f.default for cls in (ParallelConfig, StrategyOptions) for f in dataclass_fields(cls)}
    for cls in (TRAINER, FABRIC):
        params = list(inspect.signature(cls).parameters.values())[: len(fields_in_order)]
        assert [p.name for p in params] == [o.name for o in fields_in_order] == list(PARAMETER_ORDER)
        for param in params:
            assert param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, param
            assert param.default is defaults[param.name], param
            assert param.annotation == hints[param.name], param
        assert typing.get_type_hints(cls.__init__)["pipeline_schedule"] is ScheduleName


def test_jsonargparse_reads_the_generated_signature():
    """What LightningCLI builds its ``--trainer.strategy`` options from: the generated parameters with their types
    (a value outside the ``Literal`` is refused) and defaults, and their docstrings as help."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(TRAINER, "strategy")
    config = parser.parse_args(["--strategy.pipeline_schedule=ZBVZeroBubble", "--strategy.tensor_parallel_size=2"])
    assert config.strategy.pipeline_schedule == "ZBVZeroBubble" and config.strategy.tensor_parallel_size == 2
    assert config.strategy.data_parallel_size == "auto" and config.strategy.context_parallel_size == 1
    with pytest.raises(Exception, match="pipeline_schedule"):
        parser.parse_args(["--strategy.pipeline_schedule=ZB"])
    assert "keep the logits sharded over the vocabulary" in normalized(parser.format_help())


def type_checking_namespace(module: Any) -> dict[str, Any]:
    """What a type checker resolves names in for ``module``: its globals plus its module-level
    ``if TYPE_CHECKING:`` imports (run here, as a checker reads them)."""
    namespace = dict(vars(module))
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            imports = [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            exec(compile(ast.Module(body=imports, type_ignores=[]), module.__name__, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", sorted(STUB_FILES))
def test_the_type_checkers_declaration_is_the_fields(name):
    """The ``__init__`` static type checkers and IDEs read (the generated ``if TYPE_CHECKING:`` block; the one that
    runs is ``takes_options``') declares every option in ``PARAMETER_ORDER``, with the annotation the field has (as
    the module resolves it) and its default (``...`` only where it is not a literal), then the strategy's own
    keyword-only arguments; and it is the generator's text."""
    source = (PACKAGE / name).read_text()
    start, end, indent = stub_span(source)
    regenerate = "run python -m lightning_2d.tools.options_table --write-signatures"
    module = importlib.import_module("lightning_2d." + name.removesuffix(".py").replace("/", "."))
    namespace = type_checking_namespace(module)
    declared = ast.parse(textwrap.dedent(source[start:end])).body
    assert len(declared) == 1 and isinstance(declared[0], ast.FunctionDef) and declared[0].name == "__init__", regenerate
    args = declared[0].args
    extra = dict(STUB_FILES[name])
    expected = [*OPTIONS, *(opt for opt, _ in STUB_FILES[name])]
    assert [a.arg for a in args.args] == ["self", *PARAMETER_ORDER], f"{name}: {regenerate}"
    assert [a.arg for a in args.kwonlyargs] == [opt.name for opt in expected[len(OPTIONS):]], f"{name}: {regenerate}"
    params = [*args.args[1:], *args.kwonlyargs]
    for param, default, opt in zip(params, [*args.defaults, *args.kw_defaults], expected):
        annotation = eval(ast.unparse(param.annotation), namespace)
        assert annotation == opt.annotation, f"{name}: {opt.name}: {ast.unparse(param.annotation)} ≠ the field's"
        if opt.name in extra:
            assert extra[opt.name] == ast.unparse(param.annotation)
        if isinstance(default, ast.Constant) and default.value is Ellipsis:
            assert type(opt.default) not in (type(None), bool, int, float, str), f"{name}: {opt.name}: {regenerate}"
        else:
            value = ast.literal_eval(default)
            assert type(value) is type(opt.default) and value == opt.default, f"{name}: {opt.name}: {regenerate}"
    assert source[start:end] == init_stub(STUB_FILES[name], indent), f"{name}: {regenerate}"
