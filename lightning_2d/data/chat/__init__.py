"""Chat data for instruction fine-tuning: rows → conversations (``formats``) → the checkpoint's own template
(``template``) → tokens and a loss mask (``encode``) → a cache on disk (``cache``) → packed windows (``packing``)
→ ``ChatDataModule`` (``datamodule``). Knows nothing of models or parallelism beyond the data-parallel rank and size
it is given."""

from lightning_2d.data.chat.cache import ChatCacheReport, prepare_chat_cache, resolve_chat_sources
from lightning_2d.data.chat.datamodule import ChatCacheDataModule, ChatDataModule, ChatWindows, PackingReport
from lightning_2d.data.chat.encode import TRAIN_ON, ChatEncoder, EncodedChat, TemplateRewritesHistoryError
from lightning_2d.data.chat.formats import FORMATS, ChatFormatError, Conversation, to_conversation
from lightning_2d.data.chat.packing import OVERFLOW, Windows, best_fit_decreasing, pack_windows
from lightning_2d.data.chat.template import ChatTemplate, ChatTemplateError, RenderedChat

__all__ = [
    "FORMATS", "OVERFLOW", "TRAIN_ON", "ChatCacheDataModule", "ChatCacheReport", "ChatDataModule", "ChatEncoder",
    "ChatFormatError", "ChatTemplate", "ChatTemplateError", "ChatWindows", "Conversation", "EncodedChat",
    "PackingReport", "RenderedChat", "TemplateRewritesHistoryError", "Windows", "best_fit_decreasing", "pack_windows",
    "prepare_chat_cache", "resolve_chat_sources", "to_conversation",
]
