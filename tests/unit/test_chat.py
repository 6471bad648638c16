"""Instruction fine-tuning data (``ChatDataModule``): rows → conversations, the loss mask against transformers',
packing, the step's token count, bad input named by row. Tokenizers are made here (``tests/chat_tokenizers.py``)."""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np
import pytest
import torch

from lightning_2d import ChatDataModule
from lightning_2d.data import DataError
from lightning_2d.data.chat import (
    ChatEncoder,
    ChatFormatError,
    ChatTemplate,
    ChatTemplateError,
    TemplateRewritesHistoryError,
    best_fit_decreasing,
    pack_windows,
    to_conversation,
)
from lightning_2d.data.tokenizers import load_tokenizer
from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.parallel.loss import normalize_by_global_tokens
from tests.chat_tokenizers import CHATML, CHATML_GENERATION, UINT16_IDS, make_tokenizer_folder, wide_vocabulary_folder

CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What does json.dumps do?"},
    {"role": "assistant", "content": "It serializes an object to a JSON formatted str."},
    {"role": "user", "content": "And json.loads?"},
    {"role": "assistant", "content": "It deserializes a str holding JSON to a Python object."},
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_tokenizer_folder(tmp_path_factory.mktemp("chatml"), CHATML,
                                 config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                                 added=("<think>", "</think>"))


