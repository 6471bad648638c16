"""Preference data (``PreferenceDataModule``): rows → pairs in TRL's formats, the shared prompt, truncation, the
cache, and the windows' batch contract the preference training module reads (``sequence_ids``, ``position_ids``,
``labels``, ``pairs``, ``step_pairs``). The byte-level ChatML tokenizer throughout: one token per byte, so the
expected tokens are written from the text."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch

from lightning_2d import PreferenceDataModule
from lightning_2d.checkpoint.hf.tokenizer import recorded_stop_ids
from lightning_2d.data import DataError
from lightning_2d.data.chat import ChatEncoder, ChatFormatError, ChatTemplate
from lightning_2d.data.chat.builtin import byte_chat_folder
from lightning_2d.data.preference import (
    PreferenceEncoder,
    PreferenceEncodingError,
    PreferenceFormatError,
    PreferencePair,
    UnpairedExample,
    is_unpaired_row,
    stdlib_preference_rows,
    stdlib_unpaired_rows,
    to_example,
    to_pair,
    unpaired_rows,
)
from lightning_2d.data.tokenizers import load_tokenizer

IGNORE = -100


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pair_rows(n: int) -> list[dict]:
    """Explicit pairs of different lengths: the chosen answer right, the rejected one short and wrong."""
    return [{"prompt": f"Q{i}: what is {i} + {i}?", "chosen": f"It is {2 * i}." + " Sure." * (i % 5),
             "rejected": "No idea" + "!" * (i % 3)} for i in range(n)]


def module(tmp_path, rows, **kwargs) -> PreferenceDataModule:
    """A data module of ``rows`` written to ``d.jsonl`` (``None``: the file as it is; a written file is another
    cache)."""
    defaults = dict(seq_len=256, batch_size=1, val_fraction=0, shuffle=False, cache_dir=str(tmp_path / "cache"))
    path = write_rows(tmp_path / "d.jsonl", rows) if rows is not None else str(tmp_path / "d.jsonl")
    return PreferenceDataModule(path, **{**defaults, **kwargs})


def byte_encoder(tmp_path, folder=None) -> ChatEncoder:
    folder = folder or byte_chat_folder(tmp_path)
    return ChatEncoder(load_tokenizer(str(folder)), ChatTemplate.from_folder(folder), "completion")


def text(ids) -> str:
    """Byte ids as text, the ChatML tokens (256-258) written out."""
    names = {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>"}
    return "".join(names.get(int(i), chr(int(i))) for i in ids)


# ---- formats ------------------------------------------------------------------------------------------------------
def test_explicit_rows_of_strings_and_of_message_lists_are_pairs():
    pair = to_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
    assert pair.prompt == ({"role": "user", "content": "2+2?"},)
    assert pair.chosen == ({"role": "assistant", "content": "4"},)
    assert pair.rejected == ({"role": "assistant", "content": "5"},)
    chosen, rejected = pair.conversations()
    assert chosen.messages == pair.prompt + pair.chosen and chosen.completion_start == 1
    assert rejected.messages == pair.prompt + pair.rejected and rejected.completion_start == 1
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    pair = to_pair({"prompt": prompt, "chosen": [{"role": "assistant", "content": "Paris."}],
                    "rejected": [{"role": "assistant", "content": "Lyon."}]}, format="explicit")
    assert pair.prompt == tuple(prompt) and pair.chosen[0]["content"] == "Paris."
    assert pair.conversations()[1].completion_start == 2


def test_an_implicit_prompt_is_the_conversations_longest_common_prefix():
    start = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "2+2?"}]
    pair = to_pair({"chosen": start + [{"role": "assistant", "content": "4"}],
                    "rejected": start + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "?"}]})
    assert pair.prompt == tuple(start)
    assert pair.chosen == ({"role": "assistant", "content": "4"},)
    assert [m["content"] for m in pair.rejected] == ["5", "?"]
    assert pair.conversations()[0].completion_start == 3


def test_fields_rename_and_a_forced_format_reads_only_its_fields():
    fields = {"prompt": "question", "chosen": "good", "rejected": "bad", "content": "text"}
    pair = to_pair({"question": "2+2?", "good": [{"role": "assistant", "text": "4"}], "bad": "5"}, fields=fields)
    assert [pair.prompt[0]["content"], pair.chosen[0]["content"], pair.rejected[0]["content"]] == ["2+2?", "4", "5"]
    with pytest.raises(ChatFormatError, match=r"r\.jsonl:4 has no field 'prompt'"):
        to_pair({"chosen": "4", "rejected": "5"}, format="explicit", where="r.jsonl:4")
    with pytest.raises(PreferenceFormatError, match=r"fields renames \['answer'\], which are not preference fields"):
        PreferenceDataModule(fields={"answer": "x"})
    with pytest.raises(PreferenceFormatError, match=r"format must be one of 'auto', 'explicit', 'implicit'"):
        PreferenceDataModule(format="messages")


def test_unpaired_rows_are_examples_with_their_label_and_auto_tells_them_from_pairs():
    example = to_example({"prompt": "2+2?", "completion": "4", "label": True})
    assert isinstance(example, UnpairedExample) and example.desirable
    assert example.prompt == ({"role": "user", "content": "2+2?"},)
    assert example.completion == ({"role": "assistant", "content": "4"},)
    conversation = example.conversation()
    assert conversation.messages == example.prompt + example.completion and conversation.completion_start == 1
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    example = to_example({"prompt": prompt, "completion": [{"role": "assistant", "content": "Lyon."}], "label": 0},
                         format="unpaired")
    assert not example.desirable and example.conversation().completion_start == 2
    renamed = to_example({"q": "Hi", "a": "Hello", "good": False},
                         fields={"prompt": "q", "completion": "a", "label": "good"})
    assert isinstance(renamed, UnpairedExample) and not renamed.desirable
    assert isinstance(to_example({"prompt": "2+2?", "chosen": "4", "rejected": "5"}), PreferencePair)
    assert is_unpaired_row({"prompt": "a", "completion": "b", "label": True})
    assert not is_unpaired_row({"prompt": "a", "chosen": "b", "rejected": "c", "completion": "d", "label": True})
    # TRL's unpairing of a paired data set: the chosen completions desirable, then the rejected ones.
    assert unpaired_rows(pair_rows(2)) == [
        {"prompt": "Q0: what is 0 + 0?", "completion": "It is 0.", "label": True},
        {"prompt": "Q1: what is 1 + 1?", "completion": "It is 2. Sure.", "label": True},
        {"prompt": "Q0: what is 0 + 0?", "completion": "No idea", "label": False},
        {"prompt": "Q1: what is 1 + 1?", "completion": "No idea!", "label": False}]


def test_an_unpaired_row_read_as_a_pair_and_a_pair_read_as_unpaired_are_refused_naming_the_format():
    with pytest.raises(PreferenceFormatError, match=r"d\.jsonl:2 is an unpaired row \('prompt', 'completion', 'label':"
                                                    r" TRL's KTO format\), not a pair of format='explicit'; read it as"
                                                    r" an unpaired example \(format='unpaired' or 'auto'"):
        to_pair({"prompt": "2+2?", "completion": "4", "label": True}, format="explicit", where="d.jsonl:2")
    with pytest.raises(PreferenceFormatError, match=r"d\.jsonl:3 is a pair \('chosen', 'rejected'\), but"
                                                    r" format='unpaired' reads one 'completion' and its 'label'"):
        to_example({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, format="unpaired", where="d.jsonl:3")
    with pytest.raises(PreferenceFormatError, match=r"format must be one of 'auto', 'explicit', 'implicit',"
                                                    r" 'unpaired'"):
        PreferenceDataModule(format="kto")


def test_every_bad_row_is_named_by_file_and_line_at_once(tmp_path):
    user = {"role": "user", "content": "Hi"}
    rows = [
        pair_rows(1)[0],
        {"chosen": [user, {"role": "assistant", "content": "A"}], "rejected": [{"role": "user", "content": "Yo"},
                                                                               {"role": "assistant", "content": "B"}]},
        {"chosen": [user, {"role": "assistant", "content": "A"}], "rejected": [user, {"role": "assistant",
                                                                                      "content": "A"}]},
        {"chosen": [user, {"role": "assistant", "content": "A"}, {"role": "user", "content": "x"}],
         "rejected": [user, {"role": "assistant", "content": "A"}, {"role": "user", "content": "y"}]},
        {"chosen": "A", "rejected": "B"},
        {"prompt": "Hi", "completion": "A", "rejected": "B"},
        {"prompt": "Hi", "chosen": [user], "rejected": "B"},
    ]
    data = module(tmp_path, rows)
    with pytest.raises(DataError) as caught:
        data.check_prepared()  # what the CLI calls before launching any process
    message = str(caught.value)
    path = str(tmp_path / "d.jsonl")
    assert "6 bad row(s) in the preference data (nothing was cached)" in message
    assert f"{path}:2: chosen and rejected share no first message, so there is no prompt" in message
    assert f"{path}:3: chosen and rejected are the same conversation" in message
    assert f"{path}:4: chosen and rejected first differ at message 2 (user / user), not at an assistant turn" in message
    assert f"{path}:5: chosen is a string and the row has no 'prompt'" in message
    assert f"{path}:6 has no 'chosen'" in message
    assert f"{path}:7: chosen starts with a user message; a completion starts with the assistant's answer" in message
    assert f"{path}:1" not in message and "give the row an explicit 'prompt'" in message
    assert not list((tmp_path / "cache").glob("*/meta.json"))


def test_every_bad_unpaired_row_is_named_by_file_and_line_and_a_mix_of_kinds_is_refused(tmp_path):
    rows = [
        {"prompt": "Hi", "completion": "A", "label": True},
        {"prompt": "Hi", "completion": "A", "label": "yes"},
        {"prompt": "Hi", "completion": "A"},
        {"completion": "A", "label": False},
        {"prompt": "Hi", "completion": [{"role": "user", "content": "A"}], "label": False},
        {"prompt": "Hi", "chosen": "A", "rejected": "B"},
        {"prompt": "Hi", "completion": "A", "label": 2},
    ]
    data = module(tmp_path, rows, format="unpaired")
    with pytest.raises(DataError) as caught:
        data.check_prepared()
    message = str(caught.value)
    path = str(tmp_path / "d.jsonl")
    assert "6 bad row(s) in the preference data (nothing was cached)" in message
    assert f"{path}:2: label is 'yes'; an unpaired example's label is true (the completion is desirable) or false" \
        in message
    assert f"{path}:3 has no field 'label'" in message and f"{path}:4 has no field 'prompt'" in message
    assert f"{path}:5: completion starts with a user message; a completion starts with the assistant's answer" in message
    assert f"{path}:6 is a pair ('chosen', 'rejected'), but format='unpaired' reads one 'completion'" in message
    assert f"{path}:7: label is 2" in message and f"{path}:1" not in message
    # format="auto" reads each row as what it is; a data set of both kinds is refused before training.
    mixed = module(tmp_path, [rows[0], pair_rows(1)[0]] * 2)
    with pytest.raises(DataError, match=r"mixes 2 pair\(s\) \(chosen and rejected\) and 2 unpaired example\(s\)"
                                        r" \(completion and label\); a data set is one or the other"):
        mixed.check_prepared()
    with pytest.raises(DataError, match=r"pack=False puts one unpaired example in each window, and KTO's KL reference"
                                        r" point pairs each example's prompt with another example's completion"):
        PreferenceDataModule(format="unpaired", pack=False)


# ---- encoding: the shared prompt, truncation -------------------------------------------------------------------
def merging_folder(tmp_path):
    """The byte ChatML folder with one BPE merge, two newlines into one token: a completion starting with a newline
    joins the prompt's last newline (the assistant header's) into a token of its own."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from lightning_2d.data.chat.builtin import BYTE_CHAT_SPECIAL
    from lightning_2d.models.llama.tokenizer import bytes_to_unicode

    folder = tmp_path / "merging"
    shutil.copytree(byte_chat_folder(tmp_path), folder)
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)} | {chars[10] * 2: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(chars[10], chars[10])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_CHAT_SPECIAL])
    (folder / "tokenizer.json").write_text(tok.to_str())
    assert tok.encode("a\n\nb").ids == [97, 256, 98]
    return folder


