"""Strategy options on the command line, generated from ``ParallelConfig``: one flag per field, its type read
from the annotation (``option_converter``) and its help from the field's docstring (``field_docs``). Used by
``lightning-2d benchmark`` and ``lightning-2d plan``.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from dataclasses import fields
from typing import Any, Callable, Literal, Optional, Union

import torch

from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.options import options_of

#: Benchmark defaults of strategy options (the rest keep ``ParallelConfig``'s): with the default
#: 4 devices this is the reference ``(dp, tp) = (2, 2)`` layout.
STRATEGY_DEFAULTS: dict[str, Any] = {"data_parallel_size": "auto", "tensor_parallel_size": 2}


def field_docs(cls: type) -> dict[str, str]:
    """Each option's docstring (the fields of ``cls``: ``lightning_2d.parallel.options``), as one line of text."""
    return {opt.name: re.sub(r"``(.*?)``", r"\1", opt.doc) for opt in options_of(cls)}


def option_converter(hint: Any) -> Callable[[str], Any]:
    """An argparse ``type=`` for a field annotated ``hint``: the first member of the annotation the text fits.

    ``None`` for ``none``, a ``bool`` for ``true``/``false``, an ``int`` for digits, a ``Literal``
    value, a ``float``, a ``list[int]`` from ``1,2,3`` or a JSON list, else the string itself where
    ``str`` or ``torch.dtype`` (whose names ``ParallelConfig`` converts) is allowed, or where the annotation
    is a choice of words (``Literal`` strings and no number): ``ParallelConfig``'s check then names the
    valid ones and the fix.
    """
    members = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    literals = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    words = bool(literals) and all(isinstance(v, str) for v in literals) and int not in members and float not in members
    int_lists = any(typing.get_origin(m) is list and typing.get_args(m) == (int,) for m in members)

    def int_list(text: str) -> Optional[list[int]]:
        try:
            value = json.loads(text) if text.lstrip().startswith("[") else [int(v) for v in text.split(",")]
        except ValueError:  # json.JSONDecodeError is a ValueError
            return None
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return value if ok else None

    def convert(text: str) -> Any:
        if type(None) in members and text.lower() == "none":
            return None
        if int_lists and (value := int_list(text)) is not None:
            return value
        if bool in members and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if int in members and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if text in [str(v) for v in literals]:
            return next(v for v in literals if str(v) == text)
        if float in members:
            try:
                return float(text)
            except ValueError:
                pass
        if str in members or torch.dtype in members or words:
            return text
        names = [str(m) if typing.get_origin(m) is list else getattr(m, "__name__", str(m))
                 for m in members if typing.get_origin(m) is not Literal]
        allowed = ", ".join([*names, *(repr(v) for v in literals)])
        raise argparse.ArgumentTypeError(f"{text!r} is not one of: {allowed}")

    convert.__name__ = str(hint)  # argparse names the type in its error message
    return convert


def option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_strategy_options(
    parser: argparse.ArgumentParser,
    defaults: Optional[dict[str, Any]] = None,
    description: str = "ModelParallel2DStrategy / ParallelConfig options; they apply to the lightning_2d variant",
) -> None:
    """One flag per ``ParallelConfig`` field (``--sequence-parallel/--no-sequence-parallel``, ...).

    Help comes from the field's docstring; an unset flag keeps the strategy's default (or the one in
    ``defaults``: the benchmark's ``STRATEGY_DEFAULTS`` unless given). ``lightning-2d plan`` uses it too.
    """
    defaults = STRATEGY_DEFAULTS if defaults is None else defaults
    group = parser.add_argument_group("strategy options", description)
    hints = typing.get_type_hints(ParallelConfig)
    docs = field_docs(ParallelConfig)
    for f in fields(ParallelConfig):
        hint = hints[f.name]
        default = defaults.get(f.name, f.default)
        help_text = f"{docs.get(f.name, f'ParallelConfig.{f.name}')} (default: {default})".replace("%", "%%")
        if hint is bool:
            group.add_argument(option_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(option_flag(f.name), dest=f.name, type=option_converter(hint), default=None,
                               metavar=f.name.upper(), help=help_text)


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ParallelConfig`` fields given on the command line, on top of ``STRATEGY_DEFAULTS`` (or of the recipe's
    strategy options, ``recipe_strategy_options``)."""
    given = {f.name: getattr(args, f.name) for f in fields(ParallelConfig) if getattr(args, f.name, None) is not None}
    recipe = getattr(args, "recipe_strategy_options", None)  # a recipe's strategy init_args replace the defaults
    return {**(STRATEGY_DEFAULTS if recipe is None else recipe), **given}
