"""Mixture-of-experts feed-forward: a top-k router, dropless grouped experts, a deterministic combine.

``MoE(dim, MoEArgs(...))`` replaces a block's dense MLP. For the ``T`` tokens of a batch (flattened):

1. **Route** (``route``): the router's logits (``T × E``) become scores (softmax, or sigmoid as DeepSeek-V3), each
   token picks its ``top_k`` experts; with load-balancing ``bias`` (aux-loss-free balancing) the bias shifts which
   experts are picked but not their weights. The picked scores are renormalized when ``norm_topk_prob`` (Qwen3-MoE's
   flag; Mixtral always) and multiplied by ``route_scale``.
2. **Dispatch** (``dispatch``): the ``T · k`` (token, expert) assignments sorted by expert, stably (the same order
   on every run and layout), with each expert's count. Dropless: every assignment is computed, none padded.
3. **Experts** (``GroupedExperts``): SwiGLU experts whose weights are stacked ``(E, F, D)`` / ``(E, D, F)``, run on
   the sorted tokens by ``torch.nn.functional.grouped_mm`` (one kernel over all experts) where it runs, else by a
   loop over the experts that computes the same (float64, and tensors without data).
4. **Combine** (``combine``): each token's ``k`` outputs weighted and summed in a fixed order, no atomics.

Optional shared experts (a dense ``SwiGLU`` every token goes through, added; ``ops.feed_forward``) and the router's
statistics for the load balancing (``RouterStats``: tokens per expert and summed scores, which the Hugging Face
auxiliary loss and the bias update read) complete the layer. Expert parallelism moves step 2's sorted tokens between
ranks; that is ``lightning_2d.parallel.expert``'s (its styles' forward hooks around ``MoE.experts``, applied by the
plan), not this module's: here everything is local, pure torch. ``MoEArgs.from_hf_config`` is the one reader of a
Hugging Face mixture of experts' config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_2d._compat import in_backward
from lightning_2d.errors import Lightning2DError
from lightning_2d.ops.feed_forward import SwiGLU


class MoEConfigError(Lightning2DError, ValueError):
    """A mixture-of-experts setting that cannot work; says which value and what to use instead."""


@dataclass(frozen=True)
class MoEArgs:
    """The experts of a mixture-of-experts layer and how tokens are routed to them.

    Args:
        num_experts: Routed experts ``E``.
        top_k: Experts each token goes to.
        hidden_dim: Each expert's SwiGLU hidden size (Qwen3-MoE's ``moe_intermediate_size``).
        score_func: ``"softmax"`` over the experts (Qwen3-MoE, Mixtral) or ``"sigmoid"`` per expert (DeepSeek-V3).
        norm_topk_prob: Renormalize the picked scores to sum to 1 per token.
        route_scale: Multiplies the routing weights.
        num_shared_experts: Dense SwiGLU experts every token goes through (``shared_hidden_dim`` each, fused).
        shared_hidden_dim: The shared experts' hidden size (default ``hidden_dim``).
        load_balancing: ``"aux_loss"``: the routing statistics feed the auxiliary loss (``auxiliary_loss``, as
            transformers trains these models); ``"bias"``: aux-loss-free balancing, a per-expert bias
            (``MoE.expert_bias``) shifts which experts are picked; ``"none"``.
        aux_loss_coef: The auxiliary loss's weight in the training loss (transformers' ``router_aux_loss_coef``;
            Qwen3-MoE 0.001, Mixtral 0.02), with ``load_balancing="aux_loss"``.
        bias_update_rate: How far each step moves an expert's bias towards balance (DeepSeek-V3's ``gamma``), with
            ``load_balancing="bias"``.

    Raises:
        MoEConfigError: A setting out of its range (every problem in one message); a ``Lightning2DError`` and a
            ``ValueError``.

    Example:
        ```python
        from lightning_2d import LlamaLightningModule, ModelArgs
        from lightning_2d.ops.moe import MoEArgs

        moe = MoEArgs(num_experts=8, top_k=2, hidden_dim=1024, load_balancing="aux_loss", aux_loss_coef=0.01)
        args = ModelArgs(dim=1024, n_layers=8, n_heads=16, vocab_size=32000, moe=moe)
        module = LlamaLightningModule(args)  # experts split by the strategy's expert_parallel_size
        ```

        The presets ``"debug-moe"`` and ``"qwen3-30b-a3b"`` carry theirs; ``init_from`` a Qwen3-MoE or Mixtral folder
        reads them from its ``config.json`` (``from_hf_config``).
    """

    num_experts: int
    top_k: int
    hidden_dim: int
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    num_shared_experts: int = 0
    shared_hidden_dim: Optional[int] = None
    load_balancing: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_experts", "top_k", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.top_k > self.num_experts:
            problems.append(f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.load_balancing not in ("aux_loss", "bias", "none"):
            problems.append(f"load_balancing must be 'aux_loss', 'bias' or 'none', got {self.load_balancing!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            problems.append(f"num_shared_experts must be 0 or more, got {self.num_shared_experts!r}")
        for name in ("aux_loss_coef", "bias_update_rate", "route_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 or value == float("inf"):
                problems.append(f"{name} must be a finite number of at least 0, got {value!r}")
        if self.shared_hidden_dim is not None and (not isinstance(self.shared_hidden_dim, int)
                                                   or self.shared_hidden_dim < 1):
            problems.append(f"shared_hidden_dim must be a positive integer or None, got {self.shared_hidden_dim!r}")
        if problems:
            raise MoEConfigError("Invalid mixture-of-experts settings: " + "; ".join(problems))

    @property
    def uses_aux_loss(self) -> bool:
        """Whether the training loss adds the auxiliary load-balancing loss (``load_balancing="aux_loss"``, a weight
        above 0)."""
        return self.load_balancing == "aux_loss" and self.aux_loss_coef > 0

    @property
    def shared_dim(self) -> int:
        """The fused shared experts' hidden size (0: none)."""
        return self.num_shared_experts * (self.shared_hidden_dim or self.hidden_dim)

    @classmethod
    def from_hf_config(cls, config: Any) -> Optional["MoEArgs"]:
        """The experts of a Hugging Face Qwen3-MoE or Mixtral config (a ``transformers`` config, or the dict of its
        ``config.json``), balanced as transformers fine-tunes them: by the auxiliary loss when the config asks for
        the router logits (``output_router_logits``; its weight ``router_aux_loss_coef``, trained only above 0:
        ``uses_aux_loss``), else not at all.
        ``None`` for another model type, and for a Qwen3-MoE of 0 experts (transformers builds dense blocks then).

        The one reader of these fields (our Llama's import, ``HFCausalLMModule``, the Hugging Face plan and the
        planner all ask here), with one precedence: ``num_local_experts``, else ``num_experts`` (released Qwen3-MoE
        files say ``num_experts``, transformers 5 writes ``num_local_experts`` for both families, and its config
        objects answer both names); Mixtral's experts' hidden size is its ``intermediate_size``, Qwen3-MoE's its
        ``moe_intermediate_size``; Mixtral always renormalizes the picked scores. Which blocks are sparse:
        ``hf_block_rule``.

        Raises:
            KeyError, AttributeError: a required field is missing (``num_experts_per_tok``, the hidden size).
            MoEConfigError: values no layer can take.
        """
        read = _hf_reader(config)
        model_type = read("model_type", None)
        if model_type not in HF_MOE_TYPES:
            return None
        experts = read("num_local_experts", None)
        experts = read("num_experts", None) if experts is None else experts
        if model_type == "qwen3_moe" and experts == 0:
            return None
        coef = float(read("router_aux_loss_coef", 0.0) or 0.0)
        return cls(
            num_experts=experts,
            top_k=read("num_experts_per_tok"),
            hidden_dim=read("intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"),
            norm_topk_prob=bool(read("norm_topk_prob", True)) if model_type == "qwen3_moe" else True,
            load_balancing="aux_loss" if read("output_router_logits", False) else "none",
            aux_loss_coef=coef,
        )

    @staticmethod
    def hf_block_rule(config: Any) -> tuple[int, list[int]]:
        """Which blocks of a Hugging Face mixture of experts are sparse, as ``ModelArgs`` says it: ``(moe_layer_step,
        dense_layers)`` (Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``; Mixtral: every block). Read
        with ``is_sparse_block``; only meaningful where ``from_hf_config`` returns experts."""
        read = _hf_reader(config)
        if read("model_type", None) != "qwen3_moe":
            return 1, []
        return int(read("decoder_sparse_step", 1) or 1), list(read("mlp_only_layers", None) or [])

    def num_params(self, dim: int, active: bool = False) -> int:
        """Parameters of one ``MoE`` layer of width ``dim``; ``active``: those one token goes through (the router,
        its ``top_k`` experts, the shared experts), what its FLOPs are counted on."""
        experts = self.top_k if active else self.num_experts
        return dim * self.num_experts + 3 * dim * (experts * self.hidden_dim + self.shared_dim)


