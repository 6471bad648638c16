"""The Hugging Face round trip of a tokenizer: a model folder or Meta's tiktoken ``tokenizer.model`` for
``--data.tokenizer``, ``add_bos``, and ``lightning-2d export`` writing a folder that ``AutoTokenizer`` and
``pipeline()`` load as it is. Tokenizers are made here (no download)."""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import pytest
import torch

from lightning_2d.data import DataError, TextDataModule, TokenWindows, build_token_cache, resolve_sources
from lightning_2d.data.cache import cache_folder
from lightning_2d.data.tokenizers import ByteTokenizer, TiktokenTokenizer, load_tokenizer
from lightning_2d.hf import ExportError, export_hf

TEXTS = ["def f(x):\n    return x + 1\n", "hello world, hello there\n", "print('hello world')\n" * 3]
BOS, EOS = "<|doc|>", "<|end_of_text|>"  # BOS: a name only tokenizer_config.json gives
VOCAB = 320  # the model's: the tokenizer's 300 ids fit


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A model folder with a small byte-level BPE ``tokenizer.json`` and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf_tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}))
    return folder


@pytest.fixture(scope="module")
def tiktoken_folder(tmp_path_factory):
    """A model folder with a tiktoken ``tokenizer.model`` as Meta ships Llama 3's: the 256 bytes, a few merges."""
    folder = tmp_path_factory.mktemp("tiktoken")
    merges = [b"he", b"ll", b"hell", b"hello", b"de", b"def", b"  ", b"    ", b" w", b"or", b" wor", b"ld", b" world"]
    tokens = [bytes([i]) for i in range(256)] + merges
    lines = [f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)]
    (folder / "tokenizer.model").write_text("".join(lines))
    return folder


# ---- --data.tokenizer: a model folder, a tiktoken tokenizer.model -------------------------------------------------
def test_a_model_folder_is_a_tokenizer_and_one_without_a_tokenizer_is_refused(hf_folder, tiktoken_folder, tmp_path):
    assert load_tokenizer(str(hf_folder)).fingerprint == load_tokenizer(str(hf_folder / "tokenizer.json")).fingerprint
    both = tmp_path / "both"
    both.mkdir()
    for source in (hf_folder / "tokenizer.json", tiktoken_folder / "tokenizer.model"):
        (both / source.name).write_bytes(source.read_bytes())
    assert load_tokenizer(str(both)).fingerprint.startswith("hf-")  # tokenizer.json first
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'.*empty' has none of tokenizer\.json, tokenizer\.model"):
        TextDataModule(tokenizer=str(tmp_path / "empty"))


def test_a_tiktoken_tokenizer_model_is_read_with_llama3s_special_tokens(tiktoken_folder, monkeypatch):
    import pickle

    tok = load_tokenizer(str(tiktoken_folder / "tokenizer.model"))
    assert isinstance(tok, TiktokenTokenizer)  # not SentencePiece's, whose loader fails on it
    ranks = 256 + 13
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (ranks, ranks + 1, ranks + 256)
    assert tok.fingerprint.startswith("tiktoken-") and tok.fingerprint.endswith(f"-eos{ranks + 1}")
    hello, world, space = 259, 268, 32
    assert tok.encode_batch(["hello world", f"hello{EOS}"]) == [[hello, world], [hello, *map(ord, EOS)]]
    assert pickle.loads(pickle.dumps(tok)).encode_batch(["hello world"]) == [[hello, world]]
    assert load_tokenizer(str(tiktoken_folder), eos_token="<|eot_id|>").eos_id == ranks + 9
    # Meta's cuts of a long run of one kind (tiktoken's regex would crawl or overflow): every character kept.
    long = "x" * 60_000 + " hello" + " " * 30_000 + "world"
    assert tok.decode(tok.encode_batch([long])[0]) == long
    assert [len(p) for p in tok._substrings(long)][:2] == [25_000] * 2
    assert tok.encode_batch(["a" * 25_000 + " hello"])[0][-2:] == [space, *tok.encode_batch(["hello"])[0]]
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match=r"tiktoken BPE file .*'lightning-2d\[tiktoken\]'.*tokenizer\.json"):
        load_tokenizer(str(tiktoken_folder))


