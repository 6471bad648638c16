"""Names of the mesh dimensions (a leaf: every parallel module may import it).

``data_parallel`` is the flattened ``replicate × shard`` dimension (the data-parallel group: sampler,
loss normalization); with the ``tensor_parallel`` name it matches Lightning's, so
``device_mesh["data_parallel"]`` / ``["tensor_parallel"]`` work in user code written for Lightning's
``ModelParallelStrategy``. ``pipeline_parallel`` is the outermost dimension, ``context_parallel`` sits between
``data_parallel_shard`` and ``tensor_parallel``; every dimension is always in the mesh (size 1 when the layout
does not use it, ``lightning_2d.parallel.meshes``). Two more flattened dimensions: ``data_context_parallel``
(replicate × shard × context: the ranks holding distinct tokens, over which the loss is normalized) and
``data_shard_context_parallel`` (shard × context: what FSDP shards over, as torchtitan's ``dp_shard_cp``).
"""

DP_REPLICATE_DIM, DP_SHARD_DIM, TP_DIM = "data_parallel_replicate", "data_parallel_shard", "tensor_parallel"
DP_DIM = "data_parallel"
PP_DIM = "pipeline_parallel"
CP_DIM = "context_parallel"
DP_CP_DIM, DP_SHARD_CP_DIM = "data_context_parallel", "data_shard_context_parallel"
#: Expert parallelism's dimensions: the ``data_context_parallel`` ranks unflattened into ``(expert_data_replicate,
#: expert_data_shard, expert_parallel)``, the last varying fastest. A layer's experts are split over
#: ``expert_parallel`` and FSDP-sharded over ``expert_data_shard`` (with ``expert_data_replicate``, the replicas,
#: under HSDP); the other parameters keep FSDP's mesh. Always present (``ParallelMeshes``): at
#: ``expert_parallel_size`` 1, aliases of the meshes of the same ranks.
EP_DIM, EP_SHARD_DIM, EP_REPLICATE_DIM = "expert_parallel", "expert_data_shard", "expert_data_replicate"
#: The root mesh's dimensions, outermost first (the last varies fastest).
MESH_DIMS = (PP_DIM, DP_REPLICATE_DIM, DP_SHARD_DIM, CP_DIM, TP_DIM)

__all__ = ["EP_DIM", "EP_REPLICATE_DIM", "EP_SHARD_DIM", "CP_DIM", "DP_CP_DIM", "DP_SHARD_CP_DIM", "DP_DIM", "DP_REPLICATE_DIM", "DP_SHARD_DIM", "MESH_DIMS", "PP_DIM", "TP_DIM"]
