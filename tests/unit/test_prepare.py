"""Preparing the token cache: streamed pieces, a process pool, the same tokens, atomic, refused when big.

Small chunk sizes (tens of bytes) stand for big files: they cut the test files into many pieces
and tasks, so the boundaries, the ordering and the pool are exercised on kilobytes.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_2d.data import (
    DataError,
    TextDataModule,
    prepare_command,
    prepare_python,
    prepare_token_cache,
    resolve_sources,
)
from lightning_2d.data import datamodule as data_module
from lightning_2d.data.pieces import PieceTokenizer, plan_pieces
from lightning_2d.data.tokenizers import ByteTokenizer, load_tokenizer
from lightning_2d.tools.prepare import main as prepare_main
from lightning_2d.tools.prepare import parse_args

# Lines of very different lengths, multi-byte characters, and a line longer than the chunk sizes
# used below with no newline (cut at a character boundary).
LINES = ["def f(x):", "    return x + 1", "", "class Ünïcode:  # 日本語", "    pass", "é" * 300, "print('hi')" * 7]


def text_of(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "\n".join(LINES[i] for i in rng.integers(0, len(LINES), n)) + "\n"


@pytest.fixture
def corpus(tmp_path):
    """Text files (small, and large with a tiny chunk size), a JSONL file and, with pyarrow, a Parquet file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = {"a_small.txt": text_of(3, 0), "b_big.txt": text_of(400, 1), "c_small.py": text_of(5, 2)}
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    records = [text_of(int(n), 10 + i) for i, n in enumerate(np.random.default_rng(3).integers(1, 12, 60))]
    (folder / "d.jsonl").write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(records)))
    documents = list(texts.values()) + records
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pass
    else:
        rows = [text_of(int(n), 100 + i) for i, n in enumerate(np.random.default_rng(4).integers(1, 9, 50))]
        pq.write_table(pa.table({"text": rows}), folder / "e.parquet", row_group_size=7)  # 8 row groups
        documents += rows
    return folder, documents


@pytest.fixture
def hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text_of(50, s) for s in range(20)], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return load_tokenizer(str(path))


def read_tokens(folder) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    return np.fromfile(folder / "tokens.bin", dtype=meta["dtype"])


def forbid_tokenizing(monkeypatch) -> None:
    def fail(self, task):
        raise AssertionError(f"tokenized {task[0].path} although it should not have")

    monkeypatch.setattr(PieceTokenizer, "__call__", fail)


# ---- the same tokens whatever the number of processes and the piece size ----------------------
@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_two_workers_give_the_single_process_cache_token_for_token(corpus, tmp_path, tokenizer, request):
    folder, documents = corpus
    tok = ByteTokenizer() if tokenizer == "byte" else request.getfixturevalue("hf_tokenizer")
    sources = resolve_sources(str(folder))
    one = prepare_token_cache(sources, tok, tmp_path / "one", num_workers=1, chunk_bytes=64)
    two = prepare_token_cache(sources, tok, tmp_path / "two", num_workers=2, chunk_bytes=64)
    assert one.built and two.built and two.num_workers == 2 and two.tasks > 100
    assert np.array_equal(read_tokens(one.folder), read_tokens(two.folder))
    assert one.tokens == two.tokens and one.documents == two.documents == len(documents)
    assert one.folder.name == two.folder.name  # the same cache key: setup() finds either
    if tokenizer == "byte":  # UTF-8 bytes, every document followed by NUL: nothing lost or repeated at a cut
        expected = b"".join(d.encode() + b"\0" for d in documents)
        assert read_tokens(one.folder).astype(np.uint8).tobytes() == expected
    else:  # documents decode back, one by one, across pieces
        tokens = read_tokens(one.folder).tolist()
        ends = [i for i, t in enumerate(tokens) if t == tok.eos_id]
        starts = [0] + [e + 1 for e in ends[:-1]]
        assert [tok.decode(tokens[s:e]) for s, e in zip(starts, ends)] == documents


