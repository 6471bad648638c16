"""Hugging Face interop on one process: export → transformers' logits equal ours; import back."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
import transformers  # test-only dependency (the test extra)

from lightning_2d import LlamaLightningModule, ModelArgs, Transformer
from lightning_2d.hf import export_hf, hf_to_meta, meta_to_hf, model_args_from_hf

ARGS = ModelArgs.from_name("debug", n_layers=2, rope_theta=500000.0)


def hf_reference_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' convert_llama_weights_to_hf.permute, written out independently."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def test_rotary_permutation_round_trips():
    w = torch.randn(8 * 16, 32)
    assert torch.equal(meta_to_hf(w, 8), hf_reference_permute(w, 8))
    assert torch.equal(hf_to_meta(meta_to_hf(w, 8), 8), w)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained-looking model (random but not the init), saved as a full Lightning checkpoint and exported."""
    root = tmp_path_factory.mktemp("hf")
    model = Transformer(ARGS)
    model.init_weights(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # norms no longer exactly one
    checkpoint = root / "full.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "model_args": asdict(ARGS)}, checkpoint)
    export_hf(checkpoint, root / "hf")
    export_hf(checkpoint, root / "hf_sharded", max_shard_bytes=200_000)
    return model, root


def test_transformers_loads_the_export_with_equal_logits(exported):
    model, root = exported
    hf = transformers.LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["intermediate_size"] == ARGS.ffn_hidden_dim and config["num_key_value_heads"] == 4


def test_sharded_export_has_an_index(exported):
    _, root = exported
    index = json.loads((root / "hf_sharded" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((root / "hf_sharded" / f).is_file() for f in files)


@pytest.mark.parametrize("folder", ["hf", "hf_sharded"])
def test_init_from_reads_the_weights_back_exactly(exported, folder):
    model, root = exported
    module = LlamaLightningModule(init_from=str(root / folder))
    assert module.model_args.ffn_hidden_dim == ARGS.ffn_hidden_dim
    module.configure_model()
    for name, weight in model.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], weight), name
    assert model_args_from_hf(root / folder).rope_theta == 500000.0


def test_init_from_refuses_a_different_shape(exported):
    _, root = exported
    with pytest.raises(ValueError, match=r"does not match .*config\.json: n_layers: 4 vs 2"):
        LlamaLightningModule("debug", init_from=str(root / "hf")).configure_model()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        LlamaLightningModule(init_from=str(root))
