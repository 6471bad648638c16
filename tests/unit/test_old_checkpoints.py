"""Checkpoints written by lightning_2d 0.1.0 (``tests/fixtures/checkpoints_v0_1``, see its ``make_checkpoints.py``)
still read with the current code: exported to Hugging Face they hold the weights saved then."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_2d.checkpoint.hf import export_hf, hf_name, to_hf_tensor
from lightning_2d.models.llama.model import ModelArgs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_v0_1"


@pytest.mark.parametrize("name", ["sharded.ckpt", "full.ckpt"])
def test_a_checkpoint_of_version_0_1_exports_the_weights_it_holds(tmp_path, name):
    from safetensors.torch import load_file

    out = export_hf(FIXTURES / name, tmp_path / "hf")
    exported = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (32, 2, 64)
    saved = torch.load(FIXTURES / "weights.pt")
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)
    assert sorted(exported) == sorted(hf_name(k) for k in saved)
    for key, weight in saved.items():
        torch.testing.assert_close(exported[hf_name(key)], to_hf_tensor(key, weight, args, None), rtol=0, atol=0, msg=key)
