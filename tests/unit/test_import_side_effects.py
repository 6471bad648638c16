"""Importing lightning_2d changes nothing process-wide: no warning or log filter, no strategy name taken
from someone else. The filters for torch's per-step noise exist only while a strategy runs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import pytest

from lightning_2d.parallel.known_warnings import REDISTRIBUTE_LOGGER, KnownWarnings

IMPORT_EVERYTHING = """
import logging, pkgutil, warnings, importlib
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


STRATEGY_NAME_TAKEN = """
from lightning.pytorch.strategies import StrategyRegistry, DDPStrategy
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy as FabricDDP
StrategyRegistry.register('model_parallel_2d', DDPStrategy)
STRATEGY_REGISTRY.register('model_parallel_2d', FabricDDP)
import lightning_2d
assert StrategyRegistry['model_parallel_2d']['strategy'] is DDPStrategy
assert STRATEGY_REGISTRY['model_parallel_2d']['strategy'] is FabricDDP
print("ok")
"""

# One fresh interpreter imports torch and Lightning (most of its ~9 s) once, then forks a child per scenario: each
# child imports lightning_2d for the first time, as a fresh interpreter would, and prints "ok" or its traceback.
FORK_PER_SCENARIO = """
import io, json, os, sys, traceback
from contextlib import redirect_stdout
import torch, lightning, lightning.pytorch, torchmetrics, jsonargparse, torch.distributed.tensor
import torch.distributed.tensor._redistribute
results = {}
for name, code in json.loads(sys.argv[1]).items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        out = io.StringIO()
        try:
            with redirect_stdout(out):
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            message = out.getvalue()
        except BaseException:
            message = traceback.format_exc()
        with os.fdopen(write, "w") as pipe:
            pipe.write(message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        results[name] = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status:
        results[name] += f"(the child exited with status {status})"
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, str]:
    """What each scenario printed (``ok``) or its traceback, each run where lightning_2d was never imported."""
    scenarios = {"import_everything": IMPORT_EVERYTHING, "strategy_name_taken": STRATEGY_NAME_TAKEN}
    done = subprocess.run([sys.executable, "-c", FORK_PER_SCENARIO, json.dumps(scenarios)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_every_module_installs_no_warning_or_log_filter(fresh_imports):
    assert fresh_imports["import_everything"].strip() == "ok", fresh_imports["import_everything"][-2000:]


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


def test_the_strategy_name_of_someone_else_is_not_taken(fresh_imports):
    assert fresh_imports["strategy_name_taken"].strip() == "ok", fresh_imports["strategy_name_taken"][-2000:]
