"""``ParallelMeshes``: the device mesh of a layout and its named sub-meshes, every one always present.

``ParallelDims.build_mesh`` builds it (``build_meshes``). The root ``DeviceMesh`` has every dimension, size 1
allowed: ``(pipeline_parallel, data_parallel_replicate, data_parallel_shard, context_parallel, tensor_parallel)``,
the last varying fastest; the flattened ones are ``data_parallel`` (replicate × shard: the sampler's and
Lightning's name), ``data_context_parallel`` (replicate × shard × context: the ranks holding distinct tokens, the
loss's group) and ``data_shard_context_parallel`` (shard × context: what FSDP shards over). Code asks by purpose,
as torchtitan's ``ParallelDims.get_mesh``/``get_optional_mesh``:

- ``meshes.get(name)`` (or ``meshes[name]``) always returns a mesh, of size 1 when the layout does not use it;
- ``meshes.optional(name)`` returns ``None`` at size 1 (a step that only runs when the dimension is used);
- expert parallelism's ``expert_parallel`` / ``expert_data_shard`` / ``expert_data_replicate`` (the
  ``data_context_parallel`` ranks unflattened) always exist too. At ``expert_parallel_size`` 1 they are aliases
  of meshes of the same ranks, as ``data_context_parallel`` is at context size 1 (no process group of their own):
  ``expert_data_shard`` is ``data_shard_context_parallel``, ``expert_data_replicate`` is
  ``data_parallel_replicate``, ``expert_parallel`` a one-rank dimension of the root, and ``meshes.expert_fsdp`` is
  ``meshes.fsdp``;
- ``meshes.fsdp`` is what FSDP2 shards over, ``meshes.root`` is Lightning's ``strategy.device_mesh`` (so
  ``device_mesh["data_parallel"]`` / ``["tensor_parallel"]`` keep working in code written for Lightning's
  strategy).

No code asks ``name in mesh.mesh_dim_names``: a flattened dimension is reachable by name but is not among the
root's names, and such a test silently failed once (the loss was normalized over the world). ``ParallelMeshes`` is
the one mesh the package passes inward. A mesh not built here (Lightning's own 2D ``(data_parallel,
tensor_parallel)`` mesh, a root built by hand) or the root passed back by user code (``strategy.device_mesh``,
Fabric's ``parallelize_fn``) is converted once, at the public function it is given to, by ``as_meshes``: a root
``build_meshes`` made reads as the meshes it was made with (expert parallelism included, whose size is not in the
root's shape), and given the options (``as_meshes(mesh, config)``) a layout the mesh lacks is refused there.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_2d._compat import flatten_mesh_dims, unflatten_mesh
from lightning_2d.parallel.names import (
    CP_DIM,
    DP_CP_DIM,
    DP_DIM,
    DP_REPLICATE_DIM,
    DP_SHARD_CP_DIM,
    DP_SHARD_DIM,
    EP_DIM,
    EP_REPLICATE_DIM,
    EP_SHARD_DIM,
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

    Sub-meshes are made on first use and kept (slicing a ``DeviceMesh`` costs about a millisecond in torch 2.13,
    so nothing slices per step); ``build_meshes`` makes them all at once, since creating a flattened mesh's
    process groups is collective.

    Args:
        root: The root ``DeviceMesh``.
        sizes: Every name ``get`` answers → its number of ranks.
        make: ``name`` → its 1-D mesh (``FSDP``: what FSDP2 shards over).
    """

    def __init__(self, root: "DeviceMesh", sizes: Mapping[str, int], make: Callable[[str], "DeviceMesh"]) -> None:
        self.root = root
        self._sizes = dict(sizes)
        self._make = make
        self._made: dict[str, "DeviceMesh"] = {}
        #: Whether the expert groups take in the tensor-parallel ranks (``experts_over_tensor_parallel``).
        self.experts_over_tensor = False

    @property
    def names(self) -> tuple[str, ...]:
        """Every name ``get`` answers."""
        return tuple(self._sizes)

    def get(self, name: str) -> "DeviceMesh":
        """The 1-D mesh of dimension ``name`` (a root or flattened one), of size 1 when the layout does not use it."""
        if name not in self._sizes and name not in _INTERNAL:
            raise KeyError(f"no mesh dimension {name!r}; the meshes are {', '.join(self._sizes)}")
        if name not in self._made:
            self._made[name] = self._make(name)
        return self._made[name]

    __getitem__ = get

    def optional(self, name: str) -> Optional["DeviceMesh"]:
        """``get(name)``, or ``None`` when it has one rank (the dimension is not used by the layout)."""
        return self.get(name) if self.size(name) > 1 else None

    def size(self, name: str) -> int:
        """The number of ranks along ``name`` (1 for a dimension the layout does not use)."""
        return self._sizes.get(name, 1)

    @property
    def fsdp(self) -> "DeviceMesh":
        """What FSDP2 shards over: ``data_parallel`` (plain FSDP), ``data_shard_context_parallel`` (with context
        parallelism: the parameters are the same on every context rank), or the 2-D ``(replicate, shard)``
        sub-mesh under HSDP."""
        return self.get(FSDP)

    @property
    def expert_fsdp(self) -> "DeviceMesh":
        """What FSDP2 shards a layer's experts over: ``expert_data_shard`` (the data-shard × context ranks holding
        the same experts), or the 2-D ``(expert_data_replicate, expert_data_shard)`` under HSDP. Without expert
        parallelism, FSDP's mesh."""
        return self.get(EXPERT_FSDP)

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The root: Lightning's ``strategy.device_mesh``."""
        return self.root

    def __repr__(self) -> str:
        return f"ParallelMeshes({', '.join(f'{name}={size}' for name, size in self._sizes.items())})"


