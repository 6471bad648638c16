"""``lightning_2d.fabric.ModelParallel2DStrategy``: the 2D strategy for Fabric scripts (a front door; the
strategy lives in ``lightning_2d.integration.fabric_strategy``).

    fabric = L.Fabric(devices=8, strategy=ModelParallel2DStrategy(tensor_parallel_size=8))
    with fabric.init_module(empty_init=True):
        model = Transformer(ModelArgs.from_name("llama3-8b"))
    model = fabric.setup(model)            # TP/SP → AC → compile → FSDP2, then sharded init
"""

from lightning_2d.integration.fabric_strategy import FabricFSDP2Precision, ModelParallel2DStrategy

__all__ = ["FabricFSDP2Precision", "ModelParallel2DStrategy"]