def test_a_prompt_tokenized_differently_before_the_two_completions_is_refused(tmp_path):
    folder = merging_folder(tmp_path)
    pairs = PreferenceEncoder(byte_encoder(tmp_path, folder))
    same = pairs.encode(to_pair({"prompt": "Hi", "chosen": "Yes", "rejected": "No"}))
    prompt = load_tokenizer(str(folder)).decode_keep_special(same.chosen.ids[: same.prompt_tokens].tolist())
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(PreferenceEncodingError, match=r"d\.jsonl:3: the prompt is 20 token\(s\) before the chosen"
                                                      r" completion and 21 before the rejected one"):
        pairs.encode(to_pair({"prompt": "Hi", "chosen": "\nYes", "rejected": "No"}), "d.jsonl:3")


def test_truncation_keeps_the_prompts_end_and_cuts_as_the_mode_says(tmp_path):
    encoder = byte_encoder(tmp_path)
    pair = to_pair({"prompt": "P" * 40, "chosen": "A" * 20, "rejected": "B" * 10})
    full = PreferenceEncoder(encoder).encode(pair)
    prompt, chosen, rejected = full.prompt_tokens, full.chosen.ids, full.rejected.ids
    assert prompt == 59 and len(chosen) == prompt + 22 and len(rejected) == prompt + 12  # + end of turn and "\n"

    def encode(**kwargs):
        return PreferenceEncoder(encoder, **kwargs).encode(pair)

    short = encode(max_prompt_length=30)  # the prompt's last 30 tokens
    assert short.chosen.ids.tolist() == chosen[prompt - 30 :].tolist()
    assert short.rejected.ids.tolist() == rejected[prompt - 30 :].tolist()
    assert (short.prompt_tokens, short.prompt_truncated, short.completions_truncated) == (30, True, 0)
    # keep_end: the prompt's start goes first, the same tokens from both (the longer sequence decides).
    end = encode(max_length=50)
    assert len(end.chosen.ids) == 50 and end.chosen.ids.tolist() == chosen[31:].tolist()
    assert end.rejected.ids.tolist() == rejected[31:].tolist()
    assert (end.prompt_tokens, end.prompt_truncated, end.completions_truncated) == (28, True, 0)
    # ... then a completion's end, once no prompt is left.
    none_left = encode(max_length=20)
    assert none_left.chosen.ids.tolist() == chosen[prompt : prompt + 20].tolist()
    assert none_left.rejected.ids.tolist() == rejected[prompt:].tolist()
    assert (none_left.prompt_tokens, none_left.completions_truncated) == (0, 1) and none_left.trained
    # keep_start: the prompt stays, each completion's end is cut.
    start = encode(max_length=65, truncation_mode="keep_start")
    assert text(start.chosen.ids[prompt:]) == "A" * 6 and text(start.rejected.ids[prompt:]) == "B" * 6
    assert (start.prompt_truncated, start.completions_truncated) == (False, 2)
    assert not encode(max_length=59, truncation_mode="keep_start").trained  # no completion token left: dropped
    with pytest.raises(DataError, match=r"max_length must be a positive integer or None \(no limit\), got 0\n.*"
                                        r"truncation_mode must be one of 'keep_end', 'keep_start', got 'left'"):
        PreferenceDataModule(max_length=0, truncation_mode="left")


