"""Document masking of packed windows (``TextDataModule(document_mask=True)``): positions restart at each
document, attention stays within it, and a packed window equals its documents run one at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_2d import ParallelConfigError
from lightning_2d.data import DataError, TextDataModule
from lightning_2d.data.loading import document_positions
from lightning_2d.integration.module import CausalLMModule, LlamaLightningModule
from lightning_2d.integration.validation import model_context
from lightning_2d.models.llama.model import PRESETS, Transformer, document_causal_mask
from lightning_2d.parallel.config import ParallelConfig
from lightning_2d.parallel.dims import validate_parallel_dims

EOS = 0


def test_positions_restart_after_each_end_of_text_token():
    tokens = torch.tensor([5, 6, EOS, 7, 8, 9, EOS, EOS, 4])
    assert document_positions(tokens, EOS).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0]
    batch = torch.stack([tokens, tokens.flip(0)])
    assert document_positions(batch, EOS)[1].tolist() == document_positions(tokens.flip(0), EOS).tolist()


def test_the_mask_is_causal_within_documents_only():
    mask = document_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def _packed_window(vocab: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Inputs and labels of one window packing documents of ``lengths`` tokens (each closed by EOS), and the
    input span of each document."""
    g = torch.Generator().manual_seed(0)
    stream = torch.cat([torch.cat([torch.randint(1, vocab, (n,), generator=g), torch.tensor([EOS])]) for n in lengths])
    inputs, labels = stream[:-1], stream[1:]
    spans, start = [], 0
    for n in lengths:
        spans.append((start, min(start + n + 1, inputs.numel())))
        start += n + 1
    return inputs[None], labels[None], spans


def test_a_packed_window_equals_its_documents_run_one_at_a_time():
    args = PRESETS["debug"]
    model = Transformer(args, loss_chunk_size=None)
    model.init_weights(0)
    inputs, labels, spans = _packed_window(args.vocab_size, [5, 9, 4])
    positions = document_positions(inputs, EOS)

    packed = model(inputs, labels=labels, position_ids=positions)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    separate = sum(model(inputs[:, a:b], labels=labels[:, a:b]) for a, b in spans)
    separate.backward()
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Without the positions the documents see each other: the packed loss is another number.
    assert not torch.allclose(model(inputs, labels=labels), separate, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_hugging_face_decoder_keeps_packed_documents_apart(model_type):
    """transformers' own mask builder sees the restarting positions (no attention mask): a packed window gives the
    loss and gradients of its documents run one at a time, as our Llama does."""
    from lightning_2d.hf import HFCausalLMModule

    config = {"model_type": model_type, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    module = HFCausalLMModule(config, init_seed=0)
    module.configure_model()
    assert module.supports_document_mask
    inputs, labels, spans = _packed_window(64, [5, 9, 4])
    positions = document_positions(inputs, EOS)
    ce = nn.functional.cross_entropy

    packed = ce(module(inputs, position_ids=positions)[0], labels[0], reduction="sum")
    packed.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    separate = sum(ce(module(inputs[:, a:b])[0], labels[0, a:b], reduction="sum") for a, b in spans)
    separate.backward()
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)
    for name, param in module.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.allclose(ce(module(inputs)[0], labels[0], reduction="sum"), separate, rtol=1e-4)


def test_the_datamodule_carries_each_documents_positions(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(["first doc\n", "the second one\n", "third\n" * 3]):
        (corpus / f"d{i}.txt").write_text(text)
    data = TextDataModule(str(corpus), seq_len=16, batch_size=2, val_fraction=0.0, shuffle=False,
                          cache_dir=str(tmp_path / "cache"), document_mask=True)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["position_ids"].shape == batch["input_ids"].shape
    assert torch.equal(batch["position_ids"], document_positions(batch["input_ids"], EOS))
    assert (batch["position_ids"] == 0).sum() > batch["input_ids"].shape[0]  # documents start inside windows
    plain = TextDataModule(str(corpus), seq_len=16, batch_size=2, val_fraction=0.0, shuffle=False,
                           cache_dir=str(tmp_path / "cache"))
    plain.setup("fit")
    assert "position_ids" not in next(iter(plain.train_dataloader()))


def test_document_masking_without_an_end_of_text_token_is_refused(monkeypatch):
    import lightning_2d.data.datamodule as datamodule

    no_eos = type("NoEos", (), {"eos_id": None, "vocab_size": 10})()
    monkeypatch.setattr(datamodule, "load_tokenizer", lambda spec, eos: no_eos)
    with pytest.raises(DataError, match=r"document_mask=True needs an end-of-text token .*eos_token=\.\.\."):
        TextDataModule(tokenizer="tokenizer.json", document_mask=True)


class _NoPositions(CausalLMModule):
    pass


def test_document_masking_is_refused_before_launch_where_it_cannot_work():
    data = type("Data", (), {"document_mask": True, "seq_len": 16, "batch_size": 2})()
    with pytest.raises(ParallelConfigError, match=r"_NoPositions cannot take them .*Use LlamaLightningModule or"
                                                  r" HFCausalLMModule"):
        validate_parallel_dims(ParallelConfig(), world_size=1, devices_per_node=1,
                               **model_context(_NoPositions(), data, ParallelConfig(), None, before_launch=True))
    for config in (ParallelConfig(), ParallelConfig(pipeline_parallel_size=2)):  # the stages take positions too
        assert model_context(LlamaLightningModule("debug"), data, config, None)["seq_len"] == 16


def test_the_lightning_module_passes_the_positions_to_the_model():
    module = LlamaLightningModule("debug")
    seen = {}

    class Spy(nn.Module):
        def forward(self, tokens, labels=None, position_ids=None):
            seen["position_ids"] = position_ids
            return torch.zeros((), requires_grad=True)

    module.model = Spy()
    positions = torch.tensor([[0, 1, 0, 1]])
    module._loss({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long),
                  "position_ids": positions})
    assert seen["position_ids"] is positions
