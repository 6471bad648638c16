"""Validation is a registry of checks (``lightning_2d.parallel.checks``): each check reads exactly the options and
inputs its parameters name, the options' metadata (``Option.checks``) is read from the registry, and
``validate_parallel_dims`` runs every check whose inputs are known. These tests fail when the registry and the
options' metadata drift apart, or a check reads something it does not declare."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import fields

import pytest

from lightning_2d.integration.strategy_options import OPTIONS, StrategyOptions
from lightning_2d.parallel.checks import CHECKS, INPUT_OPTIONS, INPUTS, check, checks_reading, run_checks
from lightning_2d.parallel.config import ParallelConfig, ParallelConfigError, ParallelPlan
from lightning_2d.parallel.dims import validate_parallel_dims

OPTION_NAMES = {f.name for cls in (ParallelConfig, StrategyOptions) for f in fields(cls)}
#: Options any value of which is accepted (no check reads them).
UNCHECKED = {"init_seed", "save_distributed_checkpoint", "async_checkpoint"}


def body_names(function) -> tuple[set[str], set[str]]:
    """The names a function's body loads, and the attributes it reads on ``self``/``config``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    on_config = {
        n.attr for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "config")
    }
    return loaded, on_config


@pytest.mark.parametrize("registered", CHECKS, ids=lambda c: c.name.rsplit(".", 1)[-1])
def test_each_check_reads_exactly_what_it_declares(registered):
    """A check's parameters are its declaration: each names an option (a field) or an input, and each is read (a
    parameter left unused would list the check for an option it never looks at); the body reaches no option but
    through its parameters. And it is small."""
    unknown = set(registered.options) - OPTION_NAMES
    assert not unknown, f"{registered.name}: {unknown} are neither options nor inputs (a typo would never run)"
    assert set(registered.required) | set(registered.optional) <= set(INPUTS)
    loaded, on_config = body_names(registered.function)
    unread = [p for p in (*registered.options, *registered.required, *registered.optional) if p not in loaded]
    assert not unread, f"{registered.name} declares {unread} but never reads them"
    assert not on_config, f"{registered.name} reads {on_config} from an options object: make them parameters"
    lines = len(inspect.getsource(registered.function).splitlines())
    assert lines <= 26, f"{registered.name} is {lines} lines (decorator and docstring included): split it"


def test_the_options_metadata_is_the_registry_s():
    """``Option.checks`` (what test_options.py and readers see) is exactly the registered checks reading the option;
    every option but the ones any value of is accepted has one."""
    for opt in OPTIONS:
        expected = tuple(c.name for c in CHECKS if opt.name in c.options or any(
            opt.name in INPUT_OPTIONS.get(i, ()) for i in (*c.required, *c.optional)))
        assert opt.checks == expected == checks_reading(opt.name), opt.name
    assert {o.name for o in OPTIONS if not o.checks} == UNCHECKED


def test_a_check_runs_once_its_inputs_are_known():
    config = ParallelConfig(tensor_parallel_size=2)  # construction: the options' own checks only
    assert run_checks(vars(config)) == []
    plan = ParallelPlan(tensor_parallel={"w": object()}, sequence_parallel={"n": object()}, tp_divides={"n_heads": 3})
    # Without the plan or the sequence length the checks needing them do not run...
    validate_parallel_dims(config, world_size=2, devices_per_node=2)
    # ... with them, each runs, and every problem is reported at once.
    with pytest.raises(ParallelConfigError) as error:
        validate_parallel_dims(config, world_size=2, devices_per_node=2, plan=plan, seq_len=7, precision="16-mixed")
    found = [p.split(" ")[0] for p in error.value.problems]
    assert found == ["tensor_parallel_size", "sequence", "precision='16-mixed'"]


def test_a_check_declares_by_its_parameters(monkeypatch):
    monkeypatch.setattr("lightning_2d.parallel.checks.CHECKS", list(CHECKS))
    from lightning_2d.parallel import checks as module

    def needs_the_batch(pipeline_microbatches, batch_size, plan=None):
        return [f"{pipeline_microbatches} {batch_size} {plan}"]

    check(needs_the_batch)
    registered = module.CHECKS[-1]
    assert (registered.options, registered.required, registered.optional) == (
        ("pipeline_microbatches",), ("batch_size",), ("plan",))
    values = {"pipeline_microbatches": 4}
    assert "4 8 None" in module.run_checks(values, {"batch_size": 8})
    assert all("4 " not in p for p in module.run_checks(values, {"plan": "p"}))  # batch size unknown: not run
    with pytest.raises(TypeError, match="registered twice"):
        check(needs_the_batch)
