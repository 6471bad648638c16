"""The tokenizer of an exported Hugging Face directory: its files and ``generation_config.json``.

What a checkpoint says of its tokenizer (``recorded_tokenizer``), in this order:

1. ``datamodule_hyper_parameters.tokenizer``: the ``TextDataModule``'s ``tokenizer`` argument, which the
   Trainer saves in every checkpoint of a ``fit`` given that data module (``lightning-2d fit`` always is).
   It is the path *as given* when training started: a relative one is read from the current directory.
   Its ``eos_token`` is taken too.
2. ``hyper_parameters.init_from``: the Hugging Face folder ``LlamaLightningModule``/``HFCausalLMModule``
   started from, if it holds a tokenizer (a fine-tune of a downloaded model).

A Fabric loop's checkpoint and a Trainer fit given plain dataloaders record neither: ``--tokenizer PATH``
(a tokenizer file or a model folder) names it, and overrides what the checkpoint records.

From a model folder every tokenizer file it has is copied (``HF_TOKENIZER_FILES``, and its
``generation_config.json``). A lone file is copied under its standard name, Meta's tiktoken
``tokenizer.model`` (Llama 3) converted to a ``tokenizer.json`` (its original kept as ``original/tokenizer.model``,
as in Meta's Hugging Face repositories), and ``tokenizer_config.json``/``generation_config.json`` written from
its special tokens where the source has none.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_2d.checkpoint.errors import ExportError
from lightning_2d.models.llama.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    LLAMA3_BOS,
    LLAMA3_SPLIT_PATTERN,
    TOKENIZER_FILES,
    bytes_to_unicode,
    is_tiktoken_file,
    llama3_special_tokens,
    model_folder_tokenizer,
    read_tiktoken_ranks,
)

#: A model folder's files copied into an export, when it has them.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass
class TokenizerExport:
    """What the export wrote of the tokenizer.

    Args:
        source: Where the tokenizer came from (for the output), or ``None`` if none was found.
        files: The files written (names in the export folder).
        bos_id: The beginning-of-text id, if known.
        eos_id: The end-of-text id, if known.
        message: One line for the export's output: what was written, or why not and what to do.
        complete: Whether ``AutoTokenizer`` can load the export (tokenizer files written).
    """

    source: Optional[str]
    files: list[str] = field(default_factory=list)
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    message: str = ""
    complete: bool = False


#: The data modules whose checkpoint entry records ``end_of_turn_ids`` (Lightning keys it by the class's name).
DATA_MODULES_WITH_STOP_IDS = ("ChatDataModule", "PreferenceDataModule")


def recorded_stop_ids(metadata: Optional[Mapping[str, Any]]) -> list[int]:
    """The end-of-turn ids a ``ChatDataModule`` or ``PreferenceDataModule`` trained the model to stop at, as its
    checkpoint records them (under the data module's class name)."""
    for name in DATA_MODULES_WITH_STOP_IDS:
        data = (metadata or {}).get(name)
        ids = data.get("end_of_turn_ids") if isinstance(data, Mapping) else None
        if isinstance(ids, (list, tuple)):
            return [int(i) for i in ids]
    return []


def add_stop_ids(out_dir: Path, stop_ids: list[int]) -> list[int]:
    """Add ``stop_ids`` to the ``eos_token_id`` of ``out_dir/generation_config.json`` (what ``generate`` and
    ``pipeline()`` stop at); returns the ids added (none when it had them all)."""
    path = out_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    eos = config.get("eos_token_id")
    current = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    added = [i for i in stop_ids if i not in current]
    if added:
        config["eos_token_id"] = current + added
        path.write_text(json.dumps(config, indent=1))
    return added


def recorded_tokenizer(metadata: Optional[Mapping[str, Any]]) -> tuple[Optional[str], Optional[str], str]:
    """``(tokenizer, eos_token, where)`` as a checkpoint records them (``(None, None, "")`` if it does not).

    Args:
        metadata: The checkpoint without its tensors (``meta.pt``, or a full file's top level).
    """
    metadata = metadata or {}
    data = metadata.get("datamodule_hyper_parameters")
    if isinstance(data, Mapping) and isinstance(data.get("tokenizer"), str):
        eos = data.get("eos_token")
        return data["tokenizer"], eos if isinstance(eos, str) else None, "the data module's tokenizer"
    hparams = metadata.get("hyper_parameters")
    init_from = hparams.get("init_from") if isinstance(hparams, Mapping) else None
    if isinstance(init_from, str) and Path(init_from).is_dir() and model_folder_tokenizer(Path(init_from)):
        return init_from, None, "init_from"
    return None, None, ""


def resolve_export_tokenizer(
    tokenizer: Union[str, Path, None], metadata: Optional[Mapping[str, Any]]
) -> tuple[Optional[str], Optional[str], str]:
    """``(tokenizer, eos_token, where)`` to export: ``tokenizer`` if given (it must exist), else the recorded one.

    Raises:
        ExportError: ``tokenizer`` given but neither ``"byte"`` nor an existing file or model folder with one.
    """
    _, eos_token, _ = recorded_tokenizer(metadata)
    if tokenizer is None:
        return recorded_tokenizer(metadata)
    spec = str(tokenizer)
    if spec != "byte":
        path = Path(spec).expanduser()
        if not path.exists():
            raise ExportError(f"--tokenizer {spec}: no such file or folder; give a tokenizer file or a model folder")
        if path.is_dir() and model_folder_tokenizer(path) is None:
            raise ExportError(
                f"--tokenizer {spec}: the folder has none of {', '.join(TOKENIZER_FILES)}; give a model folder that"
                " holds one, or the tokenizer file itself"
            )
    return spec, eos_token, "--tokenizer"


def write_tokenizer(
    spec: Optional[str], eos_token: Optional[str], where: str, out_dir: Path, max_length: int
) -> TokenizerExport:
    """Write the tokenizer's files and ``generation_config.json`` into ``out_dir``.

    Args:
        spec: ``"byte"``, a tokenizer file or a model folder (``None``: none known).
        eos_token: The end-of-text token training used, if it named one.
        where: Where ``spec`` comes from (for the message).
        out_dir: The export folder (staging).
        max_length: The model's context (``model_max_length`` of a written ``tokenizer_config.json``).
    """
    fix = "pass --tokenizer PATH (a tokenizer.json, tokenizer.model or model folder) to add it"
    if spec is None:
        return TokenizerExport(None, message=(
            "no tokenizer written: the checkpoint records none (no data module tokenizer, no init_from folder"
            f" with one); {fix}"))
    if spec == "byte":
        # ByteTokenizer's ids as a byte-level tokenizer.json: byte b is id b, id 0 (NUL, absent from text) the
        # end-of-text token, so AutoTokenizer and pipeline() read and write what the model was trained on.
        _byte_tokenizer_json(out_dir / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False, "eos_token": BYTE_EOS}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=1))
        written = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
        return TokenizerExport("byte", written, eos_id=0, complete=True, message=(
            f"tokenizer from {where} byte: " + ", ".join(written) + f" (UTF-8 bytes as ids 1-255, {BYTE_EOS} = 0"
            " ends a document, as in training)"))
    path = Path(spec).expanduser()
    if not path.exists():
        return TokenizerExport(None, message=f"no tokenizer written: {where} is {spec}, which does not exist here;"
                                             f" {fix}")
    main = model_folder_tokenizer(path) if path.is_dir() else path
    if main is None:
        return TokenizerExport(None, message=f"no tokenizer written: {where} {spec} holds none of"
                                             f" {', '.join(TOKENIZER_FILES)}; {fix}")
    # A model folder, or a file of one under its standard name: its companions are the tokenizer's too.
    folder = path if path.is_dir() else (path.parent if path.name in TOKENIZER_FILES else None)
    written: list[str] = []
    tiktoken = main.suffix == ".model" and is_tiktoken_file(main)
    if folder is not None:
        for name in HF_TOKENIZER_FILES:
            if (folder / name).is_file() and not (name == "tokenizer.model" and tiktoken):
                shutil.copyfile(folder / name, out_dir / name)
                written.append(name)
    if tiktoken and "tokenizer.json" not in written:
        _tiktoken_to_tokenizer_json(main, out_dir / "tokenizer.json")
        (out_dir / "original").mkdir(exist_ok=True)
        shutil.copyfile(main, out_dir / "original" / "tokenizer.model")
        written += ["tokenizer.json", "original/tokenizer.model"]
    elif main.name not in written:
        name = "tokenizer.json" if main.suffix == ".json" else "tokenizer.model"
        shutil.copyfile(main, out_dir / name)
        written.append(name)
    bos_name, eos_name, bos_id, eos_id = _special_tokens(out_dir, eos_token)
    if "tokenizer_config.json" not in written:
        fast = (out_dir / "tokenizer.json").is_file()
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast" if fast else "LlamaTokenizer",
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        }
        config.update({k: v for k, v in (("bos_token", bos_name), ("eos_token", eos_name)) if v is not None})
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        written.append("tokenizer_config.json")
    if "generation_config.json" not in written:
        generation = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=1))
        written.append("generation_config.json")
    missing = [] if eos_id is not None else ["its end-of-text id is unknown (generation will not stop at one)"]
    return TokenizerExport(
        f"{where} {spec}", written, bos_id, eos_id, complete=True,
        message=f"tokenizer from {where} {spec}: " + ", ".join(written) + ("; " + missing[0] if missing else ""),
    )