@pytest.mark.parametrize("chunk_bytes", [16, 100, 4096, 1 << 20])
def test_pieces_cover_each_file_exactly_once(corpus, tmp_path, chunk_bytes):
    folder, documents = corpus
    sources = resolve_sources(str(folder))
    report = prepare_token_cache(sources, ByteTokenizer(), tmp_path / "c", chunk_bytes=chunk_bytes)
    assert read_tokens(report.folder).astype(np.uint8).tobytes() == b"".join(d.encode() + b"\0" for d in documents)


def test_a_big_file_is_read_in_bounded_pieces(tmp_path):
    path = tmp_path / "big.txt"
    text = text_of(3000, 7)  # ~100 kB, with lines of 600 bytes (longer than the chunk)
    path.write_text(text)
    chunk = 256
    pieces = plan_pieces([path], "text", chunk)
    assert len(pieces) == -(-path.stat().st_size // chunk) and [p.last for p in pieces].count(True) == 1
    report = prepare_token_cache([path], ByteTokenizer(), tmp_path / "c", num_workers=2, chunk_bytes=chunk)
    assert report.tasks == len(pieces) and report.largest_read <= 2 * chunk  # never the whole file
    assert read_tokens(report.folder).astype(np.uint8).tobytes() == text.encode() + b"\0"
    # A line longer than a piece is cut at a character boundary: every piece decodes on its own.
    tokenize = PieceTokenizer(ByteTokenizer(), "text", np.dtype(np.uint16), chunk)
    assert all(r.error is None for r in tokenize(pieces))


def test_jsonl_errors_name_the_line_across_pieces(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": f"record {i} " * 5}) for i in range(300)]
    lines[217] = json.dumps({"content": "no text"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"a\.jsonl:218 has no field 'text' \(found \['content'\]\); set text_field"):
        prepare_token_cache([path], ByteTokenizer(), tmp_path / "c", num_workers=2, chunk_bytes=128)


def test_non_strict_build_drops_a_bad_big_file_already_partly_written(tmp_path):
    good = tmp_path / "a_good.txt"
    good.write_text(text_of(50, 1))
    bad = tmp_path / "b_bad.txt"  # valid for many pieces, then a Latin-1 byte
    bad.write_bytes(text_of(200, 2).encode() + "caf\xe9\n".encode("latin-1") + b"more\n")
    blank = tmp_path / "c_blank.txt"  # only whitespace, over several pieces
    blank.write_text(" \n" * 200)
    last = tmp_path / "d_last.txt"
    last.write_text("the end\n")
    sources = [good, bad, blank, last]
    report = prepare_token_cache(sources, ByteTokenizer(), tmp_path / "c", strict=False, num_workers=2, chunk_bytes=64)
    assert read_tokens(report.folder).astype(np.uint8).tobytes() == good.read_bytes() + b"\0" + b"the end\n\0"
    assert report.documents == 2
    offset = len(text_of(200, 2).encode()) + 3
    with pytest.raises(DataError, match=rf"b_bad\.txt is not UTF-8 text \(byte {offset}: invalid"):
        prepare_token_cache(sources, ByteTokenizer(), tmp_path / "strict", chunk_bytes=64)
    with pytest.raises(DataError, match=r"c_blank\.txt is empty; remove it from paths"):
        prepare_token_cache([blank], ByteTokenizer(), tmp_path / "strict", chunk_bytes=64)


# ---- atomic: an interrupted build never looks complete ------------------------------------------
@pytest.mark.parametrize("num_workers", [1, 2])
def test_interrupted_build_leaves_no_complete_looking_cache(corpus, tmp_path, num_workers):
    folder, documents = corpus
    sources = resolve_sources(str(folder))
    calls = []

    def ctrl_c_after_three_tasks(done, total, tokens):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_token_cache(sources, ByteTokenizer(), tmp_path / "c", num_workers=num_workers, chunk_bytes=64,
                            progress=ctrl_c_after_three_tasks)
    (cache,) = (tmp_path / "c").iterdir()
    assert sorted(p.name for p in cache.iterdir()) == [".lock"]  # no tokens.bin, no meta.json, no partial file
    data = TextDataModule(str(folder), cache_dir=str(tmp_path / "c"), max_unprepared_mb=0)
    assert not (data.cache_folder / "meta.json").exists()
    report = prepare_token_cache(sources, ByteTokenizer(), tmp_path / "c", num_workers=num_workers, chunk_bytes=64)
    assert report.built and report.documents == len(documents)


def test_a_killed_build_is_not_complete_and_its_partial_file_is_removed(corpus, tmp_path):
    folder, _ = corpus
    data = TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "c"))
    cache = data.cache_folder
    cache.mkdir(parents=True)
    # What a SIGKILL leaves: a partial token file of a dead process, even a renamed tokens.bin without meta.json.
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    partial = cache / f"tokens.bin.tmp-{socket.gethostname()}-{dead}"
    partial.write_bytes(b"\1" * 100)
    (cache / "tokens.bin").write_bytes(b"\1" * 100)
    assert not data.check_prepared()  # complete means meta.json, written last
    data.setup("fit")  # a small corpus: built here
    assert not partial.exists() and len(data.train_dataset) > 0
    assert read_tokens(cache)[:3].tolist() != [1, 1, 1]


def test_a_damaged_cache_is_refused_with_the_fix(corpus, tmp_path):
    folder, _ = corpus
    data = TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "c"))
    data.prepare(num_workers=1)
    with open(data.cache_folder / "tokens.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match=r"The token cache .* is damaged \(tokens\.bin is not \d+ bytes\); delete"):
        TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "c")).setup("fit")


