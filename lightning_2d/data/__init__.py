"""Text data: sources → tokens cached on disk → packed windows → data-parallel, resumable batches.

The corpus is tokenized once into a flat token file (``uint16``/``uint32``) under ``cache_dir``,
keyed by the sources (path, size, mtime), the tokenizer, the text field and the piece size, and
memory-mapped afterwards: a multi-GB corpus costs neither RAM nor a second tokenization. The token
stream is cut into windows of ``seq_len + 1`` tokens that overlap by one (the last input token of a
window is the first label of the next), documents separated by the tokenizer's end-of-text token.

Tokenizing is streamed and parallel (``prepare_token_cache``; ``lightning-2d prepare-data`` and
``TextDataModule.prepare`` run it with every local core): files are cut into pieces of about
``CHUNK_BYTES`` (byte ranges ending at a newline for text and JSONL, row groups for Parquet), a
process pool tokenizes them and the parent writes their tokens in corpus order, so the cache is the
same token for token whatever the number of processes. When training starts, a corpus without a
cache is tokenized inline only when it is small (``max_unprepared_mb``); a larger one is refused
with the command that prepares it, instead of tokenizing on one process while every rank waits.

Batches: each data-parallel replica reads a different part of every epoch's permutation and the
ranks of a tensor-parallel group the same batch (the sampler is built from the strategy's
``distributed_sampler_kwargs``, which the 2D strategy derives from the data-parallel sub-mesh).
The training loader is stateful: checkpoints record how many samples of the current epoch were
consumed, and a resumed run continues with the next unseen batch.

One module per job, bottom to top: ``sources`` (files, folders, globs; ``DataError``), ``tokenizers``,
``pieces`` (the corpus cut into pieces and tokenized by a process pool), ``cache_folders`` (what every cache
shares: where it lives, its name, the file lock, partial files, ``meta.json`` written last), ``cache`` (the token
cache on disk), ``loading`` (windows, ``DataParallelSampler``, ``ResumableDataLoader``)
and ``datamodule`` (``TextDataModule``); ``chat/`` holds the instruction fine-tuning data (``ChatDataModule``),
``preference/`` the preference pairs built on it (``PreferenceDataModule``). Knows nothing of models or parallelism
beyond the data-parallel rank and size it is given.
"""

from lightning_2d.data.cache import CacheReport, build_token_cache, prepare_token_cache
from lightning_2d.data.chat import ChatDataModule
from lightning_2d.data.datamodule import TextDataModule, prepare_command, prepare_python
from lightning_2d.data.loading import DataParallelSampler, ResumableDataLoader, TokenWindows
from lightning_2d.data.pieces import default_num_workers
from lightning_2d.data.preference import PreferenceDataModule
from lightning_2d.data.sources import DataError, corpus_bytes, resolve_sources, stdlib_sources

__all__ = [
    "CacheReport",
    "ChatDataModule",
    "DataError",
    "DataParallelSampler",
    "PreferenceDataModule",
    "ResumableDataLoader",
    "TextDataModule",
    "TokenWindows",
    "build_token_cache",
    "corpus_bytes",
    "default_num_workers",
    "prepare_command",
    "prepare_python",
    "prepare_token_cache",
    "resolve_sources",
    "stdlib_sources",
]
