"""Our preference losses on a transformers model equal TRL's trainers on the same rows and weights, at the first step:
DPO (``DPOTrainer``: sigmoid, ipo, robust), KTO (``KTOTrainer``), SimPO (the experimental ``CPOTrainer`` with
``loss_type="simpo"``, ``cpo_alpha=0``) and ORPO (the experimental ``ORPOTrainer``).

A tiny Llama saved by transformers is the trained model, another (other seed) the reference; the rows are
conversational pairs, and KTO's the same pairs unpaired as TRL unpairs them (``data.preference.unpaired_rows``). TRL
1.16 tokenizes them with the tokenizer's chat template, runs the models and computes its loss and metrics on its
first batch (the whole data set); here ``HFCausalLMModule`` (``init_from`` the first, ``preference.reference_from``
the second) on ``PreferenceDataModule``'s batch of the same rows: the pairs one a window, the unpaired examples all
in one window, where each example's KL sequence is its prompt with the previous example's completion, the pairing
TRL's ``KTOTrainer`` makes on a batch. The template ends an assistant turn at its end-of-turn token: TRL scores
everything after the prompt, whatever the template writes after that token, where the chat data trains up to it.
TRL runs in fp32 (its configs default to bf16 autocast, on CPU too, for the reference model it prepares).

Not compared: plain CPO (``loss_type="sigmoid"`` on the summed log-probabilities with ``cpo_alpha`` × NLL), which
``PreferenceLoss`` does not have (its ``sigmoid`` is DPO's, against a reference); ORPO's NLL term, which TRL 1.16
averages over the chosen sequences' prompt and completion tokens and ours over the completion's (what the loss
trains on elsewhere): the odds-ratio term and the metrics are compared, the NLL shown apart.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

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
#: KTO's weights (the desirable one not 1: a weight left out shows), SimPO's margin.
DESIRABLE_WEIGHT, SIMPO_GAMMA = 1.3, 0.4


@contextmanager
def plain_process():
    """TRL's trainers run as in a plain single process: accelerate starts a process group when it finds a launcher's
    variables (an earlier test's Trainer leaves ``LOCAL_RANK`` … set), and keeps its state between trainers."""
    from accelerate.state import AcceleratorState, PartialState

    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                     "GROUP_RANK", "ACCELERATE_USE_CPU"):
            monkeypatch.delenv(name, raising=False)
        try:
            yield
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            PartialState._reset_state()


def first_step(trainer, compute) -> tuple[float, dict[str, float]]:
    """``compute(trainer, batch)`` on the trainer's first batch (its loss, in training mode) and the metrics logged."""
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss, metrics = compute(trainer, batch)
    return float(loss), {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def trl_steps(folders):
    """TRL's first-step loss and metrics: each of ``LOSSES`` from one ``DPOTrainer`` (its tokenization and models),
    its loss settings changed between the losses (``_compute_loss`` reads them each time); KTO, SimPO and ORPO each
    from its own trainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from lightning_2d.data.preference import unpaired_rows

    def model(name: str):
        return AutoModelForCausalLM.from_pretrained(folders[name])

    common = dict(report_to=[], use_cpu=True, seed=0, dataloader_drop_last=False, bf16=False, beta=BETA)
    tokenizer = AutoTokenizer.from_pretrained(folders["tokenizer"])
    pairs, examples = Dataset.from_list(ROWS), Dataset.from_list(unpaired_rows(ROWS))
    steps = {}
    with plain_process():
        dpo = DPOTrainer(model=model("policy"), ref_model=model("reference"), train_dataset=pairs,
                         processing_class=tokenizer, args=DPOConfig(output_dir=str(folders["tmp"] / "dpo"),
                                                                    per_device_train_batch_size=len(ROWS),
                                                                    max_length=None, **common))

        def dpo_loss(trainer, batch):
            trainer._metrics["train"].clear()
            loss = trainer.compute_loss(trainer.model, batch)
            return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}

        for loss_type, label_smoothing in LOSSES:
            dpo.loss_types, dpo.loss_weights, dpo.label_smoothing = [loss_type], [1.0], label_smoothing
            steps[loss_type] = first_step(dpo, dpo_loss)
        kto = KTOTrainer(model=model("policy"), ref_model=model("reference"), train_dataset=examples,
                         processing_class=tokenizer,
                         args=KTOConfig(output_dir=str(folders["tmp"] / "kto"), per_device_train_batch_size=len(examples),
                                        max_length=None, desirable_weight=DESIRABLE_WEIGHT, **common))
        steps["kto"] = first_step(kto, dpo_loss)  # a batch of every example: TRL's KL pairing over all of them
        # The experimental trainers tokenize the chat template's text; max_length only bounds it (512 > every row).
        cpo = CPOTrainer(model=model("policy"), train_dataset=pairs, processing_class=tokenizer,
                         args=CPOConfig(output_dir=str(folders["tmp"] / "cpo"), per_device_train_batch_size=len(ROWS),
                                        loss_type="simpo", cpo_alpha=0.0, simpo_gamma=SIMPO_GAMMA, max_length=512,
                                        **common))
        steps["simpo"] = first_step(cpo, lambda trainer, batch: trainer.get_batch_loss_metrics(trainer.model, batch))
        orpo = ORPOTrainer(model=model("policy"), train_dataset=pairs, processing_class=tokenizer,
                           args=ORPOConfig(output_dir=str(folders["tmp"] / "orpo"),
                                           per_device_train_batch_size=len(ROWS), max_length=512, **common))
        steps["orpo"] = first_step(orpo, lambda trainer, batch: trainer.get_batch_loss_metrics(trainer.model, batch))
    return steps


@pytest.fixture(scope="module")
def our_step(folders):
    """The module (``init_from`` the trained model, its frozen reference from the other folder) and the data's first
    batch, of the pairs or of the unpaired examples; ``step(loss)`` is the preference step's loss and metrics under
    ``loss`` (a ``PreferenceLoss``), on the batch of the loss's kind."""
    from lightning_2d import PreferenceDataModule
    from lightning_2d.data.preference import unpaired_rows
    from lightning_2d.hf import HFCausalLMModule

    module = HFCausalLMModule(init_from=str(folders["policy"]),
                              preference={"beta": BETA, "reference_from": str(folders["reference"])})
    module.configure_model()
    (folders["tmp"] / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(ROWS)))
    batches = {}
    for units, rows, size in (("pairs", folders["rows"], {"seq_len": 256, "pack": False, "batch_size": len(ROWS)}),
                              ("examples", folders["tmp"] / "examples.jsonl", {"seq_len": 1024, "batch_size": 1})):
        data = PreferenceDataModule(str(rows), str(folders["tokenizer"]), val_fraction=0, shuffle=False,
                                    cache_dir=str(folders["tmp"] / "cache"), **size)
        data.setup("fit")
        batches[units] = next(iter(data.train_dataloader()))
    assert batches["examples"]["examples"].tolist() == [2 * len(ROWS)]  # one window: TRL's batch

    def step(loss):
        total, _, count, metrics = module._preference_step(loss, batches["pairs" if loss.paired else "examples"],
                                                           train=False)
        assert int(count) == len(ROWS) * (1 if loss.paired else 2)
        return float(total), {k: float(v) for k, v in metrics.items()}
    return step


