"""Strategy options keep single-device numerics: loss parallel, SP off, reshard policies, clipping,
bf16 precisions and compile."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

CLIP = 0.5
OPTIONS = {
    "loss-parallel": {"loss_parallel": True, "reshard_after_forward": "never"},
    "no-sequence-parallel": {"sequence_parallel": False, "loss_parallel": True},
    "no-sequence-parallel-reshard-always": {"sequence_parallel": False, "reshard_after_forward": "always"},
}


def test_clipping_is_active_in_these_runs(jobs):
    out = jobs.reference(gradient_clip_val=CLIP).rank_output(0)
    # Every step's gradient norm exceeds the threshold, so every step is clipped to it.
    assert min(out["grad_norms"]) > 2 * CLIP
    assert out["stepped_grad_norms"] == pytest.approx([CLIP] * 6, rel=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_with_gradient_clipping_matches_single_device(jobs, name):
    """Gradient clipping needs the global norm over DTensors (on two meshes when SP is off)."""
    run = jobs.layout(2, 2, gradient_clip_val=CLIP, **OPTIONS[name])
    reference = jobs.reference(gradient_clip_val=CLIP)
    ref_out = reference.rank_output(0)
    for rank in range(4):
        out = run.rank_output(rank)
        assert worst_relative_error(out["losses"], ref_out["losses"]) <= LOSS_RTOL
        assert out["grad_norms"] == pytest.approx(ref_out["grad_norms"], rel=1e-5)
        assert out["stepped_grad_norms"] == pytest.approx([CLIP] * 6, rel=1e-5)
    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    for name_, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name_], rtol=1e-5, atol=1e-5, msg=name_)


@pytest.mark.parametrize(("precision", "shard_dtype"), [("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")])
def test_bf16_precisions(jobs, precision, shard_dtype):
    out = jobs.layout(2, 2, precision=precision).rank_output(0)
    # bf16 compute follows the fp32 run within bf16 rounding over 6 steps.
    assert worst_relative_error(out["losses"], jobs.reference().rank_output(0)["losses"]) <= 2e-3
    assert {p["dtype"] for p in out["placements"].values()} == {shard_dtype}


def test_compiled_blocks_match_single_device(jobs):
    losses = jobs.layout(2, 2, compile=True).rank_output(0)["losses"]
    # Inductor fuses and reorders fp32 reductions: equal up to a few ulps of accumulated rounding.
    assert worst_relative_error(losses, jobs.reference().rank_output(0)["losses"]) <= 1e-4