@pytest.fixture(scope="module")
def chatml_generation(tmp_path_factory):
    return make_tokenizer_folder(tmp_path_factory.mktemp("chatml_gen"), CHATML_GENERATION,
                                 config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


def encoder(folder, template=None, **kwargs) -> ChatEncoder:
    template = ChatTemplate.from_folder(folder) if template is None else ChatTemplate(template, origin="test")
    return ChatEncoder(load_tokenizer(str(folder)), template, **kwargs)


def marked(folder, encoded) -> list[str]:
    """The trained runs of ``encoded`` as text."""
    tok = load_tokenizer(str(folder))
    runs, run = [], []
    for token, trained in zip(encoded.ids.tolist(), encoded.trained.tolist()):
        if trained:
            run.append(token)
        elif run:
            runs.append(tok.decode_keep_special(run))
            run = []
    if run:
        runs.append(tok.decode_keep_special(run))
    return runs


# ---- formats ----------------------------------------------------------------------------------------------------
def test_each_format_is_read_as_messages():
    messages = to_conversation({"messages": CONVERSATION})
    assert [m["role"] for m in messages.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages.completion_start == 4
    pc = to_conversation({"prompt": "2+2?", "completion": "4"})
    assert pc.messages == ({"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"})
    assert pc.completion_start == 1
    alpaca = to_conversation({"instruction": "Add.", "input": "2 and 2", "output": "4"})
    assert alpaca.messages[0] == {"role": "user", "content": "Add.\n\n2 and 2"} and alpaca.completion_start == 1
    share = to_conversation({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    assert [m["role"] for m in share.messages] == ["user", "assistant"]
    renamed = to_conversation({"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "yo"}]},
                              fields={"messages": "dialog", "role": "speaker", "content": "text"})
    assert renamed.messages[1] == {"role": "assistant", "content": "yo"}
    tools = to_conversation({"messages": CONVERSATION[1:3], "tools": [{"type": "function"}]})
    assert tools.tools == ({"type": "function"},)


@pytest.mark.parametrize("record, match", [
    ({"text": "hello"}, r"data\.jsonl:7 has none of the fields of a chat format \(found \['text'\]\)"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"data\.jsonl:7: messages\[0\] has role 'bot'; a role is one"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, r"data\.jsonl:7: messages\[0\] \(user\): 'content' is a list,"
                                                          r" not a string"),
    ({"messages": []}, r"data\.jsonl:7: messages is an empty list"),
    ({"instruction": "a", "output": 3}, r"data\.jsonl:7: output is int, not a string"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, r"conversations\[0\] is from 'narrator'"),
])
def test_a_bad_row_is_named_with_the_fix(record, match):
    with pytest.raises(ChatFormatError, match=match):
        to_conversation(record, where="data.jsonl:7")


# ---- masks --------------------------------------------------------------------------------------------------------
def test_generation_tags_give_transformers_assistant_mask(chatml_generation):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chatml_generation))
    theirs = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = encoder(chatml_generation).encode(to_conversation({"messages": CONVERSATION}))
    assert ours.ids.tolist() == theirs["input_ids"]
    assert ours.trained.astype(int).tolist() == theirs["assistant_masks"]
    assert sum(theirs["assistant_masks"]) > 20


def test_prefix_masks_equal_the_generation_tags_masks(chatml, chatml_generation):
    """Without generation tags the assistant's turns are found by rendering prefixes: the same tokens as the tagged
    template marks (its tags enclose the text and the end-of-turn token, not the newline after it)."""
    from transformers import AutoTokenizer

    assert CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "") != CHATML  # other text
    prefix = encoder(chatml).encode(to_conversation({"messages": CONVERSATION}))
    hf = AutoTokenizer.from_pretrained(str(chatml_generation))
    theirs = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert prefix.trained.astype(int).tolist() == theirs["assistant_masks"]
    assert marked(chatml, prefix) == ["It serializes an object to a JSON formatted str.<|im_end|>",
                                      "It deserializes a str holding JSON to a Python object.<|im_end|>"]
    im_end = load_tokenizer(str(chatml)).token_to_id("<|im_end|>")
    assert prefix.end_of_turn == {im_end}


def test_train_on_and_train_on_eos_choose_the_tokens(chatml):
    conversation = to_conversation({"messages": CONVERSATION})
    last = encoder(chatml, train_on="last_assistant").encode(conversation)
    assert marked(chatml, last) == ["It deserializes a str holding JSON to a Python object.<|im_end|>"]
    no_eos = encoder(chatml, train_on_eos=False).encode(conversation)
    assert marked(chatml, no_eos) == ["It serializes an object to a JSON formatted str.",
                                      "It deserializes a str holding JSON to a Python object."]
    everything = encoder(chatml, train_on="all").encode(conversation)
    assert everything.trained.all()
    completion = encoder(chatml, train_on="completion").encode(to_conversation(
        {"prompt": [{"role": "user", "content": "Name two."}],
         "completion": [{"role": "assistant", "content": "One."}, {"role": "user", "content": "More?"},
                        {"role": "assistant", "content": "Two."}]}))
    text = "".join(marked(chatml, completion))
    assert text.startswith("One.<|im_end|>") and "More?" in text and text.endswith("Two.<|im_end|>")
    assert "Name two." not in text


def test_a_template_that_rewrites_history_is_refused_naming_the_row_and_turn(chatml):
    # Reasoning shown for the last assistant turn only, as Qwen3's template does.
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' and"
                " loop.last %}{{ '<think>' + m.get('reasoning_content', '') + '</think>' }}{% endif %}"
                "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    messages = [dict(m, reasoning_content="think") if m["role"] == "assistant" else m for m in CONVERSATION]
    conversation = to_conversation({"messages": messages})
    with pytest.raises(TemplateRewritesHistoryError,
                       match=r"chats\.jsonl:3, turn 2 \(assistant\): the chat template renders the conversation up to"
                             r" this turn differently .* \{% generation %\} tags .* train_on='last_assistant'"):
        encoder(chatml, template).encode(conversation, where="chats.jsonl:3")
    last = encoder(chatml, template, train_on="last_assistant").encode(conversation)
    assert marked(chatml, last) == ["<think>think</think>It deserializes a str holding JSON to a Python object."
                                    "<|im_end|>"]


def test_an_empty_think_block_is_not_trained(chatml):
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
                "{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    encoded = encoder(chatml, template).encode(to_conversation({"messages": CONVERSATION[1:3]}))
    assert marked(chatml, encoded) == ["It serializes an object to a JSON formatted str.<|im_end|>"]
    assert "<think>\n\n</think>" in encoded.text


def test_the_template_runs_sandboxed_with_transformers_globals(chatml):
    template = ChatTemplate("{{ raise_exception('no system messages, please') }}", origin="t.jinja")
    with pytest.raises(ChatTemplateError, match=r"The chat template \(t\.jinja\) refused the conversation: no system"):
        template.render(CONVERSATION)
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", origin="evil.jinja")
    with pytest.raises(ChatTemplateError, match=r"evil\.jinja"):
        escape.render(CONVERSATION)
    globals_ = ChatTemplate("{{ {'a': '<é>'} | tojson }} {% set ns = namespace(n=1) %}{{ ns.n }}"
                            " {{ strftime_now('%Y') | length }} {{ bos_token }}{{ enable_thinking }}",
                            special_tokens={"bos_token": "<s>"})
    assert globals_.render([], enable_thinking=False).text == '{"a": "<é>"} 1 4 <s>False'


# ---- packing ------------------------------------------------------------------------------------------------------
def test_best_fit_decreasing_fills_bins_as_the_textbook_does():
    assert best_fit_decreasing(np.array([5, 7, 3, 2, 4, 1]), 8) == [[1, 5], [0, 2], [4, 3]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=2000)
    bins = best_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(2000))
    assert max(lengths[b].sum() for b in bins) <= 100
    assert len(bins) <= 11 / 9 * np.ceil(lengths.sum() / 100) + 1  # within FFD's bound of the optimum
    windows = pack_windows(lengths, 100, pack=False)
    assert len(windows) == 2000 and windows.window(7).tolist() == [7]


def spm_model(tmp_path):
    """A SentencePiece-style tokenizer.model (not a tokenizer.json): no character offsets, no chat template."""
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "spm.txt"
    text.write_text("hello world, what is the answer\n" * 50)
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "tokenizer"), vocab_size=20,
                                   minloglevel=2)
    return tmp_path / "tokenizer.model"


