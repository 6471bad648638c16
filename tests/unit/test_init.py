"""Layout-independent seeded init: any block of a parameter equals the same slice of the full init."""

from __future__ import annotations

import pytest
import torch

import lightning_2d.ops.init as init_module
from lightning_2d.ops.init import InitSpec, fill_block_

SPECS = [InitSpec("normal", std=0.5), InitSpec("trunc_normal", std=0.02), InitSpec("constant", value=1.0)]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # Small blocks so the shapes below span several blocks, with blocks ending mid-shard.
    monkeypatch.setattr(init_module, "BLOCK_NUMEL", 24)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
@pytest.mark.parametrize("shape", [(37, 5), (10, 3, 4), (50,)])
def test_every_block_equals_the_slice_of_the_full_tensor(spec, shape):
    full = fill_block_(torch.empty(shape), spec, seed=11, name="w", global_shape=shape)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        offset = [int(torch.randint(0, n, (1,), generator=g)) for n in shape]
        size = [int(torch.randint(1, n - o + 1, (1,), generator=g)) for n, o in zip(shape, offset)]
        block = fill_block_(torch.empty(size), spec, seed=11, name="w", global_shape=shape, offset=offset)
        expected = full[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        assert torch.equal(block, expected), (offset, size)


def test_seed_and_name_change_the_values_and_dtype_is_honoured():
    shape = (8, 8)
    a = fill_block_(torch.empty(shape), SPECS[0], seed=1, name="a", global_shape=shape)
    assert not torch.equal(a, fill_block_(torch.empty(shape), SPECS[0], seed=2, name="a", global_shape=shape))
    assert not torch.equal(a, fill_block_(torch.empty(shape), SPECS[0], seed=1, name="b", global_shape=shape))
    half = fill_block_(torch.empty(shape, dtype=torch.bfloat16), SPECS[0], seed=1, name="a", global_shape=shape)
    assert torch.equal(half, a.to(torch.bfloat16))


def test_truncated_normal_respects_cutoff():
    spec = InitSpec("trunc_normal", std=1.0, truncation=1.5)
    values = fill_block_(torch.empty(400, 7), spec, seed=0, name="t", global_shape=(400, 7))
    assert values.abs().max() <= 1.5 and values.std() > 0.5


def test_mismatched_block_is_reported():
    with pytest.raises(ValueError, match=r"w: local block of shape \(2, 2\) at offset \(0,\)"):
        fill_block_(torch.empty(2, 2), SPECS[0], seed=0, name="w", global_shape=(4, 4), offset=(0,))
