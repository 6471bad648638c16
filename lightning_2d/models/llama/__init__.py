"""The Llama family: ``model`` (``ModelArgs``, ``RopeScaling``, presets, ``Transformer``; no ``torch.distributed``),
``plan`` (its tensor/sequence-parallel plan), ``pipeline`` (how it splits into pipeline stages)."""

from lightning_2d.models.llama.model import PRESETS, ModelArgs, RopeScaling, Transformer

__all__ = ["PRESETS", "ModelArgs", "RopeScaling", "Transformer"]
