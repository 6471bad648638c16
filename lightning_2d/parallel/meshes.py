"""``ParallelMeshes``: the device mesh of a layout and its named sub-meshes, every one always present.

``ParallelDims.build_mesh`` builds it (``build_meshes``). The root ``DeviceMesh`` has every dimension, size 1
allowed: ``(pipeline_parallel, data_parallel_replicate, data_parallel_shard, context_parallel, tensor_parallel)``,
the last varying fastest; the flattened ones are ``data_parallel`` (replicate × shard: the sampler's and
Lightning's name), ``data_context_parallel`` (replicate × shard × context: the ranks holding distinct tokens, the
loss's group) and ``data_shard_context_parallel`` (shard × context: what FSDP shards over). Code asks by purpose,
as torchtitan's ``ParallelDims.get_mesh``/``get_optional_mesh``:

- ``meshes.get(name)`` (or ``meshes[name]``) always returns a mesh, of size 1 when the layout does not use it;
- ``meshes.optional(name)`` returns ``None`` at size 1 (a step that only runs when the dimension is used);
- ``meshes.fsdp`` is what FSDP2 shards over, ``meshes.root`` is Lightning's ``strategy.device_mesh`` (so
  ``device_mesh["data_parallel"]`` / ``["tensor_parallel"]`` keep working in code written for Lightning's
  strategy).

No code asks ``name in mesh.mesh_dim_names``: a flattened dimension is reachable by name but is not among the
root's names, and such a test silently failed once (the loss was normalized over the world). A mesh not built
here (Lightning's own 2D ``(data_parallel, tensor_parallel)`` mesh, or the root passed back by user code) is read
once, by ``as_meshes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_2d._compat import flatten_mesh_dims
from lightning_2d.parallel.names import (
    CP_DIM,
    DP_CP_DIM,
    DP_DIM,
    DP_REPLICATE_DIM,
    DP_SHARD_CP_DIM,
    DP_SHARD_DIM,
    PP_DIM,
    MESH_DIMS,
    TP_DIM,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The flattened dimensions and the root dimensions each one spans.
FLATTENED: dict[str, tuple[str, ...]] = {
    DP_DIM: (DP_REPLICATE_DIM, DP_SHARD_DIM),
    DP_CP_DIM: (DP_REPLICATE_DIM, DP_SHARD_DIM, CP_DIM),
    DP_SHARD_CP_DIM: (DP_SHARD_DIM, CP_DIM),
}
#: What a flattened dimension is when the context dimension has size 1: the same ranks as another mesh, reused
#: (no second process group of the same members).
_WITHOUT_CONTEXT = {DP_CP_DIM: DP_DIM, DP_SHARD_CP_DIM: DP_SHARD_DIM}


class ParallelMeshes:
    """The root mesh and every named sub-mesh of a layout (see the module docstring).

    Args:
        root: The root ``DeviceMesh``.
        meshes: Every name (root and flattened dimensions) → its 1-D mesh.
        fsdp: What FSDP2 shards over: ``data_parallel`` (plain FSDP), ``data_shard_context_parallel`` (with context
            parallelism: the parameters are the same on every context rank), or the 2-D ``(replicate, shard)``
            sub-mesh under HSDP.
    """

    def __init__(self, root: "DeviceMesh", meshes: Mapping[str, "DeviceMesh"], fsdp: "DeviceMesh") -> None:
        self.root = root
        self._meshes = dict(meshes)
        self.fsdp = fsdp

    @property
    def names(self) -> tuple[str, ...]:
        """Every name ``get`` answers."""
        return tuple(self._meshes)

    def get(self, name: str) -> "DeviceMesh":
        """The 1-D mesh of dimension ``name`` (a root or flattened one), of size 1 when the layout does not use it."""
        try:
            return self._meshes[name]
        except KeyError:
            raise KeyError(f"no mesh dimension {name!r}; the meshes are {', '.join(self._meshes)}") from None

    __getitem__ = get

    def optional(self, name: str) -> Optional["DeviceMesh"]:
        """``get(name)``, or ``None`` when it has one rank (the dimension is not used by the layout)."""
        mesh = self._meshes.get(name)
        return mesh if mesh is not None and mesh.size() > 1 else None

    def size(self, name: str) -> int:
        """The number of ranks along ``name`` (1 for a dimension the layout does not use)."""
        mesh = self._meshes.get(name)
        return mesh.size() if mesh is not None else 1

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The root: Lightning's ``strategy.device_mesh``."""
        return self.root

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={self.size(name)}" for name in self._meshes)
        return f"ParallelMeshes({sizes})"


