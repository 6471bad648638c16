"""``python loss_probe.py SCRIPT [ARGS...]``: run SCRIPT as ``__main__`` with every Trainer it creates printing,
on rank 0, each training step's logged loss (``[loss-probe] step N loss X``), so a test can check that a
documented script trained (its first losses against its last) without the script printing them itself.

Rank 0 is this process under Lightning's own launcher (the other ranks run SCRIPT unprobed: the callback does
no collective, so they need not have it); under a cluster launcher each rank runs the probe (the ``script``
scenario of ``worker.py`` calls ``install``).
"""

from __future__ import annotations

import runpy
import sys

import lightning as L

LOSS_KEYS = ("train_loss", "loss")  # LlamaLightningModule logs train_loss; recipes/custom_model_plan.py, loss


class PrintLoss(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != 0:
            return
        key = next((k for k in LOSS_KEYS if k in trainer.callback_metrics), None)
        if key is not None:
            print(f"[loss-probe] step {trainer.global_step} loss {float(trainer.callback_metrics[key]):.4f}",
                  flush=True)


def install() -> None:
    """Make every ``L.Trainer`` created from now on in this process print its losses (a ``PrintLoss`` callback)."""
    init = L.Trainer.__init__

    def probed_init(self, *args, callbacks=None, **kwargs) -> None:
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, L.Callback):
            callbacks = [callbacks]
        init(self, *args, callbacks=[*callbacks, PrintLoss()], **kwargs)

    L.Trainer.__init__ = probed_init


def main() -> None:
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # the script parses its own arguments; Lightning's launcher restarts it by them
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
