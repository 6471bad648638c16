"""TextDataModule in a real 2D job: batch identity per TP group and token counting.

Its resumable position is tested with the checkpoints (test_checkpoints.py: bit-identical resume
mid-epoch and at an epoch's end, and resumes at other layouts).
"""

from __future__ import annotations

import shutil

import pytest

from lightning_2d.data import stdlib_sources

pytestmark = pytest.mark.distributed

SEQ_LEN, BATCH = 64, 2


@pytest.fixture(scope="module")
def text_job(jobs, tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    for path in stdlib_sources()[:40]:  # real text, ~0.5 MB
        shutil.copy(path, corpus / path.name)
    config = {
        "corpus": str(corpus), "cache_dir": str(corpus.parent / "cache"),
        "dp": 2, "tp": 2, "seq_len": SEQ_LEN, "batch_size": BATCH,
    }
    job = jobs.run("text_2x2", "text", config)
    return [job.rank_output(r) for r in range(4)]


def test_tensor_parallel_group_reads_one_batch_data_parallel_ranks_differ(text_job):
    by_dp: dict[int, list[list[str]]] = {}
    for out in text_job:
        by_dp.setdefault(out["dp_rank"], []).append(out["batches"])
    assert sorted(by_dp) == [0, 1]
    for group in by_dp.values():
        assert len(group) == 2 and group[0] == group[1] and len(group[0]) == 6
    assert all(a != b for a, b in zip(by_dp[0][0], by_dp[1][0]))


def test_tokens_are_counted_once_per_data_parallel_replica(text_job):
    # 2 replicas × batch 2 × 64 tokens, not 4 ranks × ...
    assert all(out["tokens_per_step"] == 2 * BATCH * SEQ_LEN for out in text_job)
    assert all(out["tokens_per_sec"] and out["tokens_per_sec"] > 0 for out in text_job)