# ---- the data module ----------------------------------------------------------------------------------------------
def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def qa_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Q{i}: what is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}." + " More." * (i % 9)}]} for i in range(n)]


def test_batches_pack_conversations_as_documents_with_their_labels(chatml, tmp_path):
    data = ChatDataModule(write_rows(tmp_path / "d.jsonl", qa_rows(60)), str(chatml), seq_len=256, batch_size=2,
                          val_fraction=0, cache_dir=str(tmp_path / "cache"), shuffle=False)
    assert data.check_prepared()
    data.setup("fit")
    assert data.packing.efficiency > 0.9 and data.packing.conversations == 60 and data.packing.windows < 20
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, 256)
    # Each conversation is a document: positions restart, the last input of each predicts nothing.
    window = data.train_dataset.windows.window(0)
    offsets = np.fromfile(data.cache_folder / "offsets.bin", dtype=np.int64)
    lengths = [int(offsets[c + 1] - offsets[c]) - 1 for c in data.train_dataset.conversations[window]]
    starts = np.cumsum([0] + lengths)
    positions = batch["position_ids"][0]
    assert all(positions[s] == 0 for s in starts[:-1]) and (positions[: starts[-1]] >= 0).all()
    assert all(batch["labels"][0, e - 1] == -100 for e in starts[1:])
    trained = int((batch["labels"] != -100).sum())
    # step_tokens: this replica's trained tokens over the optimizer step (one batch here).
    assert batch["step_tokens"].item() == trained > 0