#: The name ``ParallelMeshes.get`` gives FSDP's mesh (``ParallelMeshes.fsdp``).
FSDP = "fsdp"
#: The name ``ParallelMeshes.get`` gives the experts' FSDP mesh (``ParallelMeshes.expert_fsdp``).
EXPERT_FSDP = "expert_fsdp"
_INTERNAL = (FSDP, EXPERT_FSDP)


#: The expert dimensions, outermost first: the ``data_context_parallel`` ranks as (replicate, shard, expert); with
#: ``experts_over_tensor_parallel``, the ``expert_tokens`` ranks (data × context × tensor) as (replicate, shard,
#: expert), the tensor-parallel ranks inside each expert group.
EXPERT_DIMS = (EP_REPLICATE_DIM, EP_SHARD_DIM, EP_DIM)
#: The ranks holding different tokens as the experts see them: ``data_context_parallel``, and the tensor-parallel
#: ranks too when they route their own sequence slices (``experts_over_tensor_parallel``). What the routing's
#: statistics are summed over (the auxiliary loss's counts, the balancing bias's).
EXPERT_TOKENS = "expert_tokens"
#: At ``expert_parallel_size`` 1, the meshes of the same ranks each expert name reads (no group of its own).
_WITHOUT_EXPERTS = {EP_REPLICATE_DIM: DP_REPLICATE_DIM, EP_SHARD_DIM: DP_SHARD_CP_DIM, EXPERT_FSDP: FSDP,
                    EXPERT_TOKENS: DP_CP_DIM}

#: The meshes ``build_meshes`` made, by the identity of their root, for as long as they live: a root handed back by
#: user code (``strategy.device_mesh``, what Fabric's ``parallelize_fn`` receives) reads as the very meshes it was
#: built with, expert parallelism included (its size is not in the root's shape) and no group made twice.
_BUILT: "weakref.WeakValueDictionary[int, ParallelMeshes]" = weakref.WeakValueDictionary()


