"""The mixture-of-experts layer's pure logic (``lightning_2d.ops.moe``): routing, dropless dispatch, the grouped
experts against a per-expert loop, the deterministic combine, and the layer and its auxiliary loss against
transformers' Qwen3-MoE and Mixtral blocks on the same weights."""

from __future__ import annotations

import pytest
import torch

from lightning_2d.ops.moe import (
    MoE, MoEArgs, MoEConfigError, auxiliary_loss, combine, dispatch, route, uses_grouped_mm,
)

DIM, HIDDEN, EXPERTS, TOP_K = 32, 24, 6, 2


def moe(args: MoEArgs | None = None, seed: int = 0) -> MoE:
    layer = MoE(DIM, args or MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return layer


def tokens(*shape: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(True)


def test_routing_picks_the_top_scores_renormalizes_and_the_bias_moves_only_the_choice():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 2.5, 0.1]])
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8)
    routing = route(logits, args)
    assert routing.experts.tolist() == [[0, 1], [1, 2]]
    scores = torch.softmax(logits, -1)
    picked = scores.gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, picked / picked.sum(-1, keepdim=True))
    unnormalized = route(logits, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, norm_topk_prob=False, route_scale=2.5))
    torch.testing.assert_close(unnormalized.weights, 2.5 * picked)
    biased = route(logits, args, bias=torch.tensor([0.0, 0.0, 0.0, 1.0]))  # expert 3 now chosen, at its own score
    assert biased.experts.tolist() == [[3, 0], [3, 1]]
    chosen = scores.gather(-1, biased.experts)
    torch.testing.assert_close(biased.weights, chosen / chosen.sum(-1, keepdim=True))
    sigmoid = route(logits, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, score_func="sigmoid"))
    torch.testing.assert_close(sigmoid.scores, torch.sigmoid(logits))


def test_dispatch_is_dropless_stable_and_combine_puts_every_output_back():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 0]])  # expert 4 and 5 get nothing
    order, counts = dispatch(experts, 6)
    assert counts.tolist() == [3, 1, 3, 1, 0, 0] and int(counts.sum()) == experts.numel()
    assert experts.reshape(-1)[order].tolist() == [0, 0, 0, 1, 2, 2, 2, 3]
    assert order.tolist() == [1, 4, 7, 3, 0, 2, 5, 6]  # within an expert, in token order
    outputs = torch.arange(8.0).unsqueeze(1).repeat(1, 3)  # sorted slot i holds i
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75], [0.0, 1.0]])
    combined = combine(outputs, order, weights)
    # token t's slot j sits at sorted position order.tolist().index(2t + j)
    where = {slot: i for i, slot in enumerate(order.tolist())}
    expected = torch.tensor([[sum(weights[t, j] * where[2 * t + j] for j in range(2))] * 3 for t in range(4)])
    torch.testing.assert_close(combined, expected)


def kernel_tolerance(dtype: torch.dtype, reduction: int, chained: int = 3) -> float:
    """How far two kernels computing the same products may drift apart, relative to the result's largest entry.

    ``grouped_mm`` and the loop's ``@`` are different kernels: each accumulates a ``reduction``-long sum in float32 in
    its own order (blocking, vector width: it changes with the CPU, oneDNN or MKL picking per instruction set). Each
    order is within ``reduction · u`` of the exact sum, relative to its terms' magnitudes (u = eps/2, Higham's γ_K),
    so two orders differ by at most ``reduction · eps(float32)``; each result is then rounded to ``dtype`` once (one ``eps(dtype)`` more). The
    experts chain ``chained`` such products (gate/up, down, and backward's through them). float32: 3 · (32 + 1) ·
    eps = 1.2e-5 (measured: the loop with its reductions' operands permuted differs by ≤ 8 eps = 9.5e-7);
    bfloat16: 2.3e-2, three roundings to bf16's 8 bits."""
    return chained * (torch.finfo(dtype).eps + reduction * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_loop_over_the_experts_forward_and_backward(dtype):
    layer = moe().to(dtype)
    x = tokens(11, DIM, dtype=dtype)
    counts = torch.tensor([3, 0, 4, 1, 0, 3])  # empty experts included
    assert uses_grouped_mm(x)
    grouped = layer.experts(x, counts)
    grads = torch.autograd.grad(grouped.float().square().sum(), [x, *layer.experts.parameters()])
    looped = layer.experts._loop(x, counts)
    loop_grads = torch.autograd.grad(looped.float().square().sum(), [x, *layer.experts.parameters()])
    # Two kernels: equal up to their accumulation order (bit-equal on some CPUs, not on others), not bit for bit.
    tolerance = kernel_tolerance(dtype, reduction=max(DIM, HIDDEN))
    for name, got, want in zip(["output", "x", "w1", "w2", "w3"], [grouped, *grads], [looped, *loop_grads]):
        scale = float(want.detach().abs().max())
        assert scale > 0, name  # a zero reference would make the bound vacuous
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_float64_and_meta_tensors_take_the_loop():
    layer = moe().double()
    x = tokens(2, 7, DIM, dtype=torch.float64)
    assert not uses_grouped_mm(x)
    reference = moe()
    torch.testing.assert_close(layer(x), reference(x.float()).double(), rtol=1e-5, atol=1e-6)
    with torch.device("meta"):
        meta = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN))
        assert meta(torch.empty(2, 7, DIM)).shape == (2, 7, DIM)


