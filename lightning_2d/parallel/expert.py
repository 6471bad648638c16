"""Expert parallelism: a plan entry (``ParallelPlan.expert_parallel``: a layer's stacked experts → ``ExpertParallel``)
applied by the step ``apply_expert_parallel`` over the ``expert_parallel`` mesh, as tensor parallelism's plan is over
its mesh; then each such module is FSDP-sharded over the experts' own mesh (``shard_experts``). Each rank of an
expert-parallel group holds ``E / EP`` of a layer's experts, and the tokens routed to an expert travel to its rank
and back (torchtitan's all-to-all dispatcher, dropless).

``ExpertExchange(group, num_experts)`` does the travelling, as forward hooks around the experts module
(``attach``): an ``ops.moe.MoE`` layer calls its experts as on one device and knows nothing of
``torch.distributed``. With this rank's assignments sorted by expert (``ops.moe.dispatch``) and their counts per
expert:

1. **Counts first**: one ``all_to_all_single`` of the ``E`` counts, so each rank learns how many tokens every rank
   sends to each of its local experts (and the split sizes of the token exchange).
2. **Tokens**: a differentiable ``all_to_all_single`` with those uneven splits (zero allowed) sends each rank's
   tokens to their experts' ranks. They arrive grouped by source rank, then local expert; a fixed permutation
   groups them by local expert for ``GroupedExperts`` (one grouped matrix product over the local experts).
3. **Back**: the inverse permutation and the reverse ``all_to_all_single`` return each output to where its token
   came from, in the order it left. The backward pass runs the same exchanges in reverse.

Every permutation and split follows from the counts alone: the same on every run, whatever the routing, an expert
or a whole rank receiving nothing included.

Tensor parallelism of a mixture-of-experts layer is a style too (``MoETensorParallel``, in the model's tensor-parallel
plan), and the load balancing that training adds (the auxiliary loss over the global batch, the bias update) is
``LoadBalancing``'s, one object for the Trainer's module and a Fabric loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_2d.ops.moe import MoE, MoEArgs, RouterStats, auxiliary_loss_terms, local_part
from lightning_2d.parallel.config import ParallelConfig, ParallelPlan
from lightning_2d.parallel.lora import expert_adapter_placements, with_adapter_placements
from lightning_2d.parallel.loss import data_context_group
from lightning_2d.parallel.modules import matching_modules
from lightning_2d.parallel.styles import gather_sequence_around

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


class ExpertExchange:
    """Send tokens to the ranks of their experts and the outputs back, over ``group``: forward hooks around a layer's
    experts module (``attach``), which then holds this rank's experts only.

    Args:
        group: The expert-parallel process group (``EP`` ranks; rank ``r`` holds experts ``r·E/EP`` to
            ``(r+1)·E/EP − 1``).
        num_experts: The layer's experts ``E``; ``EP`` must divide it.
        expert_grad_scale: Multiplies the gradients of the experts' weights (not of the tokens): under the strategy
            ``1 / EP`` (``ExpertParallel``; see ``shard_experts``).
    """

    def __init__(self, group: "ProcessGroup", num_experts: int, expert_grad_scale: float = 1.0) -> None:
        self.group = group
        self.expert_grad_scale = expert_grad_scale
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs a number of experts divisible by {self.size}, got"
                f" {num_experts}; use an expert_parallel_size that divides {num_experts}"
            )
        self.num_experts = num_experts
        self.local_experts = num_experts // self.size
        # Each call's splits, from the tokens' way out to their way back (a checkpoint's recompute runs both again).
        self._pending: list[tuple[list[int], list[int], torch.Tensor, int]] = []

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local_experts

    def attach(self, experts: nn.Module) -> nn.Module:
        """Exchange around ``experts`` (called as ``experts(tokens, counts)``: this rank's assignments sorted by
        global expert, ``counts`` per expert): before its forward the tokens go to their experts' ranks, grouped by
        local expert with the local counts; after it the outputs come back, in the order the tokens left."""
        experts.register_forward_pre_hook(self._send)
        experts.register_forward_hook(self._return)
        return experts

    def _send(self, _experts: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, counts = args
        size, local = self.size, self.local_experts
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # equal splits: `local` counts per rank
        send_splits = counts.view(size, local).sum(dim=1).tolist()
        by_source = received_counts.view(size, local)  # [source rank, local expert]
        receive_splits = by_source.sum(dim=1).tolist()
        received = all_to_all_single(tokens.new_empty(sum(receive_splits), tokens.shape[-1]), tokens,
                                     receive_splits, send_splits, group=self.group)
        grouped = _by_expert_order(by_source)
        self._pending.append((send_splits, receive_splits, grouped, tokens.shape[0]))
        received = received[grouped]
        if self.expert_grad_scale != 1.0:  # the weights' gradients scaled, the tokens' unchanged (scaled back here)
            received = _ScaleGrad.apply(received, 1.0 / self.expert_grad_scale)
        return received, by_source.sum(dim=0)

    def _return(self, _experts: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        send_splits, receive_splits, grouped, tokens = self._pending.pop()
        if self.expert_grad_scale != 1.0:
            out = _ScaleGrad.apply(out, self.expert_grad_scale)
        back = torch.empty_like(out).index_copy_(0, grouped, out)  # source-rank order again
        return all_to_all_single(out.new_empty(tokens, out.shape[-1]), back, send_splits, receive_splits,
                                 group=self.group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _by_expert_order(by_source: torch.Tensor) -> torch.Tensor:
    """The permutation that takes received tokens from (source rank, local expert) order to (local expert, source
    rank) order: ``received[perm]`` is grouped by local expert. ``by_source``: counts ``[source, expert]``."""
    sources, experts = by_source.shape
    starts = torch.cumsum(by_source.reshape(-1), dim=0) - by_source.reshape(-1)  # where each (source, expert) run starts
    starts, lengths = starts.view(sources, experts).t().reshape(-1), by_source.t().reshape(-1)
    if int(lengths.sum()) == 0:
        return torch.zeros(0, dtype=torch.long, device=by_source.device)
    return torch.cat([torch.arange(int(s), int(s) + int(n), device=by_source.device)
                      for s, n in zip(starts.tolist(), lengths.tolist())])


def moe_layers(model: nn.Module) -> list[MoE]:
    """The mixture-of-experts layers of ``model`` (``ops.moe.MoE``), in module order: what load balancing reads and
    moves (their routing statistics, their bias). Which experts expert parallelism splits is the plan's."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class ExpertParallel(ParallelStyle):
    """The expert-parallel style of a layer's stacked routed experts (``ParallelPlan.expert_parallel``, applied over
    the ``expert_parallel`` mesh by ``apply_expert_parallel``): every parameter of the module becomes a ``Shard(0)``
    DTensor, dimension 0 being the expert (rank ``r`` holds experts ``r·E/EP …``; on the meta model, materialization
    then fills each rank's), the module computes on its local part (``ops.moe.local_part``), and an
    ``ExpertExchange`` around it brings each token to its expert's rank and back. The experts' gradients are scaled
    by ``1 / EP`` (``shard_experts`` says why)."""

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        params = list(module.named_parameters(recurse=False))
        if not params:
            raise TypeError(f"ExpertParallel applies to a module of stacked experts (its parameters' first dimension"
                            f" is the expert), got {type(module).__name__} with no parameters of its own")
        for name, param in params:
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        ExpertExchange(device_mesh.get_group(), int(params[0][1].shape[0]),
                       expert_grad_scale=1.0 / device_mesh.size()).attach(module)
        return module