def test_processes_building_one_cache_take_turns(corpus, tmp_path):
    folder, _ = corpus
    sources = resolve_sources(str(folder))
    first_started, second_waits = threading.Event(), threading.Event()
    reports, waits = {}, []

    def slow(done, total, tokens):
        first_started.set()
        second_waits.wait(timeout=30)

    def build(name, **kwargs):
        reports[name] = prepare_token_cache(sources, ByteTokenizer(), tmp_path / "c", chunk_bytes=256, **kwargs)

    first = threading.Thread(target=build, args=("first",), kwargs={"progress": slow})
    first.start()
    assert first_started.wait(timeout=30)

    def log(line):
        waits.append(line)
        second_waits.set()

    second = threading.Thread(target=build, args=("second",), kwargs={"log": log})
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert reports["first"].built and not reports["second"].built  # the second found the first's cache
    assert waits and "Waiting for another process that is building" in waits[0]


# ---- refused when training would tokenize a big corpus -------------------------------------------
def test_a_big_corpus_without_cache_is_refused_before_any_tokenizing(corpus, tmp_path, monkeypatch):
    folder, _ = corpus
    monkeypatch.setattr(sys, "argv", ["train.py"])
    forbid_tokenizing(monkeypatch)
    data = TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "c"), max_unprepared_mb=0.01)
    size_mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
    expected = (
        rf"The corpus \({len(list(folder.iterdir()))} files, {size_mb:.1f} MB\) has no token cache in .*c and is"
        rf" larger than max_unprepared_mb \(0\.01 MB\).*\n"
        rf"    lightning-2d prepare-data --data\.paths={folder} --data\.cache_dir={tmp_path / 'c'}\n"
        rf"or in Python:\n"
        rf"    TextDataModule\(paths='{folder}', cache_dir='{tmp_path / 'c'}'\)\.prepare\(\).*\n"
        rf".*raise max_unprepared_mb above {size_mb:.1f} or set it to null"
    )
    with pytest.raises(DataError, match=expected):
        data.prepare_data()  # rank 0 of each node, before the others wait
    with pytest.raises(DataError, match=expected):
        data.setup("fit")  # every rank
    assert not (tmp_path / "c").exists()  # nothing was written, nothing tokenized
    monkeypatch.undo()
    # The command it gives works: prepared, training starts without tokenizing.
    eval(prepare_python(data).split("#")[0], {"TextDataModule": TextDataModule})
    forbid_tokenizing(monkeypatch)
    data.setup("fit")
    assert len(data.train_dataset) > 0