def assert_metrics_equal(metrics: dict[str, float], want: dict[str, float]) -> None:
    """Each of ours equals TRL's of its name. Both in fp32, the same tokens and weights; what differs is the order of
    the sums (TRL's chunked fused head, its attention kernel): measured 1e-6 on a reward (β × the difference of two
    sums of ~-100), 1e-7 relative on the log-probabilities."""
    for name, value in metrics.items():
        tolerance = {"rel": 1e-6} if name.startswith("logps/") else {"abs": 5e-6}
        assert value == pytest.approx(want[name], **tolerance), (name, value, want[name])


@pytest.mark.parametrize("loss_type,label_smoothing", LOSSES)
def test_dpo_loss_and_metrics_equal_trls_dpo_trainer_at_the_first_step(trl_steps, our_step, loss_type,
                                                                      label_smoothing):
    from lightning_2d import PreferenceLoss

    want, want_metrics = trl_steps[loss_type]
    got, metrics = our_step(PreferenceLoss(loss_type, beta=BETA, label_smoothing=label_smoothing))
    assert want_metrics["rewards/margins"] != 0.0  # two models: the rewards are not trivially zero
    assert got == pytest.approx(want, rel=5e-6), (got, want)  # measured 1.3e-6 relative
    assert_metrics_equal(metrics, want_metrics)


def test_kto_loss_and_metrics_equal_trls_kto_trainer_at_the_first_step(trl_steps, our_step):
    """The KL sequences: each example's prompt with the previous example's completion in the data set's order (TRL's
    rotation of a batch), their log-ratio's mean the reference point, clamped at 0."""
    from lightning_2d import PreferenceLoss

    want, want_metrics = trl_steps["kto"]
    got, metrics = our_step(PreferenceLoss("kto", beta=BETA, desirable_weight=DESIRABLE_WEIGHT))
    assert want_metrics["kl"] > 0.1  # above the clamp: a KL term left out or estimated otherwise shows in the loss
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                            "kl"}
    assert got == pytest.approx(want, rel=5e-6), (got, want)  # measured 5e-7 relative
    assert_metrics_equal(metrics, want_metrics)


def test_simpo_loss_and_metrics_equal_trls_cpo_trainer_at_the_first_step(trl_steps, our_step):
    """SimPO is TRL's CPO with ``loss_type="simpo"`` and no NLL term (``cpo_alpha=0``): mean log-probabilities per
    completion token, the margin γ."""
    from lightning_2d import PreferenceLoss

    want, want_metrics = trl_steps["simpo"]
    got, metrics = our_step(PreferenceLoss("simpo", beta=BETA, simpo_gamma=SIMPO_GAMMA))
    assert want_metrics["nll_loss"] == 0.0
    assert got == pytest.approx(want, rel=5e-6), (got, want)  # measured 1.3e-7 relative
    assert_metrics_equal(metrics, want_metrics)


def test_orpo_odds_ratio_term_and_metrics_equal_trls_orpo_trainer_at_the_first_step(trl_steps, our_step):
    """The loss less its NLL term (logged by both as ``nll_loss``) is the odds-ratio term; TRL's NLL is over the chosen
    sequences' prompt and completion, ours over their completion (the module docstring)."""
    from lightning_2d import PreferenceLoss

    want, want_metrics = trl_steps["orpo"]
    got, metrics = our_step(PreferenceLoss("orpo", beta=BETA))
    odds_ratio, want_odds_ratio = got - metrics.pop("nll_loss"), want - want_metrics["nll_loss"]
    assert want_odds_ratio == pytest.approx(-BETA * want_metrics["log_odds_ratio"], rel=1e-6)  # TRL's own split
    assert odds_ratio == pytest.approx(want_odds_ratio, abs=5e-6), (odds_ratio, want_odds_ratio)
    assert_metrics_equal(metrics, want_metrics)
