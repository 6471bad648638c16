"""The attention core (``lightning_2d.ops.attention``) and its one mask per batch, on CPU.

FlexAttention's block-mask path is what CUDA runs (document masks, context parallelism); torch 2.13 runs its
forward on CPU (eagerly: no backward there), so ``flex=True`` forces it here and it is checked against the dense
path. Its backward is checked in tests/gpu/test_attention.py. The context-parallel forms (ranks as threads) are in
tests/unit/test_context_parallel.py.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lightning_2d.data.loading import document_positions
from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.models.llama.pipeline import PipelineStageModule
from lightning_2d.ops import attention as ops_attention
from lightning_2d.ops.attention import attend, attention_mask, document_block_mask, document_causal_mask
from tests.unit.test_context_parallel import EAGER_FLEX, check_block_mask, count_masks


def _documents(batch: int, length: int, ends: list[list[int]]) -> torch.Tensor:
    """Positions of windows whose end-of-text tokens (id 1) are at ``ends[b]``."""
    tokens = torch.zeros(batch, length, dtype=torch.long)
    for b, where in enumerate(ends):
        tokens[b, where] = 1
    return document_positions(tokens, eos_id=1)


@pytest.mark.filterwarnings(EAGER_FLEX)
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)], ids=["grouped-query", "multi-head"])
def test_the_block_mask_path_equals_the_dense_path(heads, kv_heads):
    """Documents across and inside 128-token blocks, grouped-query attention (the key/value heads not repeated for
    FlexAttention) or not: the block mask's forward equals SDPA under the dense mask, and its block tables (what the
    CUDA kernel reads) are the dense mask's."""
    torch.manual_seed(0)
    batch, length, dim = 2, 384, 16
    positions = _documents(batch, length, [[40, 130, 131, 250, 300], [200]])
    q = torch.randn(batch, heads, length, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    block = attention_mask(positions, flex=True)
    dense = attention_mask(positions, flex=False)
    assert torch.equal(dense, document_causal_mask(positions))  # the default off CUDA
    check_block_mask(block, dense[:, 0])
    assert int(block.to_dense().sum()) < block.to_dense().numel()  # blocks across documents are skipped
    with torch.no_grad():
        flex, reference = attend(q, k, v, block), attend(q, k, v, dense)
    difference = float((flex - reference).abs().max())
    print(f"\nflex vs dense, documents, H {heads} / H_kv {kv_heads}: max |difference| {difference:.2e}")
    torch.testing.assert_close(flex, reference, rtol=1e-5, atol=2e-6)


@pytest.mark.filterwarnings(EAGER_FLEX)
@pytest.mark.parametrize("flex", [False, True], ids=["dense", "block"])
def test_the_model_builds_one_mask_per_forward_for_all_its_layers(flex):
    """4 layers with packed documents: one mask per forward (not one per layer), the same object in every layer; the
    block-mask model (CUDA's path, forced) gives the dense model's logits."""
    args = PRESETS["debug"]
    model = Transformer(args)
    model.init_weights(0)
    tokens = torch.randint(2, args.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    positions = _documents(2, 256, [[60, 140], [10]])
    with torch.no_grad():
        reference = model(tokens, position_ids=positions)
    model.build_attention_mask = functools.partial(attention_mask, flex=flex)
    builds, seen = count_masks(model)
    for step in range(2):
        with torch.no_grad():
            logits = model(tokens, position_ids=positions)
        assert len(builds) == step + 1, f"{len(builds)} masks built in {step + 1} forwards of {args.n_layers} layers"
        assert len(seen) == args.n_layers * (step + 1) and all(m is builds[-1] for m in seen[-args.n_layers:])
    assert ops_attention.is_block_mask(builds[-1]) == flex
    difference = float((logits - reference).abs().max())
    print(f"\nmodel, {'block' if flex else 'dense'} mask: max |logits - dense| {difference:.2e}")
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # without documents: no mask, plain causal attention
        model(tokens)
    assert len(builds) == 2 and seen[-1] is None


def test_each_pipeline_stage_builds_one_mask_per_micro_batch():
    """Two stages of two blocks: each builds the mask once per call (one micro-batch), with the model's builder (so
    context parallelism's, once installed), and together they give the model's loss."""
    args = PRESETS["debug"]
    model = Transformer(args)
    model.init_weights(3)
    tokens = torch.randint(2, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = _documents(2, 32, [[5, 20], [9]])
    expected = model(tokens, labels=labels, position_ids=positions)
    builds, seen = count_masks(model)
    first = PipelineStageModule(model, ["0", "1"], first=True, last=False)
    last = PipelineStageModule(model, ["2", "3"], first=False, last=True)
    for stage in (first, last):
        stage.seq_len = 32
    hidden = first(tokens, position_ids=positions)
    assert len(builds) == 1 and len(seen) == 2
    loss = last(hidden, labels=labels, position_ids=positions)
    assert len(builds) == 2 and len(seen) == 4 and seen[2] is seen[3] is builds[1]
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings(EAGER_FLEX)
def test_flex_attention_is_compiled_once_for_the_process_and_used_by_every_layer(monkeypatch):
    """With the device type compiled (CPU here, standing in for CUDA: compiling for real costs ~80 s on CPU), two
    forwards of a 4-layer model and a second model compile FlexAttention and ``create_block_mask`` once each, every
    layer calls that one compiled FlexAttention and each forward builds its mask with the compiled builder.
    ``torch.compile`` is counted (it returns the eager functions, which run on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled, calls = [], []
    real_compile = torch.compile

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        if fn not in (flex_attention, create_block_mask):  # FlexAttention's eager path compiles its own helpers
            return real_compile(fn, **kwargs)

        def compiled_fn(*args: Any, **kw: Any) -> Any:
            calls.append(fn.__name__)
            return fn(*args, **kw)

        compiled.append(fn)
        return compiled_fn

    monkeypatch.setattr(ops_attention, "_compiled", {})
    monkeypatch.setattr(ops_attention, "COMPILED_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(torch, "compile", fake_compile)
    args = PRESETS["debug"]
    tokens = torch.randint(2, args.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    positions = _documents(1, 128, [[50]])
    for seed in (0, 1):
        model = Transformer(args)
        model.init_weights(seed)
        model.build_attention_mask = functools.partial(attention_mask, flex=True)
        with torch.no_grad():
            model(tokens, position_ids=positions)
            model(tokens, position_ids=positions)
    assert compiled == [create_block_mask, flex_attention]
    assert calls == (["create_block_mask"] + ["flex_attention"] * args.n_layers) * 4
    flex = ops_attention.compiled_flex_attention()
    assert ops_attention.flex_attention_for(torch.device("cpu")) is flex
    assert ops_attention.flex_attention_for(torch.device("cuda")) is flex
    assert ops_attention.create_block_mask_for(torch.device("cuda")) is ops_attention.compiled_create_block_mask()
    monkeypatch.setattr(ops_attention, "COMPILED_DEVICE_TYPES", ("cuda",))  # the default: eager elsewhere
    assert ops_attention.flex_attention_for(torch.device("cpu")) is flex_attention


def test_without_positions_there_is_no_mask_and_the_default_follows_the_device():
    positions = _documents(1, 8, [[3]])
    assert attention_mask(None) is None and attention_mask(None, flex=True) is None
    assert isinstance(attention_mask(positions), torch.Tensor)  # CPU: the dense mask
    assert not ops_attention.is_block_mask(None) and not ops_attention.is_block_mask(torch.ones(1))
    assert ops_attention.is_block_mask(document_block_mask(positions))
