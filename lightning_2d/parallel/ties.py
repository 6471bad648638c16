"""Tied parameters (one ``Parameter`` registered in two modules: Llama 3.2's embedding and output head) through
tensor parallelism and FSDP2.

A tie is found, not declared: ``shared_parameters`` groups a model's parameter names by the object they name.
Tensor parallelism distributes each module's parameters on its own, so a tie would come out as two DTensors:
``retie`` puts the first one back under every name, after checking that the styles gave each name the same
layout (the embedding's ``RowwiseParallel`` and the head's ``ColwiseParallel`` both shard the ``(vocab, dim)``
weight over the vocabulary, ``Shard(0)``). FSDP2 manages a parameter in one unit only: a unit that holds a tied
parameter whose other names lie outside it is not sharded on its own (``holds_shared_outside``), and the parameter
stays in the root unit, gathered once per forward for both uses. Its gradient is the sum of both uses by
autograd, reduce-scattered once. Pipeline stages cannot share it (the first holds the embedding, the last the
head): ``lightning_2d.parallel.pipeline`` refuses a tied model.
"""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn


def shared_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter registered under more than one name, in registration order (the first name
    is the one ``named_parameters`` keeps)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


def retie(model: nn.Module, groups: Iterable[tuple[str, ...]]) -> None:
    """Make every name of each group the same parameter again: the first name's (after tensor parallelism gave
    each its own). Refuses names whose layouts differ: one tensor cannot be sharded two ways."""
    for group in groups:
        first_module, first_attr = _owner(model, group[0])
        param = getattr(first_module, first_attr)
        for name in group[1:]:
            module, attr = _owner(model, name)
            other = getattr(module, attr)
            if other is param:
                continue
            layouts = [_layout(param), _layout(other)]
            if layouts[0] != layouts[1] or other.shape != param.shape:
                raise ValueError(
                    f"the tied parameters {group[0]} and {name} got different tensor-parallel layouts ({layouts[0]}"
                    f" vs {layouts[1]}): one weight cannot be sharded two ways. Give both modules styles that"
                    " shard the weight alike (the embedding RowwiseParallel and the head ColwiseParallel both"
                    " shard it over the vocabulary), or untie them"
                )
            module.register_parameter(attr, param)


def _layout(param: nn.Parameter) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return f"{list(param.placements)} over {param.device_mesh.mesh_dim_names}"
    return "not distributed"


def holds_shared_outside(
    unit: nn.Module | list[nn.Module], model: nn.Module, ties: Optional[list[tuple[str, ...]]] = None,
) -> list[str]:
    """The names of the tied parameters ``unit`` (a module or a group of modules run as one FSDP unit) holds whose
    other names belong to modules outside it: such a unit must stay in its parent's FSDP unit.

    ``ties``: the model's ``shared_parameters``, when the caller asks for many units (each call would otherwise walk
    every parameter of the model: quadratic in the blocks, seconds for a 126-layer plan). An untied model (most)
    returns at once, without walking the unit.
    """
    ties = shared_parameters(model) if ties is None else ties
    if not ties:
        return []
    modules = unit if isinstance(unit, list) else [unit]
    inside = {id(p) for m in modules for p in m.parameters()}
    held = set()
    for group in ties:
        param = model.get_parameter(group[0])
        if id(param) not in inside:
            continue
        owners = [_owner(model, name)[0] for name in group]
        if not all(any(owner is m or _contains(m, owner) for m in modules) for owner in owners):
            held.update(group)
    return sorted(held)


def _contains(parent: nn.Module, child: nn.Module) -> bool:
    return any(m is child for m in parent.modules())


def tied_pipeline_message(ties: Iterable[tuple[str, ...]]) -> str:
    """Why a model with tied parameters is refused under pipeline parallelism."""
    names = "; ".join(" = ".join(group) for group in ties)
    return (
        f"pipeline parallelism cannot split a model with tied parameters ({names}): the first stage would hold the"
        " embedding and the last the output head, two copies whose gradients this library does not sum across"
        " stages. Use pipeline_parallel_size=1 (FSDP × tensor parallelism keep the tie), or untie the weights"
        " (tie_word_embeddings=False, which changes the model)"
    )