def test_a_layer_balanced_by_bias_routes_by_its_bias():
    layer = moe(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN, load_balancing="bias"))
    x = tokens(4, 5, DIM)
    layer(x)
    before = layer.last_stats.counts.clone()
    layer.expert_bias[5] = 10.0  # every token now picks expert 5 (at its own, unbiased score)
    layer(x)
    assert layer.last_stats.counts[5] == 20 and not torch.equal(layer.last_stats.counts, before)


def test_the_layer_gives_the_same_bits_every_run_and_counts_every_assignment():
    layer = moe(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN, num_shared_experts=1))
    x = tokens(3, 9, DIM)
    first, second = layer(x), layer(x)
    assert torch.equal(first, second)
    assert int(layer.last_stats.counts.sum()) == 3 * 9 * TOP_K and layer.last_stats.tokens == 27


def _hf_block(family: str, norm_topk_prob: bool = True):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=DIM, num_experts_per_tok=TOP_K, hidden_act="silu")
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=HIDDEN,
                                             norm_topk_prob=norm_topk_prob, **common)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    else:
        config = transformers.MixtralConfig(num_local_experts=EXPERTS, intermediate_size=HIDDEN, **common)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    block = Block(config).eval()
    ours = moe(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN, norm_topk_prob=norm_topk_prob))
    with torch.no_grad():  # transformers 5 fuses gate and up per expert: (E, 2F, D)
        block.gate.weight.copy_(ours.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        block.experts.down_proj.copy_(ours.experts.w2)
    return block, ours


@pytest.mark.parametrize("family, norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_the_layer_computes_transformers_block_on_the_same_weights(family, norm_topk_prob):
    block, ours = _hf_block(family, norm_topk_prob)
    x = tokens(2, 8, DIM)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    ours_out = ours(x)
    torch.testing.assert_close(ours_out, out, rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad(out.square().sum(), x)[0]
    got = torch.autograd.grad(ours_out.square().sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_auxiliary_loss_is_transformers_over_every_layer_at_once():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers = [moe(seed=s) for s in (0, 1)]
    x = tokens(2, 8, DIM)
    logits = []
    for layer in layers:
        layer(x)
        logits.append(layer.router(x.reshape(-1, DIM)))
    want = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    got = auxiliary_loss([layer.last_stats for layer in layers], EXPERTS, TOP_K)
    torch.testing.assert_close(got, want)
    (router_grad,) = torch.autograd.grad(got, layers[0].router.weight)  # the loss trains the router
    assert router_grad.abs().sum() > 0


def test_bad_settings_name_the_values():
    with pytest.raises(MoEConfigError, match=r"top_k \(9\) cannot exceed num_experts \(8\)"):
        MoEArgs(num_experts=8, top_k=9, hidden_dim=16)
    with pytest.raises(MoEConfigError, match=r"score_func must be 'softmax' or 'sigmoid', got 'relu'.*"):
        MoEArgs(num_experts=8, top_k=2, hidden_dim=16, score_func="relu")
    with pytest.raises(MoEConfigError, match=r"load_balancing must be 'aux_loss', 'bias' or 'none', got 'loss'"):
        MoEArgs(num_experts=8, top_k=2, hidden_dim=16, load_balancing="loss")
    with pytest.raises(MoEConfigError, match=r"num_experts must be a positive integer, got 0"):
        MoEArgs(num_experts=0, top_k=1, hidden_dim=16)


def test_tokens_received_from_each_rank_are_regrouped_by_local_expert():
    """Expert parallelism receives tokens grouped by source rank, then local expert; the experts need them grouped by
    local expert: ``[source 0: e0 ×1, e1 ×2][source 1: e0 ×3, e1 ×0]`` → ``e0: 0, 3, 4, 5`` then ``e1: 1, 2``."""
    from lightning_2d.parallel.expert import _by_expert_order

    assert _by_expert_order(torch.tensor([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert _by_expert_order(torch.tensor([[0, 0], [0, 0]])).tolist() == []
