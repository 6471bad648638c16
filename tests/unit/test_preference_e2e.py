"""DPO changes what a model says, end to end (#44): a tiny transformers Llama fine-tuned on chats answered in two
styles, then DPO on pairs preferring one of them, exported: transformers' ``pipeline`` answers in that style more
often than the fine-tuned model did.

The styles are whole answers, ``"Sure!"`` and ``"No."``, which a 2-block, 64-wide byte-level model learns in seconds;
the chats answer each prompt once in the first and twice in the second, so the fine-tuned model samples both (about
1 : 2). The fractions are of answers sampled (seeded, from the whole distribution) to prompts in neither data set.

DPO trains the whole model against a frozen copy of it (``reference: auto``), with AdamW's ``eps`` at 1e-3. Adam's
default 1e-8 makes a step about ``lr`` whatever a gradient's size: once fine-tuned, the output rows of the bytes after
an answer's first ("u", "r", "o", ".", p ≈ 1) get gradients of ~1e-4 against 0.14 on "S" and "N", moved as far, and
the answers began with them ("re!", "!", "Noure!": 0.60-0.84 preferred after 30 steps at lr 1e-3, over 6 seeds).
With ``eps`` above those gradients they stay small: 1.00 for each of the 6 seeds. LoRA on the attention and MLP
projections (lr 1e-2) reached 0.12-0.65: it moves the hidden state both first bytes are read from, which lifts bytes
never trained there. The step's gradients equal those of a transformers model's DPO loss on the same pairs unpacked
(within 3e-8, checked by hand): what goes wrong is DPO on a model this small, not the step.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import lightning as L
import torch

from lightning_2d import ChatDataModule, LlamaLightningModule, PreferenceDataModule
from lightning_2d.hf import export_hf

PREFERRED, OTHER = "Sure!", "No."
TOPICS = ["cats", "maps", "tea", "rain", "jazz", "glue", "kites", "salt", "mud", "owls", "wool", "ink"]
#: The prompts the fractions are measured on, in no training data.
HELD_OUT = ["bees", "fog", "clay", "moss", "soup", "wind"]
#: Answers sampled to each held-out prompt.
SAMPLES = 16


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about {topic}"}]


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fit(module, data, steps: int, callbacks=()) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, datamodule=data)
    return trainer


def answers(folder) -> Counter:
    """``SAMPLES`` answers to each held-out prompt from the exported model in transformers' ``pipeline`` with its
    chat template (sampled from the whole distribution: temperature 1, no top-k or top-p; seeded), counted by their
    text (the answer up to the end of turn, which the tokenizer's ``eos_token`` ``<|im_end|>`` stops at)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    generate = pipeline("text-generation", model=AutoModelForCausalLM.from_pretrained(folder),
                        tokenizer=AutoTokenizer.from_pretrained(folder))
    torch.manual_seed(0)
    return Counter(out["generated_text"][-1]["content"] for topic in HELD_OUT
                   for out in generate(ask(topic), max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0,
                                       top_p=1.0, num_return_sequences=SAMPLES))


def test_dpo_makes_the_exported_model_answer_in_the_preferred_style_more_often(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tmp_path / "tokenizer"  # the built-in byte ChatML tokenizer, its end of text <|im_end|>
    shutil.copytree(ChatDataModule(cache_dir=str(tmp_path / "cache")).hparams["tokenizer"], tokenizer)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "tiny")

    # Fine-tuning on chats: each prompt answered once in the preferred style, twice in the other.
    chats = [{"messages": ask(topic) + answer(text)} for topic in TOPICS for text in (PREFERRED, OTHER, OTHER)] * 8
    sft = fit(LlamaLightningModule(init_from=str(tmp_path / "tiny"), learning_rate=0.01, warmup_steps=2,
                                   max_steps=150),
              ChatDataModule(write_rows(tmp_path / "chats.jsonl", chats), str(tokenizer), seq_len=128, batch_size=4,
                             val_fraction=0, cache_dir=str(tmp_path / "cache")), steps=150)
    sft.save_checkpoint(tmp_path / "sft.ckpt")
    export_hf(tmp_path / "sft.ckpt", tmp_path / "sft", log=lambda line: None)
    before = answers(tmp_path / "sft")

    # DPO from the fine-tuned export, on the same prompts: the preferred style chosen, the other rejected.
    pairs = [{"prompt": ask(topic), "chosen": answer(PREFERRED), "rejected": answer(OTHER)} for topic in TOPICS]
    metrics = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rewards/")})

    dpo = fit(LlamaLightningModule(init_from=str(tmp_path / "sft"), learning_rate=3e-3, eps=1e-3, warmup_steps=2,
                                   max_steps=30, preference={"loss_type": "sigmoid", "beta": 0.1}),
              PreferenceDataModule(write_rows(tmp_path / "pairs.jsonl", pairs), str(tmp_path / "sft"), seq_len=128,
                                   batch_size=2, val_fraction=0, cache_dir=str(tmp_path / "cache")),
              steps=30, callbacks=[Record()])
    dpo.save_checkpoint(tmp_path / "dpo.ckpt")
    export_hf(tmp_path / "dpo.ckpt", tmp_path / "dpo", log=lambda line: None)
    after = answers(tmp_path / "dpo")

    total = len(HELD_OUT) * SAMPLES
    fraction = {"before": before[PREFERRED] / total, "after": after[PREFERRED] / total}
    print(f"preferred style: {fraction}; before {dict(before)}, after {dict(after)}; last step {metrics[-1]}")
    # Measured: 32 "Sure!" and 64 "No." of 96 before; 96 "Sure!" after.
    assert before[PREFERRED] / total > 0.15 and before[OTHER] / total > 0.4, before  # both styles, as trained
    assert fraction["after"] > fraction["before"] + 0.5, (fraction, after)
    # The first step's model is its reference (rewards 0); the last prefers every chosen answer, whose likelihood rose
    # (measured: margins 0.74, chosen 0.11; over 6 other seeds 0.72-0.79 and 0.11-0.12).
    assert metrics[0]["rewards/margins"] == 0.0 and metrics[0]["rewards/accuracies"] == 0.0, metrics[0]
    assert metrics[-1]["rewards/accuracies"] == 1.0 and metrics[-1]["rewards/margins"] > 0.5, metrics[-1]
    assert metrics[-1]["rewards/chosen"] > 0.0, metrics[-1]