def test_truncated_and_dropped_pairs_are_counted_in_the_packing_report(tmp_path):
    rows = [{"prompt": "P" * 40, "chosen": "A" * 20, "rejected": "B" * 10},  # prompt cut twice (both limits)
            {"prompt": "Q", "chosen": "A", "rejected": "B"},  # fits
            {"prompt": "P" * 80, "chosen": "A", "rejected": "B"},  # prompt cut
            {"prompt": "Q", "chosen": "A" * 60, "rejected": "B"}]  # no prompt left, then the chosen one cut
    data = module(tmp_path, rows, max_prompt_length=40, max_length=50)
    data.setup("fit")
    report = data.packing
    assert (report.pairs, report.prompts_truncated, report.completions_truncated, report.no_target) == (4, 3, 1, 0)
    assert "3 prompt(s), 1 completion(s) of the data set; 0 pair(s) dropped without a trained token" in \
        "\n".join(report.lines())
    data = module(tmp_path, rows, max_length=59, truncation_mode="keep_start", cache_dir=str(tmp_path / "c2"))
    data.setup("fit")
    assert (data.packing.pairs, data.packing.no_target) == (2, 2)  # the long prompts leave no completion


# ---- the cache -----------------------------------------------------------------------------------------------------
def test_the_cache_holds_two_conversations_a_pair_built_once_and_keyed_by_the_truncation(tmp_path):
    rows = pair_rows(5)
    data = module(tmp_path, rows)
    report = data.prepare(num_workers=1)
    assert report.built and report.conversations == 10 and report.counts["pairs"] == 5
    assert not data.prepare(num_workers=1).built  # complete: not encoded again
    folder = data.cache_folder
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["settings"]["kind"] == "preference" and meta["counts"]["pairs"] == 5
    offsets = np.fromfile(folder / "offsets.bin", dtype=np.int64)
    tokens = np.fromfile(folder / "tokens.bin", dtype=np.uint16)
    rows_bin = np.fromfile(folder / "rows.bin", dtype=np.int64).reshape(-1, 2)
    assert rows_bin[:, 1].tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # each sequence's JSONL line
    for k, row in enumerate(rows):
        chosen, rejected = (text(tokens[offsets[c] : offsets[c + 1]]) for c in (2 * k, 2 * k + 1))
        assert chosen.endswith(f"assistant\n{row['chosen']}<|im_end|>\n")
        assert rejected.endswith(f"assistant\n{row['rejected']}<|im_end|>\n")
    assert module(tmp_path, None, max_length=100).cache_folder != folder
    assert module(tmp_path, None, max_prompt_length=100).cache_folder != folder
    assert module(tmp_path, None, truncation_mode="keep_start").cache_folder != folder
    assert module(tmp_path, None, seq_len=128, pack=False).cache_folder == folder  # packing is not the cache's