#: The Hugging Face model types whose blocks may be mixtures of experts (``MoEArgs.from_hf_config``).
HF_MOE_TYPES = ("qwen3_moe", "mixtral")
_REQUIRED = object()


def _hf_reader(config: Any) -> Callable[..., Any]:
    """``read(name[, default])`` of a ``transformers`` config (its attributes) or a ``config.json`` dict (its keys);
    without a default a missing field raises as the container does."""
    if isinstance(config, Mapping):
        return lambda name, default=_REQUIRED: config[name] if default is _REQUIRED else config.get(name, default)
    return lambda name, default=_REQUIRED: (getattr(config, name) if default is _REQUIRED
                                           else getattr(config, name, default))


def is_sparse_block(layer_id: int, moe_layer_step: int, dense_layers: Any) -> bool:
    """Whether block ``layer_id`` of a model with experts is a mixture of experts (Qwen3-MoE's rule, transformers'
    too: not among ``dense_layers`` and ``(layer_id + 1) % moe_layer_step == 0``)."""
    return layer_id not in dense_layers and (layer_id + 1) % moe_layer_step == 0


@dataclass(frozen=True)
class Routing:
    """Where each token goes: ``experts`` and ``weights`` (``T × k``, best first), the scores of every expert
    (``T × E``, float32, what the auxiliary loss reads) and the router's raw logits."""

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor


def route(logits: torch.Tensor, args: MoEArgs, bias: Optional[torch.Tensor] = None) -> Routing:
    """Pick each token's ``top_k`` experts from the router's ``logits`` (``T × E``); see the module docstring.

    Scores are computed in float32 whatever the logits' dtype (as transformers and torchtitan do). Ties between
    scores go to the lower expert index (``torch.topk``'s order), the same on every rank.
    """
    scores = torch.softmax(logits.float(), dim=-1) if args.score_func == "softmax" else torch.sigmoid(logits.float())
    select = scores if bias is None else scores + bias.float()
    experts = torch.topk(select, args.top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if args.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if args.route_scale != 1.0:
        weights = weights * args.route_scale
    return Routing(experts, weights, scores, logits)


def dispatch(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``T · k`` assignments sorted by expert: ``order`` (indices into ``experts.flatten()``; token ``order //
    k``) and ``counts`` (assignments per expert, ``E``). Stable: within an expert, tokens keep their order."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    # Not bincount: it has no meta kernel (a planner's model has no data). Integer adds: exact in any order.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's output: its ``k`` expert outputs (``expert_out``, in ``order``'s sorted layout) weighted by
    ``weights`` (``T × k``) and summed over ``k`` in a fixed order (no scatter-add: the same bits every run)."""
    tokens, k = weights.shape
    unsorted = torch.empty_like(expert_out).index_copy_(0, order, expert_out)  # back to (token, slot) order
    return (unsorted.view(tokens, k, -1) * weights.unsqueeze(-1).to(expert_out.dtype)).sum(dim=1)


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs the experts for ``x``: on the CPU in float32 and bfloat16, on
    CUDA in bfloat16 (compute capability 8.0+); elsewhere (float64, meta and fake tensors) the loop computes the
    same."""
    if not hasattr(F, "grouped_mm") or x.is_meta or type(x).__name__ == "FakeTensor":
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


def local_part(weight: torch.Tensor, grad_placements: Optional[Any] = None) -> torch.Tensor:
    """A distributed tensor's local part (its ``to_local()``: the gradient flows back to it), any other tensor as it
    is. ``grad_placements``: how the local gradient is laid out, when not as the tensor (``to_local``'s argument: a
    replicated weight whose local gradients are partial sums, ``[Partial()]``), given by the parallel style that
    distributed it. Duck-typed: this layer imports nothing of ``torch.distributed``."""
    to_local = getattr(weight, "to_local", None)
    if not callable(to_local):
        return weight
    return to_local() if grad_placements is None else to_local(grad_placements=grad_placements)


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts, weights stacked: ``w1``/``w3`` ``(E, F, D)`` (gate/up), ``w2`` ``(E, D, F)`` (down), each
    expert's slice laid out as an ``nn.Linear`` weight (out × in), as Hugging Face checkpoints store them.

    ``forward`` computes on each weight's local part (``local_part``): the whole weight here; under expert or tensor
    parallelism (``lightning_2d.parallel.expert``'s styles, which make the weights DTensors) this rank's experts, or
    its slice of every expert's hidden features, the tokens then brought and taken away by the style's forward
    hooks."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        #: Parameter name → its local gradient's placements (``local_part``), where a parallel style says they differ
        #: from the parameter's (``parallel.expert.MoETensorParallel``: the adapters replicated over the ranks that
        #: split the experts' hidden features).
        self.local_grad_placements: dict[str, Any] = {}
        #: Whether a compiled block calls this module eagerly (``MoE.forward``: one graph break): set by a parallel
        #: style whose hooks around it take host values or run in-place collectives (expert parallelism's exchange and
        #: its split sizes, the experts' tensor-parallel reductions).
        self.eager_under_compile = False
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: the dispatched tokens (``N × D``, sorted by expert); ``counts``: tokens per expert (sum ``N``)."""
        if not uses_grouped_mm(x):
            return self._loop(x, counts)
        return self._grouped(x, counts)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate = self._project(x, "w1", offsets)
        up = self._project(x, "w3", offsets)
        return self._project(F.silu(gate) * up, "w2", offsets)

    def _project(self, x: torch.Tensor, which: str, offsets: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (grouped by expert, ``offsets`` their ends) through their experts' ``which`` projection
        (``w1``, ``w2`` or ``w3``): one grouped matrix product over this rank's experts."""
        return F.grouped_mm(x, self._local(which).transpose(-2, -1), offs=offsets)

    def _local(self, name: str) -> torch.Tensor:
        """This rank's part of parameter ``name`` (``local_part``), the gradient laid out as the style says."""
        return local_part(getattr(self, name), self.local_grad_placements.get(name))

    def _expert_project(self, rows: torch.Tensor, which: str, expert: int) -> torch.Tensor:
        """``_project`` of one expert's rows, as the loop computes it."""
        return rows @ self._local(which)[expert].t()

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # no data, no counts to split by: the shape is all there is
            return x.new_empty(x.shape[0], self._local("w2").shape[1])
        outs = []
        for expert, rows in enumerate(torch.split(x, counts.tolist())):
            hidden = F.silu(self._expert_project(rows, "w1", expert)) * self._expert_project(rows, "w3", expert)
            outs.append(self._expert_project(hidden, "w2", expert))
        return torch.cat(outs)


@torch.compiler.disable
def _eager_call(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``experts(x, counts)`` run eagerly inside a compiled block (a graph break): ``grouped_mm``'s compiled path
    takes bfloat16 only (torch 2.13: its meta kernel refuses float32, which the eager CPU kernel runs), and a parallel
    style's hooks around the experts may take host values (the exchange's split sizes) or run in-place collectives
    (``GroupedExperts.eager_under_compile``)."""
    return experts(x, counts)


@dataclass(frozen=True)
class RouterStats:
    """One forward's routing, what load balancing reads: assignments per expert (``E``, float32) and each expert's
    summed score over the tokens (``E``, float32, with the graph: the auxiliary loss's gradient reaches the router
    through it), over ``tokens`` tokens."""

    counts: torch.Tensor
    score_sums: torch.Tensor
    tokens: int


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (``router``, ``experts``, optional ``shared_experts``); see the module
    docstring. ``forward`` keeps the routing's statistics in ``last_stats`` for the load balancing.

    Args:
        dim: The model width ``D``.
        args: The experts and the routing.
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.num_experts, bias=False)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = SwiGLU(dim, args.shared_dim) if args.shared_dim else None
        # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias shifts selection only, updated after each optimizer
        # step from the tokens each expert got since (`tokens_per_expert`, summed over the ranks by the caller:
        # `lightning_2d.parallel.expert.update_expert_bias`). Saved with the model when it is used: it routes.
        balancing = args.load_balancing == "bias"
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=balancing)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.last_stats: Optional[RouterStats] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        bias = self.expert_bias if self.args.load_balancing == "bias" else None
        routing = route(self.router(tokens), self.args, bias)
        order, counts = dispatch(routing.experts, self.args.num_experts)
        dispatched = tokens[order // self.args.top_k]
        # Under expert parallelism the experts' forward hooks send the tokens to their experts' ranks and the outputs
        # back (``lightning_2d.parallel.expert``): the same call, this rank's sorted tokens in and their outputs out.
        if torch.compiler.is_compiling() and (self.experts.eager_under_compile or dispatched.dtype != torch.bfloat16):
            expert_out = _eager_call(self.experts, dispatched, counts)  # one graph break (see ``_eager_call``)
        else:
            expert_out = self.experts(dispatched, counts)
        out = combine(expert_out, order, routing.weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self.last_stats = RouterStats(counts.float(), routing.scores.sum(dim=0), tokens.shape[0])
        # Not again in an activation checkpoint's recompute: eagerly it runs in a backward pass; compiled, the
        # recompute replays no side effect (``parallel.compile``: dynamo's checkpoint skips them in backward).
        if self.training and self.args.load_balancing == "bias" and (torch.compiler.is_compiling() or not in_backward()):
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        return out.view(shape)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing's step: each expert's bias moves by ``bias_update_rate`` towards balance (up when
        it got fewer than the mean of ``tokens_per_expert``, the counts of every rank since the last update),
        centered; then the counts restart."""
        counts = tokens_per_expert.float()
        delta = self.args.bias_update_rate * torch.sign(counts.mean() - counts)
        self.expert_bias += (delta - delta.mean()).to(self.expert_bias.dtype)
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def reset_buffers(self, device: Optional[torch.device] = None) -> None:
        """Zero the balancing bias and the counts (``Transformer.init_buffers``, after ``to_empty``)."""
        device = device if device is not None else self.expert_bias.device
        self.expert_bias = torch.zeros(self.args.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.args.num_experts, device=device)


def auxiliary_loss(stats: list[RouterStats], num_experts: int, top_k: int) -> torch.Tensor:
    """The Switch/Mixtral load-balancing loss as transformers computes it (``load_balancing_loss_func``): over every
    MoE layer's tokens at once, ``E · Σ_e f_e · P_e`` with ``f_e`` the share of assignments and ``P_e`` the mean score
    of expert ``e`` (``f`` sums to ``top_k``). Multiply by ``router_aux_loss_coef`` and add to the language-model loss.
    """
    return auxiliary_loss_terms(stats, num_experts)[0]


def auxiliary_loss_terms(stats: list[RouterStats], num_experts: int,
                         all_reduce: Optional[Callable[[torch.Tensor], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``auxiliary_loss`` over the tokens of several ranks, each holding some of them: ``(term, value)``.

    The loss is a product of sums over *all* tokens, so a mean of each rank's own loss is not one device's. With the
    counts known (summed over the ranks by ``all_reduce``, in place; they carry no gradient) the loss is linear in the
    scores: each rank's ``term`` (its own scores against the global counts) carries exactly its share of the
    gradient, and the ``term`` s of the ranks sum to the loss. ``value`` is the loss itself (detached), the same on
    every rank. Without ``all_reduce`` (one process) both are the loss.
    """
    counts = torch.stack([s.counts for s in stats]).sum(dim=0).detach()
    score_sums = torch.stack([s.score_sums for s in stats]).sum(dim=0)
    rows = torch.tensor([float(sum(s.tokens for s in stats))], device=counts.device)
    summed = torch.cat([counts, score_sums.detach(), rows])
    if all_reduce is not None:
        all_reduce(summed)
    counts, global_scores, rows = summed[:num_experts], summed[num_experts:-1], summed[-1]
    term = num_experts * torch.sum((counts / rows) * (score_sums / rows))
    value = num_experts * torch.sum((counts / rows) * (global_scores / rows))
    return term, value


__all__ = ["GroupedExperts", "HF_MOE_TYPES", "MoE", "MoEArgs", "MoEConfigError", "RouterStats", "Routing",
           "auxiliary_loss", "auxiliary_loss_terms", "combine", "dispatch", "is_sparse_block", "local_part", "route",
           "uses_grouped_mm"]
