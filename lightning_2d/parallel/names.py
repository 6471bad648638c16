"""Names of the mesh dimensions (a leaf: every parallel module may import it).

``data_parallel`` is the flattened ``replicate × shard`` dimension (the data-parallel group: sampler,
loss normalization); with the ``tensor_parallel`` name it matches Lightning's, so
``device_mesh["data_parallel"]`` / ``["tensor_parallel"]`` work in user code written for Lightning's
``ModelParallelStrategy``. ``pipeline_parallel`` is the outermost dimension, present only when pp > 1.
"""

DP_REPLICATE_DIM, DP_SHARD_DIM, TP_DIM = "data_parallel_replicate", "data_parallel_shard", "tensor_parallel"
DP_DIM = "data_parallel"
PP_DIM = "pipeline_parallel"
MESH_DIMS = (DP_REPLICATE_DIM, DP_SHARD_DIM, TP_DIM)

__all__ = ["DP_DIM", "DP_REPLICATE_DIM", "DP_SHARD_DIM", "MESH_DIMS", "PP_DIM", "TP_DIM"]