def expert_modules(model: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    """The modules ``plan.expert_parallel`` names in ``model`` (its patterns as ``tensor_parallel``'s: ``*`` one name
    level), in the plan's order; a name ``model`` does not hold (a pipeline stage's pruned block) is skipped."""
    return [module for pattern in plan.expert_parallel for module in matching_modules(model, pattern)]


def apply_expert_parallel(model: nn.Module, ep_mesh: "DeviceMesh", plan: ParallelPlan,
                          config: ParallelConfig) -> None:
    """Apply ``plan.expert_parallel`` (module name → style, ``ExpertParallel`` for stacked experts) to ``model`` over
    ``ep_mesh`` (in place): the step ``parallelize_model`` runs after tensor parallelism when ``expert_parallel_size >
    1``, replaceable by a hook of the same name (``parallel/hooks.py``). Works on the meta model."""
    from torch.distributed.tensor.parallel import parallelize_module

    for pattern, style in plan.expert_parallel.items():
        for module in matching_modules(model, pattern):
            parallelize_module(module, ep_mesh, style)


def shard_experts(experts: list[nn.Module], mesh: "DeviceMesh", config: ParallelConfig, reshard: bool = True) -> None:
    """FSDP2 over each of ``experts`` (the plan's expert-parallel modules) by itself, before the blocks' FSDP (which
    then leaves them out), over the ranks holding the same experts (``ParallelMeshes.expert_fsdp``).

    Each expert's gradient gathers the tokens of its expert-parallel group only; the groups' gradients are then
    averaged by the reduce-scatter over ``expert_fsdp``, ``D / EP`` ranks. Every rank's loss is scaled for FSDP's
    average over all ``D`` ``data_context_parallel`` ranks (``parallel/loss.py``), so the experts' gradients would
    come out ``EP`` times too large: the exchange scales them by ``1 / EP`` in backward (``ExpertExchange``'s
    ``expert_grad_scale``). torchtitan sets FSDP's gradient divide factor to ``D`` instead; that is a
    ``PREMUL_SUM`` reduction, which gloo does not run.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    for module in experts:
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel ranks (each holds a partial one: its
    slice of the experts' hidden features). Megatron's ``f``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: "ProcessGroup") -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward sums the partial outputs over the tensor-parallel ranks; backward passes the (full, equal) gradient
    to each partial output unchanged. Megatron's ``g``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: "ProcessGroup") -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TensorParallelExperts:
    """A layer's routed experts split over the tensor-parallel ranks by their hidden features (``w1``/``w3`` rows,
    ``w2`` columns: each rank computes a partial sum of every expert's output), the tokens the same on every rank.
    Forward hooks around the experts module (``attach``): the experts' outputs are summed over the ranks before the
    routing weights combine them, so the router and everything after see full values, equal on every rank."""

    def __init__(self, group: "ProcessGroup") -> None:
        self.group = group

    def attach(self, experts: nn.Module) -> nn.Module:
        """Megatron's ``f`` on the tokens into ``experts``, its ``g`` on their partial outputs."""
        experts.register_forward_pre_hook(
            lambda _module, args: (_CopyToTensorParallel.apply(args[0], self.group), *args[1:]))
        experts.register_forward_hook(lambda _module, _args, out: _ReduceFromTensorParallel.apply(out, self.group))
        return experts


class MoETensorParallel(ParallelStyle):
    """The tensor-parallel style of a mixture-of-experts layer (``ops.moe.MoE``), applied at the layer itself.

    - Input: the whole sequence on every tensor-parallel rank (gathered under sequence parallelism, whose
      backward keeps each rank's slice: the gradients there are full); output: scattered back to the sequence
      slices under sequence parallelism.
    - The router runs on every rank, on the same tokens (the same routing everywhere; a plain parameter,
      FSDP-sharded over the data-parallel ranks only).
    - Routed experts: split by their hidden features (``TensorParallelExperts``) when ``experts_tensor_parallel``;
      else (under expert parallelism) whole on each rank, split over the expert-parallel ranks instead. Their LoRA
      adapters (``ops.lora.LoRAExperts``) follow the hidden features (``parallel.lora.expert_adapter_placements``).
    - Shared experts: column-wise ``w1``/``w3``, row-wise ``w2``, as a dense feed-forward (their adapters placed as
      a dense layer's, ``parallel.lora.with_adapter_placements``).

    Args:
        sequence_parallel: The layer's input and output are sequence slices (``Shard(1)``).
        experts_tensor_parallel: Split the routed experts over the tensor-parallel ranks.
    """

    def __init__(self, sequence_parallel: bool, experts_tensor_parallel: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.experts_tensor_parallel = experts_tensor_parallel

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if not isinstance(module, MoE):
            raise TypeError(
                f"MoETensorParallel applies to a mixture-of-experts layer (ops.moe.MoE), got {type(module).__name__}"
            )
        if self.experts_tensor_parallel:
            experts = module.experts
            for name, placement in (("w1", Shard(1)), ("w3", Shard(1)), ("w2", Shard(2)),
                                    *expert_adapter_placements(experts)):
                param = getattr(experts, name)
                experts.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [placement]),
                                                              requires_grad=param.requires_grad))
                if isinstance(placement, Replicate):  # each rank's gradient a partial sum: FSDP2 reduces it
                    experts.local_grad_placements[name] = [Partial()]
            TensorParallelExperts(device_mesh.get_group()).attach(experts)  # on its local slices (ops.moe.local_part)
        if module.shared_experts is not None:
            # Adapted shared experts (dense LoRA) take their adapters' placements beside the base's styles.
            parallelize_module(module.shared_experts, device_mesh, with_adapter_placements(
                {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}))
        gather_sequence_around(module, device_mesh, self.sequence_parallel)
        return module


