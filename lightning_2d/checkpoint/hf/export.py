"""A Lightning checkpoint exported as a Hugging Face directory (``export_hf``), streamed file by file.

The checkpoint (a DCP folder read tensor by tensor without a process group, or a memory-mapped full file)
is opened with its metadata only (``open_checkpoint``). What is written is chosen once, from that metadata
(``plan_export``: the full Hugging Face model, a LoRA checkpoint's adapters for peft, or its base with them merged;
the model args resolved and checked against the weights' shapes; the output files and the one conversion of every
weight). One writer (``write_export``) then reads, converts and writes each file into a staging folder, freeing it
before the next, and moves the folder in once complete.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch

from lightning_2d.checkpoint.dcp_metadata import DCPMetadataUnpickler, shard_size_problems
from lightning_2d.checkpoint.digests import check_items, read_manifest
from lightning_2d.checkpoint.discovery import is_complete
from lightning_2d.checkpoint.errors import CheckpointError, ExportError
from lightning_2d.checkpoint.hf.layout import (
    INDEX_FILE,
    SINGLE_FILE,
    WeightInfo,
    expert_hf_name,
    expert_name,
    hf_config,
    hf_export_problems,
    hf_model_type,
    hf_name,
    meta_to_hf,
    rotary_heads,
    same_shapes,
    tied_aliases,
    transformers_to_files,
)
from lightning_2d.checkpoint.hf.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    MergedWeights,
    PeftTensors,
    adapter_config,
    base_weights_of,
    hf_module_name,
    is_expert_adapter,
    split_adapter_name,
)
from lightning_2d.checkpoint.hf.tokenizer import (
    HF_TOKENIZER_FILES,
    TokenizerExport,
    add_stop_ids,
    recorded_stop_ids,
    resolve_export_tokenizer,
    write_tokenizer,
)
from lightning_2d.checkpoint.integrity import Integrity, describe_changed
from lightning_2d.checkpoint.names import DCP_METADATA_FILE, METADATA_FILE
from lightning_2d.checkpoint.safe_load import load_checkpoint_file
from lightning_2d.models.llama.model import PRESETS, ModelArgs, Transformer

#: Where ``LlamaLightningModule`` keeps the transformer: its weights are ``model.<our name>`` in the
#: checkpoint's ``state_dict`` (``state_dict.model.<our name>`` among DCP's flattened keys).
STATE_DICT_PREFIX = "model."


def _refusal(path: Path, problems: list[str], more: str = "") -> CheckpointError:
    """The export's refusal of a checkpoint whose bytes changed (``problems``: the changed items' lines)."""
    return CheckpointError(
        f"Checkpoint {path} {describe_changed(path, problems)}. Nothing was exported: export an earlier checkpoint, or"
        f" copy this one again.{more}"
    )


class _ShardedCheckpoint:
    """The weights of a DCP checkpoint folder, read tensor by tensor without a process group.

    Each ``dcp.load`` gets one preallocated full tensor: DCP reads only the byte ranges of that
    tensor's chunks (one per saving rank) from the ``.distcp`` files and copies them in place.
    """

    def __init__(self, path: Path, allow_globals: Sequence[str], need_metadata: bool, integrity: Integrity) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

        try:
            with open(path / DCP_METADATA_FILE, "rb") as f:
                dcp_metadata = DCPMetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise ExportError(
                f"{path / DCP_METADATA_FILE} was not loaded: {err} (unpickling it could run code)"
            ) from err
        if not isinstance(dcp_metadata, Metadata):
            raise ExportError(f"{path / DCP_METADATA_FILE} holds a {type(dcp_metadata).__name__}, not DCP's Metadata")
        if dcp_metadata.storage_meta is None:
            dcp_metadata.storage_meta = StorageMeta()
        self.reader = _metadata_once_reader(FileSystemReader, path, dcp_metadata)
        self.path = path
        if problems := shard_size_problems(path, dcp_metadata):
            raise ExportError(
                f"{path} is damaged (cut short or incomplete after saving):\n  - " + "\n  - ".join(problems)
                + "\nExport an earlier checkpoint, or copy this one again."
            )
        self.key_prefix = f"state_dict.{STATE_DICT_PREFIX}"
        self.weights = [
            WeightInfo(key[len(self.key_prefix):], tuple(meta.size), meta.properties.dtype)
            for key, meta in dcp_metadata.state_dict_metadata.items()
            if key.startswith(self.key_prefix) and isinstance(meta, TensorStorageMetadata)
        ]
        # Each tensor's stored chunks are checked against their digests just before DCP reads them (``read``).
        try:
            manifest = read_manifest(path)
        except ValueError as err:  # digests.ManifestError
            raise CheckpointError(f"Checkpoint {path} is damaged: {err}. Export an earlier checkpoint") from err
        self.digest_hash = manifest[0] if manifest else None
        self.digests: dict[str, list[Any]] = {}
        whole = []
        for item in manifest[1] if manifest else ():
            if item.whole:
                whole.append(item)
            else:
                self.digests.setdefault(item.fqn, []).append(item)
        if manifest is None:
            integrity.warn_undigested(path, lambda message: warnings.warn(message, stacklevel=3))
        # DCP's .metadata (just read, by a reader that builds DCP's types only) and meta.pt before it is read.
        read_whole = [i for i in whole if i.file in (DCP_METADATA_FILE, METADATA_FILE)]
        changed = {i.file: i for i in check_items(path, read_whole, self.digest_hash)} if read_whole else {}
        problems = [i.problem() for i in changed.values()]
        if DCP_METADATA_FILE in changed or (METADATA_FILE in changed and need_metadata):
            weights_only = f" Or pass --model PRESET: the export then reads the weights only, not {METADATA_FILE}."
            raise _refusal(path, problems, weights_only if DCP_METADATA_FILE not in changed else "")
        self.metadata: Optional[dict[str, Any]] = None
        try:
            if METADATA_FILE in changed:
                raise ExportError(f"Checkpoint {path} {describe_changed(path, problems)}.")
            self.metadata = load_checkpoint_file(path / METADATA_FILE, allow_globals=allow_globals)
        except ExportError as err:
            if need_metadata:
                raise ExportError(
                    f"{err} Or pass --model PRESET: the export then reads the weights only, not {METADATA_FILE}."
                ) from err
            warnings.warn(f"{err} Exporting with the given model args, without {METADATA_FILE}.", stacklevel=2)

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` for each of ``names``, one tensor read at a time."""
        import torch.distributed.checkpoint as dcp

        shapes = {w.name: w for w in self.weights}
        for name in names:
            info = shapes[name]
            if self.digest_hash is not None:
                changed = check_items(self.path, self.digests.get(self.key_prefix + name, ()), self.digest_hash)
                if changed:
                    raise _refusal(self.path, [i.problem() for i in changed])
            tensor = torch.empty(info.shape, dtype=info.dtype)
            with warnings.catch_warnings():
                # On purpose: one process, no process group.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                try:
                    dcp.load({self.key_prefix + name: tensor}, storage_reader=self.reader, no_dist=True)
                except Exception as err:  # DCP wraps a reader's EOF/zip error in a CheckpointException
                    raise ExportError(
                        f"{self.path}: reading {name} failed ({type(err).__name__}: {str(err).splitlines()[0]}); the"
                        " checkpoint is damaged (a shard corrupted after saving): export an earlier checkpoint"
                    ) from err
            yield name, tensor
            del tensor  # before the next one is allocated


