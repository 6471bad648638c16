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
from lightning_2d.parallel.meshes import EXPERT_TOKENS, as_meshes
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
        experts.eager_under_compile = True  # the split sizes are host values: a compiled block calls it eagerly
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
    by ``1 / EP`` (``shard_experts`` says why), ``tp / EP`` when the groups take in the tensor-parallel ranks.

    Args:
        tensor_ranks: The tensor-parallel ranks inside each expert-parallel group (``experts_over_tensor_parallel``:
            ``tp``; else 1): each routes tokens of its own, and FSDP averages over the data ranks only.
    """

    def __init__(self, tensor_ranks: int = 1) -> None:
        super().__init__()
        self.tensor_ranks = tensor_ranks

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
                       expert_grad_scale=self.tensor_ranks / device_mesh.size()).attach(module)
        return module


#: The attribute ``MoETensorParallel(route_slices=True)`` sets on a layer's experts module: the tensor-parallel ranks
#: routing their own slices, whose expert-parallel groups take them in (``ExpertParallel(tensor_ranks=...)``).
ROUTING_TENSOR_RANKS = "_routing_tensor_ranks"


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
            # Experts whose layer routes each tensor-parallel rank's slice (``MoETensorParallel(route_slices=True)``,
            # applied before): the groups take in those ranks, which FSDP's average does not count.
            tensor_ranks = getattr(module, ROUTING_TENSOR_RANKS, 1)
            if isinstance(style, ExpertParallel) and tensor_ranks != style.tensor_ranks:
                style = ExpertParallel(tensor_ranks=tensor_ranks)
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
        experts.eager_under_compile = True  # in-place all-reduces in autograd functions: eager in a compiled block
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

    With ``route_slices`` (``experts_over_tensor_parallel``: the expert-parallel groups take in the tensor-parallel
    ranks) the layer's input is not gathered: each tensor-parallel rank routes its own sequence slice and sends its
    tokens to their experts' ranks (the exchange's group spans the tensor-parallel ranks), so no expert computes a
    token twice. The router then runs on the slice with its weight replicated over the tensor-parallel ranks (torch's
    ``SequenceParallel`` on the flattened tokens: its gradient, a partial sum over the slices, is summed over the ranks
    as the norms' are); the shared experts, split by their hidden features as without it, get the tokens of every
    slice gathered for them alone.

    Args:
        sequence_parallel: The layer's input and output are sequence slices (``Shard(1)``).
        experts_tensor_parallel: Split the routed experts over the tensor-parallel ranks.
        route_slices: Each tensor-parallel rank routes its own sequence slice (needs ``sequence_parallel``; the
            routed experts are then split over the expert-parallel ranks only).
    """

    def __init__(self, sequence_parallel: bool, experts_tensor_parallel: bool = True,
                 route_slices: bool = False) -> None:
        super().__init__()
        if route_slices and (experts_tensor_parallel or not sequence_parallel):
            raise ValueError("MoETensorParallel(route_slices=True) routes each rank's sequence slice: it needs"
                             " sequence_parallel=True and experts_tensor_parallel=False")
        self.sequence_parallel = sequence_parallel
        self.experts_tensor_parallel = experts_tensor_parallel
        self.route_slices = route_slices

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if not isinstance(module, MoE):
            raise TypeError(
                f"MoETensorParallel applies to a mixture-of-experts layer (ops.moe.MoE), got {type(module).__name__}"
            )
        if self.route_slices:
            _route_slices(module, device_mesh)
        elif self.experts_tensor_parallel:
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
            if self.route_slices:  # the slice's flattened tokens, gathered for the shared experts alone
                gather_sequence_around(module.shared_experts, device_mesh, True, dim=0)
        if not self.route_slices:
            gather_sequence_around(module, device_mesh, self.sequence_parallel)
        return module