def moe_auxiliary_loss(stats: list[RouterStats], num_experts: int, coef: float,
                       mesh: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' load-balancing loss over the global batch, for the loss each rank differentiates:
    ``(term, value)``.

    ``term`` (with the router's graph) is this rank's share, scaled like the language-model loss of
    ``parallel/loss.py`` (by the data × context size that FSDP's gradient average divides by) and by ``coef``: add
    it to the loss to differentiate. ``value`` is ``coef`` × the loss of the whole batch, detached, the same on every
    rank (to log). The counts and scores are summed over the ``data_context_parallel`` ranks in one all-reduce of
    ``2E + 1`` numbers (``ops.moe.auxiliary_loss_terms``); tensor-parallel ranks hold the same tokens and are not
    counted twice.
    """
    group = data_context_group(mesh)
    size = dist.get_world_size(group) if group is not None else 1
    reduce = (lambda t: dist.all_reduce(t, group=group)) if group is not None and size > 1 else None
    term, value = auxiliary_loss_terms(stats, num_experts, reduce)
    return term * (coef * size), value * coef


@torch.no_grad()
def update_expert_bias(model: nn.Module, mesh: Any = None) -> int:
    """Aux-loss-free balancing's update after an optimizer step: the tokens each expert got since the last one,
    summed over the ``data_context_parallel`` ranks (one all-reduce for every layer), move each layer's bias
    (``MoE.update_bias``). Layers balanced otherwise are left alone; returns how many were updated."""
    layers = [m for m in moe_layers(model) if m.args.load_balancing == "bias"]
    if not layers:
        return 0
    counts = torch.stack([m.tokens_per_expert.float() for m in layers])
    group = data_context_group(mesh)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for layer, row in zip(layers, counts):
        layer.update_bias(row)
    return len(layers)


__all__ = ["ExpertExchange", "ExpertParallel", "LoadBalancing", "MoETensorParallel", "TensorParallelExperts",
           "apply_expert_parallel", "expert_modules", "local_part", "moe_auxiliary_loss", "moe_layers", "shard_experts",
           "update_expert_bias"]


@dataclass(frozen=True)
class LoadBalancing:
    """A mixture of experts' training contract, written once for every loop (``LlamaLightningModule``, a Fabric loop
    such as ``recipes/fabric_pretrain.py``):

    - ``loss(model)``: what each micro-batch's loss adds, ``(term, value)``: this rank's share of transformers'
      auxiliary loss over the global batch, scaled like the language-model loss (``moe_auxiliary_loss``), and the
      whole batch's value to log; ``None`` when the experts are not balanced by it (``MoEArgs.uses_aux_loss``).
      Under pipeline parallelism the auxiliary loss is refused before launch; a pipelined step does not ask.
    - ``after_optimizer_step(model)``: aux-loss-free balancing's bias update (``update_expert_bias``: the tokens each
      expert got since the last step, summed over the ranks holding different tokens); layers balanced otherwise
      are left alone.

    Both read the model's ``ops.moe.MoE`` layers (``moe_layers``: their routing statistics, their bias), in module
    order, whatever the wrappers (FSDP, activation checkpointing, Fabric's).

    Args:
        moe: The model's experts (``ModelArgs.moe``); ``None`` for a dense model (both then do nothing).
        meshes: The strategy's meshes (``strategy.meshes``) or its ``device_mesh``; ``None`` on one device.
    """

    moe: Optional[MoEArgs]
    meshes: Any = None

    @property
    def uses_aux_loss(self) -> bool:
        """Whether the training loss adds the auxiliary loss (``MoEArgs.uses_aux_loss``)."""
        return self.moe is not None and self.moe.uses_aux_loss

    def loss(self, model: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(term, value)`` of this forward's routing (see the class docstring), else ``None``."""
        if self.moe is None or not self.moe.uses_aux_loss:
            return None
        stats = [layer.last_stats for layer in moe_layers(model) if layer.last_stats is not None]
        return moe_auxiliary_loss(stats, self.moe.num_experts, self.moe.aux_loss_coef, self.meshes)

    def after_optimizer_step(self, model: nn.Module) -> int:
        """The bias update of the layers balanced by their bias; returns how many were updated."""
        return update_expert_bias(model, self.meshes) if self.moe is not None else 0