def build_meshes(device_type: str, sizes: Mapping[str, int], expert_parallel: int = 1,
                 over_tensor: bool = False) -> ParallelMeshes:
    """Build the root mesh with every dimension of ``MESH_DIMS`` (sizes from ``sizes``, 1 where missing) and every
    sub-mesh. Needs the default process group; every rank calls it (creating process groups is collective).

    Size-1 dimensions cost one single-rank process group per rank each, as the ``data_parallel_replicate`` of plain
    FSDP always did (measured on gloo, world 4: CONTRIBUTING's "One owner of the mesh"). At context size 1 the
    context-flattened names reuse the meshes of the same ranks (``data_parallel``, ``data_parallel_shard``), and at
    expert-parallel size 1 the expert names theirs (``_WITHOUT_EXPERTS``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(int(sizes.get(name, 1)) for name in MESH_DIMS)
    meshes = meshes_of_root(init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS), expert_parallel,
                            over_tensor)
    for name in (*meshes.names, FSDP, EXPERT_FSDP):
        meshes.get(name)
    _BUILT[id(meshes.root)] = meshes
    return meshes


def meshes_of_root(root: "DeviceMesh", expert_parallel: int = 1, over_tensor: bool = False) -> ParallelMeshes:
    """The ``ParallelMeshes`` of a root mesh with every dimension of ``MESH_DIMS`` (``build_meshes``'s), with
    expert parallelism over ``expert_parallel`` ranks (its size is not in the root's shape: ``as_meshes`` finds the
    meshes a root was built with, or takes the size from the options); ``over_tensor``: each expert group is
    ``expert_parallel / tp`` data-shard × context ranks with all their tensor-parallel ranks
    (``experts_over_tensor_parallel``).

    Making a flattened mesh the first time creates its process groups (collective: every rank); torch keeps each
    on the root, so a later ``ParallelMeshes`` of the same root (user code passing ``strategy.device_mesh`` back)
    finds it without a collective. The unflattened expert meshes are not kept on the root: made again, they are new
    groups (collective), which is why a built root reads as its own meshes.
    """
    sizes = dict(zip(MESH_DIMS, (int(n) for n in root.shape)))
    for name, dims in FLATTENED.items():
        sizes[name] = math.prod(sizes[d] for d in dims)
    context = sizes[CP_DIM] > 1
    shards = sizes[DP_SHARD_DIM] * sizes[CP_DIM]
    over_tensor = over_tensor and expert_parallel > 1 and sizes[TP_DIM] > 1
    tp = sizes[TP_DIM] if over_tensor else 1  # the tensor-parallel ranks in each expert group
    if expert_parallel % tp or shards % (expert_parallel // tp):
        raise ValueError(f"expert_parallel_size ({expert_parallel}) must divide data-shard × context ({shards})"
                         + (f" × tensor ({tp})" if over_tensor else ""))
    sizes.update({EP_REPLICATE_DIM: sizes[DP_REPLICATE_DIM], EP_SHARD_DIM: shards // (expert_parallel // tp),
                  EP_DIM: expert_parallel, EXPERT_TOKENS: sizes[DP_CP_DIM] * tp})

    def make(name: str) -> "DeviceMesh":
        if name in _WITHOUT_EXPERTS and expert_parallel == 1:
            return meshes.get(_WITHOUT_EXPERTS[name])
        if name == EXPERT_TOKENS:  # the data × context × tensor ranks, else an alias of data_context_parallel
            if not over_tensor:
                return meshes.get(DP_CP_DIM)
            return flatten_mesh_dims(root, (DP_REPLICATE_DIM, DP_SHARD_DIM, CP_DIM, TP_DIM), EXPERT_TOKENS)
        if name in EXPERT_DIMS or name == EXPERT_FSDP:
            if name == EP_DIM and expert_parallel == 1 and (alone := _one_rank_dim(root)) is not None:
                return root[alone]  # this rank alone: the same group as any size-1 dimension of the root
            if "experts" not in sparse:  # the data × context (× tensor) ranks as (replicate, shard, expert)
                sparse["experts"] = unflatten_mesh(meshes.get(EXPERT_TOKENS), tuple(sizes[d] for d in EXPERT_DIMS),
                                                   EXPERT_DIMS)
            experts = sparse["experts"]
            if name == EXPERT_FSDP:
                return experts[(EP_REPLICATE_DIM, EP_SHARD_DIM)] if sizes[EP_REPLICATE_DIM] > 1 else experts[EP_SHARD_DIM]
            return experts[name]
        if name == FSDP:
            if sizes[DP_REPLICATE_DIM] > 1:  # HSDP: replicate over the first dim, shard over the second
                shard = DP_SHARD_CP_DIM if context else DP_SHARD_DIM
                meshes.get(shard)  # flattened first (a 2-D slice names it)
                return root[(DP_REPLICATE_DIM, shard)]
            return meshes.get(DP_SHARD_CP_DIM if context else DP_DIM)
        if name in FLATTENED:
            if not context and name in _WITHOUT_CONTEXT:
                return meshes.get(_WITHOUT_CONTEXT[name])
            return flatten_mesh_dims(root, FLATTENED[name], name)
        return root[name]

    sparse: dict[str, "DeviceMesh"] = {}
    meshes = ParallelMeshes(root, sizes, make)
    meshes.experts_over_tensor = over_tensor
    return meshes


def _one_rank_dim(root: "DeviceMesh") -> Optional[str]:
    """A root dimension of one rank (each is this rank alone), else ``None`` (every dimension is used)."""
    return next((name for name, n in zip(MESH_DIMS, root.shape) if int(n) == 1), None)


MeshLike = Union[ParallelMeshes, "DeviceMesh"]


#: The options sizing a mesh dimension, and the dimension (``ParallelMeshes.size``'s name).
SIZED_BY = {"pipeline_parallel_size": PP_DIM, "data_parallel_replicate_size": DP_REPLICATE_DIM,
            "data_parallel_size": DP_DIM, "context_parallel_size": CP_DIM, "tensor_parallel_size": TP_DIM,
            "expert_parallel_size": EP_DIM}


def as_meshes(mesh: Optional[Any], config: Any = None) -> Optional[ParallelMeshes]:
    """``ParallelMeshes`` of what a caller passed to a public function: itself, ``None`` (no parallelism), the root
    ``DeviceMesh`` of one (``strategy.device_mesh``: the meshes ``build_meshes`` made with it, else its sub-meshes
    looked up, with ``config``'s expert parallelism), or Lightning's own 2D ``(data_parallel, tensor_parallel)`` mesh
    (``ModelParallelStrategy``: no pipeline, no context, no replicas, no expert parallelism; ``data_parallel`` is
    also the loss's and FSDP's mesh).

    Args:
        mesh: What the caller passed.
        config: The options the mesh is to run (a ``ParallelConfig``: ``parallelize_model``'s; read by attribute,
            importing its module here would close an import circle): every size above 1 it asks for must be the
            mesh's; a size of 1 (or ``"auto"``) leaves the mesh's, but for ``expert_parallel_size``, which must be
            the mesh's (``layout_problems``).

    Raises:
        ValueError: a mesh with other dimension names, saying which it has and which are read; a mesh lacking a
            dimension ``config`` asks for (or of another size), naming both.
    """
    if mesh is None or isinstance(mesh, ParallelMeshes):
        meshes = mesh
    else:
        meshes = _of_device_mesh(mesh, int(getattr(config, "expert_parallel_size", 1) or 1),
                                 bool(getattr(config, "experts_over_tensor_parallel", False)))
    if config is not None and meshes is not None and (problems := layout_problems(meshes, config)):
        raise ValueError(
            "the mesh does not have the layout the options ask for: " + "; ".join(problems) + ". Pass the meshes"
            " of that layout (the strategy's `meshes` or `device_mesh`, or lightning_2d.parallel.ParallelDims(...)"
            ".build_mesh(device_type)), or options that match the mesh"
        )
    return meshes


def layout_problems(meshes: ParallelMeshes, config: Any) -> list[str]:
    """Each size above 1 that ``config`` asks for (``SIZED_BY``) and ``meshes`` do not have, naming both; and an
    expert-parallel size other than the mesh's, 1 included: the plan a config gives (whether tensor parallelism
    splits the experts) holds for that size only."""
    problems = []
    for option, dim in SIZED_BY.items():
        asked = getattr(config, option, 1)
        if not isinstance(asked, int) or isinstance(asked, bool) or meshes.size(dim) == asked:
            continue
        if asked > 1 or dim == EP_DIM:
            problems.append(f"{option}={asked} but the mesh's {dim} has {meshes.size(dim)} rank(s)")
    over = bool(getattr(config, "experts_over_tensor_parallel", False)) and meshes.size(EP_DIM) > 1
    if over != meshes.experts_over_tensor:
        problems.append(f"experts_over_tensor_parallel={over} but the mesh's expert groups"
                        f" {'take in' if meshes.experts_over_tensor else 'leave out'} the tensor-parallel ranks")
    return problems


def _of_device_mesh(mesh: "DeviceMesh", expert_parallel: int, over_tensor: bool = False) -> ParallelMeshes:
    names = tuple(mesh.mesh_dim_names or ())
    if set(MESH_DIMS) <= set(names):
        built = _BUILT.get(id(mesh))
        if built is not None and built.root is mesh:
            return built
        shards = math.prod(int(n) for name, n in zip(names, mesh.shape) if name in (DP_SHARD_DIM, CP_DIM))
        tp = int(mesh.shape[names.index(TP_DIM)]) if over_tensor else 1
        # A size the root cannot hold is the options' problem to name (`layout_problems`), not a failed split.
        fits = expert_parallel % tp == 0 and shards % (expert_parallel // tp) == 0
        return meshes_of_root(mesh, expert_parallel if fits else 1, over_tensor and fits)
    if set(names) == {DP_DIM, TP_DIM}:
        # Each data-parallel name (and FSDP's) is Lightning's `data_parallel` dimension, and so are the experts'
        # data-parallel ones (no expert parallelism: every rank holds every expert).
        own = {DP_DIM: DP_DIM, DP_SHARD_DIM: DP_DIM, DP_CP_DIM: DP_DIM, DP_SHARD_CP_DIM: DP_DIM, EP_SHARD_DIM: DP_DIM,
               FSDP: DP_DIM, EXPERT_FSDP: DP_DIM, EXPERT_TOKENS: DP_DIM, TP_DIM: TP_DIM}
        sizes = dict(zip(names, (int(n) for n in mesh.shape)))
        return ParallelMeshes(mesh, {name: sizes[dim] for name, dim in own.items() if name not in _INTERNAL},
                              lambda name: mesh[own[name]])
    raise ValueError(
        f"a device mesh with dimensions {names} is neither one lightning_2d builds (ParallelDims.build_mesh:"
        f" {MESH_DIMS}) nor Lightning's ({DP_DIM!r}, {TP_DIM!r}); build it with"
        " lightning_2d.parallel.ParallelDims(...).build_mesh(device_type)"
    )


__all__ = ["EXPERT_DIMS", "EXPERT_FSDP", "EXPERT_TOKENS", "FLATTENED", "FSDP", "MeshLike", "ParallelMeshes", "SIZED_BY", "as_meshes",
           "build_meshes", "layout_problems", "meshes_of_root"]
