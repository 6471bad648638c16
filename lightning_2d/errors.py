"""The base of the library's own errors: an input it refuses (a configuration, a file, a checkpoint).

Every such error's message names the value and the fix, so the ``lightning-2d`` command prints it as one line
(``lightning-2d fit: error: …``, exit code 1) instead of a traceback; ``LIGHTNING_2D_TRACEBACK=1`` shows the
traceback. Each subclass also keeps the builtin base it had (``ValueError``, ``FileNotFoundError``), so code
catching those still does.
"""

from __future__ import annotations


class Lightning2DError(Exception):
    """An input the library refuses, with a message that says what is wrong and what to do.

    Subclasses: ``ParallelConfigError``, ``ModelArgsError``, ``MaterializationError``, ``DataError``,
    ``CheckpointError``, ``ExportError``, ``BenchmarkConfigError``.
    """


class CheckpointError(Lightning2DError, FileNotFoundError):
    """The checkpoint asked for cannot be loaded (missing, interrupted, damaged, or holding objects a weights-only
    load refuses); names it and the way on. Defined here, below ``checkpoint/``, so that every module of that package
    (the weights-only reader included) raises the one class."""


class Lightning2DWarning(UserWarning):
    """A warning of the library's mechanics (``parallel/``: an option without effect, a skipped step, an init that
    depends on the layout), issued with ``warnings.warn`` on every rank. ``parallel/`` knows nothing of ranks or
    Lightning: the strategies show these on rank 0 only (a filter on the other ranks while they run), a script
    without a strategy (the planner, a hand-written loop) sees each one."""
