"""Context parallelism equals one device: real jobs of 4 CPU processes on gloo, 6 fp32 AdamW steps against the
single-device ``Trainer`` on the same batches.

Each job holds a different mix, so that together they cover every composition once: context 2 × data 2 (causal),
context 2 × tensor 2 with sequence parallelism (packed documents: the mask and positions follow the load-balanced
slices), context 4 (packed documents) and context 2 × pipeline 2 (causal). The attention of one rank's slice
against every rank's keys is a unit test for context 2 and 4, with and without documents
(tests/unit/test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (dp, tp, extra options, documents)
    "cp2_dp2": (2, 1, {"context_parallel_size": 2}, False),
    "cp2_tp2": (1, 2, {"context_parallel_size": 2}, True),
    "cp4": (1, 1, {"context_parallel_size": 4}, True),
    "cp2_pp2": (1, 1, {"context_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "1F1B"}, False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_training_equals_one_device(jobs, name):
    dp, tp, extra, documents = LAYOUTS[name]
    reference = jobs.reference(documents=True) if documents else jobs.reference()
    run = jobs.layout(dp, tp, nprocs=4, documents=documents, **extra)
    ref = reference.rank_output(0)
    cp = extra["context_parallel_size"]
    for rank in range(4):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], ref["losses"])
        print(f"{name} rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref["losses"])
        assert "context_parallel" in out["mesh_dims"] and out["mesh_shape"][out["mesh_dims"].index("context_parallel")] == cp
        # Every attention layer this rank holds exchanges keys and values (not the one-device core).
        held = {name.split(".")[1] for name in out["placements"] if name.startswith("layers.")}
        assert held and out["context_parallel_attention"] == sorted(f"layers.{b}.attention" for b in held), out
        # FSDP shards over data-shard × context ranks: the parameters are split over dp · cp ranks.
        sizes = dict(zip(*out["fsdp_mesh"]))
        assert sizes["data_shard_context_parallel"] == dp * cp and sizes.get("tensor_parallel", 1) == tp, sizes
    final, ref_final = load_weights(run, "final"), load_weights(reference, "final")
    assert final.keys() == ref_final.keys()
    for weight_name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[weight_name], rtol=1e-5, atol=1e-5, msg=weight_name)
