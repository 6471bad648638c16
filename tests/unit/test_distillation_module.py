"""Distillation's integration on one process: ``distillation_step`` against the dense computation (both models' full
logits, TRL's divergence per token, the masked means mixed by ``alpha``), the distilled positions, the options of
both modules (a preset, a folder, the yaml dict through the CLI) and the teacher held beside the student: frozen,
unregistered (no optimizer state, no checkpoint entry), built by its own shape."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_2d import DistillationConfig, LlamaLightningModule
from lightning_2d.fabric import distillation_step
from lightning_2d.integration.distillation import distillation_mask
from lightning_2d.models.llama.model import ModelArgs, Transformer
from lightning_2d.ops.distillation import DistillationConfigError, jsd

VOCAB = 96
STUDENT = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=16, max_seq_len=64)
TEACHER = ModelArgs(dim=48, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=VOCAB, multiple_of=16, max_seq_len=64)


def models() -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    student, teacher = Transformer(STUDENT), Transformer(TEACHER)
    student.init_weights(1)
    teacher.init_weights(2)
    teacher.requires_grad_(False)
    return student, teacher


def batch() -> dict[str, torch.Tensor]:
    """Two rows of 24 tokens: row 0 two packed documents whose prompts (-100) precede their answers, then padding
    (a document of its own without labels); row 1 one document with a few ignored labels."""
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    labels = torch.randint(0, VOCAB, (2, 24), generator=g)
    labels[0, :4] = labels[0, 9:13] = labels[0, 8] = labels[0, 17:] = -100
    labels[1, [2, 5, 23]] = -100
    position_ids = torch.cat([torch.arange(9), torch.arange(8), torch.arange(7)]).expand(2, -1).clone()
    position_ids[1] = torch.arange(24)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def expected_mask(rows: dict[str, torch.Tensor], tokens: str) -> torch.Tensor:
    """``tokens="all"`` by its definition, position by position: every position of a document up to the document's
    last trained position."""
    trained = rows["labels"] != -100
    if tokens == "trained":
        return trained
    mask = torch.zeros_like(trained)
    for b, positions in enumerate(rows["position_ids"].tolist()):
        start = 0
        for end in range(1, len(positions) + 1):
            if end == len(positions) or positions[end] != positions[end - 1] + 1:
                last = max((t for t in range(start, end) if trained[b, t]), default=-1)
                mask[b, start:last + 1] = True
                start = end
    return mask


def test_all_distils_each_documents_prompt_up_to_its_last_trained_token_and_never_padding():
    rows = batch()
    mask = distillation_mask(rows, "all")
    assert torch.equal(mask, expected_mask(rows, "all"))
    assert mask[0, :8].all() and not mask[0, 8] and mask[0, 9:16].all() and not mask[0, 17:].any()
    assert mask[1, :23].all() and not mask[1, 23]  # after the last trained: nothing
    assert torch.equal(distillation_mask(rows, "trained"), rows["labels"] != -100)
    plain = {"labels": rows["labels"]}  # without documents: the row up to its last trained position
    assert torch.equal(distillation_mask(plain, "all")[0], torch.arange(24) < 17)


CONFIGS = [
    DistillationConfig(loss="jsd", beta=0.3, temperature=2.0, alpha=0.5, chunk_size=10),
    DistillationConfig(loss="forward_kl", alpha=0.7, tokens="all", chunk_size=7),
    DistillationConfig(loss="reverse_kl", temperature=0.5, alpha=1.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.loss}-{c.tokens}-alpha{c.alpha}")
def test_the_step_equals_the_dense_computation_and_leaves_the_teacher_alone(config):
    """One device: the fused step's loss, logged means and every student gradient equal the dense form (both
    models' full logits, TRL's per-token divergence at the temperature, each term's masked mean, ``alpha``'s mix);
    the teacher gets no gradient and keeps its bits."""
    rows = batch()
    student, teacher = models()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    loss, mean, tokens, metrics = distillation_step(student, teacher, rows, config)
    loss.backward()
    fused = {n: p.grad.clone() for n, p in student.named_parameters()}

    student.zero_grad()
    logits = student(rows["input_ids"], position_ids=rows["position_ids"])
    with torch.no_grad():
        teacher_logits = teacher(rows["input_ids"], position_ids=rows["position_ids"])
    mask = expected_mask(rows, config.tokens)
    divergence = jsd(logits, teacher_logits, config.divergence_beta, config.temperature)[mask].mean()
    nll = F.cross_entropy(logits.flatten(0, 1), rows["labels"].flatten(), ignore_index=-100)
    dense = config.alpha * divergence + (1 - config.alpha) * nll
    dense.backward()

    torch.testing.assert_close(loss, dense, rtol=1e-5, atol=0)
    torch.testing.assert_close(mean, dense.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(metrics[config.metric], divergence.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(metrics["distill/next_token_loss"], nll.detach(), rtol=1e-5, atol=0)
    assert tokens == (rows["labels"] != -100).sum()
    for name, param in student.named_parameters():
        torch.testing.assert_close(fused[name], param.grad, rtol=2e-5, atol=1e-7, msg=name)
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())


def test_alpha_one_trains_the_divergence_alone():
    """At ``alpha=1`` the next-token loss is logged, not differentiated: the gradients are the divergence's."""
    rows = batch()
    student, teacher = models()
    config = DistillationConfig(loss="forward_kl")
    loss, *_ = distillation_step(student, teacher, rows, config)
    loss.backward()
    fused = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    logits = student(rows["input_ids"], position_ids=rows["position_ids"])
    with torch.no_grad():
        teacher_logits = teacher(rows["input_ids"], position_ids=rows["position_ids"])
    jsd(logits, teacher_logits, 0.0)[rows["labels"] != -100].mean().backward()
    for got, want in zip(fused, (p.grad for p in student.parameters())):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)