# ---- add_bos -------------------------------------------------------------------------------------------------------
def test_add_bos_starts_every_document_with_bos_and_is_another_cache(hf_folder, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXTS[2] * 4)  # one document cut into several pieces below
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tok = load_tokenizer(str(hf_folder))
    sources = resolve_sources(str(corpus))
    plain = build_token_cache(sources, tok, tmp_path / "cache", chunk_bytes=16)
    with_bos = build_token_cache(sources, tok, tmp_path / "cache", chunk_bytes=16, add_bos=True)
    assert with_bos != plain  # an old cache is never read for add_bos
    stream = np.fromfile(with_bos / "tokens.bin", dtype=np.uint16).tolist()
    assert np.fromfile(plain / "tokens.bin", dtype=np.uint16).tolist() == [t for t in stream if t != tok.bos_id]
    documents, current = [], []
    for t in stream:
        current.append(t)
        if t == tok.eos_id:
            documents.append(current)
            current = []
    assert len(documents) == 4 and all(d[0] == tok.bos_id and tok.bos_id not in d[1:] for d in documents)
    assert [tok.decode(d[1:-1]) for d in documents] == [TEXTS[2] * 4, *TEXTS]

    data = TextDataModule(str(corpus), tokenizer=str(hf_folder), add_bos=True, cache_dir=str(tmp_path / "dm"))
    without = TextDataModule(str(corpus), tokenizer=str(hf_folder), cache_dir=str(tmp_path / "dm"))
    assert data.cache_folder != without.cache_folder
    # Document masking: the BOS is its document's first token (position 0), the EOS its last.
    windows = TokenWindows(with_bos, 8, 0, (len(stream) - 1) // 8, eos_id=tok.eos_id)
    for i in range(len(windows)):
        item = windows[i]
        bos = item["input_ids"] == tok.bos_id
        assert (item["position_ids"][bos] == 0).all() and bos.sum() <= (item["position_ids"] == 0).sum()
    with pytest.raises(DataError, match=r"add_bos=True needs a beginning-of-text token, but the tokenizer 'byte' has"
                                        r" none .*<\|begin_of_text\|>.*set add_bos=False"):
        TextDataModule(add_bos=True)


# ---- export: a folder AutoTokenizer and pipeline() load ------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted(hf_folder, tmp_path_factory):
    """A real checkpoint of a 1-step Trainer fit on a TextDataModule given the model folder: what it records."""
    import lightning as L

    from lightning_2d import LlamaLightningModule

    root = tmp_path_factory.mktemp("fitted")
    L.seed_everything(0)
    (root / "corpus.txt").write_text("".join(TEXTS) * 8)
    data = TextDataModule(str(root / "corpus.txt"), tokenizer=str(hf_folder), seq_len=16, batch_size=2,
                          val_fraction=0.0, cache_dir=str(root / "cache"))
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 1, "vocab_size": VOCAB}, warmup_steps=1,
                                  max_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(root / "full.ckpt")
    return root / "full.ckpt"


