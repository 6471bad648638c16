"""``ValidatingLauncher``: Lightning's launcher of the Trainer's ranks, validating the layout first.

The LightningModule and the datamodule reach the strategy only inside the launched function, i.e. in
every process once the ranks are started; the launcher's arguments carry them earlier. This launcher
checks the plan's sizes and the sequence length in the launching process, before any rank starts, then
launches as Lightning's does.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_2d._compat import subprocess_script_launcher_class

_SubprocessScriptLauncher: Any = subprocess_script_launcher_class()


class ValidatingLauncher(_SubprocessScriptLauncher):
    """Lightning's ``_SubprocessScriptLauncher`` that calls ``validate(arguments)`` before launching.

    Args:
        cluster_environment, num_processes, num_nodes: As for Lightning's launcher.
        validate: Called with the positional and keyword arguments of ``trainer.fit/validate/test/predict``
            (the LightningModule, the datamodule …); raises to refuse the launch.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int,
                 validate: Callable[[list[Any]], None]) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.validate = validate

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.validate([*args, *kwargs.values()])
        return super().launch(function, *args, trainer=trainer, **kwargs)