def _route_slices(module: MoE, device_mesh: "DeviceMesh") -> None:
    """``MoETensorParallel(route_slices=True)`` on ``module``: its input (this rank's sequence slice, a ``Shard(1)``
    DTensor or its local tensor) taken as the local tensor, its output the slice's; the router on the slice's
    flattened tokens (``SequenceParallel`` over dimension 0: its weight replicated, its gradient summed over the
    ranks). The shared experts stay split by their hidden features, on the tokens gathered for them (the caller)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    def local_input(_module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (x.to_local() if isinstance(x, DTensor) else x, *rest)

    module.register_forward_pre_hook(local_input)
    setattr(module.experts, ROUTING_TENSOR_RANKS, device_mesh.size())  # for ExpertParallel's gradient scale
    slices = SequenceParallel(sequence_dim=0, use_local_output=True)
    parallelize_module(module.router, device_mesh, slices)


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
    tokens = routing_group(mesh)  # the tensor-parallel ranks too when each routes its own slice
    reduce = (lambda t: dist.all_reduce(t, group=tokens)) if tokens is not None and dist.get_world_size(tokens) > 1 \
        else None
    term, value = auxiliary_loss_terms(stats, num_experts, reduce)
    return term * (coef * size), value * coef


def routing_group(mesh: Any) -> Any:
    """The ranks whose routing differs (``meshes.EXPERT_TOKENS``): ``data_context_parallel``'s, and the
    tensor-parallel ranks too when each routes its own sequence slice (``experts_over_tensor_parallel``); ``None``
    without a process group. What the routing statistics are summed over."""
    group = data_context_group(mesh)
    meshes = as_meshes(mesh) if group is not None else None
    if meshes is None or not meshes.experts_over_tensor:
        return group
    return meshes.get(EXPERT_TOKENS).get_group()


@torch.no_grad()
def update_expert_bias(model: nn.Module, mesh: Any = None) -> int:
    """Aux-loss-free balancing's update after an optimizer step: the tokens each expert got since the last one,
    summed over the ``data_context_parallel`` ranks (one all-reduce for every layer), move each layer's bias
    (``MoE.update_bias``). Layers balanced otherwise are left alone; returns how many were updated."""
    layers = [m for m in moe_layers(model) if m.args.load_balancing == "bias"]
    if not layers:
        return 0
    counts = torch.stack([m.tokens_per_expert.float() for m in layers])
    group = routing_group(mesh)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for layer, row in zip(layers, counts):
        layer.update_bias(row)
    return len(layers)


def _score_gradient(carry: torch.Tensor, num_experts: int, scale: float) -> torch.Tensor:
    """The gradient of ``scale`` × transformers' auxiliary loss with respect to the summed scores of any layer
    (``RouterStats.score_sums``), given the micro-batch's global ``carry`` (``[counts (E), scores (E), rows (1)]``
    summed over every MoE layer and the data × context ranks): ``scale · E · (counts / rows) / rows``, the order in
    which autograd differentiates ``auxiliary_loss_terms``' term."""
    counts, rows = carry[:num_experts], carry[-1]
    return (counts / rows) / rows * (num_experts * scale)


class _PassRouting(torch.autograd.Function):
    """A pipeline stage's output with its micro-batch's routing statistics carried to the next stage; in backward
    the gradient of the auxiliary loss reaches this stage's scores. Megatron's ``MoEAuxLossAutoScaler`` (the output
    unchanged in forward, the auxiliary loss's gradient added in backward) across stages:

    - forward: ``out`` unchanged and ``carry_in + own`` (the routing of the stages so far, this rank's tokens);
    - backward: the gradient the next stage sends for the carried statistics is the micro-batch's *global* counts
      and rows (``_AddAuxiliaryLoss``), from which this stage's scores get ``_score_gradient``; it is passed on
      unchanged to the previous stage's carry.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, carry_in: torch.Tensor, score_sums: torch.Tensor, own: torch.Tensor,
                num_experts: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.num_experts, ctx.scale = num_experts, scale
        # A copy, not a view: the zero-bubble schedules detach a stage's outputs in place after their input-gradient
        # pass, which a view (``view_as``, or the input returned as is) refuses. One hidden-state copy per micro-batch.
        return out.clone(), carry_in.detach() + own

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_carry: torch.Tensor) -> tuple[Any, ...]:
        scores = _score_gradient(grad_carry, ctx.num_experts, ctx.scale) if ctx.needs_input_grad[2] else None
        return grad_out, grad_carry, scores, None, None, None


class _AddAuxiliaryLoss(torch.autograd.Function):
    """The last stage's output unchanged; in backward the auxiliary loss's gradient reaches its scores, and the
    micro-batch's global counts and rows (``totals``) go back as the gradient of the statistics it received, for the
    earlier stages' scores (``_PassRouting``)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, carry_in: torch.Tensor, score_sums: torch.Tensor, totals: torch.Tensor,
                num_experts: int, scale: float) -> torch.Tensor:
        ctx.num_experts, ctx.scale = num_experts, scale
        ctx.save_for_backward(totals)
        return out.clone()  # not a view (``_PassRouting`` says why)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (totals,) = ctx.saved_tensors
        experts = ctx.num_experts
        back = torch.cat([totals[:experts], torch.zeros_like(totals[experts:-1]), totals[-1:]])
        scores = _score_gradient(back, experts, ctx.scale) if ctx.needs_input_grad[2] else None
        return grad_out, back if ctx.needs_input_grad[1] else None, scores, None, None, None