# ---- windows and batches: the contract -----------------------------------------------------------------------------
def expected_window(data, rows, pairs: list[int]) -> dict[str, list[int]]:
    """The window of ``pairs`` (cache pair numbers, in window order) written from the rows, encoded anew."""
    parts = []
    for p, pair in enumerate(pairs):
        encoded = data.pair_encoder.encode(to_pair(rows[pair]))
        for side, sequence in enumerate((encoded.chosen, encoded.rejected)):
            parts.append((2 * p + side, sequence.ids.tolist(), sequence.trained.tolist()))
    return window_of(data, parts)


def window_of(data, parts: list[tuple[int, list[int], list[int]]]) -> dict[str, list[int]]:
    """A window written by hand: each ``(sequence id, tokens, trained mask)`` one after another (its inputs, the next
    trained token as label, positions from 0), then padding."""
    ids, labels, positions, sequences = [], [], [], []
    for slot, tokens, mask in parts:
        ids += tokens[:-1]
        labels += [tokens[t + 1] if mask[t + 1] else IGNORE for t in range(len(tokens) - 1)]
        positions += list(range(len(tokens) - 1))
        sequences += [slot] * (len(tokens) - 1)
    pad = data.seq_len - len(ids)
    return {"input_ids": ids + [data.pad_id] * pad, "labels": labels + [IGNORE] * pad,
            "position_ids": positions + list(range(pad)), "sequence_ids": sequences + [-1] * pad}