class _FullCheckpoint:
    """The weights of a full checkpoint file, memory-mapped: only the tensors asked for are read.

    ``read`` maps the file anew for each call, so that once the caller drops the tensors of one
    call the mapping goes and its pages leave this process's memory (a mapping kept for the whole
    export would end up holding every page read).
    """

    def __init__(self, path: Path, allow_globals: Sequence[str], integrity: Integrity) -> None:
        self.path, self.allow_globals = path, allow_globals
        # The weights' digests, before any is read (the file is mapped: this reads them once more).
        changed = integrity.digest_problems(path, prefixes=(f"state_dict.{STATE_DICT_PREFIX}",),
                                            allow_globals=allow_globals)
        if changed:
            raise _refusal(path, changed)
        if changed is None:
            integrity.warn_undigested(path, lambda message: warnings.warn(message, stacklevel=3))
        loaded = load_checkpoint_file(path, mmap=True, allow_globals=allow_globals)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), Mapping):
            raise ExportError(f"{path} is not a Lightning checkpoint: it has no 'state_dict' dictionary")
        self.weights = [
            WeightInfo(key[len(STATE_DICT_PREFIX):], tuple(value.shape), value.dtype)
            for key, value in loaded["state_dict"].items()
            if key.startswith(STATE_DICT_PREFIX) and isinstance(value, torch.Tensor)
        ]
        self.metadata: Optional[dict[str, Any]] = {
            k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states")
        }

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each of ``names``: views of the mapped file, read when used."""
        state = load_checkpoint_file(self.path, mmap=True, allow_globals=self.allow_globals)["state_dict"]
        for name in names:
            yield name, state[STATE_DICT_PREFIX + name]


def open_checkpoint(
    checkpoint: Path, allow_globals: Sequence[str] = (), need_metadata: bool = True
) -> Union[_ShardedCheckpoint, _FullCheckpoint]:
    """A complete sharded (folder) or full (file) checkpoint, its metadata read, its weights not yet.

    Args:
        checkpoint: The folder or file.
        allow_globals: See ``load_checkpoint_file``.
        need_metadata: Whether a sharded checkpoint's ``meta.pt`` that cannot be loaded safely is an
            error (``False``: the model args come from elsewhere; only the weights are needed).
    """
    checkpoint = Path(checkpoint)
    if not is_complete(checkpoint):
        raise FileNotFoundError(
            f"{checkpoint} is not a complete checkpoint (a folder with .metadata and meta.pt, or a file)"
        )
    integrity = Integrity()  # the export's own checks: one process, nothing checked before
    if checkpoint.is_dir():
        return _ShardedCheckpoint(checkpoint, allow_globals, need_metadata, integrity)
    return _FullCheckpoint(checkpoint, allow_globals, integrity)


def _describe_model(model: Union[str, ModelArgs, Mapping[str, Any], None], overrides: Mapping[str, Any]) -> str:
    """Where the export's model args come from, for messages."""
    if model is None:
        described = "the model args stored in the checkpoint"
    else:
        described = f"--model {model}" if isinstance(model, str) else "the given model args"
    if not overrides:
        return described
    # A RopeScaling given in Python is written as the JSON the command line takes.
    shown = json.dumps(dict(overrides), default=lambda value: asdict(value) if is_dataclass(value) else str(value))
    return f"{described} with --model-overrides '{shown}'"