def routing_carry(stats: list[RouterStats], num_experts: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(carry, score_sums)`` of some layers' routing in one forward: ``carry`` the detached ``[counts (E), summed
    scores (E), rows (1)]`` (float32) that ``auxiliary_loss_terms`` sums over the layers, ``score_sums`` the summed
    scores with their graph (zeros without one when there are no layers)."""
    if not stats:
        zeros = torch.zeros(num_experts, device=device)
        return torch.zeros(2 * num_experts + 1, device=device), zeros
    counts = torch.stack([s.counts for s in stats]).sum(dim=0).float()
    score_sums = torch.stack([s.score_sums for s in stats]).sum(dim=0)
    rows = torch.tensor([float(sum(s.tokens for s in stats))], device=counts.device)
    return torch.cat([counts.detach(), score_sums.detach().float(), rows]), score_sums


def pass_routing(out: torch.Tensor, carry_in: torch.Tensor, stats: list[RouterStats], num_experts: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage that is not the last: ``(out, carry_out)``, ``out`` unchanged, ``carry_out`` the routing of this and
    the earlier stages (``_PassRouting``: in backward ``scale`` × the auxiliary loss's gradient reaches ``stats``'
    scores). Pure autograd, no communication."""
    own, score_sums = routing_carry(stats, num_experts, carry_in.device)
    return _PassRouting.apply(out, carry_in, score_sums, own, num_experts, scale)


