"""The Llama model alone: presets, shapes, rotary embedding (and Llama 3.1's scaling), causality, seeded init."""

from __future__ import annotations

import ast
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import lightning_2d.models.llama.model as model_module
from lightning_2d.models.llama.model import (
    PRESETS,
    ModelArgs,
    RopeScaling,
    Transformer,
    apply_rotary_emb,
    rope_frequencies,
    rope_table,
)

# Published SwiGLU hidden sizes and parameter counts (Meta's model cards / reference code).
PUBLISHED = {
    "llama2-7b": (11008, 6.74e9),
    "llama2-13b": (13824, 13.0e9),
    "llama2-70b": (28672, 69.0e9),
    "llama3-8b": (14336, 8.03e9),
    "llama3-70b": (28672, 70.6e9),
    "llama3-405b": (53248, 405.9e9),
    "llama3.1-8b": (14336, 8.03e9),
    "llama3.1-70b": (28672, 70.6e9),
    "llama3.1-405b": (53248, 405.9e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_published_shapes(name):
    args = ModelArgs.from_name(name)
    hidden, params = PUBLISHED[name]
    assert args.ffn_hidden_dim == hidden
    assert args.num_params() == pytest.approx(params, rel=0.01)


def test_param_count_formula_matches_a_built_model():
    args = ModelArgs.from_name("debug")
    model = Transformer(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    assert args.num_params(exclude_embedding=True) == args.num_params() - args.vocab_size * args.dim


def test_meta_names_follow_meta_reference():
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_name("llama3-8b", n_layers=2))
    names = {n for n, _ in model.named_parameters()}
    for expected in (
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.1.attention.wo.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "norm.weight",
        "output.weight",
    ):
        assert expected in names
    assert model.layers["0"].attention.wk.weight.shape == (8 * 128, 4096)  # GQA: 8 kv heads of 128


def test_unknown_preset_and_bad_args_are_reported():
    with pytest.raises(ValueError, match="Unknown model name 'llama9'.*debug"):
        ModelArgs.from_name("llama9")
    with pytest.raises(ValueError, match=r"Unknown ModelArgs fields \['layers'\]"):
        ModelArgs.from_name("debug", layers=3)
    with pytest.raises(ValueError, match=r"n_heads \(6\) must divide dim \(128\)") as err:
        ModelArgs(dim=128, n_heads=6, vocab_size=-1)
    assert "vocab_size must be a positive integer, got -1" in str(err.value)
    with pytest.raises(ValueError, match=r"n_kv_heads \(3\) must divide n_heads \(8\)"):
        ModelArgs(dim=128, n_heads=8, n_kv_heads=3)


def test_rotary_embedding_equals_meta_complex_formulation():
    head_dim, seqlen, theta = 16, 10, 500000.0
    x = torch.randn(2, seqlen, 3, head_dim)
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    freqs_cis = torch.polar(torch.ones(seqlen, head_dim // 2), torch.outer(torch.arange(seqlen).float(), freqs))
    x_complex = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    expected = torch.view_as_real(x_complex * freqs_cis[None, :, None, :]).flatten(3)
    torch.testing.assert_close(apply_rotary_emb(x, rope_table(head_dim, seqlen, theta)), expected)


def test_llama31_presets_are_llama3_with_128k_scaled_rotary_positions():
    for size in ("8b", "70b", "405b"):
        llama3, llama31 = PRESETS[f"llama3-{size}"], PRESETS[f"llama3.1-{size}"]
        assert llama31.max_seq_len == 131072 and llama31.rope_theta == 500000.0
        assert llama31.rope_scaling == RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=8192)
        assert replace(llama31, max_seq_len=8192, rope_scaling=None) == llama3


# Llama 3.1's own (head size 128, theta 500000, factor 8 from 8192), and small ones where each band is visible.
SCALINGS = [
    (128, 500000.0, RopeScaling()),
    (16, 10000.0, RopeScaling(factor=4.0, original_max_position_embeddings=32)),
    (32, 500000.0, RopeScaling(factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0,
                               original_max_position_embeddings=64)),
]


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), SCALINGS)
def test_scaled_rotary_table_equals_transformers_llama3(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4,
        max_position_embeddings=scaling.original_max_position_embeddings * 8,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                         "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings": scaling.original_max_position_embeddings},
    )
    theirs = LlamaRotaryEmbedding(config)
    freqs = rope_frequencies(head_dim, theta, scaling)
    torch.testing.assert_close(freqs, theirs.inv_freq, rtol=1e-6, atol=0)
    # Their cos/sin repeat the head_dim // 2 frequencies in two halves (the rotate-half layout of their q/k rows);
    # ours pairs them. Positions well past the original length, where the scaling matters.
    length = 4 * scaling.original_max_position_embeddings
    cos, sin = theirs(torch.zeros(1, length, head_dim), torch.arange(length)[None])
    table = rope_table(head_dim, length, theta, scaling=scaling)
    for half in (slice(None, head_dim // 2), slice(head_dim // 2, None)):
        torch.testing.assert_close(table[..., 0], cos[0, :, half], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(table[..., 1], sin[0, :, half], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), SCALINGS)
def test_scaling_slows_the_low_frequencies_keeps_the_high_ones_and_interpolates_between(head_dim, theta, scaling):
    import math

    plain, scaled = rope_frequencies(head_dim, theta), rope_frequencies(head_dim, theta, scaling)
    wavelength = 2 * math.pi / plain
    original = scaling.original_max_position_embeddings
    high = wavelength < original / scaling.high_freq_factor
    low = wavelength > original / scaling.low_freq_factor
    assert high.any() and low.any()  # each band is present
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / scaling.factor)
    between = ~high & ~low
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / scaling.factor)).all()
    assert not torch.equal(rope_table(head_dim, 64, theta, scaling=scaling), rope_table(head_dim, 64, theta))


