"""Warnings and log lines torch emits on every step of a correct 2D run, silenced only while a strategy
runs (``setup_environment`` → ``teardown``), never process-wide at import.

- ``mesh["data_parallel"]`` of a flattened dim warns "will be deprecated in PT 2.11" on every call (still
  supported in 2.13). Lightning's sampler kwargs and user code written for Lightning's 2D mesh read it by
  that name, so the name must keep working; the warning is not actionable by users.
- FSDP2 warns on every step that the root returned a view (under TP the logits are a view of the local
  shard, ColwiseParallel's ``to_local``); the loss only reads them.
- DTensor logs, once per process, that a 2D redistribution (a strided FSDP × TP shard gathered, a norm
  reduced over both mesh dims) needs two collectives: expected here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Messages (regular expressions, matched at the start) of the warnings silenced while a strategy runs.
KNOWN_WARNINGS = (
    r"Slicing a flattened dim from root mesh will be deprecated",
    r"FSDP2-wrapped module .* returned a view tensor",
)
#: The logger and the text of the DTensor log line silenced while a strategy runs.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


class _SequentialCollectives(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_" not in record.getMessage()


class KnownWarnings:
    """``install()`` adds the filters, ``remove()`` takes exactly those out again (others' filters kept)."""

    def __init__(self) -> None:
        self._filters: list[Any] = []
        self._log_filter: logging.Filter | None = None

    def install(self, ignore: tuple[type[Warning], ...] = ()) -> None:
        """Add the filters; ``ignore``: categories silenced too (the strategies pass the library's own warnings on
        every rank but 0, so each is shown once per job)."""
        if self._log_filter is not None:
            return
        for message in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
            self._filters.append(warnings.filters[0])
        for category in ignore:
            warnings.filterwarnings("ignore", category=category)
            self._filters.append(warnings.filters[0])
        self._log_filter = _SequentialCollectives()
        logging.getLogger(REDISTRIBUTE_LOGGER).addFilter(self._log_filter)

    def remove(self) -> None:
        for entry in self._filters:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._filters = []
        if self._log_filter is not None:
            logging.getLogger(REDISTRIBUTE_LOGGER).removeFilter(self._log_filter)
            self._log_filter = None


@contextmanager
def known_warnings_silenced() -> Iterator[None]:
    """The same filters for the duration of a block (the planner and benchmarks, which run no strategy)."""
    known = KnownWarnings()
    known.install()
    try:
        yield
    finally:
        known.remove()
