"""``lightning_2d.fabric``: what a Fabric script uses (a front door; the strategy lives in
``lightning_2d.integration.fabric_strategy``).

    fabric = L.Fabric(devices=8, strategy=ModelParallel2DStrategy(tensor_parallel_size=8))
    with fabric.init_module(empty_init=True):
        model = Transformer(ModelArgs.from_name("llama3-8b"))
    model = fabric.setup(model)            # TP/SP → AC → compile → FSDP2, then sharded init

A model that is not trained beside it (a DPO reference, a distillation teacher): freeze it, then ``fabric.setup`` it
too (the same steps on the same meshes, no gradients, no optimizer, in no checkpoint). ``preference_step`` is the
preference loss of a ``PreferenceDataModule`` batch, the one the Trainer's modules compute
(``recipes/fabric_dpo.py``); ``distillation_step`` the loss of a student against a frozen teacher set up beside it, the
one the modules compute under ``teacher=`` (``lightning_2d.integration.distillation``; ``recipes/fabric_distill.py``).
"""

from lightning_2d.integration.fabric_strategy import FabricFSDP2Precision, ModelParallel2DStrategy
from lightning_2d.integration.distillation import distillation_step
from lightning_2d.integration.preference import preference_step

__all__ = ["FabricFSDP2Precision", "ModelParallel2DStrategy", "distillation_step", "preference_step"]