def add_auxiliary_loss(out: torch.Tensor, carry_in: torch.Tensor, stats: list[RouterStats], num_experts: int,
                       scale: float, all_reduce: Optional[Any] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage: ``(out, value)``, ``out`` unchanged whose backward adds ``scale`` × the gradient of
    transformers' auxiliary loss of the whole micro-batch (every stage's layers, every data × context rank: the
    statistics ``carry_in`` brought plus ``stats``, summed over the ranks by ``all_reduce``, in place) to every
    stage's scores (``_AddAuxiliaryLoss``, ``_PassRouting``); ``value`` the loss itself (detached, ``coef`` not
    applied), the same on every rank."""
    own, score_sums = routing_carry(stats, num_experts, carry_in.device)
    totals = carry_in.detach() + own
    if all_reduce is not None:
        all_reduce(totals)
    counts, scores, rows = totals[:num_experts], totals[num_experts:-1], totals[-1]
    value = num_experts * torch.sum((counts / rows) * (scores / rows))
    return _AddAuxiliaryLoss.apply(out, carry_in, score_sums, totals, num_experts, scale), value


class PipelineAuxiliaryLoss:
    """transformers' auxiliary load-balancing loss under pipeline parallelism: hooks on each stage module
    (``attach``), installed by ``parallelize_pipeline`` when the plan has an ``aux_loss_coef``, that
    ``parallel.pipeline.Pipeline`` turns on for its training steps (``start``/``stop``).

    The loss is per pipeline micro-batch (what one device computes under gradient accumulation over the same
    micro-batches, as transformers does): its counts and scores summed over every MoE layer of every stage and over
    the data × context ranks. Under 1F1B a micro-batch's backward runs before later micro-batches' forwards, so
    nothing of the whole batch can be waited for; and the loss sums the layers' statistics before the product, so a
    stage's gradient needs the later stages' counts. Both travel with the activations, no collective of their own:

    - forward: each stage's output carries ``[counts, scores, rows]`` of its layers plus the earlier stages' (one
      ``2E + 1`` float32 tensor beside the hidden states); the last stage sums them over the data × context ranks
      (one all-reduce of ``2E + 1`` numbers per micro-batch, as without a pipeline) and keeps ``coef`` × the loss;
    - backward: the last stage sends the micro-batch's global counts back as the carried tensor's gradient, and
      each stage's output adds, in backward, ``scale`` × the loss's gradient to its layers' scores
      (``_PassRouting``, ``_AddAuxiliaryLoss``: Megatron's ``MoEAuxLossAutoScaler``). ``scale`` = ``coef`` × the
      data × context size (the language-model loss's scaling for FSDP's average) × ``grad_scale`` / micro-batches.

    The hooks run once per stage forward: an activation-checkpointed block recomputed in backward does not add the
    term again. The last training step's value (``coef`` × the mean over its micro-batches) is ``Pipeline``'s
    ``last_aux_loss`` on every pipeline rank (``LoadBalancing.pipelined_loss``).

    Args:
        num_experts: Each MoE layer's routed experts ``E``.
        coef: The auxiliary loss's weight (``MoEArgs.aux_loss_coef``).
        meshes: The strategy's meshes (their ``data_context_parallel`` ranks hold distinct tokens).
    """

    def __init__(self, num_experts: int, coef: float, meshes: Any = None) -> None:
        self.num_experts, self.coef, self.meshes = num_experts, coef, meshes
        self.active = False
        self.scale = 0.0
        #: ``coef`` × each micro-batch's loss of the running step, on the last stage's ranks.
        self.values: list[torch.Tensor] = []
        self._carried: dict[int, torch.Tensor] = {}

    @property
    def carry_size(self) -> int:
        """The carried statistics' length: ``2E + 1``."""
        return 2 * self.num_experts + 1

    def start(self, grad_scale: float, microbatches: int) -> None:
        """Carry the statistics and add the loss in the stages' forwards of the coming training step."""
        group = data_context_group(self.meshes)
        size = dist.get_world_size(group) if group is not None else 1
        self.scale = self.coef * size * grad_scale / microbatches
        self.values, self._carried, self.active = [], {}, True

    def stop(self) -> None:
        self.active = False
        self._carried = {}

    def attach(self, stage: nn.Module, first: bool, last: bool) -> None:
        """Hooks on ``stage`` (a pipeline stage module: hidden states, or token ids for the first, in; hidden states,
        or the loss for the last, out): while active, the statistics received as its second input are taken out
        before its forward (before FSDP's hooks, which would cast them) and its output is wrapped."""
        layers = moe_layers(stage)

        def before(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if not self.active:
                return None
            for layer in layers:
                layer.last_stats = None
            if first:
                return None
            self._carried[id(module)] = args[1]
            return (args[0], *args[2:]), kwargs

        def after(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            if not self.active:
                return None
            stats = [layer.last_stats for layer in layers if layer.last_stats is not None]
            device = out.device if isinstance(out, torch.Tensor) else None
            carry = self._carried.pop(id(module), None)
            if carry is None:
                carry = torch.zeros(self.carry_size, device=device)
            if not last:
                return pass_routing(out, carry, stats, self.num_experts, self.scale)
            group = routing_group(self.meshes)  # the tensor ranks too when each routes its own slice
            reduce = (lambda t: dist.all_reduce(t, group=group)) if group is not None and dist.get_world_size(group) > 1 else None
            out, value = add_auxiliary_loss(out, carry, stats, self.num_experts, self.scale, reduce)
            self.values.append(value * self.coef)
            return out

        stage.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
        stage.register_forward_hook(after, with_kwargs=True)


__all__ = ["ExpertExchange", "ExpertParallel", "LoadBalancing", "MoETensorParallel", "PipelineAuxiliaryLoss",
           "TensorParallelExperts", "add_auxiliary_loss", "apply_expert_parallel", "expert_modules", "local_part",
           "moe_auxiliary_loss", "moe_layers", "pass_routing", "routing_carry", "routing_group", "shard_experts",
           "update_expert_bias"]


@dataclass(frozen=True)
class LoadBalancing:
    """A mixture of experts' training contract, written once for every loop (``LlamaLightningModule``, a Fabric loop
    such as ``recipes/fabric_pretrain.py``):

    - ``loss(model)``: what each micro-batch's loss adds, ``(term, value)``: this rank's share of transformers'
      auxiliary loss over the global batch, scaled like the language-model loss (``moe_auxiliary_loss``), and the
      whole batch's value to log; ``None`` when the experts are not balanced by it (``MoEArgs.uses_aux_loss``).
      Not under pipeline parallelism: there the stages add the loss inside the schedule (``PipelineAuxiliaryLoss``,
      installed with the pipeline), and ``pipelined_loss(pipeline)`` after ``pipeline.train_step`` is its value.
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

    def pipelined_loss(self, pipeline: Any) -> Optional[torch.Tensor]:
        """Under pipeline parallelism, after ``pipeline.train_step``: the auxiliary loss that step trained (``coef``
        × its mean over the pipeline's micro-batches, each over every stage's layers and the data × context ranks;
        detached, the same on every rank), to log; ``None`` when the experts are not balanced by it. The gradient is
        already in the parameters: the stages added it in the schedule (``PipelineAuxiliaryLoss``)."""
        if self.moe is None or not self.moe.uses_aux_loss:
            return None
        return getattr(pipeline, "last_aux_loss", None)

    def after_optimizer_step(self, model: nn.Module) -> int:
        """The bias update of the layers balanced by their bias; returns how many were updated."""
        return update_expert_bias(model, self.meshes) if self.moe is not None else 0
