"""Small helpers on module trees shared by the parallelize steps."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

#: Name parts that wrappers insert into parameter names (activation checkpointing, compile, FSDP1).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attention.wq.weight`` → ``layers.0.attention.wq.weight``."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _plan_submodule(model: nn.Module, name: str, field: str, fix: str) -> nn.Module:
    """``model.get_submodule(name)``; a missing one is an error naming the plan's ``field`` and ``fix``."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        children = ", ".join(n for n, _ in model.named_children()) or "none"
        raise ValueError(
            f"ParallelPlan.{field} names {name!r}, but {type(model).__name__} has no such submodule (its"
            f" children: {children}). {fix}"
        ) from None


def get_submodule_container(model: nn.Module, name: str) -> nn.Module:
    """The ``ModuleDict``/``ModuleList`` of repeated blocks called ``name`` (a dotted path)."""
    blocks = _plan_submodule(model, name, "blocks", "Set ParallelPlan(blocks=...) to the container of the blocks.")
    if not isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError(
            f"ParallelPlan.blocks={name!r} is a {type(blocks).__name__}; it must name an nn.ModuleDict or"
            " nn.ModuleList holding the repeated blocks"
        )
    return blocks


def get_named_submodules(model: nn.Module, names: tuple[str, ...], field: str) -> list[nn.Module]:
    """The submodules ``names`` (dotted paths) of ``model``; a missing one is an error naming ``field``."""
    return [_plan_submodule(model, name, field, f"Fix the plan's {field} or leave it empty.") for name in names]


def matching_modules(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The submodules of ``model`` a plan's name pattern names, as ``parallelize_module`` reads a plan's keys: dotted,
    each part an ``fnmatch`` pattern of one name level (``layers.*.feed_forward.experts``). A part matching nothing
    gives nothing (a pipeline stage's pruned block)."""
    from fnmatch import fnmatch

    found = [model]
    for part in pattern.split(".") if pattern else ():
        found = [child for module in found for name, child in module.named_children() if fnmatch(name, part)]
    return found


def replace_blocks(blocks: nn.Module, fn: Callable[[int, nn.Module], nn.Module]) -> None:
    """Replace each block ``b`` at position ``i`` of ``blocks`` by ``fn(i, b)``, keeping its name."""
    for index, (name, block) in enumerate(list(blocks.named_children())):
        new = fn(index, block)
        if new is not block:
            blocks.register_module(name, new)
