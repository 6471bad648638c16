"""torchao, the optional dependency of float8 training and of QLoRA's NF4 base weights: is it there, and importing it
quietly. Reads the package metadata instead of importing torchao for the checks: the import takes seconds and (on ROCm)
queries the GPU, which must not happen in a constructor."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata

import torch

from lightning_2d._compat import PYTREE_LOGGER

#: Oldest torchao whose float8 training API and NF4 tensor (FSDP2 all-gather included) this package is written against.
MIN_TORCHAO_VERSION = (0, 18)


def torchao_version() -> str | None:
    """The installed torchao version, ``"unknown"`` for a checkout without metadata, ``None`` if absent."""
    try:
        if importlib.util.find_spec("torchao") is None:
            return None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return None
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return "unknown"


def torchao_problem(feature: str, extra: str, version: str | None) -> str | None:
    """Why ``feature`` (e.g. ``"float8=True"``) cannot use the installed torchao ``version``, else ``None``.

    Args:
        feature: What needs torchao, as the user wrote it.
        extra: The package extra that installs it (``"float8"``).
        version: ``torchao_version()`` (passed in, so callers and their tests can pin it).
    """
    wanted = ".".join(map(str, MIN_TORCHAO_VERSION))
    if version is None:
        return (f'{feature} needs torchao>={wanted}, which is not installed; install it with'
                f' `pip install "lightning-2d[{extra}]"` (or `pip install "torchao>={wanted}"`)')
    if version == "unknown":
        return None
    from packaging.version import InvalidVersion, Version

    try:
        # `release` ignores dev/local suffixes, so a 0.18 nightly counts as 0.18.
        too_old = Version(version).release[:2] < MIN_TORCHAO_VERSION
    except InvalidVersion:
        return None
    if too_old:
        return f'{feature} needs torchao>={wanted}, found torchao {version}; upgrade with `pip install -U "lightning-2d[{extra}]"`'
    return None


@contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Import torchao without its noise: on a torch build without CUDA it logs a warning for every CUDA extension it
    cannot load, and torch logs a deprecation aimed at torchao's own code; neither is actionable by our users."""
    names = [PYTREE_LOGGER]
    if torch.version.cuda is None and torch.version.hip is None:
        names.append("torchao")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


__all__ = ["MIN_TORCHAO_VERSION", "quiet_torchao_import", "torchao_problem", "torchao_version"]
