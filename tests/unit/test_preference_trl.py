"""DPO on a transformers model equals TRL's ``DPOTrainer`` on the same rows and weights, at the first step.

A tiny Llama saved by transformers is the trained model, another (other seed) the reference; the rows are
conversational pairs. TRL 1.16 tokenizes them with the tokenizer's chat template, runs both models and computes its
loss and metrics (``DPOTrainer.compute_loss`` on its first batch: the whole data set); here ``HFCausalLMModule``
(``init_from`` the first, ``preference.reference_from`` the second) on ``PreferenceDataModule``'s batch of the same
rows. The template ends an assistant turn at its end-of-turn token: TRL scores everything after the prompt,
whatever the template writes after that token, where the chat data trains up to it. TRL runs in fp32 (its
``DPOConfig`` defaults to bf16 autocast, on CPU too, for the reference model it prepares).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("trl", reason="trl is in the test extra (pip install -e '.[test]')")

#: The byte-level ChatML template, no newline after an assistant turn's <|im_end|>.
TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
            "{{ message['content'] + '<|im_end|>' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "I would rather not say."}]},
    {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "no"}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "It is a city somewhere in Europe, I think."}]},
    {"prompt": [{"role": "user", "content": "Say yes"}], "chosen": [{"role": "assistant", "content": "yes"}],
     "rejected": [{"role": "assistant", "content": "maybe"}]},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_2d import ChatDataModule

    tmp = tmp_path_factory.mktemp("trl")
    tokenizer = tmp / "tokenizer"
    shutil.copytree(ChatDataModule(cache_dir=str(tmp / "cache")).hparams["tokenizer"], tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    models = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     tie_word_embeddings=False)).save_pretrained(tmp / name)
        for file in tokenizer.iterdir():
            shutil.copy(file, tmp / name / file.name)
        models[name] = tmp / name
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"tmp": tmp, "tokenizer": tokenizer, "rows": tmp / "pairs.jsonl", **models}


LOSSES = [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.1)]
BETA = 0.3


@pytest.fixture(scope="module")
def trl_steps(folders):
    """TRL's first-step loss and metrics for each of ``LOSSES``: one trainer (its tokenization and models), its loss
    settings changed between the losses (``_compute_loss`` reads them each time), run as in a plain single process:
    accelerate starts a process group when it finds a launcher's variables (an earlier test's Trainer leaves
    ``LOCAL_RANK`` … set), and keeps its state between trainers."""
    from accelerate.state import AcceleratorState, PartialState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                     "GROUP_RANK", "ACCELERATE_USE_CPU"):
            monkeypatch.delenv(name, raising=False)
        args = DPOConfig(output_dir=str(folders["tmp"] / "trl"), per_device_train_batch_size=len(ROWS), beta=BETA,
                         max_length=None, report_to=[], use_cpu=True, seed=0, dataloader_drop_last=False, bf16=False)
        trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(folders["policy"]),
                             ref_model=AutoModelForCausalLM.from_pretrained(folders["reference"]), args=args,
                             train_dataset=Dataset.from_list(ROWS),
                             processing_class=AutoTokenizer.from_pretrained(folders["tokenizer"]))
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model.train()
        steps = {}
        for loss_type, label_smoothing in LOSSES:
            trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = [loss_type], [1.0], label_smoothing
            trainer._metrics["train"].clear()
            loss = trainer.compute_loss(trainer.model, batch)
            steps[loss_type] = float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    return steps


@pytest.fixture(scope="module")
def our_step(folders):
    """The module (``init_from`` the trained model, its frozen reference from the other folder) and the data's first
    batch; ``step(loss)`` is the preference step's loss and metrics under ``loss`` (a ``PreferenceLoss``)."""
    from lightning_2d import PreferenceDataModule
    from lightning_2d.hf import HFCausalLMModule

    module = HFCausalLMModule(init_from=str(folders["policy"]),
                              preference={"beta": BETA, "reference_from": str(folders["reference"])})
    module.configure_model()
    data = PreferenceDataModule(str(folders["rows"]), str(folders["tokenizer"]), seq_len=256, pack=False,
                                batch_size=len(ROWS), val_fraction=0, shuffle=False,
                                cache_dir=str(folders["tmp"] / "cache"))
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))

    def step(loss):
        total, _, pairs, metrics = module._preference_step(loss, batch, train=False)
        assert int(pairs) == len(ROWS)
        return float(total), {k: float(v) for k, v in metrics.items()}
    return step


@pytest.mark.parametrize("loss_type,label_smoothing", LOSSES)
def test_dpo_loss_and_metrics_equal_trls_dpo_trainer_at_the_first_step(trl_steps, our_step, loss_type,
                                                                      label_smoothing):
    from lightning_2d import PreferenceLoss

    want, want_metrics = trl_steps[loss_type]
    got, metrics = our_step(PreferenceLoss(loss_type, beta=BETA, label_smoothing=label_smoothing))
    assert want_metrics["rewards/margins"] != 0.0  # two models: the rewards are not trivially zero
    # Both in fp32 (TRL's default bf16 autocast off), the same tokens and weights; what differs is the order of the
    # sums (TRL's chunked fused head, its attention kernel): measured 1.3e-6 relative on the loss, 1e-6 on a reward
    # (β × the difference of two sums of ~-100), 1e-7 on the log-probabilities.
    assert got == pytest.approx(want, rel=5e-6), (got, want)
    for name, value in metrics.items():
        tolerance = {"rel": 1e-6} if name.startswith("logps/") else {"abs": 5e-6}
        assert value == pytest.approx(want_metrics[name], **tolerance), (name, value, want_metrics[name])