def test_step_tokens_cover_the_accumulated_batches(chatml, tmp_path):
    data = ChatDataModule(write_rows(tmp_path / "d.jsonl", qa_rows(80)), str(chatml), seq_len=64, batch_size=2,
                          val_fraction=0, cache_dir=str(tmp_path / "cache"))
    data.set_data_parallel(2, 1, accumulate_grad_batches=3)
    data.setup("fit")
    batches = list(data.train_dataloader())
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    for i, batch in enumerate(batches):
        window = range(i // 3 * 3, min(i // 3 * 3 + 3, len(batches)))
        assert batch["step_tokens"].item() == sum(counts[j] for j in window)


def test_the_loss_over_accumulated_batches_weighs_every_token_alike():
    """With ``step_tokens`` the accumulated gradient equals one device's on the whole step (the mean over all its
    trained tokens), also when the batches hold different numbers of them."""
    torch.manual_seed(0)
    weight = torch.randn(5, requires_grad=True)
    losses = [torch.rand(7), torch.rand(7)]
    labels = [torch.tensor([1, 2, -100, -100, -100, -100, -100]), torch.tensor([1, 2, 3, 4, 5, 6, -100])]
    step = torch.tensor(float(sum(int((lab != -100).sum()) for lab in labels)))
    for loss, lab in zip(losses, labels):
        summed = (loss * (lab != -100) * weight.sum()).sum()
        scaled, _, _ = normalize_by_global_tokens(summed, lab, None, step_tokens=step, accumulate=2)
        (scaled / 2).backward()  # the Trainer divides by accumulate_grad_batches
    accumulated = weight.grad.clone()
    weight.grad = None
    whole = sum((loss * (lab != -100)).sum() for loss, lab in zip(losses, labels)) * weight.sum() / step
    whole.backward()
    torch.testing.assert_close(accumulated, weight.grad)
    weight.grad = None
    for loss, lab in zip(losses, labels):  # without step_tokens: the mean of the batches' means, another number
        summed = (loss * (lab != -100) * weight.sum()).sum()
        (normalize_by_global_tokens(summed, lab, None)[0] / 2).backward()
    assert not torch.allclose(accumulated, weight.grad)


def test_a_packed_window_equals_its_conversations_one_at_a_time(chatml, tmp_path):
    data = ChatDataModule(write_rows(tmp_path / "d.jsonl", qa_rows(30)), str(chatml), seq_len=256, batch_size=1,
                          val_fraction=0, cache_dir=str(tmp_path / "cache"), shuffle=False)
    data.setup("fit")
    sample = data.train_dataset[0]
    window = data.train_dataset.windows.window(0)
    assert len(window) >= 3
    model = Transformer(PRESETS["debug"].__class__(**{**PRESETS["debug"].__dict__, "vocab_size": 1024}),
                        loss_chunk_size=None)
    model.init_weights(0)
    packed = model(sample["input_ids"][None], labels=sample["labels"][None], position_ids=sample["position_ids"][None])
    packed.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    offsets = np.fromfile(data.cache_folder / "offsets.bin", dtype=np.int64)
    tokens = np.fromfile(data.cache_folder / "tokens.bin", dtype=np.uint16)
    trained = np.fromfile(data.cache_folder / "trained.bin", dtype=np.uint8)
    separate = 0
    for c in data.train_dataset.conversations[window].tolist():
        ids = torch.from_numpy(tokens[offsets[c] : offsets[c + 1]].astype(np.int64))
        labels = torch.where(torch.from_numpy(trained[offsets[c] + 1 : offsets[c + 1]] > 0), ids[1:], -100)
        separate = separate + model(ids[None, :-1], labels=labels[None])
    separate.backward()
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_interrupted_chat_build_leaves_no_file_and_a_killed_ones_partial_files_are_removed(chatml, tmp_path):
    """The token cache's protocol (``cache_folders``): partial files renamed only on success, removed on an error, and
    those of a dead process of this machine removed by the next build."""
    data = ChatDataModule(write_rows(tmp_path / "d.jsonl", qa_rows(10)), str(chatml), cache_dir=str(tmp_path / "c"))
    folder = data.cache_folder
    folder.mkdir(parents=True)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for name in ("trained.bin", "meta.json"):
        (folder / f"{name}.tmp-{socket.gethostname()}-{dead}").write_bytes(b"\1" * 10)

    def ctrl_c(done, total, conversations):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        data.prepare(num_workers=1, progress=ctrl_c)
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # no cache file, no partial file, no meta.json
    report = data.prepare(num_workers=1)
    assert report.built and report.conversations == 10 and (folder / "meta.json").is_file()
    assert not data.prepare(num_workers=1).built


def test_bad_input_is_refused_before_any_process_starts(chatml, tmp_path):
    rows = qa_rows(5)
    rows[3] = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}
    rows.insert(1, {"text": "raw"})
    data = ChatDataModule(write_rows(tmp_path / "bad.jsonl", rows), str(chatml), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"2 bad row\(s\) in the chat data \(nothing was cached\):\n  - .*bad\.jsonl:2"
                                        r" has none of the fields.*\n  - .*bad\.jsonl:5: messages\[1\] has role 'robot'"):
        data.check_prepared()
    assert not list((tmp_path / "c").glob("*/meta.json"))
    plain = make_tokenizer_folder(tmp_path / "plain", None)
    with pytest.raises(ChatTemplateError, match=r"has no chat template .* chat_template=PATH"):
        ChatDataModule(str(tmp_path / "bad.jsonl"), str(plain))
    with pytest.raises(DataError, match=r"needs a Hugging Face tokenizer .* got '.*tokenizer\.model'"):
        ChatDataModule(str(tmp_path / "bad.jsonl"), str(spm_model(tmp_path)))
    failing = tmp_path / "failing.jinja"
    failing.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
                       "{% endif %}")
    data = ChatDataModule(write_rows(tmp_path / "ok.jsonl", qa_rows(3)), str(chatml), chat_template=str(failing),
                          cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"ok\.jsonl:1: The chat template \(.*failing\.jinja\) refused the"
                                        r" conversation: a system message first"):
        data.check_prepared()
    long = qa_rows(4)
    long[2]["messages"][1]["content"] = "word " * 300
    data = ChatDataModule(write_rows(tmp_path / "long.jsonl", long), str(chatml), seq_len=64, overflow="error",
                          cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"1 conversation\(s\) are longer than seq_len \+ 1 \(65 tokens\) under"
                                        r" overflow='error': .*long\.jsonl:3 \(\d+ tokens\); raise seq_len"):
        data.check_prepared()
    with pytest.raises(DataError, match=r"train_on must be one of .* got 'user'"):
        ChatDataModule(str(tmp_path / "ok.jsonl"), str(chatml), train_on="user")