def _token_name(value: Any) -> Optional[str]:
    value = value.get("content") if isinstance(value, Mapping) else value
    return value if isinstance(value, str) else None


def _special_tokens(out_dir: Path, eos_token: Optional[str]) -> tuple[Optional[str], Optional[str], Optional[int],
                                                                        Optional[int]]:
    """``(bos name, eos name, bos id, eos id)`` of the tokenizer written in ``out_dir``: the names its
    ``tokenizer_config.json`` gives (else ``eos_token``, else the usual names found in its vocabulary)."""
    config: dict[str, Any] = {}
    if (out_dir / "tokenizer_config.json").is_file():
        config = json.loads((out_dir / "tokenizer_config.json").read_text())
    vocab = _vocabulary(out_dir)
    bos_names = [n for n in (_token_name(config.get("bos_token")),) if n] + list(BOS_CANDIDATES)
    eos_names = [n for n in (_token_name(config.get("eos_token")), eos_token) if n] + list(EOS_CANDIDATES)
    bos = next((n for n in bos_names if n in vocab), None)
    eos = next((n for n in eos_names if n in vocab), None)
    return bos, eos, vocab.get(bos) if bos else None, vocab.get(eos) if eos else None


def _vocabulary(out_dir: Path) -> dict[str, int]:
    """Token → id of a written ``tokenizer.json`` (its model's vocabulary and its added tokens), else of a
    SentencePiece ``tokenizer.model`` (its special pieces, if ``sentencepiece`` is installed)."""
    if (out_dir / "tokenizer.json").is_file():
        data = json.loads((out_dir / "tokenizer.json").read_text())
        model_vocab = (data.get("model") or {}).get("vocab") or {}
        vocab = dict(model_vocab) if isinstance(model_vocab, dict) else {
            entry[0]: i for i, entry in enumerate(model_vocab)  # Unigram: [[piece, score], ...]
        }
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
        return vocab
    try:
        import sentencepiece as spm
    except ImportError:
        return {}
    sp = spm.SentencePieceProcessor(model_file=str(out_dir / "tokenizer.model"))
    return {sp.id_to_piece(i): i for i in (sp.bos_id(), sp.eos_id(), sp.pad_id()) if i >= 0}