def test_rope_scaling_from_a_dict_and_its_refusals():
    args = ModelArgs.from_name("debug", rope_scaling={"rope_type": "llama3", "factor": 4.0})
    assert args.rope_scaling == RopeScaling(factor=4.0)  # the other fields: Llama 3.1's
    assert ModelArgs(**asdict(args)) == args  # as checkpoints store them (plain data) and read them back
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type 'yarn' is not supported; supported: 'llama3'"):
        ModelArgs.from_name("debug", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError) as err:
        ModelArgs.from_name("debug", n_heads=6, rope_scaling={
            "factor": 0.5, "low_freq_factor": 4.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 81.9,
            "beta_fast": 32,
        })
    message = str(err.value)
    for line in (  # every problem at once, each naming the field and the value
        "n_heads (6) must divide dim (128)",
        "rope_scaling has no field 'beta_fast'; its fields are rope_type, factor, low_freq_factor",
        "rope_scaling.factor must be a number of at least 1, got 0.5",
        "rope_scaling.high_freq_factor (2.0) must be greater than low_freq_factor (4.0)",
        "rope_scaling.original_max_position_embeddings must be a positive integer, got 81.9",
    ):
        assert line in message
    with pytest.raises(ValueError, match=r"rope_scaling\.low_freq_factor must be a positive number, got 'one'"):
        RopeScaling(low_freq_factor="one")
    with pytest.raises(ValueError, match=r"rope_scaling must be None, a RopeScaling or the dict of its fields, got 8"):
        ModelArgs(rope_scaling=8)


def test_a_scaled_model_built_on_meta_allocates_no_table_and_materializes_the_eager_one():
    with torch.device("meta"):
        big = Transformer(ModelArgs.from_name("llama3.1-405b", n_layers=1))
    assert big.rope.is_meta and big.rope.shape == (131072, 64, 2)
    args = ModelArgs.from_name("debug", max_seq_len=256, rope_scaling=RopeScaling(original_max_position_embeddings=32))
    eager = Transformer(args)
    with torch.device("meta"):
        lazy = Transformer(args)
    lazy.to_empty(device="cpu")
    lazy.init_buffers()
    assert torch.equal(lazy.rope, eager.rope)
    assert torch.equal(eager.rope, rope_table(args.head_dim, 256, args.rope_theta, scaling=args.rope_scaling))
    assert not torch.equal(eager.rope, Transformer(replace(args, rope_scaling=None)).rope)


def test_forward_is_causal_and_fp32():
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("debug"))
    model.init_weights(0)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_too_long_sequence_is_refused():
    model = Transformer(ModelArgs.from_name("debug", max_seq_len=8))
    with pytest.raises(ValueError, match="Sequence length 9 exceeds max_seq_len \\(8\\)"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_meta_build_then_init_equals_eager_init():
    args = ModelArgs.from_name("debug")
    eager = Transformer(args)
    eager.init_weights(3)
    with torch.device("meta"):
        lazy = Transformer(args)
    lazy.to_empty(device="cpu")
    lazy.init_weights(3)
    for (name, a), (_, b) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(eager.rope, lazy.rope)
    other = Transformer(args)
    other.init_weights(4)
    assert not torch.equal(other.output.weight, eager.output.weight)


def test_init_follows_torchtitan_scales():
    args = ModelArgs.from_name("debug", dim=256, n_heads=8, n_kv_heads=4)
    model = Transformer(args)
    model.init_weights(0)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers["3"].attention.wo.weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.05)
    out = model.output.weight
    assert out.abs().max().item() <= 3 * 256**-0.5 + 1e-6
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_model_file_does_not_import_torch_distributed():
    tree = ast.parse(Path(model_module.__file__).read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert imported and not any("torch.distributed" in (name or "") for name in imported)


def test_debug_preset_supports_tensor_parallel_1_2_4():
    args = PRESETS["debug"]
    for tp in (1, 2, 4):
        assert args.n_heads % tp == 0 and args.kv_heads % tp == 0 and args.ffn_hidden_dim % tp == 0