def _model_args(model: Union[str, ModelArgs, Mapping[str, Any]], overrides: Mapping[str, Any]) -> ModelArgs:
    if isinstance(model, str):
        return ModelArgs.from_name(model, **overrides)
    fields = asdict(model) if isinstance(model, ModelArgs) else dict(model)
    return ModelArgs(**{**fields, **overrides})


def checkpoint_model_args(metadata: Optional[Mapping[str, Any]]) -> Optional[ModelArgs]:
    """The model args a checkpoint records, or ``None`` if it does not.

    ``LlamaLightningModule`` saves them as ``model_args`` (exact fields); older checkpoints have only
    the hyper-parameters ``model`` (a preset name, a field dict or a ``ModelArgs``) and
    ``model_overrides``.

    Args:
        metadata: The checkpoint without its tensors (``meta.pt``, or a full file's top level).
    """
    if not metadata:
        return None
    stored = metadata.get("model_args")
    if stored is not None:
        return _model_args(stored, {})
    hparams = metadata.get("hyper_parameters")
    if not isinstance(hparams, Mapping) or "model" not in hparams:
        return None
    model, overrides = hparams["model"], hparams.get("model_overrides") or {}
    if model is None:
        if hparams.get("init_from"):
            return None  # the shapes came from that directory's config.json, not recorded here
        model = "debug"  # what LlamaLightningModule builds for model=None without init_from
    return _model_args(model, overrides)