def build_meshes(device_type: str, sizes: Mapping[str, int]) -> ParallelMeshes:
    """Build the root mesh with every dimension of ``MESH_DIMS`` (sizes from ``sizes``, 1 where missing) and the
    flattened ones. Needs the default process group; every rank calls it (creating process groups is collective).

    Size-1 dimensions cost one single-rank process group per rank each, as the ``data_parallel_replicate`` of plain
    FSDP always did (measured on gloo, world 4: see CONTRIBUTING's "One owner of the mesh"). At context size 1 the
    context-flattened names reuse the meshes of the same ranks (``data_parallel``, ``data_parallel_shard``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(int(sizes.get(name, 1)) for name in MESH_DIMS)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    return meshes_of_root(root)


def meshes_of_root(root: "DeviceMesh") -> ParallelMeshes:
    """The ``ParallelMeshes`` of a root mesh with every dimension of ``MESH_DIMS`` (``build_meshes``'s).

    The first call on a root creates its flattened meshes (collective: every rank calls it); torch keeps each on the
    root, so a later call (user code passing ``strategy.device_mesh`` back) finds them without a collective.
    """
    meshes: dict[str, "DeviceMesh"] = {name: root[name] for name in MESH_DIMS}
    context = meshes[CP_DIM].size() > 1
    for name, dims in FLATTENED.items():
        if not context and name in _WITHOUT_CONTEXT:
            meshes[name] = meshes[_WITHOUT_CONTEXT[name]]
        else:
            meshes[name] = flatten_mesh_dims(root, dims, name)
    if meshes[DP_REPLICATE_DIM].size() > 1:  # HSDP: replicate over the first dim, shard over the second
        fsdp = root[(DP_REPLICATE_DIM, DP_SHARD_CP_DIM if context else DP_SHARD_DIM)]
    else:
        fsdp = meshes[DP_SHARD_CP_DIM if context else DP_DIM]
    return ParallelMeshes(root, meshes, fsdp)


MeshLike = Union[ParallelMeshes, "DeviceMesh"]


def as_meshes(mesh: Optional[Any]) -> Optional[ParallelMeshes]:
    """``ParallelMeshes`` of what a caller passed: itself, ``None`` (no parallelism), the root ``DeviceMesh`` of one
    (``strategy.device_mesh``: its sub-meshes looked up), or Lightning's own 2D ``(data_parallel, tensor_parallel)``
    mesh (``ModelParallelStrategy``: no pipeline, no context, no replicas; ``data_parallel`` is also the loss's and
    FSDP's mesh).

    Raises:
        ValueError: a mesh with other dimension names, saying which it has and which are read.
    """
    if mesh is None or isinstance(mesh, ParallelMeshes):
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    if set(MESH_DIMS) <= set(names):
        return meshes_of_root(mesh)
    if set(names) == {DP_DIM, TP_DIM}:
        dp, tp = mesh[DP_DIM], mesh[TP_DIM]
        aliases = {DP_DIM: dp, DP_SHARD_DIM: dp, DP_CP_DIM: dp, DP_SHARD_CP_DIM: dp, TP_DIM: tp}
        return ParallelMeshes(mesh, aliases, dp)
    raise ValueError(
        f"a device mesh with dimensions {names} is neither one lightning_2d builds (ParallelDims.build_mesh: {MESH_DIMS})"
        f" nor Lightning's ({DP_DIM!r}, {TP_DIM!r}); build it with"
        " lightning_2d.parallel.ParallelDims(...).build_mesh(device_type)"
    )


__all__ = ["FLATTENED", "MeshLike", "ParallelMeshes", "as_meshes", "build_meshes", "meshes_of_root"]
