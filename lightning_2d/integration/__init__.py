"""The Lightning glue: the Trainer and Fabric strategies (``trainer_strategy``, ``fabric_strategy``; what they
share in ``strategy_base``, composed of the parts ``validation``, ``precision``, ``step_guard`` and
``checkpoint_io``), the LightningModules (``module``, ``hf_module``) and callbacks. Thin: the mechanics are
in ``parallel``, checkpoints in ``checkpoint``, data in ``data``."""