# ---- the options -----------------------------------------------------------------------------------------------
SMALL_TEACHER = {"model": "debug", "model_overrides": {"dim": 256, "n_layers": 4}}


def test_a_preset_teacher_is_held_frozen_beside_the_student_by_its_own_shape():
    """The dict form: the teacher's shape is its own, it is declared on configure (one device: materialized), frozen,
    kept out of the module's children: no optimizer state, no checkpoint entry."""
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2}, teacher=SMALL_TEACHER,
                                  distillation={"loss": "jsd", "alpha": 0.5}, init_seed=3, max_steps=4)
    assert module.hparams["teacher"] == SMALL_TEACHER and module.hparams["distillation"]["loss"] == "jsd"
    assert module.distillation == DistillationConfig(loss="jsd", alpha=0.5)
    module.configure_model()
    teacher = module.teacher
    assert teacher is not None and module.frozen_models() == [teacher] and teacher.name == "teacher"
    assert teacher.frozen().args.dim == 256 and len(teacher.frozen().layers) == 4
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert all(not p.is_meta for p in teacher.parameters())
    assert not any(k.startswith("teacher") or "layers.3" in k for k in module.state_dict())
    teacher_ids = {id(p) for p in teacher.parameters()}
    optimizer = module.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.model.parameters()}
    assert not teacher_ids & optimized and not teacher_ids & {id(p) for p in module.parameters()}


