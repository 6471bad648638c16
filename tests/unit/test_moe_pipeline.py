"""The auxiliary load-balancing loss under pipeline parallelism, its pure part (``parallel.expert``: ``pass_routing``,
``add_auxiliary_loss``, no process group): two stages of mixture-of-experts layers on one process, the hidden states
and the carried routing statistics detached between them as the pipeline's send and receive do, give the gradients of
``output · g + scale · aux`` over both stages (Megatron's identity-with-aux trick across stages), and each stage's own
layers alone give another. The ``debug-moe`` model's router gradient changes with the term (what the distributed
``pp2_ep2_aux`` job's parity would miss without it)."""

from __future__ import annotations

import pytest
import torch

from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.ops.moe import MoE, MoEArgs, auxiliary_loss
from lightning_2d.parallel.expert import LoadBalancing, add_auxiliary_loss, pass_routing

ARGS = MoEArgs(num_experts=4, top_k=2, hidden_dim=16)
DIM, SCALE = 8, 0.37


def _stages(seed: int = 0) -> list[torch.nn.Sequential]:
    torch.manual_seed(seed)
    layers = [MoE(DIM, ARGS) for _ in range(3)]
    for layer in layers:
        for weight in layer.experts.parameters():
            torch.nn.init.normal_(weight, std=0.3)
    # Stage 0: a plain layer and a MoE layer; stage 1: two MoE layers (the stats are summed over a stage's layers).
    return [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), layers[0]), torch.nn.Sequential(layers[1], layers[2])]


def _stats(stage: torch.nn.Sequential) -> list:
    return [m.last_stats for m in stage if isinstance(m, MoE)]


def _grads(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters()]


def _pipelined(stages, x, g, own_stage_only: bool = False):
    """Stage 0 then stage 1, the tensors between them detached and received as the pipeline does; the backward of
    stage 1 first, its input gradients sent back to stage 0's outputs."""
    first, last = stages
    x = x.clone().requires_grad_()
    h = first(x)
    carry0 = torch.zeros(2 * ARGS.num_experts + 1)
    h_out, carry = pass_routing(h, carry0, _stats(first), ARGS.num_experts, SCALE)
    h_in, carry_in = h_out.detach().requires_grad_(), carry.detach().requires_grad_()
    out = last(h_in)
    if own_stage_only:  # each stage's term from its own layers: nothing received
        carry_in = torch.zeros_like(carry_in).requires_grad_()
    out, value = add_auxiliary_loss(out, carry_in, _stats(last), ARGS.num_experts, SCALE)
    torch.autograd.backward((out * g).sum())
    grad_carry = carry_in.grad if not own_stage_only else torch.cat(
        [carry[:4], torch.zeros(4), carry[-1:]]).detach()  # the first stage's own counts only
    torch.autograd.backward([h_out, carry], [h_in.grad, grad_carry])
    return value, x.grad, _grads(*stages)


def test_the_stages_terms_are_the_gradient_of_output_g_plus_scaled_aux_over_every_layer():
    x, g = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    stages = _stages()
    value, x_grad, grads = _pipelined(stages, x, g)

    reference = _stages()
    xr = x.clone().requires_grad_()
    out = reference[1](reference[0](xr))
    aux = auxiliary_loss(_stats(reference[0]) + _stats(reference[1]), ARGS.num_experts, ARGS.top_k)
    ((out * g).sum() + SCALE * aux).backward()
    torch.testing.assert_close(value, aux.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(x_grad, xr.grad, rtol=1e-5, atol=1e-7)
    for got, expected in zip(grads, _grads(*reference)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # The routers' gradients hold the term: without it they are another.
    plain = _stages()
    (plain[1](plain[0](x.clone().requires_grad_())) * g).sum().backward()
    router = [i for i, (n, _) in enumerate([(n, p) for m in stages for n, p in m.named_parameters()]) if "router" in n]
    assert all(not torch.allclose(grads[i], _grads(*plain)[i], rtol=1e-3, atol=0) for i in router)


def test_each_stage_s_own_layers_alone_are_not_the_loss():
    """The loss sums the counts over every layer before the product: a stage's gradient needs the later stages'
    counts, which the carried statistics' gradient brings back."""
    x, g = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    _, _, carried = _pipelined(_stages(), x, g)
    _, _, alone = _pipelined(_stages(), x, g, own_stage_only=True)
    routers = [i for i, (n, _) in enumerate([(n, p) for m in _stages() for n, p in m.named_parameters()])
               if "router" in n]
    assert all(not torch.allclose(carried[i], alone[i], rtol=1e-3, atol=0) for i in routers)


def test_the_debug_moe_router_gradient_changes_with_the_auxiliary_loss():
    """In the distributed parity jobs' setting (``debug-moe``, coefficient 0.01, 2 rows of 32 tokens a micro-batch)
    the term moves every router's gradient far beyond the parity tolerance (1e-5), so a pipeline dropping it fails
    there."""
    args = PRESETS["debug-moe"]
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for with_aux in (False, True):
        model = Transformer(args)
        model.init_weights(7)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
        if with_aux:
            loss = loss + LoadBalancing(args.moe).loss(model)[0]
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if ".router." in n})
    assert len(grads[0]) == 3
    for name, plain in grads[0].items():
        change = ((grads[1][name] - plain).norm() / plain.norm()).item()
        assert change > 1e-2, (name, change)


@pytest.mark.parametrize("last", [False, True])
def test_without_moe_layers_a_stage_passes_the_statistics_on(last):
    """A stage holding no mixture-of-experts layer (the debug model's dense block 0) carries zeros, or what it
    received, and gives no score gradient."""
    h = torch.randn(3, DIM, requires_grad=True)
    carry = torch.arange(9.0) + 1
    if last:
        out, value = add_auxiliary_loss(h, carry, [], 4, SCALE)
        assert value.item() == pytest.approx(4 * sum((carry[i] / carry[-1]) * (carry[4 + i] / carry[-1])
                                                     for i in range(4)).item())
    else:
        out, passed = pass_routing(h, carry, [], 4, SCALE)
        assert torch.equal(passed, carry)
    assert torch.equal(out, h)
    out.sum().backward()
    assert torch.equal(h.grad, torch.ones_like(h))