def resolve_model_args(
    checkpoint: Path,
    metadata: Optional[Mapping[str, Any]],
    model: Union[str, ModelArgs, Mapping[str, Any], None] = None,
    model_overrides: Optional[Mapping[str, Any]] = None,
) -> ModelArgs:
    """The model args to export with: ``model`` if given (it must agree with those the checkpoint
    records, if any), else the checkpoint's; ``model_overrides`` applies to either.

    Args:
        checkpoint: The checkpoint (for messages).
        metadata: Its non-tensor part (``None``: not read).
        model: A preset name, ``ModelArgs`` or their dict.
        model_overrides: Fields to change.

    Raises:
        ExportError: The checkpoint records no model args and ``model`` is not given, or both exist
            and disagree.
    """
    overrides = dict(model_overrides or {})
    try:
        stored = checkpoint_model_args(metadata)
    except (TypeError, ValueError) as err:
        raise ExportError(
            f"{checkpoint} records model args that are not valid ModelArgs ({err}); pass --model PRESET"
        ) from err
    if model is None:
        if stored is None:
            raise ExportError(
                f"{checkpoint} does not record its model args (no 'model_args' entry, no 'model' hyper-parameter"
                " of LlamaLightningModule): the export cannot know the shapes and refuses to guess. Pass the"
                f" model it was trained with: --model PRESET (one of {', '.join(PRESETS)}), plus"
                " --model-overrides '{\"n_layers\": 2}' for the fields that differ from the preset"
                " (export_hf(..., model=..., model_overrides=...) in Python)."
            )
    source = _describe_model(model, overrides)
    try:
        args = _model_args(stored if model is None else model, overrides)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{source}: {err}") from err
    if model is not None and stored is not None and (mismatch := same_shapes(args, stored)):
        raise ExportError(
            f"{source} disagrees with the model args stored in {checkpoint}: " + "; ".join(mismatch)
            + " (given vs stored). Drop --model to export with the stored ones."
        )
    return args


def check_weight_shapes(args: ModelArgs, weights: Sequence[WeightInfo], checkpoint: Path, source: str) -> None:
    """Refuse, naming them, weights missing from the checkpoint, unexpected, or of another shape
    than a ``Transformer(args)`` has.

    Args:
        args: The model args the export would use.
        weights: The checkpoint's weights.
        checkpoint: The checkpoint (for messages).
        source: Where ``args`` come from (for messages).
    """
    aliases = tied_aliases(args)  # a tied head: the embedding's weight, whether the checkpoint names it or not
    with torch.device("meta"):  # shapes only: nothing allocated, whatever the model size
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items() if k not in aliases}
    found = {w.name: tuple(w.shape) for w in weights if w.name not in aliases}
    problems = [f"{name}: stored {list(found[name])}, expected {list(shape)}"
                for name, shape in expected.items() if name in found and found[name] != shape]
    problems += [f"{name}: missing" for name in expected if name not in found]
    problems += [f"{name}: not a weight of this model" for name in found if name not in expected]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise ExportError(
            f"The weights of {checkpoint} do not fit {source} ({len(problems)} of {len(expected)} tensors): {shown}."
            " Pass the model the checkpoint was trained with (--model PRESET --model-overrides '{...}')."
        )


