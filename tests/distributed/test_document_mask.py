"""Document masking (packed documents kept apart) under FSDP × TP/SP equals one device.

One real job: 4 CPU processes on gloo, 2 data-parallel × 2 tensor-parallel ranks with sequence parallelism,
batches whose samples pack several documents (``position_ids`` restart after each end-of-text token), 6 fp32
AdamW steps against the single-device ``Trainer`` on the same batches. The positions reach the blocks through
the tensor-parallel plan (by keyword, beside the sequence-sharded hidden states); the packed-vs-separate
equality itself is a unit test (tests/unit/test_document_mask.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed


def test_document_masking_at_2x2_with_sequence_parallelism_equals_one_device(jobs):
    reference, run = jobs.reference(documents=True), jobs.layout(2, 2, documents=True)
    ref = reference.rank_output(0)
    assert ref["blocks_given_positions"] >= len(ref["losses"]) > 0  # the reference masked too
    for rank in range(4):
        out = run.rank_output(rank)
        assert out["blocks_given_positions"] >= len(out["losses"])  # every step's blocks got the positions
        error = worst_relative_error(out["losses"], ref["losses"])
        print(f"rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