def test_overflow_truncates_or_drops(chatml, tmp_path):
    long = qa_rows(6)
    long[2]["messages"][1]["content"] = "word " * 300
    path = write_rows(tmp_path / "long.jsonl", long)
    truncated = ChatDataModule(path, str(chatml), seq_len=64, val_fraction=0, cache_dir=str(tmp_path / "c"))
    truncated.setup("fit")
    assert truncated.packing.truncated == 1 and truncated.packing.conversations == 6
    dropped = ChatDataModule(path, str(chatml), seq_len=64, val_fraction=0, overflow="drop",
                             cache_dir=str(tmp_path / "c"))
    dropped.setup("fit")
    assert dropped.packing.dropped == 1 and dropped.packing.conversations == 5


def test_shared_arguments_default_as_in_text_data_module():
    """The CLI's default data class is TextDataModule; jsonargparse keeps its values for the arguments a recipe's
    ChatDataModule shares with it, so their defaults must agree."""
    import inspect

    from lightning_2d import TextDataModule

    chat, text = (inspect.signature(c).parameters for c in (ChatDataModule, TextDataModule))
    shared = set(chat) & set(text)
    assert {"paths", "tokenizer", "seq_len", "batch_size", "val_fraction", "seed", "cache_dir"} <= shared
    assert {k: chat[k].default for k in shared} == {k: text[k].default for k in shared}


def test_the_built_in_corpus_and_byte_tokenizer_need_no_download(tmp_path):
    from transformers import AutoTokenizer

    data = ChatDataModule(seq_len=512, batch_size=2, val_fraction=0.01, cache_dir=str(tmp_path))
    assert data.hparams["tokenizer"] == str(tmp_path / "byte-chatml-v1")  # what a checkpoint records, export reads
    data.setup("fit")
    assert data.packing.conversations > 2500 and data.packing.efficiency > 0.9
    assert data.vocab_size == 259 and data.end_of_turn_ids == [258]
    hf = AutoTokenizer.from_pretrained(data.hparams["tokenizer"])
    conversation = [{"role": "user", "content": "What does the function `textwrap.dedent` do? ✓"},
                    {"role": "assistant", "content": "Remove any common leading whitespace."}]
    ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = data.encoder.encode(to_conversation({"messages": conversation}))
    assert ours.ids.tolist() == ids["input_ids"] and ours.trained.astype(int).tolist() == ids["assistant_masks"]
    assert ids["input_ids"][:1] == [257] and list(b"user") == ids["input_ids"][1:5]  # bytes are their own ids


def test_prepare_data_previews_and_builds_a_chat_recipe(chatml, tmp_path, monkeypatch, capsys):
    import yaml

    from lightning_2d.tools.prepare import main as prepare_main

    monkeypatch.setattr(sys, "argv", ["lightning-2d", "prepare-data"])
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"class_path": "lightning_2d.ChatDataModule", "init_args": {
        "paths": write_rows(tmp_path / "d.jsonl", qa_rows(40)), "tokenizer": str(chatml), "seq_len": 64,
        "cache_dir": str(tmp_path / "c")}}}))
    assert prepare_main(["--config", str(recipe), "--preview", "1"]) is None
    out = capsys.readouterr().out
    assert "---- " in out and "d.jsonl:1: " in out and "[[It is 0.<|im_end|>]]" in out
    assert "<|im_start|>user\nQ0: what is 0 + 0?<|im_end|>" in out and "nothing written" in out
    assert not list((tmp_path / "c").glob("*/meta.json"))
    report = prepare_main(["--config", str(recipe), "--processes", "2"])
    out = capsys.readouterr().out
    assert report.built and report.conversations == 40 and "efficiency" in out and "end of turn" in out


