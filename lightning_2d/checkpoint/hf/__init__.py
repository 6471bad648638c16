"""Hugging Face Llama interop: export a checkpoint to ``model.safetensors`` + ``config.json``, and load
such a directory into a (sharded) model.

Names map one to one (``layers.N.attention.wq`` ↔ ``model.layers.N.self_attn.q_proj``). The only
change of values is in ``wq``/``wk``: Meta's rotary embedding rotates interleaved pairs
``(x[2i], x[2i+1])`` while Hugging Face's rotates the halves ``(x[i], x[i + d/2])`` of each head,
so the rows of each head are permuted between the two layouts.

Both directions stream, so a 70B model never has to fit in one process's memory: the export reads,
converts and writes one output file at a time (``export_hf``), the import reads each rank's blocks
as safetensors slices (``HFWeights``). Checkpoints are read with ``torch.load(weights_only=True)``
(and DCP's ``.metadata`` with a restricted unpickler): a pickled object that could run code is
refused, not built.

Torch DCP's ``HuggingFaceStorageWriter``/``HuggingFaceStorageReader`` are not used. The writer
writes what one ``dcp.save`` call is given: the whole state dict at once (no streaming), or one
call per file, each call overwriting the index with its own file only; it also names a single file
``model-00001-of-00001.safetensors`` and adds DCP keys to the headers. The reader reads a
``(rows, cols)`` box of each stored tensor, while a block of ``wq``/``wk`` whose rows cut a head
needs the whole heads it touches (the RoPE permutation moves rows within a head), which
``HFWeights.fill_block_`` reads itself with the same ``safe_open``/``get_slice``. Neither maps names.

One module per job: ``layout`` (names, RoPE permutation, ``config.json``), ``export`` (a checkpoint to a
Hugging Face directory) and ``weights`` (a Hugging Face directory into a sharded model).
"""

from lightning_2d.checkpoint.hf.export import (
    STATE_DICT_PREFIX,
    WeightInfo,
    check_weight_shapes,
    checkpoint_model_args,
    export_hf,
    open_checkpoint,
    plan_shards,
    resolve_model_args,
    to_hf_tensor,
)
from lightning_2d.checkpoint.hf.layout import (
    INDEX_FILE,
    SINGLE_FILE,
    hf_config,
    hf_name,
    hf_to_meta,
    meta_to_hf,
    model_args_from_hf,
    rotary_heads,
    same_shapes,
)
from lightning_2d.checkpoint.hf.weights import HFWeights, SafetensorsWeights
from lightning_2d.checkpoint.errors import ExportError

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "STATE_DICT_PREFIX",
    "ExportError",
    "HFWeights",
    "SafetensorsWeights",
    "WeightInfo",
    "check_weight_shapes",
    "checkpoint_model_args",
    "export_hf",
    "hf_config",
    "hf_name",
    "hf_to_meta",
    "meta_to_hf",
    "model_args_from_hf",
    "open_checkpoint",
    "plan_shards",
    "resolve_model_args",
    "rotary_heads",
    "same_shapes",
    "to_hf_tensor",
]
