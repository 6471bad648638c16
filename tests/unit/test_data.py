"""TextDataModule pieces: sources, tokenizers, the token cache, packing, sampling, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_2d.data import (
    DataError,
    DataParallelSampler,
    ResumableDataLoader,
    TextDataModule,
    TokenWindows,
    build_token_cache,
    resolve_sources,
    stdlib_sources,
)
from lightning_2d.data.tokenizers import ByteTokenizer, load_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "class Ünïcode:\n    pass\n", "print('hello world')\n" * 3]


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return folder


def decode_windows(dataset: TokenWindows) -> list[int]:
    """Rebuild the token stream from the windows (each overlaps the next by one token)."""
    stream: list[int] = []
    for i in range(len(dataset)):
        item = dataset[i]
        assert torch.equal(item["input_ids"][1:], item["labels"][:-1])  # labels are the inputs shifted
        window = item["input_ids"].tolist() + [item["labels"][-1].item()]
        if stream:
            assert stream[-1] == window[0]
            window = window[1:]
        stream.extend(window)
    return stream


def test_byte_tokenizer_cache_and_windows_round_trip(corpus, tmp_path):
    folder = build_token_cache(resolve_sources(str(corpus)), ByteTokenizer(), tmp_path / "cache")
    meta = json.loads((folder / "meta.json").read_text())
    expected = b"".join(t.encode() + b"\0" for t in TEXTS)  # NUL ends each document
    assert meta["num_tokens"] == len(expected) and meta["num_documents"] == 3 and meta["dtype"] == "uint16"
    seq_len = 7
    windows = TokenWindows(folder, seq_len, 0, (len(expected) - 1) // seq_len)
    stream = decode_windows(windows)
    assert bytes(stream) == expected[: len(stream)] and len(stream) > len(expected) - seq_len - 1


def test_cache_is_reused_and_keyed_by_content(corpus, tmp_path):
    sources = resolve_sources(str(corpus))
    first = build_token_cache(sources, ByteTokenizer(), tmp_path / "cache")
    stamp = (first / "tokens.bin").stat().st_mtime_ns
    assert build_token_cache(sources, ByteTokenizer(), tmp_path / "cache") == first
    assert (first / "tokens.bin").stat().st_mtime_ns == stamp  # not rewritten
    (corpus / "doc0.txt").write_text("changed text\n")
    assert build_token_cache(resolve_sources(str(corpus)), ByteTokenizer(), tmp_path / "cache") != first


def test_hugging_face_tokenizer_round_trip(corpus, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = load_tokenizer(str(path))
    assert hf.vocab_size == tok.get_vocab_size() and hf.eos_id == tok.token_to_id("<|endoftext|>")
    assert hf.encode_batch(TEXTS) == [e.ids for e in tok.encode_batch(TEXTS, add_special_tokens=False)]
    folder = build_token_cache(resolve_sources(str(corpus)), hf, tmp_path / "cache")
    tokens = np.memmap(folder / "tokens.bin", dtype=np.uint16, mode="r").tolist()
    docs, current = [], []
    for t in tokens:
        if t == hf.eos_id:
            docs.append(hf.decode(current))
            current = []
        else:
            current.append(t)
    assert docs == TEXTS


def test_sentencepiece_tokenizer_round_trip(corpus, tmp_path):
    import sentencepiece as spm

    train = tmp_path / "train.txt"
    train.write_text("\n".join(TEXTS * 30))
    spm.SentencePieceTrainer.train(
        input=str(train), model_prefix=str(tmp_path / "sp"), vocab_size=30, character_coverage=1.0,
        minloglevel=2, normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    sp = load_tokenizer(str(tmp_path / "sp.model"))
    assert sp.vocab_size == 30 and sp.eos_id is not None
    ids = sp.encode_batch(["hello world"])[0]
    assert sp.decode(ids) == "hello world"


def test_jsonl_and_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)))
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "b.parquet")
    a = build_token_cache(resolve_sources(str(tmp_path / "a.jsonl")), ByteTokenizer(), tmp_path / "c1")
    b = build_token_cache(resolve_sources(str(tmp_path / "b.parquet")), ByteTokenizer(), tmp_path / "c2", "body")
    expected = b"".join(t.encode() + b"\0" for t in TEXTS)
    for folder in (a, b):
        assert np.fromfile(folder / "tokens.bin", dtype=np.uint16).astype(np.uint8).tobytes() == expected


def test_builtin_corpus_is_the_standard_library():
    sources = stdlib_sources()
    assert len(sources) > 500 and all(p.suffix == ".py" for p in sources)
    assert not any("site-packages" in p.parts for p in sources)
    assert sum(p.stat().st_size for p in sources) > 10e6  # tens of MB of real text


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_global_batch_sequence_does_not_depend_on_data_parallel_size(replicas):
    n, batch, global_batch = 64, 8 // replicas, 8
    reference = list(DataParallelSampler(n, 1, 0, shuffle=True, seed=3))
    per_rank = [list(DataParallelSampler(n, replicas, r, shuffle=True, seed=3)) for r in range(replicas)]
    for step in range(n // global_batch):
        union = sorted(i for rank in per_rank for i in rank[step * batch : (step + 1) * batch])
        assert union == sorted(reference[step * global_batch : (step + 1) * global_batch])


def test_sampler_epochs_differ_and_resume_skips_consumed_samples():
    sampler = DataParallelSampler(40, 2, 1, shuffle=True, seed=0)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != epoch0
    sampler.set_epoch(0)
    sampler.resume(epoch=0, consumed=12)  # 3 global batches of 2 × 2
    assert len(sampler) == 20 and list(sampler) == epoch0[6:]  # the length stays the epoch's
    assert list(sampler) == epoch0  # the skip applies once


def test_loader_state_counts_consumed_batches_not_prefetched_ones(corpus, tmp_path):
    folder = build_token_cache(resolve_sources(str(corpus)), ByteTokenizer(), tmp_path / "cache")
    dataset = TokenWindows(folder, 4, 0, 16)
    consumed = {"batches": 0}
    loader = ResumableDataLoader(
        dataset, batch_size=2, sampler=DataParallelSampler(16, 2, 0, seed=1), consumed_batches=lambda: consumed["batches"]
    )
    it = iter(loader)
    next(it), next(it)  # the trainer fetched two batches but trained on one
    consumed["batches"] = 1
    state = loader.state_dict()
    assert state["consumed_samples"] == 4 and state["epoch"] == 0
    resumed = ResumableDataLoader(dataset, batch_size=2, sampler=DataParallelSampler(16, 2, 0, seed=1))
    resumed.load_state_dict(state)
    full = [b["input_ids"] for b in ResumableDataLoader(dataset, batch_size=2, sampler=DataParallelSampler(16, 2, 0, seed=1))]
    rest = [b["input_ids"] for b in resumed]
    assert len(rest) == len(full) - 1 and all(torch.equal(a, b) for a, b in zip(rest, full[1:]))
    assert len(resumed) == len(full)  # Lightning sizes the epoch from len() and counts restored batches


# ---- bad input ---------------------------------------------------------------------------------
def test_no_files_matched(tmp_path):
    with pytest.raises(DataError, match=r"No files matched '.*nothing/\*\.txt'"):
        resolve_sources(str(tmp_path / "nothing/*.txt"))


def test_empty_and_non_utf8_files_are_named(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match=r"empty\.txt is empty; remove it from paths"):
        build_token_cache(resolve_sources(str(tmp_path / "empty.txt")), ByteTokenizer(), tmp_path / "c")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not UTF-8 text \(byte 3"):
        build_token_cache(resolve_sources(str(tmp_path / "latin1.txt")), ByteTokenizer(), tmp_path / "c")


def test_unreadable_file_is_named(tmp_path):
    # An OS-level read failure (here: a directory where a file is expected; a mode-000 file would
    # do too but root, as in CI, can read it) names the path and the reason.
    with pytest.raises(DataError, match=rf"Cannot read {tmp_path}: Is a directory"):
        build_token_cache([tmp_path], ByteTokenizer(), tmp_path / "c")


def test_missing_jsonl_field_and_parquet_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"a\.jsonl:1 has no field 'text' \(found \['content'\]\); set text_field"):
        build_token_cache(resolve_sources(str(tmp_path / "a.jsonl")), ByteTokenizer(), tmp_path / "c")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1 is not valid JSON"):
        build_token_cache(resolve_sources(str(tmp_path / "bad.jsonl")), ByteTokenizer(), tmp_path / "c")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet has no column 'text' \(columns: \['body'\]\)"):
        build_token_cache(resolve_sources(str(tmp_path / "b.parquet")), ByteTokenizer(), tmp_path / "c")


def test_corpus_shorter_than_one_sequence(tmp_path):
    (tmp_path / "tiny.txt").write_text("abc")
    data = TextDataModule(str(tmp_path / "tiny.txt"), seq_len=64, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"The corpus has 4 tokens, fewer than one sequence needs \(65\)"):
        data.setup("fit")


def test_tokenizer_that_does_not_load(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"Could not load the Hugging Face tokenizer .*tokenizer\.json"):
        TextDataModule(tokenizer=str(tmp_path / "tokenizer.json"))
    (tmp_path / "sp.model").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"Could not load the SentencePiece model .*sp\.model"):
        TextDataModule(tokenizer=str(tmp_path / "sp.model"))
    with pytest.raises(FileNotFoundError, match=r"Tokenizer 'missing\.json' is neither 'byte' nor an existing file"):
        TextDataModule(tokenizer="missing.json")


def test_vocabulary_mismatch_and_bad_arguments():
    data = TextDataModule()
    data.check_model(256)
    with pytest.raises(DataError, match=r"vocab_size \(100\) is smaller than the tokenizer's \(256\)"):
        data.check_model(100)
    with pytest.raises(DataError) as err:
        TextDataModule(seq_len=0, batch_size=-1, val_fraction=1.5, max_unprepared_mb=-1)
    assert "seq_len must be a positive integer, got 0" in str(err.value)
    assert "val_fraction must be in [0, 1), got 1.5" in str(err.value)
    assert "max_unprepared_mb must be >= 0 or None (no limit), got -1" in str(err.value)


def test_a_folder_contributes_its_corpus_files_not_metadata_or_hidden_files(tmp_path):
    from lightning_2d.data import DataError

    root = tmp_path / "dataset"
    (root / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "train").mkdir()
    for name in ("train/a.txt", "train/b.jsonl", "code.py", "README.md", ".gitattributes", "__pycache__/code.cpython-311.pyc",
                 ".git/HEAD", "dataset_info.json", "LICENSE"):
        (root / name).write_text("x")
    assert resolve_sources(str(root)) == [(root / "code.py").resolve(), (root / "train/a.txt").resolve(),
                                          (root / "train/b.jsonl").resolve()]
    # Named explicitly, or by a glob, anything is taken.
    assert resolve_sources(str(root / "README.md")) == [(root / "README.md").resolve()]
    assert resolve_sources(str(root / "*.md")) == [(root / "README.md").resolve()]
    only_meta = tmp_path / "cards"
    only_meta.mkdir()
    (only_meta / "README.md").write_text("# card")
    with pytest.raises(DataError, match=r"cards holds no corpus files .*: it holds README\.md\. Name the files or a glob"):
        resolve_sources(str(only_meta))


def test_every_bad_file_is_reported_at_once_and_nothing_is_cached(tmp_path):
    """JSONL values that are not strings (null, numbers, objects) would be tokenized as their repr; a run
    with several bad files names each with its line, in one error, and leaves no cache or partial file."""
    from lightning_2d.data import DataError

    (tmp_path / "a_null.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    (tmp_path / "b_number.jsonl").write_text('{"text": 42}\n')
    (tmp_path / "c_object.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": {"nested": "x"}}\n')
    (tmp_path / "d_latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "e_good.txt").write_text("good text")
    sources = sorted(tmp_path.glob("*.*"))
    with pytest.raises(DataError) as err:
        build_token_cache(sources, ByteTokenizer(), tmp_path / "cache")
    message = str(err.value)
    assert message.startswith("4 problem(s) in the corpus (nothing was cached):")
    assert "a_null.jsonl:2: field 'text' holds null (null), not a string" in message
    assert "b_number.jsonl:1: field 'text' holds int (42), not a string" in message
    assert "c_object.jsonl:3: field 'text' holds dict ({\"nested\": \"x\"}), not a string" in message
    assert "d_latin1.txt is not UTF-8 text (byte 3" in message
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert not any(p.name.startswith("tokens.bin") or p.name == "meta.json" for p in leftovers), leftovers
