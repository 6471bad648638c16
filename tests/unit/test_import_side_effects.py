"""Importing lightning_2d changes nothing process-wide: no warning or log filter, no strategy name taken
from someone else. The filters for torch's per-step noise exist only while a strategy runs."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

from lightning_2d.parallel.known_warnings import REDISTRIBUTE_LOGGER, KnownWarnings

IMPORT_EVERYTHING = """
import logging, pkgutil, warnings, importlib
import torch, lightning, lightning.pytorch, torchmetrics, jsonargparse, torch.distributed.tensor
import torch.distributed.tensor._redistribute
before = list(warnings.filters)
logger = logging.getLogger("torch.distributed.tensor._redistribute")
log_filters = list(logger.filters)
import lightning_2d
for info in pkgutil.walk_packages(lightning_2d.__path__, "lightning_2d."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
added = [f for f in warnings.filters if f not in before]
assert not added, f"importing lightning_2d added warning filters: {added}"
assert logger.filters == log_filters, f"importing lightning_2d added log filters: {logger.filters}"
print("ok")
"""


def test_importing_every_module_installs_no_warning_or_log_filter():
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_known_warnings_are_silenced_between_install_and_remove_only():
    known = KnownWarnings()
    message = "FSDP2-wrapped module Transformer returned a view tensor"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        known.install()
        warnings.warn(message, UserWarning)
        known.remove()
        warnings.warn(message, UserWarning)
    assert [str(w.message) for w in seen] == [message]  # only the one after remove()
    assert not logging.getLogger(REDISTRIBUTE_LOGGER).filters


def test_the_librarys_own_warnings_are_silenced_on_the_ranks_that_ask():
    """``parallel/`` warns on every rank (it knows nothing of ranks); the strategies pass ``ignore=`` on every rank
    but 0 (``setup_environment``), so a job shows each once, and only while it runs."""
    from lightning_2d.errors import Lightning2DWarning

    known = KnownWarnings()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        known.install(ignore=(Lightning2DWarning,))
        warnings.warn("from parallel/", Lightning2DWarning)
        warnings.warn("anyone else's", UserWarning)
        known.remove()
        warnings.warn("after the run", Lightning2DWarning)
    assert [str(w.message) for w in seen] == ["anyone else's", "after the run"]
    assert issubclass(Lightning2DWarning, UserWarning)  # pytest.warns(UserWarning) and user filters still see them


def test_the_strategy_name_of_someone_else_is_not_taken():
    code = (
        "from lightning.pytorch.strategies import StrategyRegistry, DDPStrategy\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy as FabricDDP\n"
        "StrategyRegistry.register('model_parallel_2d', DDPStrategy)\n"
        "STRATEGY_REGISTRY.register('model_parallel_2d', FabricDDP)\n"
        "import lightning_2d\n"
        "assert StrategyRegistry['model_parallel_2d']['strategy'] is DDPStrategy\n"
        "assert STRATEGY_REGISTRY['model_parallel_2d']['strategy'] is FabricDDP\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