def test_a_folder_teacher_reads_its_shape_and_its_tokenizer_is_checked(tmp_path):
    """A Hugging Face Llama folder: its config gives the shape, its weights the values; a folder whose tokenizer maps
    other tokens than the student's is refused, naming both."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    for name, vocab in (("teacher", ["a", "b"]), ("same", ["a", "b"]), ("other", ["b", "a"])):
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer = {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab)}, "merges": []},
                     "added_tokens": [], "normalizer": None if name != "same" else {"type": "NFC"}}
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(tokenizer))
    module = LlamaLightningModule(init_from=str(tmp_path / "same"), teacher=str(tmp_path / "teacher"),
                                  distillation={"loss": "forward_kl"})
    assert module._teacher_spec.facts.vocab_size == 256 and module.hparams["teacher"] == {
        "init_from": str(tmp_path / "teacher")}
    module.configure_model()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "teacher")
    torch.testing.assert_close(module.teacher.frozen().output.weight, loaded.lm_head.weight)
    with pytest.raises(DistillationConfigError, match=r"the teacher's tokenizer \(.*teacher/tokenizer.json\) maps"
                                                      r" other tokens to ids than the student's \(.*other/"):
        LlamaLightningModule(init_from=str(tmp_path / "other"), teacher=str(tmp_path / "teacher"),
                             distillation={"loss": "forward_kl"})


def test_the_yaml_dict_form_parses_through_the_cli(tmp_path, monkeypatch):
    from lightning_2d.tools.cli import cli_main

    monkeypatch.setattr(sys, "argv", ["lightning-2d"])
    config = tmp_path / "distill.yaml"
    config.write_text(
        "model:\n  model: debug\n  model_overrides: {n_layers: 2}\n"
        "  teacher:\n    model: debug\n    model_overrides: {dim: 256, n_layers: 4}\n"
        "  distillation: {loss: jsd, beta: 0.3, temperature: 2.0, alpha: 0.5, tokens: all}\n"
    )
    module = cli_main([f"--config={config}", "--trainer.accelerator=cpu", "--trainer.devices=1",
                       "--trainer.logger=false"], run=False).model
    assert module.distillation == DistillationConfig(loss="jsd", beta=0.3, temperature=2.0, alpha=0.5, tokens="all")
    assert module._teacher_spec.facts.name == "preset 'debug' with {'dim': 256, 'n_layers': 4}"


def test_the_hugging_face_module_distils_from_a_teacher_of_another_family():
    """A Qwen3 student from a wider Llama teacher, one step on one device against the dense computation."""
    pytest.importorskip("transformers")
    from lightning_2d.hf import HFCausalLMModule

    student_config = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                      "max_position_embeddings": 64}
    teacher = {"config": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "max_position_embeddings": 64}}
    config = DistillationConfig(loss="jsd", temperature=1.5, alpha=0.6, tokens="all")
    module = HFCausalLMModule(student_config, teacher=teacher, distillation=config, init_seed=5)
    module.configure_model()
    rows = batch()
    loss, *_ = module._distillation_step(rows, train=False)
    logits = module(rows["input_ids"], position_ids=rows["position_ids"])
    with torch.no_grad():
        teacher_logits = module.logits_of(module.teacher.frozen(), rows["input_ids"], rows["position_ids"])
    mask = expected_mask(rows, "all")
    dense = 0.6 * jsd(logits, teacher_logits, 0.5, 1.5)[mask].mean() + 0.4 * F.cross_entropy(
        logits.flatten(0, 1), rows["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, dense, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("settings", "pattern"), [
    ({"loss": "kl"}, r"distillation loss must be one of forward_kl, reverse_kl, jsd; got 'kl'"),
    ({"loss": "forward_kl", "beta": 0.5}, r"beta=0.5 weighs jsd's mixture, but loss='forward_kl'"),
    ({"loss": "jsd", "beta": 1.0}, r"beta must be in \(0, 1\) for jsd, got 1.0: its ends are the KLs"),
    ({"alpha": 0.0}, r"alpha must be in \(0, 1\]"),
    ({"temperature": 0}, r"temperature must be a positive number"),
    ({"tokens": "prompt"}, r"tokens must be one of trained, all"),
    ({"chunk": 3}, r"distillation has no field\(s\) \['chunk'\]"),
])
def test_bad_settings_are_refused_naming_the_value(settings, pattern):
    with pytest.raises(DistillationConfigError, match=pattern):
        DistillationConfig.of(settings)


def test_a_qlora_student_learns_from_its_teacher_on_one_device():
    """A QLoRA student (NF4 bases, rank-4 adapters) beside a teacher: the teacher is never converted (plain weights,
    no adapters), two steps train the adapters only (the NF4 bases and the teacher bit for bit unchanged), and the
    logged divergence is finite and positive."""
    import lightning as L

    from lightning_2d.ops.nf4 import is_nf4

    qlora = {"rank": 4, "quantize_base": "nf4", "targets": ["wq", "wo"]}  # 128 × 128: whole NF4 scaler groups
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2}, lora=qlora,
                                  teacher=SMALL_TEACHER, distillation={"alpha": 0.5}, init_seed=3, max_steps=2,
                                  learning_rate=1e-2)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": t[:-1], "labels": t[1:]} for t in torch.randint(0, 256, (4, 33), generator=g)]
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def plain(tensor: torch.Tensor) -> torch.Tensor:  # an NF4 base compared by its dequantized values
        return tensor.get_original_weight() if is_nf4(tensor) else tensor.detach().clone()

    class Snapshot(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen["before"] = {**{f"teacher.{k}": plain(v) for k, v in pl_module.teacher.state_dict().items()},
                              **{k: plain(v) for k, v in pl_module.model.state_dict().items()}}

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Snapshot()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(rows, batch_size=2))
    teacher = module.teacher
    assert not any(is_nf4(p) or "lora" in n for n, p in teacher.named_parameters())
    after = {**{f"teacher.{k}": v for k, v in teacher.state_dict().items()}, **module.model.state_dict()}
    changed = {k for k, v in seen["before"].items() if not torch.equal(v, plain(after[k]))}
    assert changed and all("lora" in k for k in changed)  # the adapters only: no base, no norm, nothing of the teacher
    assert any(is_nf4(p) for p in module.model.parameters())
    divergence = float(trainer.callback_metrics["distill/forward_kl"])
    assert divergence > 0 and torch.isfinite(torch.tensor(divergence))
