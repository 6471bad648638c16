"""Context parallelism equals one device: real jobs of CPU processes on gloo, 6 fp32 AdamW steps against the
single-device ``Trainer`` on the same batches.

Context 2 (2 processes) and 4, context 2 × data 2, × tensor 2 with sequence parallelism, × pipeline 2 (1F1B), each
causal and with packed documents (the mask and positions follow the load-balanced slices), 2 blocks of the debug
model (``SMALL``; the pipeline's stages one each). The attention of one
rank's slice against every rank's keys is a unit test (tests/unit/test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import SMALL, load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

COMPOSITIONS = {  # name: (dp, tp, extra options)
    "cp2": (1, 1, {"context_parallel_size": 2}),
    "cp4": (1, 1, {"context_parallel_size": 4}),
    "cp2_dp2": (2, 1, {"context_parallel_size": 2}),
    "cp2_tp2": (1, 2, {"context_parallel_size": 2}),
    "cp2_pp2": (1, 1, {"context_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "1F1B"}),
}


def _nprocs(dp: int, tp: int, extra: dict) -> int:
    return dp * tp * extra["context_parallel_size"] * extra.get("pipeline_parallel_size", 1)


@pytest.fixture(scope="module")
def context_runs(jobs):
    """Every (composition, masking) run; those of one process count share a launch (one fit after another)."""
    runs = {}
    for nprocs in sorted({_nprocs(*spec) for spec in COMPOSITIONS.values()}):
        group = {f"{name}_{'documents' if documents else 'causal'}": (dp, tp, {**extra, "documents": documents, **SMALL})
                 for name, (dp, tp, extra) in COMPOSITIONS.items() if _nprocs(dp, tp, extra) == nprocs
                 for documents in (False, True)}
        runs.update(jobs.layouts(f"context_parallel_{nprocs}procs", group, nprocs=nprocs))
    return runs


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_context_parallel_training_equals_one_device(jobs, context_runs, name, documents):
    dp, tp, extra = COMPOSITIONS[name]
    reference = jobs.reference(documents=True, **SMALL) if documents else jobs.reference(**SMALL)
    cp, nprocs = extra["context_parallel_size"], _nprocs(dp, tp, extra)
    run = context_runs[f"{name}_{'documents' if documents else 'causal'}"]
    ref = reference.rank_output(0)
    for rank in range(nprocs):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], ref["losses"])
        print(f"{name} ({'documents' if documents else 'causal'}) rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
        assert "context_parallel" in out["mesh_dims"] and out["mesh_shape"][out["mesh_dims"].index("context_parallel")] == cp
        # Every attention layer this rank holds exchanges keys and values (not the one-device core).
        held = {name.split(".")[1] for name in out["placements"] if name.startswith("layers.")}
        assert held and out["context_parallel_attention"] == sorted(f"layers.{b}.attention" for b in held), out
        # The ring (the measured alternative) over this layout's real context group agrees with the all-gather.
        assert out["ring_vs_all_gather"] <= 1e-5, out["ring_vs_all_gather"]
        # FSDP shards over data-shard × context ranks: the parameters are split over dp · cp ranks.
        sizes = dict(zip(*out["fsdp_mesh"]))
        assert sizes["data_shard_context_parallel"] == dp * cp and sizes.get("tensor_parallel", 1) == tp, sizes
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()
    for weight_name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[weight_name], rtol=1e-5, atol=1e-5, msg=weight_name)