def plan_shards(weights: Sequence[WeightInfo], dtype: Optional[torch.dtype], max_shard_bytes: int) -> list[list[str]]:
    """The names of the weights of each output file, in checkpoint order, from the metadata alone.

    A new file starts when the next weight would take the current one beyond ``max_shard_bytes``
    (a weight larger than that has a file of its own).

    Args:
        weights: The checkpoint's weights.
        dtype: The exported dtype (``None``: as stored).
        max_shard_bytes: Largest file size, in bytes of tensor data.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for weight in weights:
        nbytes = math.prod(weight.shape) * (dtype or weight.dtype).itemsize
        if size and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(weight.name)
        size += nbytes
    return shards


def _release_freed_memory() -> None:
    """Hand memory freed by the last output file back to the OS (glibc only; elsewhere a no-op).

    glibc serves allocations below its mmap threshold (which grows up to 32 MiB as blocks are freed)
    from heaps it keeps: without a trim, a freed file's smaller tensors may still count in the
    process's memory while the next file is read (measured: 0.26-0.49 GiB peaks over runs for
    0.25 GiB files, 0.27-0.29 GiB with the trim; see tests/benchmarks/bench_export.py).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def to_hf_tensors(name: str, tensor: torch.Tensor, args: ModelArgs, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """One of our weights as the Hugging Face tensors of ``hf_model_type(args)``: a stacked experts tensor becomes
    one tensor per expert (the per-expert layout transformers writes and reads), any other one tensor."""
    model_type = hf_model_type(args)
    expert = expert_name(name)
    if expert is None:
        return {hf_name(name, model_type): to_hf_tensor(name, tensor, args, dtype)}
    layer, which = expert
    return {expert_hf_name(layer, which, e, model_type): tensor[e].to(dtype or tensor.dtype).contiguous()
            for e in range(tensor.shape[0])}


def to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """One of our weights in the Hugging Face layout: ``dtype``, and the RoPE row permutation of ``wq``/``wk``."""
    tensor = tensor.to(dtype or tensor.dtype)
    heads = rotary_heads(name, args)
    if heads is not None:
        tensor = meta_to_hf(tensor, heads)
    return tensor.contiguous()


def export_hf(
    checkpoint: Path,
    out_dir: Path,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
    model: Union[str, ModelArgs, Mapping[str, Any], None] = None,
    model_overrides: Optional[Mapping[str, Any]] = None,
    allow_globals: Sequence[str] = (),
    tokenizer: Union[str, Path, None] = None,
    log: Optional[Callable[[str], None]] = None,
    merge_lora: bool = False,
) -> Path:
    """Write ``out_dir/model.safetensors`` (or shards + index), ``config.json`` and the tokenizer's files with
    ``generation_config.json`` from a Lightning checkpoint.

    A LoRA run's checkpoint (adapters only) is written as a peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``, the tokenizer): ``peft.PeftModel.from_pretrained`` puts it on the base; with
    ``merge_lora`` as a plain Hugging Face folder of the base with the adapters merged in
    (``lightning_2d.checkpoint.hf.lora``).

    Streams: the output files are planned from the checkpoint's metadata (DCP's ``.metadata``, or
    the memory-mapped full file; ``plan_export``), then each is read, converted, written and freed before the next
    is read (``write_export``). Peak memory is about one output file plus one tensor, whatever the model size.

    Torch DCP's ``HuggingFaceStorageWriter`` is not used: it writes what one ``dcp.save`` call is
    given (the whole state dict in memory, or one call per file, each overwriting the index with
    its own file), names even a single file ``model-00001-of-00001.safetensors`` and adds DCP keys
    to the safetensors header; the name mapping and the RoPE permutation are ours either way.

    Args:
        checkpoint: A sharded checkpoint folder or a full checkpoint file of ``LlamaLightningModule``
            (names mapped, RoPE rows permuted) or of ``HFCausalLMModule`` (the weights as they are,
            ``config.json`` from the config the checkpoint records).
        out_dir: Where the Hugging Face directory is written.
        dtype: Dtype of the exported weights (default: as stored).
        max_shard_bytes: Start a new ``.safetensors`` file beyond this size.
        model: The model args, for a checkpoint that does not record them (a preset name,
            ``ModelArgs`` or their dict); if it does, they must agree.
        model_overrides: Fields to change in ``model`` (or in the stored model args).
        allow_globals: ``module.Name`` of types the checkpoint may hold besides the ones known safe
            (see ``load_checkpoint_file``); only for a file you trust.
        tokenizer: ``"byte"``, a tokenizer file or a model folder whose tokenizer files are copied (see
            ``lightning_2d.checkpoint.hf.tokenizer``); ``None``: the one the checkpoint records (the data
            module's ``tokenizer``, else an ``init_from`` folder's).
        log: Called with a line saying what was written of the tokenizer, or why nothing (no tokenizer
            recorded or found). ``None``: that case is a warning.
        merge_lora: For a LoRA checkpoint: the base with the adapters merged, instead of a peft folder.

    Raises:
        ExportError: Model args missing, disagreeing or not fitting the weights; a checkpoint that a
            weights-only load refuses; a ``tokenizer`` that does not exist. Nothing is written then.
        FileNotFoundError: Not a complete checkpoint.

    Returns:
        ``out_dir``.

    Example:
        ```python
        from pathlib import Path
        import torch
        from lightning_2d.hf import export_hf

        out = export_hf(Path("checkpoints/step=1000.ckpt"), Path("export/"), dtype=torch.bfloat16)
        # transformers.AutoModelForCausalLM.from_pretrained(out) loads it; `lightning-2d export` is its command line
        ```
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    source = open_checkpoint(checkpoint, allow_globals=allow_globals, need_metadata=model is None)
    if not source.weights:
        raise ExportError(f"{checkpoint} holds no model weights (expected keys under '{STATE_DICT_PREFIX}')")
    tokenizer_spec, eos_token, where = resolve_export_tokenizer(tokenizer, source.metadata)
    plan = plan_export(checkpoint, source, dtype, max_shard_bytes, model, model_overrides, merge_lora)
    written = write_export(plan, out_dir, tokenizer_spec, eos_token, where)
    if log is not None:
        log(written.message)
    elif not written.complete:
        warnings.warn(f"{out_dir}: {written.message}", stacklevel=2)
    return out_dir


@dataclass
class ExportPlan:
    """What ``export_hf`` writes, chosen once from the checkpoint (``plan_export``); ``write_export`` writes any plan
    the same way."""

    #: ``"full"``: the whole model as a Hugging Face folder (our Llama's weights converted, a Hugging Face module's as
    #: they are); ``"peft"``: a LoRA checkpoint's adapters as a peft folder; ``"merged"``: its base with them merged.
    kind: Literal["full", "peft", "merged"]
    #: The weights: ``read(names)`` yields ``(name, tensor)``; ``metadata``, the checkpoint's non-tensor part.
    source: Any
    #: Each output weights file and the source's weights in it, in order.
    files: list[tuple[str, list[str]]]
    #: One source weight → its tensors in the files (names mapped, RoPE rows permuted, experts split, dtype).
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
    #: The model's ``config.json`` (written unless ``kind`` is ``"peft"``); the tokenizer's ids are added once written.
    config: dict[str, Any]
    #: peft's ``adapter_config.json``, written instead of ``config.json`` when ``kind`` is ``"peft"``.
    adapter_config: Optional[dict[str, Any]] = None


def plan_export(
    checkpoint: Path,
    source: Any,
    dtype: Optional[torch.dtype],
    max_shard_bytes: int,
    model: Union[str, ModelArgs, Mapping[str, Any], None],
    model_overrides: Optional[Mapping[str, Any]],
    merge_lora: bool,
) -> ExportPlan:
    """What to write for ``source`` (``open_checkpoint(checkpoint)``), refusing what cannot be exported; the
    arguments are ``export_hf``'s.

    Raises:
        ExportError: ``merge_lora`` for a checkpoint of the whole model; model args missing, disagreeing, not
            fitting the weights or the Hugging Face layout; ``model``/``model_overrides`` for a Hugging Face module's
            checkpoint (it records its own config).
    """
    metadata = source.metadata or {}
    native_config = metadata.get("hf_config")  # a Hugging Face module's checkpoint: its weights as transformers has them
    adapters = metadata.get("adapters")  # a LoRA run's checkpoint: the adapters only
    out_dtype = dtype or source.weights[-1].dtype  # the last weight's dtype (all weights share one in our checkpoints)
    if adapters is None and merge_lora:
        raise ExportError(f"{checkpoint} holds the whole model, not LoRA adapters: export it without --merge-lora")
    kind: Literal["full", "peft", "merged"] = "full" if adapters is None else "merged" if merge_lora else "peft"
    args = None if native_config is not None else resolve_model_args(checkpoint, source.metadata, model, model_overrides)
    peft = None
    if kind == "merged":
        source = MergedWeights(source, *base_weights_of(metadata, args), out_dtype)
    elif kind == "peft":
        n_layers = int(native_config["num_hidden_layers"]) if native_config is not None else args.n_layers
        modules = sorted({hf_module_name(split_adapter_name(w.name)[0], native_config is not None)
                          for w in source.weights if not is_expert_adapter(w.name)})
        experts = sorted({split_adapter_name(w.name)[0] for w in source.weights if is_expert_adapter(w.name)})
        moe_type = hf_model_type(args) if args is not None and args.moe is not None else None
        peft = adapter_config(adapters, modules, n_layers, experts, moe_type)
    # The model's Hugging Face config, and the names not written (tied: one tensor in the files, as transformers saves
    # it and ties on load).
    if native_config is not None:
        if model is not None or model_overrides:
            raise ExportError(
                f"{checkpoint} is a checkpoint of a Hugging Face model (HFCausalLMModule) and records its own"
                " config; --model/--model-overrides apply to LlamaLightningModule checkpoints only: drop them"
            )
        config = {**native_config, "torch_dtype": str(out_dtype).removeprefix("torch."),
                  "dtype": str(out_dtype).removeprefix("torch.")}
        tied = {"lm_head.weight"} if native_config.get("tie_word_embeddings") else set()
    else:
        assert args is not None
        if problems := hf_export_problems(args):
            raise ExportError(
                f"{checkpoint} holds a model that {hf_model_type(args)}'s Hugging Face layout cannot hold: "
                + "; ".join(problems) + ". Nothing was written."
            )
        if kind != "peft":  # (adapters: their shapes were checked against the model when the run resumed or saved)
            check_weight_shapes(args, source.weights, checkpoint, _describe_model(model, model_overrides or {}))
        config = hf_config(args, out_dtype)
        tied = set(tied_aliases(args))
    weights = [w for w in source.weights if w.name not in tied]
    if kind == "peft":  # one file of adapters, under peft's names
        files = [(ADAPTER_WEIGHTS_FILE, [w.name for w in weights])]
        return ExportPlan(kind, source, files, PeftTensors([w.name for w in weights], args, dtype), config, peft)
    shards = plan_shards(weights, dtype, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    if native_config is not None:
        convert = partial(transformers_tensors, model_type=str(native_config.get("model_type")), dtype=dtype)
    else:
        convert = partial(to_hf_tensors, args=args, dtype=dtype)
    return ExportPlan(kind, source, list(zip(names, shards)), convert, config)


def transformers_tensors(name: str, tensor: torch.Tensor, model_type: str,
                         dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """A Hugging Face module's weight as it goes in the files: ``dtype``, and a mixture of experts' fused experts per
    expert (the layout transformers saves and every reader loads)."""
    return transformers_to_files(name, tensor.to(dtype or tensor.dtype).contiguous(), model_type)


def write_export(
    plan: ExportPlan, out_dir: Path, tokenizer_spec: Optional[str], eos_token: Optional[str], where: str
) -> TokenizerExport:
    """Write ``plan`` into ``out_dir``, one weights file at a time, and the tokenizer (``resolve_export_tokenizer``'s
    answer); return what ``write_tokenizer`` wrote.

    Written into a staging folder next to ``out_dir`` and moved in only once complete: a failure (a corrupt shard, a
    full disk) leaves ``out_dir`` as it was (absent, or an earlier export, intact).
    """
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    config = plan.config
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for file, names in plan.files:
            tensors: dict[str, torch.Tensor] = {}
            for name, tensor in plan.source.read(names):
                tensors.update(plan.convert(name, tensor))
            save_file(tensors, staging / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors  # before the next file is read: one file's tensors in memory at a time
            _release_freed_memory()
        if len(plan.files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=1))
        written = write_tokenizer(tokenizer_spec, eos_token, where, staging,
                                  int(config.get("max_position_embeddings") or 0) or 2048)
        stop_ids = recorded_stop_ids(plan.source.metadata)
        if written.complete and stop_ids:  # fine-tuned on chats: generation stops at the end of a turn
            added = add_stop_ids(staging, stop_ids)
            written.message += (f"; stop ids {stop_ids} (the end of a turn, from the chat data) in"
                                f" generation_config.json{' (added)' if added else ''}")
        config.update({k: v for k, v in (("bos_token_id", written.bos_id), ("eos_token_id", written.eos_id))
                       if v is not None and k not in config})
        if plan.adapter_config is not None:
            (staging / ADAPTER_CONFIG_FILE).write_text(json.dumps(plan.adapter_config, indent=1))
        else:
            (staging / "config.json").write_text(json.dumps(config, indent=1))
        out_dir.mkdir(exist_ok=True)
        # Files of an earlier export to the same folder would be read instead of ours or beside them
        # (transformers prefers model.safetensors to an index; peft an adapter beside a model): only this export's
        # names remain.
        files = [file for file, _ in plan.files]
        for stale in [out_dir / SINGLE_FILE, out_dir / INDEX_FILE, *out_dir.glob("model-*-of-*.safetensors"),
                      out_dir / "config.json", out_dir / "adapter_config.json", out_dir / "adapter_model.safetensors"]:
            if stale.is_file() and stale.name not in files:
                stale.unlink()
        # The same for the tokenizer: an earlier export's files would be read with this one's.
        for name in [*HF_TOKENIZER_FILES, "original/tokenizer.model"]:
            if (out_dir / name).is_file() and not (staging / name).exists():
                (out_dir / name).unlink()
        for staged in staging.iterdir():
            if staged.is_dir():  # original/ (a tiktoken tokenizer.model): replaced as a whole
                shutil.rmtree(out_dir / staged.name, ignore_errors=True)
            os.replace(staged, out_dir / staged.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _metadata_once_reader(reader_class: type, path: Path, metadata: Any) -> Any:
    """A DCP ``FileSystemReader`` of ``path`` whose ``read_metadata`` returns ``metadata``, read once (safely, by
    the caller), not once per tensor: a large job's ``.metadata`` lists every chunk. A subclass, so that no
    method is replaced on a live object."""

    class MetadataOnceReader(reader_class):  # type: ignore[misc, valid-type]  # torch's class, imported lazily
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return MetadataOnceReader(str(path))