def test_the_command_repeats_the_recipe_and_data_options_of_the_cli():
    data = TextDataModule()
    argv = ["/venv/bin/lightning-2d", "fit", "--config", "recipes/debug_cpu.yaml", "--trainer.max_steps=20",
            "--data.seq_len", "64", "--trainer.devices", "2", "--data.paths=/my corpus/*.txt", "-c=extra.yaml"]
    assert prepare_command(data, argv) == (
        "lightning-2d prepare-data --config recipes/debug_cpu.yaml --data.seq_len 64 '--data.paths=/my corpus/*.txt'"
        " -c=extra.yaml"
    )
    argv = ["/repo/lightning_2d/__main__.py", "validate", "--config=r.yaml"]
    assert prepare_command(data, argv) == "python -m lightning_2d prepare-data --config=r.yaml"
    assert prepare_command(data, ["script.py"]) == "lightning-2d prepare-data"
    assert prepare_python(data).startswith("TextDataModule().prepare()")
    lists = TextDataModule(["a/*.jsonl", "b/*.jsonl"], text_field="body", seq_len=7)
    assert prepare_command(lists, ["script.py"]) == (
        """lightning-2d prepare-data '--data.paths=["a/*.jsonl", "b/*.jsonl"]' --data.text_field=body"""
    )


def test_a_small_corpus_is_still_tokenized_when_training_starts(corpus, tmp_path):
    folder, _ = corpus
    data = TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "c"))  # default limit: 8 MB
    data.prepare_data()
    data.setup("fit")
    assert len(data.train_dataset) > 0
    unlimited = TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "d"), max_unprepared_mb=None)
    unlimited.setup("fit")
    assert unlimited.cache_folder.name == data.cache_folder.name


# ---- lightning-2d prepare-data ------------------------------------------------------------------------
def write_recipe(path, data: dict) -> None:
    recipe = {
        "seed_everything": 3,
        "trainer": {"accelerator": "gpu", "devices": 8, "max_steps": 5,  # a GPU recipe prepares on a CPU machine
                    "strategy": {"class_path": "lightning_2d.ModelParallel2DStrategy",
                                 "init_args": {"tensor_parallel_size": 2}}},
        "model": {"model": "debug"},
        "data": data,
    }
    path.write_text(yaml.safe_dump(recipe))


@pytest.mark.parametrize("form", ["init_args", "class_path"])
def test_cli_builds_the_cache_that_setup_uses(corpus, tmp_path, monkeypatch, capsys, form):
    folder, documents = corpus
    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    args = {"paths": str(folder), "seq_len": 16, "cache_dir": str(tmp_path / "c"), "max_unprepared_mb": 0.001}
    if form == "class_path":
        args = {"class_path": "lightning_2d.TextDataModule", "init_args": args}
    write_recipe(tmp_path / "recipe.yaml", args)
    report = prepare_main(["--config", str(tmp_path / "recipe.yaml"), "--num-workers", "2"])
    out = capsys.readouterr().out
    assert report.built and report.documents == len(documents) and report.num_workers == 2
    for line in ("Built: ", "  files      ", "  bytes      ", "  tokens     ", "  seconds    ", "  tokens/s   "):
        assert line in out
    assert f"  tokens     {report.tokens:,}" in out and f"{report.tokens_per_second:,.0f}" in out
    # Training: the same data section finds the cache, nothing is tokenized again.
    forbid_tokenizing(monkeypatch)
    data = TextDataModule(str(folder), seq_len=16, cache_dir=str(tmp_path / "c"), max_unprepared_mb=0.001)
    data.prepare_data()
    data.setup("fit")
    assert data.cache_folder == report.folder and len(data.train_dataset) > 0
    again = prepare_main(["--config", str(tmp_path / "recipe.yaml")])
    assert not again.built and "Already complete" in capsys.readouterr().out


