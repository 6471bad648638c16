"""Document masking (packed documents kept apart) under FSDP × TP/SP and under pipeline parallelism equals one
device.

Two real jobs of 4 CPU processes on gloo (one launch: ``Jobs.share``), against the single-device ``Trainer`` on the same batches (samples
packing several documents: ``position_ids`` restart after each end-of-text token), 6 fp32 AdamW steps: 2
data-parallel × 2 tensor-parallel ranks with sequence parallelism (the mask built from the positions reaches the
blocks by keyword, beside the sequence-sharded hidden states), and 2 pipeline stages × 2 data-parallel ranks (every
stage receives the positions and builds the mask). The packed-vs-separate equality itself is a unit test (tests/unit/test_document_mask.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed


PIPELINED = {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "documents": True}


@pytest.fixture(scope="module", autouse=True)
def shared_launches(jobs):
    """The two jobs (and the reference, unless an earlier module ran it) in one launch per process count."""
    jobs.share("document_mask", [jobs.reference_job(documents=True), jobs.layout_job(2, 2, documents=True),
                                 jobs.layout_job(2, 1, nprocs=4, **PIPELINED)])


def test_document_masking_at_2x2_with_sequence_parallelism_equals_one_device(jobs):
    reference, run = jobs.reference(documents=True), jobs.layout(2, 2, documents=True)
    ref = reference.rank_output(0)
    assert ref["blocks_given_masks"] >= len(ref["losses"]) > 0  # the reference masked too
    for rank in range(4):
        out = run.rank_output(rank)
        assert out["blocks_given_masks"] >= len(out["losses"])  # every step's blocks got the documents' mask
        error = worst_relative_error(out["losses"], ref["losses"])
        print(f"rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def test_document_masking_under_pipeline_parallelism_equals_one_device(jobs):
    """2 pipeline stages (1F1B) × 2 data-parallel ranks: every stage receives the positions (keyword arguments of
    the schedule's step reach each stage), against the same single-device reference."""
    reference = jobs.reference(documents=True)
    run = jobs.layout(2, 1, nprocs=4, **PIPELINED)
    ref = reference.rank_output(0)
    for rank in range(4):
        out = run.rank_output(rank)
        if "0" in out["blocks"]:  # the ranks of the first stage hold block 0, whose calls are counted
            assert out["blocks_given_masks"] >= len(out["losses"])
        error = worst_relative_error(out["losses"], ref["losses"])
        print(f"pipeline rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
    assert sum("0" in run.rank_output(r)["blocks"] for r in range(4)) == 2
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