def test_export_writes_a_folder_that_auto_tokenizer_and_pipeline_load(fitted, hf_folder, tmp_path):
    import transformers

    lines: list[str] = []
    out = export_hf(fitted, tmp_path / "hf", log=lines.append)
    assert lines == [f"tokenizer from the data module's tokenizer {hf_folder}: tokenizer.json, tokenizer_config.json,"
                     " generation_config.json"]
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    bos, eos = reference.token_to_id(BOS), reference.token_to_id(EOS)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": bos, "eos_token_id": eos}
    assert {k: json.loads((out / "config.json").read_text())[k] for k in ("bos_token_id", "eos_token_id")} == {
        "bos_token_id": bos, "eos_token_id": eos}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello world", add_special_tokens=False).input_ids == reference.encode("hello world").ids
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos)
    generate = transformers.pipeline("text-generation", model=str(out), device="cpu")
    assert generate("hello world", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("hello world")
    ids = generate("hello world", max_new_tokens=4, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert ids[:len(prompt := tok("hello world").input_ids)] == prompt and len(prompt) < len(ids) <= len(prompt) + 4


def test_export_of_a_tiktoken_tokenizer_encodes_as_tiktoken(fitted, tiktoken_folder, tmp_path):
    import transformers

    lines: list[str] = []
    out = export_hf(fitted, tmp_path / "hf", tokenizer=tiktoken_folder, log=lines.append)
    assert "tokenizer.json, original/tokenizer.model, tokenizer_config.json, generation_config.json" in lines[0]
    ours = load_tokenizer(str(tiktoken_folder))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["hello world", "def hello(world):\n        return 'hello'  \n\n", "Ünïcode wörld 123456 hello!!"]
    for text in texts:
        assert theirs(text, add_special_tokens=False).input_ids == ours.encode_batch([text])[0], text
        assert theirs(text).input_ids[0] == ours.bos_id  # Meta's tokenizer.json adds <|begin_of_text|>
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": ours.bos_id,
                                                                         "eos_token_id": ours.eos_id}


def test_export_says_when_it_writes_no_tokenizer(fitted, hf_folder, tmp_path, capsys):
    from lightning_2d.tools.export import main

    main([str(fitted), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    (tmp_path / "hf" / "special_tokens_map.json").write_text("{}")  # as an earlier export may have left it
    main([str(fitted), str(tmp_path / "hf"), "--tokenizer", "byte"])  # into the same folder
    out = capsys.readouterr().out
    assert "tokenizer from --tokenizer byte: tokenizer.json, tokenizer_config.json, generation_config.json" in out
    assert not (tmp_path / "hf" / "special_tokens_map.json").exists()  # the earlier export's tokenizer is gone
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"eos_token_id": 0}
    checkpoint = torch.load(fitted, weights_only=True)
    del checkpoint["datamodule_hyper_parameters"]
    torch.save(checkpoint, tmp_path / "bare.ckpt")
    with pytest.warns(UserWarning, match=r"no tokenizer written: the checkpoint records none .*pass --tokenizer PATH"):
        export_hf(tmp_path / "bare.ckpt", tmp_path / "bare")
    with pytest.raises(ExportError, match=r"--tokenizer .*missing: no such file or folder"):
        export_hf(tmp_path / "bare.ckpt", tmp_path / "bare", tokenizer=tmp_path / "missing")


def test_the_byte_tokenizer_exports_as_a_tokenizer_json_of_the_same_ids(fitted, tmp_path):
    """The main job (recipes/debug_cpu.yaml) trains on bytes: its export loads in AutoTokenizer and pipeline()."""
    import transformers

    out = export_hf(fitted, tmp_path / "hf", tokenizer="byte", log=lambda line: None)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["def f(x):\n    return x  # plain", "Ünïcode wörld ✓ 😀", "  two  spaces\ttab\r\n"]
    for text in texts:
        ids = tok(text).input_ids
        assert ids == list(text.encode("utf-8")) == ByteTokenizer().encode_batch([text])[0], text
        assert tok.decode(ids) == text
    assert tok.eos_token_id == ByteTokenizer.eos_id == 0 and tok.decode([104, 105, 0], skip_special_tokens=True) == "hi"
    generate = transformers.pipeline("text-generation", model=str(out), device="cpu")
    ids = generate("def ", max_new_tokens=3, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert ids[:4] == list(b"def ") and 4 < len(ids) <= 7


def test_where_the_export_finds_the_tokenizer(hf_folder, tmp_path):
    from lightning_2d.checkpoint.hf.tokenizer import recorded_tokenizer

    data = {"tokenizer": "byte", "eos_token": None}
    started = {"init_from": str(hf_folder)}
    # The data module's tokenizer is what training used; an init_from folder (a fine-tune) otherwise.
    assert recorded_tokenizer({"datamodule_hyper_parameters": data, "hyper_parameters": started})[::2] == (
        "byte", "the data module's tokenizer")
    assert recorded_tokenizer({"hyper_parameters": started}) == (str(hf_folder), None, "init_from")
    assert recorded_tokenizer({"hyper_parameters": {"init_from": str(tmp_path)}}) == (None, None, "")  # no tokenizer
    assert recorded_tokenizer({}) == (None, None, "")