def test_end_to_end_a_transformers_model_fine_tuned_on_chats_answers_and_stops(tmp_path):
    """A tiny Llama saved by transformers → ``init_from`` → fine-tuned on conversations ("Say yes" → "yes") →
    ``export`` → transformers' ``pipeline`` with the chat template: it answers, and stops at ``<|im_end|>``, which
    export added to ``generation_config.json`` (the tokenizer's own end-of-text is ``<|endoftext|>``, as a base
    model's, so without the chat data's stop id generation would run on)."""
    import shutil

    import lightning as L
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, pipeline

    from lightning_2d import LlamaLightningModule
    from lightning_2d.hf import export_hf

    words = ["hi", "yes", "no", "maybe"]
    rows = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
            for w in words] * 64
    tokenizer = tmp_path / "tokenizer"  # the built-in byte ChatML tokenizer, as a base model would ship it
    builtin = ChatDataModule(cache_dir=str(tmp_path / "cache")).hparams["tokenizer"]
    shutil.copytree(builtin, tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    (tokenizer / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "tiny")

    data = ChatDataModule(write_rows(tmp_path / "chats.jsonl", rows), str(tokenizer), seq_len=128, batch_size=4,
                          val_fraction=0, cache_dir=str(tmp_path / "cache"))
    module = LlamaLightningModule(init_from=str(tmp_path / "tiny"), learning_rate=0.01, warmup_steps=2, max_steps=150)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=150, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(tmp_path / "sft.ckpt")
    assert data.end_of_turn_ids == [258]

    export_hf(tmp_path / "sft.ckpt", tmp_path / "hf", log=lambda line: None)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == [256, 258]
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    generate = pipeline("text-generation", model=AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                        tokenizer=hf_tokenizer)
    for word in words:
        chat = [{"role": "user", "content": f"Say {word}"}]
        prompt = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = generate(chat, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
        answer = ids[len(prompt["input_ids"]):]
        assert bytes(answer[:-1]).decode() == word and answer[-1] == 258, (word, answer)  # the answer, then it stops
        assert generate(chat, max_new_tokens=12, do_sample=False)[0]["generated_text"][-1] == {
            "role": "assistant", "content": word}


def test_json_parquet_and_a_datasets_folder_are_read_like_jsonl(chatml, tmp_path):
    """The same rows from a JSON list, a Parquet file and a folder as ``datasets``' ``save_to_disk`` writes it (Arrow
    IPC stream files named by ``state.json``, read with pyarrow: no ``datasets`` needed) give the conversations JSONL
    gives, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = qa_rows(12)
    write_rows(tmp_path / "rows.jsonl", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=5)
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    for i, part in enumerate((table.slice(0, 7), table.slice(7))):
        with pa.OSFile(str(saved / "train" / f"data-0000{i}-of-00002.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, part.schema) as writer:
            writer.write_table(part)
    (saved / "train" / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]}))
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))

    def tokens(path):
        data = ChatDataModule(str(path), str(chatml), val_fraction=0, cache_dir=str(tmp_path / "c"))
        report = data.prepare(num_workers=2)
        assert report.rows == 12 and report.conversations == 12
        return np.fromfile(report.folder / "tokens.bin", dtype=np.uint16).tolist()

    expected = tokens(tmp_path / "rows.jsonl")
    for source in ("rows.json", "rows.parquet", "saved"):
        assert tokens(tmp_path / source) == expected, source
    with pytest.raises(DataError, match=r"(?s)bad row.*rows\.parquet row 3: messages\[1\] has role 'robot'"):
        bad = [dict(r) for r in rows]
        bad[3] = {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}
        pq.write_table(pa.Table.from_pylist(bad), tmp_path / "rows.parquet", row_group_size=5)
        ChatDataModule(str(tmp_path / "rows.parquet"), str(chatml), cache_dir=str(tmp_path / "c")).prepare()


def test_the_cache_is_keyed_by_the_template_and_rows_without_targets_are_counted(chatml, tmp_path):
    rows = qa_rows(6) + [{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "no answer"}]}]
    path = write_rows(tmp_path / "d.jsonl", rows)
    plain = ChatDataModule(path, str(chatml), cache_dir=str(tmp_path / "c"))
    report = plain.prepare(num_workers=1)
    assert (report.rows, report.conversations, report.no_target) == (7, 6, 1)
    other = tmp_path / "other.jinja"
    other.write_text(CHATML + "{# the same rendering, another template #}")
    for changed in (ChatDataModule(path, str(chatml), chat_template=str(other), cache_dir=str(tmp_path / "c")),
                    ChatDataModule(path, str(chatml), train_on="all", cache_dir=str(tmp_path / "c")),
                    ChatDataModule(path, str(chatml), template_kwargs={"date_string": "1 Jan 2025"},
                                   cache_dir=str(tmp_path / "c")),
                    ChatDataModule(path, "byte", cache_dir=str(tmp_path / "c"))):
        assert changed.cache_folder != plain.cache_folder
    assert ChatDataModule(path, str(chatml), seq_len=64, cache_dir=str(tmp_path / "c")).cache_folder == plain.cache_folder


def test_a_vocabulary_over_65536_ids_is_cached_as_uint32_and_its_high_ids_come_back_exactly(tmp_path):
    """Every Llama 3 and Qwen tokenizer has more than 65,536 ids: its cache is uint32, and an id above 65,535 must
    come back as itself (stored as uint16 it would wrap to another token), in the cache and in the batches."""
    rows = qa_rows(12)
    folder = wide_vocabulary_folder(tmp_path / "wide", [m["content"] for r in rows for m in r["messages"]])
    data = ChatDataModule(write_rows(tmp_path / "d.jsonl", rows), str(folder), seq_len=64, batch_size=1,
                          val_fraction=0, pack=False, shuffle=False, cache_dir=str(tmp_path / "cache"))
    assert data.tokenizer.vocab_size > UINT16_IDS
    assert data.check_prepared()
    assert json.loads((data.cache_folder / "meta.json").read_text())["dtype"] == "uint32"
    encoded = [data.encoder.encode(to_conversation(row)) for row in rows]
    stored = np.fromfile(data.cache_folder / "tokens.bin", dtype=np.uint32)
    assert np.array_equal(stored, np.concatenate([e.ids for e in encoded]))
    assert stored.max() >= UINT16_IDS and stored.min() < UINT16_IDS  # both sides of the uint16 range
    data.setup("fit")
    high = 0
    for index in range(len(data.train_dataset)):
        (conversation,) = data.train_dataset.conversations[data.train_dataset.windows.window(index)].tolist()
        ids, trained = torch.from_numpy(encoded[conversation].ids), torch.from_numpy(encoded[conversation].trained)
        sample, n = data.train_dataset[index], len(ids) - 1
        assert torch.equal(sample["input_ids"][:n], ids[:-1])
        assert torch.equal(sample["labels"][:n], torch.where(trained[1:], ids[1:], -100))
        high += int((sample["labels"] >= UINT16_IDS).sum())
    assert high > 0  # trained targets above 65,535 reached the loss's labels


def test_the_training_loader_resumes_at_the_next_unseen_batch(chatml, tmp_path):
    def loader():
        data = ChatDataModule(write_rows(tmp_path / "d.jsonl", qa_rows(80)), str(chatml), seq_len=64, batch_size=2,
                              val_fraction=0, cache_dir=str(tmp_path / "c"))
        data.set_data_parallel(2, 0, accumulate_grad_batches=2)
        data.setup("fit")
        return data.train_dataloader()

    first = loader()
    batches = list(first)
    resumed = loader()
    resumed.load_state_dict({"epoch": 0, "consumed_samples": 4 * 2 * 2, "seed": 1234, "shuffle": True})
    rest = list(resumed)
    assert len(rest) == len(batches) - 4
    for a, b in zip(rest, batches[4:]):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["step_tokens"], b["step_tokens"])