def test_a_packed_window_holds_whole_pairs_chosen_before_rejected(tmp_path):
    rows = pair_rows(3)
    data = module(tmp_path, rows, seq_len=320)
    data.setup("fit")
    assert len(data.train_dataset) == 1 and data.document_mask
    sample = data.train_dataset[0]
    pairs = data.train_dataset.conversations[data.train_dataset.windows.window(0)].tolist()
    assert sorted(pairs) == [0, 1, 2] and pairs != [0, 1, 2]  # longest first: the window's order, not the rows'
    expected = expected_window(data, rows, pairs)
    for key, values in expected.items():
        assert sample[key].dtype == torch.long and sample[key].shape == (320,)
        assert sample[key].tolist() == values, key
    assert sample["pairs"].shape == () and sample["pairs"].item() == 3
    # What the labels of each sequence train: its completion and end-of-turn token, nothing of the prompt.
    seq, labels = sample["sequence_ids"], sample["labels"]
    for p, pair in enumerate(pairs):
        for side, key in ((0, "chosen"), (1, "rejected")):
            trained = labels[(seq == 2 * p + side) & (labels != IGNORE)]
            assert text(trained) == rows[pair][key] + "<|im_end|>"
    starts = torch.nonzero(sample["position_ids"] == 0).flatten().tolist()
    changes = torch.nonzero(torch.diff(seq, prepend=torch.tensor([-2])) != 0).flatten().tolist()
    assert starts == changes  # positions restart exactly where a sequence (or the padding) starts
    assert seq.unique().tolist() == [-1, 0, 1, 2, 3, 4, 5]


def test_an_unpacked_window_holds_one_pair_and_padding(tmp_path):
    rows = pair_rows(2)
    data = module(tmp_path, rows, seq_len=128, pack=False)
    data.setup("fit")
    assert len(data.train_dataset) == 2 and data.document_mask  # chosen and rejected: documents, packed or not
    for w in range(2):
        sample = data.train_dataset[w]
        (pair,) = data.train_dataset.conversations[data.train_dataset.windows.window(w)].tolist()
        expected = expected_window(data, rows, [pair])
        assert {key: sample[key].tolist() for key in expected} == expected
        assert sample["pairs"].item() == 1 and sample["sequence_ids"][-1].item() == -1