def test_cli_takes_data_overrides_and_the_defaults_of_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    write_recipe(tmp_path / "recipe.yaml", {"paths": "/nowhere", "seq_len": 16})
    data, workers = parse_args(["--config", str(tmp_path / "recipe.yaml"), "--data.paths=/data/x.jsonl",
                                "--data.text_field=body", "--trainer.devices=2"])
    assert data.paths == "/data/x.jsonl" and data.text_field == "body" and data.seq_len == 16
    assert data.max_unprepared_mb == data_module.DEFAULT_MAX_UNPREPARED_MB
    assert data.tokenizer.fingerprint == "byte-utf8-v1"
    assert workers == len(os.sched_getaffinity(0))
    data, workers = parse_args(["--data.paths=/data", "--num-workers=3"])  # no recipe at all
    assert data.paths == "/data" and workers == 3
    with pytest.raises(DataError, match=r"--num-workers must be at least 1, got 0"):
        parse_args(["--num-workers=0"])
    write_recipe(tmp_path / "other.yaml", {"class_path": "lightning.pytorch.LightningDataModule", "init_args": {}})
    with pytest.raises(DataError, match=r"other\.yaml: data\.class_path is 'lightning\.pytorch\.LightningDataModule';"
                                        r" prepare-data builds the cache of a TextDataModule or a ChatDataModule"):
        parse_args(["--config", str(tmp_path / "other.yaml")])


# ---- tokenizers travel to spawned workers -------------------------------------------------------------
def test_tokenizers_pickle_with_their_content(hf_tokenizer, tmp_path):
    spm = pytest.importorskip("sentencepiece")
    train = tmp_path / "train.txt"
    train.write_text(text_of(300, 0))
    spm.SentencePieceTrainer.train(input=str(train), model_prefix=str(tmp_path / "sp"), vocab_size=36,
                                   character_coverage=1.0, minloglevel=2)
    texts = [text_of(5, 1), "hello world"]
    for tok in (hf_tokenizer, load_tokenizer(str(tmp_path / "sp.model")), ByteTokenizer()):
        copy = pickle.loads(pickle.dumps(tok))
        assert copy.encode_batch(texts) == tok.encode_batch(texts)
        assert (copy.vocab_size, copy.eos_id, copy.fingerprint) == (tok.vocab_size, tok.eos_id, tok.fingerprint)


RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_can_be_prepared(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    data, _ = parse_args(["--config", str(recipe), "--data.paths=/data/*.jsonl", "--data.tokenizer=byte"])
    expected = yaml.safe_load(recipe.read_text())["data"]
    expected = expected.get("init_args", expected)  # data: {class_path, init_args} (ChatDataModule) or its arguments
    assert data.paths == "/data/*.jsonl" and data.seq_len == expected["seq_len"]
    assert data.batch_size == expected["batch_size"]


def test_lightning_2d_prepare_data_is_the_console_command(corpus, tmp_path, monkeypatch, capsys):
    from lightning_2d.tools.cli import main as cli_main

    folder, documents = corpus
    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data", f"--data.paths={folder}",
                                      f"--data.cache_dir={tmp_path / 'c'}", "--num-workers=2"])
    cli_main()
    out = capsys.readouterr().out
    assert f"  documents  {len(documents):,}" in out and "  tokens/s   " in out
    assert TextDataModule(str(folder), cache_dir=str(tmp_path / "c"), max_unprepared_mb=0).check_prepared()
