"""Data: text sources, tokenizers, the token cache, data-parallel resumable loading and the
``TextDataModule`` (``text``); ``tokenizers``. Knows nothing of models or parallelism beyond the
data-parallel rank and size it is given."""

from lightning_2d.data.text import TextDataModule

__all__ = ["TextDataModule"]