def test_batches_count_their_pairs_and_their_steps_pairs(tmp_path):
    data = module(tmp_path, pair_rows(40), seq_len=160, batch_size=2, shuffle=True)
    data.set_data_parallel(2, 1, accumulate_grad_batches=3)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) >= 4
    counts = []
    for batch in batches:
        assert batch["pairs"].shape == (2,) and batch["pairs"].dtype == torch.long
        in_window = [int((s[s >= 0] // 2).unique().numel()) for s in batch["sequence_ids"]]
        assert batch["pairs"].tolist() == in_window  # pairs: the window's pair count
        counts.append(sum(in_window))
        assert "step_tokens" not in batch and batch["step_pairs"].dtype == torch.float32
    for i, batch in enumerate(batches):
        step = range(i // 3 * 3, min(i // 3 * 3 + 3, len(batches)))  # the optimizer step's batches on this replica
        assert batch["step_pairs"].shape == () and batch["step_pairs"].item() == sum(counts[j] for j in step)


def test_a_pair_is_never_split_across_windows(tmp_path):
    rows = pair_rows(30)
    data = module(tmp_path, rows, seq_len=160)
    data.setup("fit")
    dataset, seen = data.train_dataset, []
    assert len(dataset) > 5 and data.packing.dropped == 0
    for w in range(len(dataset)):
        sample = dataset[w]
        pairs = dataset.conversations[dataset.windows.window(w)].tolist()
        seq = sample["sequence_ids"]
        for p, pair in enumerate(pairs):  # both sequences of each of its pairs, whole, in this window
            encoded = data.pair_encoder.encode(to_pair(rows[pair]))
            assert int((seq == 2 * p).sum()) == len(encoded.chosen.ids) - 1
            assert int((seq == 2 * p + 1).sum()) == len(encoded.rejected.ids) - 1
        seen += pairs
    assert sorted(seen) == list(range(30))


def test_a_pair_longer_than_the_window_is_dropped_and_counted_or_named(tmp_path):
    rows = pair_rows(4) + [{"prompt": "long", "chosen": "A" * 60, "rejected": "B" * 60}]
    data = module(tmp_path, rows, seq_len=120)
    data.setup("fit")
    assert data.packing.pairs == 4 and data.packing.dropped == 1
    assert 4 not in data.train_dataset.conversations.tolist()
    assert "1 pair(s) dropped as longer than the window" in "\n".join(data.packing.lines())
    data = module(tmp_path, None, seq_len=120, overflow="error")
    with pytest.raises(DataError, match=r"1 pair\(s\) take more than seq_len \(120\) positions .*d\.jsonl:5 \(\d+"
                                        r" positions\); raise seq_len, shorten the pairs with max_length"):
        data.check_prepared()
    with pytest.raises(DataError, match=r"overflow must be one of 'drop', 'error', got 'truncate' \(a pair is"
                                        r" shortened by max_length"):
        PreferenceDataModule(overflow="truncate")


def test_validation_holds_out_pairs_and_checkpoints_keep_the_stop_ids(tmp_path):
    data = module(tmp_path, pair_rows(20), val_fraction=0.2)
    data.setup("fit")
    train, val = data.train_dataset.conversations.tolist(), data.val_dataset.conversations.tolist()
    assert len(val) == 4 and sorted(train + val) == list(range(20))
    again = module(tmp_path, pair_rows(20), val_fraction=0.2)
    again.setup("fit")
    assert again.val_dataset.conversations.tolist() == val  # seeded
    assert "step_pairs" not in next(iter(data.val_dataloader()))
    state = {type(data).__name__: data.state_dict()}
    assert recorded_stop_ids(state) == [258]  # what export writes as generation_config's stop ids


# ---- unpaired examples: windows with their KL sequences -----------------------------------------------------------
def example_rows(n: int) -> list[dict]:
    """Unpaired examples of different lengths, every prompt once: the even ones desirable (the right answer), the odd
    ones not."""
    return [{"prompt": f"Q{i}: what is {i} + {i}?", "label": i % 2 == 0,
             "completion": f"It is {2 * i}." + " Sure." * (i % 5) if i % 2 == 0 else "No idea" + "!" * (i % 3)}
            for i in range(n)]


def expected_unpaired_window(data, rows, examples: list[int]) -> dict[str, list]:
    """The window of ``examples`` (row numbers, in the data set's order) written from the rows, encoded anew: each
    example, then its KL sequence (its prompt and the previous example's completion, the first the last's)."""
    encoded = [data.pair_encoder.encode_example(to_example(rows[e])) for e in examples]
    windowed = []
    for k, example in enumerate(encoded):
        x, trained, p = example.sequence.ids.tolist(), example.sequence.trained.tolist(), example.prompt_tokens
        parts = [(x, trained)]
        if len(encoded) > 1:
            before = encoded[k - 1]
            q = before.prompt_tokens
            parts.append((x[:p] + before.sequence.ids[q:].tolist(), [0] * p + before.sequence.trained[q:].tolist()))
        windowed += [(2 * k + side, tokens, mask) for side, (tokens, mask) in enumerate(parts)]
    return window_of(data, windowed)


def test_a_window_of_unpaired_examples_holds_each_with_its_kl_sequence_in_the_data_sets_order(tmp_path):
    rows = example_rows(4)
    data = module(tmp_path, rows, seq_len=400)
    data.setup("fit")
    assert data.preference_units == "examples" and len(data.train_dataset) == 1 and data.document_mask
    sample = data.train_dataset[0]
    expected = expected_unpaired_window(data, rows, [0, 1, 2, 3])  # rows' order, whatever the packing's
    for key, values in expected.items():
        assert sample[key].dtype == torch.long and sample[key].shape == (400,)
        assert sample[key].tolist() == values, key
    assert sample["examples"].shape == () and sample["examples"].item() == 4
    assert sample["desirable"].shape == (200,) and sample["desirable"].tolist() == [True, False, True, False] + \
        [False] * 196
    # What each sequence scores: an example its completion; its KL sequence the previous example's, after its prompt.
    seq, labels, inputs = sample["sequence_ids"], sample["labels"], sample["input_ids"]
    for k in range(4):
        before = rows[k - 1]["completion"]
        assert text(labels[(seq == 2 * k) & (labels != IGNORE)]) == rows[k]["completion"] + "<|im_end|>"
        assert text(labels[(seq == 2 * k + 1) & (labels != IGNORE)]) == before + "<|im_end|>"
        assert text(inputs[seq == 2 * k + 1]) == (f"<|im_start|>user\n{rows[k]['prompt']}<|im_end|>\n"
                                                   f"<|im_start|>assistant\n{before}<|im_end|>")
    report = data.packing
    assert (report.examples, report.desirable, report.alone) == (4, 2, 0)
    assert "4 examples (2 desirable, 2 undesirable), 4 KL sequences" in "\n".join(report.lines())


def test_a_kl_sequence_is_cut_by_max_length_as_an_example_is(tmp_path):
    rows = [{"prompt": "P" * 40, "completion": "a", "label": True},
            {"prompt": "Q", "completion": "B" * 30, "label": False}]
    for mode, cut in (("keep_start", slice(None, 60)), ("keep_end", slice(-60, None))):
        data = module(tmp_path, rows, seq_len=400, max_length=60, truncation_mode=mode,
                      cache_dir=str(tmp_path / mode))
        data.setup("fit")
        sample = data.train_dataset[0]
        seq, inputs = sample["sequence_ids"], sample["input_ids"]
        first, second = (data.pair_encoder.encode_example(to_example(r)) for r in rows)
        p, q = first.prompt_tokens, second.prompt_tokens
        whole = first.sequence.ids[:p].tolist() + second.sequence.ids[q:].tolist()  # the prompt left, 32 tokens
        mask = [0] * p + second.sequence.trained[q:].tolist()
        tokens, mask = whole[cut], mask[cut]
        assert len(whole) > 80 and inputs[seq == 1].tolist() == tokens[:-1], mode
        assert sample["labels"][seq == 1].tolist() == [t if m else IGNORE for t, m in zip(tokens[1:], mask[1:])]


def test_an_example_alone_in_its_window_has_no_kl_sequence_and_is_counted(tmp_path):
    rows = example_rows(3) + [{"prompt": "long", "completion": "A" * 80, "label": True}]
    data = module(tmp_path, rows, seq_len=200)
    data.setup("fit")
    alone = [w for w in range(len(data.train_dataset)) if data.train_dataset[w]["examples"].item() == 1]
    assert len(alone) == 1 and data.packing.alone == 1
    sample = data.train_dataset[alone[0]]
    assert sample["sequence_ids"].unique().tolist() == [-1, 0] and sample["desirable"][0].item()
    assert "1 example(s) alone in a window: no KL sequence" in "\n".join(data.packing.lines())
    data = module(tmp_path, None, seq_len=150, overflow="error")
    with pytest.raises(DataError, match=r"1 example\(s\) take more than seq_len \(150\) positions with their KL"
                                        r" sequence \(twice an example's positions.*d\.jsonl:4 \(\d+ positions\)"):
        data.check_prepared()


def test_batches_count_their_examples_and_their_steps_examples(tmp_path):
    data = module(tmp_path, example_rows(40), seq_len=160, batch_size=2, shuffle=True)
    data.set_data_parallel(2, 1, accumulate_grad_batches=3)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) >= 4
    counts = []
    for batch in batches:
        assert batch["examples"].shape == (2,) and batch["desirable"].shape == (2, 80)
        in_window = [int((s[s >= 0] // 2).unique().numel()) for s in batch["sequence_ids"]]
        assert batch["examples"].tolist() == in_window
        counts.append(sum(in_window))
        assert "step_pairs" not in batch and batch["step_examples"].dtype == torch.float32
    for i, batch in enumerate(batches):
        step = range(i // 3 * 3, min(i // 3 * 3 + 3, len(batches)))
        assert batch["step_examples"].item() == sum(counts[j] for j in step)


def test_the_rows_kind_is_known_before_training_from_the_format_the_first_row_or_the_cache(tmp_path):
    assert PreferenceDataModule(cache_dir=str(tmp_path)).preference_units == "pairs"
    assert PreferenceDataModule(format="unpaired", cache_dir=str(tmp_path)).preference_units == "examples"
    unpaired = module(tmp_path, example_rows(4))
    assert unpaired.preference_units == "examples" and not list((tmp_path / "cache").glob("*/meta.json"))
    (tmp_path / "p").mkdir()
    assert module(tmp_path / "p", pair_rows(4)).preference_units == "pairs"
    assert module(tmp_path, example_rows(4), format="explicit").preference_units == "pairs"  # as the format says


# ---- built-in data and prepare-data --------------------------------------------------------------------------------
def test_the_built_in_pairs_need_no_download(tmp_path):
    rows = stdlib_preference_rows()
    assert len(rows) > 2500 and rows == stdlib_preference_rows()  # deterministic
    assert all(r["chosen"] != r["rejected"] and r["prompt"].startswith("What does the") for r in rows)
    name = rows[0]["prompt"].split("`")[1]
    assert name in rows[0]["rejected"] and name not in rows[0]["chosen"]  # evasive: names it, says nothing
    data = PreferenceDataModule(seq_len=512, batch_size=2, val_fraction=0.01, cache_dir=str(tmp_path))
    assert data.hparams["tokenizer"] == str(tmp_path / "byte-chatml-v1") and data.vocab_size == 259
    data.setup("fit")
    assert data.packing.pairs > 2500 and data.sources[0].parent == tmp_path
    first = [json.loads(line) for line in data.sources[0].read_text().splitlines()[:3]]
    assert first == rows[:3]
    # KTO's: the same pairs unpaired, as TRL unpairs them (each answer desirable, then each evasive one not).
    unpaired = PreferenceDataModule(format="unpaired", cache_dir=str(tmp_path))
    lines = unpaired.sources[0].read_text().splitlines()
    assert unpaired.sources[0] != data.sources[0] and len(lines) == 2 * len(rows)
    assert [json.loads(lines[i]) for i in (0, len(rows))] == [
        {"prompt": rows[0]["prompt"], "completion": rows[0]["chosen"], "label": True},
        {"prompt": rows[0]["prompt"], "completion": rows[0]["rejected"], "label": False}]
    assert stdlib_unpaired_rows() == unpaired_rows(rows)


def test_prepare_data_previews_a_pair_and_builds_a_preference_recipe(tmp_path, monkeypatch, capsys):
    import yaml

    from lightning_2d.tools.prepare import main as prepare_main

    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"class_path": "lightning_2d.PreferenceDataModule", "init_args": {
        "paths": write_rows(tmp_path / "d.jsonl", pair_rows(12)), "seq_len": 128, "cache_dir": str(tmp_path / "c")}}}))
    assert prepare_main(["--config", str(recipe), "--preview", "1"]) is None
    out = capsys.readouterr().out
    assert "d.jsonl:1: prompt 37 tokens; chosen 10 tokens, 9 trained; rejected 9 tokens, 8 trained" in out
    assert "prompt:   <|im_start|>user\nQ0: what is 0 + 0?<|im_end|>\n<|im_start|>assistant\n\n" in out
    assert "chosen:   [[It is 0.<|im_end|>]]\n" in out and "rejected: [[No idea<|im_end|>]]\n" in out
    assert "12 pairs" in out and "nothing written" in out
    assert not list((tmp_path / "c").glob("*/meta.json"))
    report = prepare_main(["--config", str(recipe), "--processes", "2"])
    out = capsys.readouterr().out
    assert report.built and report.counts["pairs"] == 12 and report.conversations == 24
    assert "pairs          12" in out and "11 pairs (22 sequences)" in out and "truncated      0 prompt(s)" in out


def test_prepare_data_previews_unpaired_examples_with_their_labels(tmp_path, monkeypatch, capsys):
    import yaml

    from lightning_2d.tools.prepare import main as prepare_main

    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    recipe = tmp_path / "kto.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"class_path": "lightning_2d.PreferenceDataModule", "init_args": {
        "paths": write_rows(tmp_path / "d.jsonl", example_rows(12)), "seq_len": 256,
        "cache_dir": str(tmp_path / "c")}}}))
    assert prepare_main(["--config", str(recipe), "--preview", "2"]) is None
    out = capsys.readouterr().out
    assert "d.jsonl:1: desirable; prompt 37 tokens; completion 10 tokens, 9 trained" in out
    assert "d.jsonl:2: undesirable; prompt 37 tokens; completion 10 tokens, 9 trained" in out
    assert "completion: [[No idea!<|im_end|>]]\n" in out and "d.jsonl:3" not in out
    assert "---- 12 examples (6 desirable)" in out and "nothing written" in out
    report = prepare_main(["--config", str(recipe), "--processes", "1"])
    out = capsys.readouterr().out
    assert report.counts["examples"] == 12 and report.conversations == 12
    assert "examples       12 (6 desirable)" in out and "11 examples (5 desirable, 6 undesirable)" in out