#: The end-of-text token of the exported byte tokenizer (id 0: the byte NUL, which never occurs in text).
BYTE_EOS = "<|endoftext|>"


def _byte_tokenizer_json(out: Path) -> None:
    """``ByteTokenizer`` as a ``tokenizer.json``: a byte-level BPE without merges whose vocabulary maps byte ``b``'s
    character to id ``b`` (1-255) and ``BYTE_EOS`` to 0, so encoding any text gives its UTF-8 bytes."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as err:
        raise ExportError("Writing the byte tokenizer as a tokenizer.json needs the `tokenizers` package:"
                          " pip install 'lightning-2d[hf]'") from err
    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={BYTE_EOS: 0, **{chars[b]: b for b in range(1, 256)}}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True, normalized=False)])
    tok.save(str(out))


def _tiktoken_to_tokenizer_json(path: Path, out: Path) -> None:
    """Meta's tiktoken ``tokenizer.model`` as a ``tokenizer.json`` that encodes alike: the ranks as a byte-level
    BPE vocabulary, the merges recovered from the ranks (each token's splits into two tokens, in the order of the
    merged token's rank, as transformers' ``TikTokenConverter``), Llama 3's split pattern, its special tokens after
    the ranks, and ``<|begin_of_text|>`` added in front as Meta's published ``tokenizer.json`` does."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError as err:
        raise ExportError(
            f"Converting the tiktoken tokenizer {path} into a tokenizer.json needs the `tokenizers` package:"
            " pip install 'lightning-2d[hf]'"
        ) from err
    ranks = read_tiktoken_ranks(path)
    chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[left], ranks[right], left, right) for left, right in splits]
    merges.sort()
    try:  # ignore_merges: a word that is a token is that token, as in tiktoken (tokenizers >= 0.19)
        bpe = models.BPE(vocab={text(t): r for t, r in ranks.items()},
                         merges=[(text(left), text(right)) for *_, left, right in merges],
                         fuse_unk=False, byte_fallback=False, ignore_merges=True)
    except TypeError as err:
        raise ExportError(
            f"Converting the tiktoken tokenizer {path} needs tokenizers >= 0.19 (BPE's ignore_merges): pip install -U"
            " tokenizers"
        ) from err
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = llama3_special_tokens(len(ranks))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bos_id = special[LLAMA3_BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS}:0 $A:0", pair=f"{LLAMA3_BOS}:0 $A:0 {LLAMA3_BOS}:1 $B:1",
        special_tokens=[(LLAMA3_BOS, bos_id)],
    )
    tok.save(str(out))