def test_a_lora_dpo_checkpoint_holds_the_adapters_only_and_exports_for_peft_and_merged(tmp_path):
    """LoRA DPO (the reference its adapters off): the checkpoint holds the adapters and their optimizer state only (no
    reference copy, no frozen state, no record of one), as a LoRA run's always did; ``lightning-2d export`` writes it
    as a peft folder, which on transformers' base, and merged, which alone, give the trained model's logits."""
    import pytest

    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from lightning_2d.checkpoint.safe_load import load_checkpoint_file
    from lightning_2d.data.preference.builtin import stdlib_preference_rows
    from lightning_2d.integration.preference_module import PreferenceTuning
    from lightning_2d.checkpoint.subset import ADAPTERS_KEY
    from lightning_2d.ops.lora import is_adapter_parameter
    from lightning_2d.tools.export import main as export

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "base")
    module = LlamaLightningModule(init_from=str(tmp_path / "base"), lora={"rank": 4, "alpha": 8.0},
                                  learning_rate=1e-2, warmup_steps=1, max_steps=3,
                                  preference={"loss_type": "sigmoid", "beta": 0.1})
    margins = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            margins.append(float(trainer.callback_metrics["rewards/margins"]))

    trainer = fit(module, PreferenceDataModule(write_rows(tmp_path / "pairs.jsonl", stdlib_preference_rows()[:8]),
                                               "byte", seq_len=128, batch_size=2, val_fraction=0, max_length=60,
                                               cache_dir=str(tmp_path / "cache")), steps=3, callbacks=[Record()])
    assert module.frozen_models() == [] and margins[0] == 0.0 and margins[-1] != 0.0  # trained against its base
    trainer.save_checkpoint(tmp_path / "dpo.ckpt")
    saved = load_checkpoint_file(tmp_path / "dpo.ckpt")
    adapters = [name for name, p in module.model.named_parameters() if p.requires_grad]
    assert len(adapters) == 2 * 7 * 2 and all(is_adapter_parameter(name) for name in adapters)
    assert sorted(saved["state_dict"]) == sorted(f"model.{name}" for name in adapters)  # nothing else, no copy
    assert len(saved["optimizer_states"][0]["state"]) == len(adapters)
    assert PreferenceTuning.REFERENCE_RECORD_KEY not in saved  # no frozen copy to record
    assert saved[ADAPTERS_KEY]["base"]["init_from"] == str((tmp_path / "base").resolve())

    module.eval()
    tokens = torch.randint(0, 264, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = module(tokens)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        assert (ours - base(tokens).logits).abs().max() > 1e-3  # the adapters trained
        export([str(tmp_path / "dpo.ckpt"), str(tmp_path / "peft")])
        assert (tmp_path / "peft" / "adapter_config.json").exists()
        assert not (tmp_path / "peft" / "model.safetensors").exists()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
        torch.testing.assert_close(adapted(tokens).logits, ours, rtol=1e-5, atol=1e-5)
        export([str(tmp_path / "dpo.ckpt"), str(tmp_path / "merged"), "--merge-lora"])
        assert not (tmp_path / "merged" / "adapter_config.json").exists()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=1e-5, atol=1e-5)
