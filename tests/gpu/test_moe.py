"""The mixture-of-experts CUDA path the CPU suite cannot run, in one process: ``torch.nn.functional.grouped_mm`` on
CUDA (bfloat16 only, compute capability 8.0+, by its docstring), forward and backward.

On CPU the grouped product equals the per-expert loop in float32 and bfloat16 up to accumulation order
(tests/unit/test_moe_ops.py; bit-exact on some CPUs, not on others).
On CUDA the kernels differ, so both are held against a float64 loop on the same bf16-rounded weights and tokens:
the grouped product must be no further from it than the bf16 loop is (within 2x, plus a floor), empty experts
included. Then a ``debug-moe`` model trains a few bf16 steps on CUDA through the grouped path and stays within bf16
rounding of the same steps in float32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from lightning_2d.models.llama.model import PRESETS, Transformer
from lightning_2d.ops.moe import MoE, MoEArgs, uses_grouped_mm

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("grouped_mm's CUDA kernels (the CPU suite checks the CPU ones against the loop)")


def _layer(dtype: torch.dtype, device: str) -> MoE:
    torch.manual_seed(0)
    layer = MoE(256, MoEArgs(num_experts=8, top_k=2, hidden_dim=512))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return layer.to(device=device, dtype=dtype)


def _experts_run(layer: MoE, x: torch.Tensor, counts: torch.Tensor, loop: bool) -> tuple[torch.Tensor, list]:
    x = x.detach().requires_grad_(True)
    out = layer.experts._loop(x, counts) if loop else layer.experts(x, counts)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *layer.experts.parameters()])
    return out, list(grads)


def test_grouped_mm_on_cuda_is_as_close_to_float64_as_the_bf16_loop():
    layer = _layer(torch.bfloat16, "cuda")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([50, 0, 80, 20, 0, 100, 30, 20], device="cuda")  # two empty experts
    assert uses_grouped_mm(x)
    grouped, grouped_grads = _experts_run(layer, x, counts, loop=False)
    looped, looped_grads = _experts_run(layer, x, counts, loop=True)
    exact_layer = _layer(torch.float64, "cpu")
    with torch.no_grad():  # the same bf16-rounded weights, in float64
        for exact, rounded in zip(exact_layer.parameters(), layer.parameters()):
            exact.copy_(rounded.double().cpu())
    exact, exact_grads = _experts_run(exact_layer, x.double().cpu(), counts.cpu(), loop=True)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double().cpu() - b).abs().max() / b.abs().max())

    print(f"grouped vs float64 {error(grouped, exact):.2e}, bf16 loop vs float64 {error(looped, exact):.2e}")
    assert error(grouped, exact) <= 2 * error(looped, exact) + 1e-3
    for got, loop_grad, want in zip(grouped_grads, looped_grads, exact_grads):
        assert error(got, want) <= 2 * error(loop_grad, want) + 1e-3


def test_a_mixture_of_experts_trains_in_bf16_on_cuda_like_fp32_on_cpu(monkeypatch):
    """bf16 weights and activations (as ``bf16-true``, and as FSDP computes under ``bf16-mixed``): the experts run
    through ``grouped_mm`` (counted), and 4 AdamW steps stay within bf16 rounding of fp32 on the CPU."""
    import torch.nn.functional as F

    calls = {"n": 0}
    grouped_mm = F.grouped_mm

    def counted(*args, **kwargs):
        calls["n"] += 1
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", counted)
    args = PRESETS["debug-moe"]
    losses = {}
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        model = Transformer(args)
        model.init_weights(7)
        model = model.to(device=device, dtype=dtype)
        model.init_buffers(torch.device(device))  # the rotary table in fp32 again
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, args.vocab_size, (4, 129), generator=torch.Generator().manual_seed(1)).to(device)
        losses[device] = []
        before = calls["n"]
        for _ in range(4):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[device].append(float(loss))
        if device == "cuda":  # 3 MoE blocks x 3 grouped products x 4 forwards, on the CUDA kernels
            assert calls["n"] - before == 3 * 3 * 4, calls
    worst = max(abs(a - b) / b for a, b in zip(losses["cuda"], losses["cpu"]))
    print(f"debug-moe bf16 CUDA vs fp32 CPU: worst relative loss error {worst:.2e}")
    assert worst <= 2e-2
