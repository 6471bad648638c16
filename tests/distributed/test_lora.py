"""LoRA (``lora=``) under every parallelism equals one device: only the adapters train, the base stays bit for bit.

Real jobs: 4 CPU processes on gloo, the parity setup of test_parity.py (6 fp32 AdamW steps of the ``debug`` Llama)
with rank-4 adapters on all seven projections and the adapters' gradients clipped, against the single-device
``Trainer`` with the same adapters: 2×2 with sequence parallelism (full activation checkpointing), 1×4 tensor
parallel (per-op selective checkpointing), pipeline 2 × data parallel 2, context parallel 2 × data parallel 2 (two
accumulated micro-batches per step), HSDP (2 replicas × 2 shards) and SimpleFSDP at 2×2 (full checkpointing), in one
launch; every job on packed documents (document masks). QLoRA (NF4 bases) in the same launches: one rank, FSDP over 4 ranks,
context parallel 2 × data parallel 2 and pipeline 2 × data parallel 2 against the single-device QLoRA run, on a model whose projections split into whole
NF4 scaler groups (dim 256).
"""

from __future__ import annotations

import pytest
import torch

from lightning_2d.ops.lora import is_adapter_parameter
from tests.distributed.conftest import SMALL, load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

LORA = {"rank": 4, "alpha": 8.0}
CLIP = 0.01
#: Packed documents (each attends within itself) and even target counts (so two accumulated micro-batches are the
#: double batch's mean) in every job and the reference, of 2 blocks (``SMALL``; the pipeline's stages one each).
COMMON = {"lora": LORA, "gradient_clip_val": CLIP, "grad_norms": True, "documents": True, "even_labels": True, **SMALL}
BLOCKS = SMALL["blocks"]
#: Each layout also carries an option LoRA must compose with (the reference needs none of them to be equal).
LAYOUTS = {
    "2x2_sp": dict(dp=2, tp=2, activation_checkpointing="full"),
    "1x4": dict(dp=1, tp=4, activation_checkpointing="selective", selective_ac_option="op"),
    "pp2xdp2": dict(dp=2, tp=1, nprocs=4, pipeline_parallel_size=2),
    "cp2xdp2": dict(dp=2, tp=1, nprocs=4, context_parallel_size=2, accumulate=2),
    "hsdp": dict(dp=4, tp=1, data_parallel_replicate_size=2),
    "simple_fsdp_2x2": dict(dp=2, tp=2, fsdp_backend="simple_fsdp", activation_checkpointing="full"),
}
#: QLoRA: the frozen projections in NF4. Every projection of this model holds whole NF4 scaler groups (16,384
#: elements) in each of 4 row shards: 256 × 256 attention weights, 768 × 256 MLP weights.
QLORA = {**COMMON, "lora": {**LORA, "quantize_base": "nf4"},
         "model_overrides": {"dim": 256, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 256}}
QLORA_LAYOUTS = {
    "qlora_fsdp1": dict(dp=1, tp=1),  # one rank: FSDP leaves the NF4 weights alone (torch's one-rank path cannot gather them)
    "qlora_fsdp4": dict(dp=4, tp=1),
    "qlora_cp2xdp2": dict(dp=2, tp=1, nprocs=4, context_parallel_size=2),
    "qlora_pp2xdp2": dict(dp=2, tp=1, nprocs=4, pipeline_parallel_size=2),
}
#: LoRA on a mixture of experts (``debug-moe`` cut to its dense block 0 and sparse block 1: a router, 8 routed experts,
#: a shared expert), every projection adapted: the routed experts per expert (``ops.lora.LoRAExperts``), the shared
#: experts' Linears as a dense layer's. Expert parallel 2 × FSDP 2 (the adapters split by expert with their experts,
#: FSDP over the experts' own mesh; full checkpointing: the exchange recomputed in backward), tensor parallel 2 ×
#: data parallel 2 (the experts split by hidden features, their adapters placed with them) and expert parallel 4 over
#: data 2 × tensor 2 (``experts_over_tensor_parallel``) against one device.
MOE = {**COMMON, "model": "debug-moe"}
MOE_LAYOUTS = {
    "moe_ep2_fsdp2": dict(dp=4, tp=1, expert_parallel_size=2, activation_checkpointing="full"),
    "moe_tp2_dp2": dict(dp=2, tp=2),
    # expert parallel 4 over data 2 × tensor 2: each tensor rank routes its slice, the adapters with their experts
    "moe_ep4_over_tp2": dict(dp=2, tp=2, expert_parallel_size=4, experts_over_tensor_parallel=True),
}
#: The seven projections, by how tensor parallelism splits their base weight.
COLUMN_WISE, ROW_WISE = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")


def layout_job(jobs, name: str):
    options = dict({**LAYOUTS, **QLORA_LAYOUTS, **MOE_LAYOUTS}[name])
    common = COMMON if name in LAYOUTS else QLORA if name in QLORA_LAYOUTS else MOE
    return jobs.layout_job(options.pop("dp"), options.pop("tp"), **options, **common)


@pytest.fixture(scope="module")
def runs(jobs) -> dict:
    specs = {"reference": jobs.reference_job(**COMMON), **{name: layout_job(jobs, name) for name in LAYOUTS},
             "qlora_reference": jobs.reference_job(**QLORA), **{name: layout_job(jobs, name) for name in QLORA_LAYOUTS},
             "moe_reference": jobs.reference_job(**MOE), **{name: layout_job(jobs, name) for name in MOE_LAYOUTS}}
    jobs.share("lora", list(specs.values()))
    return {key: jobs.run(name, "fit", config, nprocs=nprocs) for key, (name, config, nprocs, _) in specs.items()}


def test_the_reference_trains_only_its_adapters_and_clips_them(runs):
    reference = runs["reference"]
    out = reference.rank_output(0)
    adapters = [n for n in load_weights(reference, "final") if is_adapter_parameter(n)]
    assert len(adapters) == BLOCKS * 7 * 2  # blocks × projections × (A, B)
    assert out["optimized"] == out["requires_grad"] == out["optimizer_state"] == sorted(adapters)
    assert min(out["grad_norms"]) > 2 * CLIP  # the adapters' norm, clipped every step
    # To CLIP / (norm + 1e-6) (torch's clipping epsilon): 3e-5 below CLIP at norms of ~0.03.
    assert out["stepped_grad_norms"] == pytest.approx([CLIP] * 6, rel=1e-4)
    initial, final = load_weights(reference, "initial"), load_weights(reference, "final")
    moved = [n for n in adapters if not torch.equal(initial[n], final[n])]
    assert moved == adapters
    for name in adapters:  # peft's init: B zero, A uniform in ±1/√in_features
        if name.endswith("lora_b.weight"):
            assert not initial[name].any(), name
        else:
            bound = initial[name].shape[1] ** -0.5
            assert 0.5 * bound < initial[name].abs().max() <= bound, name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_training_equals_one_device_and_leaves_the_base_bit_for_bit(runs, layout):
    reference, run = runs["reference"], runs[layout]
    ref_out = reference.rank_output(0)
    for rank in range(4):
        out = run.rank_output(rank)
        if layout != "pp2xdp2" or "0" in out.get("blocks", ["0"]):  # a pipeline's first stage holds block 0
            assert out["blocks_given_masks"] >= len(out["losses"])  # each step's blocks got the documents' mask
        losses = out["losses"]
        if layout == "cp2xdp2":  # two micro-batches per step: their mean is the step's loss (even target counts)
            assert len(losses) == 12
            losses = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
        error = worst_relative_error(losses, ref_out["losses"])
        print(f"lora {layout} rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (losses, ref_out["losses"])
        assert out["grad_norms"] == pytest.approx(ref_out["grad_norms"], rel=1e-5)
        # Only adapters are optimized, hold optimizer state and require gradients (on a pipeline rank: its stage's).
        assert out["optimized"] == out["requires_grad"] == out["optimizer_state"]
        assert out["optimized"] and all(is_adapter_parameter(n) for n in out["optimized"]), out["optimized"]
    initial, ref_final, final = (load_weights(reference, "initial"), load_weights(reference, "final"),
                                 load_weights(run, "final"))
    assert final.keys() == ref_final.keys()
    for name, weight in final.items():
        if is_adapter_parameter(name):
            torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
        else:  # frozen: the seeded init, the same bits at every layout, untouched by 6 steps
            assert torch.equal(weight, initial[name]), name


def test_adapters_take_their_base_layers_tensor_parallel_placements(runs):
    """Column-wise base (output features split): A replicated, B split like the base. Row-wise base (input
    features split): A split like the base's input, B replicated. FSDP shards both over the data-parallel ranks.
    Every adapter the job placed is checked, and they must be all of them: each block's seven projections."""
    placed = runs["2x2_sp"].rank_output(0)["placements"]
    checked = []
    for name in placed:
        if not name.endswith(".lora_a.weight"):
            continue
        base = name.removesuffix(".lora_a.weight")
        projection = base.rpartition(".")[2]
        weight, a, b = (placed[f"{base}{suffix}.weight"] for suffix in ("", ".lora_a", ".lora_b"))
        tp = weight["mesh_dims"].index("tensor_parallel")
        assert a["mesh_dims"] == b["mesh_dims"] == weight["mesh_dims"]
        if projection in COLUMN_WISE:
            assert weight["placements"][tp] == "Shard(dim=0)"
            assert a["placements"][tp] == "Replicate()" and b["placements"][tp] == "Shard(dim=0)", (base, a, b)
        else:
            assert weight["placements"][tp] == "Shard(dim=1)"
            assert a["placements"][tp] == "Shard(dim=1)" and b["placements"][tp] == "Replicate()", (base, a, b)
        dp = weight["mesh_dims"].index("data_parallel_shard") if "data_parallel_shard" in weight["mesh_dims"] else 0
        assert "Shard" in a["placements"][dp] and "Shard" in b["placements"][dp], (base, a, b)
        checked.append(base)
    # LORA names no targets: the seven projections of every block (2 of the debug model's), 14 adapted layers.
    expected = BLOCKS * len(COLUMN_WISE + ROW_WISE)
    assert len(checked) == expected, f"{len(checked)} adapted layers checked, {expected} expected: {sorted(checked)}"


def _nf4_codes_per_block(weight: torch.Tensor) -> int:
    """The most distinct values in any 64-element block: at most 16 for a weight stored in NF4."""
    return max(len(torch.unique(block)) for block in weight.reshape(-1, 64))


def test_the_qlora_reference_stores_its_bases_in_nf4_and_trains_only_its_adapters(runs):
    out = runs["qlora_reference"].rank_output(0)
    projections = [f"layers.{i}.{p}.weight" for i in range(BLOCKS) for p in
                   [f"attention.{n}" for n in ("wq", "wk", "wv", "wo")] + [f"feed_forward.{n}" for n in ("w1", "w2", "w3")]]
    assert out["nf4"] == sorted(projections)
    assert out["optimized"] and all(is_adapter_parameter(n) for n in out["optimized"])
    initial = load_weights(runs["qlora_reference"], "initial")
    assert _nf4_codes_per_block(initial["layers.0.attention.wq.weight"]) <= 16  # 4-bit codes × one scaler per block
    assert _nf4_codes_per_block(initial["output.weight"]) > 16  # the head is not adapted: not quantized


@pytest.mark.parametrize("layout", list(QLORA_LAYOUTS))
def test_qlora_training_equals_one_device_with_the_same_nf4_bits(runs, layout):
    """Each rank quantizes the whole weight and keeps its rows: the gathered NF4 bases equal the single device's
    bit for bit (a per-shard quantization would not: the scalers' mean is the whole tensor's) after training."""
    reference, run = runs["qlora_reference"], runs[layout]
    ref_out = reference.rank_output(0)
    held = set()
    for rank in range(len(run.returncodes)):
        out = run.rank_output(rank)
        assert out["nf4"] and set(out["nf4"]) <= set(ref_out["nf4"])  # a pipeline rank: its stage's projections
        held |= set(out["nf4"])
        error = worst_relative_error(out["losses"], ref_out["losses"])
        print(f"qlora {layout} rank {rank}: worst relative loss error {error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref_out["losses"])
        assert out["grad_norms"] == pytest.approx(ref_out["grad_norms"], rel=1e-5)
        assert out["optimized"] == out["requires_grad"] == out["optimizer_state"]
        assert out["optimized"] and set(out["optimized"]) <= set(ref_out["optimized"])
    assert held == set(ref_out["nf4"])
    ref_initial, ref_final, final = (load_weights(reference, "initial"), load_weights(reference, "final"),
                                     load_weights(run, "final"))
    for name in ref_out["nf4"]:  # the single device's NF4 bits, untouched by training
        assert torch.equal(final[name], ref_initial[name]), name
        assert torch.equal(ref_final[name], ref_initial[name]), name
    for name, weight in final.items():
        if is_adapter_parameter(name):
            torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


def _moe_adapters(names) -> list[str]:
    return sorted(n for n in names if is_adapter_parameter(n) and ".experts." in n)


def test_lora_on_a_mixture_of_experts_adapts_the_routed_experts_per_expert(runs):
    """The one-device reference: every routed projection of the sparse block carries per-expert adapters (A zero-free
    peft init, B zero), the shared experts their dense ones; only adapters train, and the routed ones move."""
    reference = runs["moe_reference"]
    out = reference.rank_output(0)
    initial, final = load_weights(reference, "initial"), load_weights(reference, "final")
    routed = _moe_adapters(final)
    assert routed == [f"layers.1.feed_forward.experts.{w}_lora_{ab}" for w in ("w1", "w2", "w3") for ab in "ab"]
    assert initial["layers.1.feed_forward.experts.w2_lora_a"].shape == (8, 4, 64)  # (E, r, hidden)
    assert initial["layers.1.feed_forward.experts.w2_lora_b"].shape == (8, 128, 4)  # (E, dim, r)
    assert "layers.1.feed_forward.shared_experts.w2.lora_b.weight" in final
    assert out["optimized"] == out["requires_grad"] == out["optimizer_state"] == sorted(
        n for n in final if is_adapter_parameter(n))
    for name in routed:
        assert not torch.equal(initial[name], final[name]), name
        if name.endswith("_lora_b"):
            assert not initial[name].any(), name
    assert min(out["expert_grad_norms"]) > 0  # the routed experts' adapters' own norm (the base holds none)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_lora_on_a_mixture_of_experts_equals_one_device(runs, layout):
    """Losses, gradient norms (the total and the routed experts' adapters' own), the final adapters within 1e-5; the
    frozen base (routed experts, router, shared experts) bit for bit its seeded init; only adapters optimized."""
    reference, run = runs["moe_reference"], runs[layout]
    ref_out = reference.rank_output(0)
    for rank in range(4):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], ref_out["losses"])
        norm_error = worst_relative_error(out["grad_norms"], ref_out["grad_norms"])
        expert_error = worst_relative_error(out["expert_grad_norms"], ref_out["expert_grad_norms"])
        print(f"lora {layout} rank {rank}: worst relative loss error {error:.2e}, gradient norm error"
              f" {norm_error:.2e}, routed experts' adapters' {expert_error:.2e}")
        assert error <= LOSS_RTOL, (out["losses"], ref_out["losses"])
        assert norm_error <= LOSS_RTOL, (out["grad_norms"], ref_out["grad_norms"])
        assert expert_error <= LOSS_RTOL, (out["expert_grad_norms"], ref_out["expert_grad_norms"])
        assert out["optimized"] == out["requires_grad"] == out["optimizer_state"] == ref_out["optimized"]
    initial, ref_final, final = (load_weights(reference, "initial"), load_weights(reference, "final"),
                                 load_weights(run, "final"))
    assert final.keys() == ref_final.keys()
    worst = 0.0
    for name, weight in final.items():
        if is_adapter_parameter(name):
            worst = max(worst, float((weight - ref_final[name]).abs().max()))
            torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert torch.equal(weight, initial[name]), name
    print(f"lora {layout}: final adapters' largest difference from one device {worst:.2e}")


def test_the_routed_experts_adapters_are_split_with_their_experts(runs):
    """Expert parallelism: every parameter of the experts module, adapters included, Shard(0) (the expert) over the
    expert-parallel ranks. The experts' tensor parallelism (hidden features split): w1/w3's B with the hidden rows
    (Shard(1)), their A replicated; w2's A with the hidden columns (Shard(2)), its B replicated."""
    placed = runs["moe_ep2_fsdp2"].rank_output(0)["placements"]
    experts = {n: p for n, p in placed.items() if n.startswith("layers.1.feed_forward.experts.")}
    assert len(experts) == 3 + 6
    for name, p in experts.items():
        assert p["placements"][p["mesh_dims"].index("expert_parallel")] == "Shard(dim=0)", (name, p)
    placed = runs["moe_tp2_dp2"].rank_output(0)["placements"]
    expected = {"w1": "Shard(dim=1)", "w3": "Shard(dim=1)", "w2": "Shard(dim=2)",
                "w1_lora_a": "Replicate()", "w1_lora_b": "Shard(dim=1)", "w3_lora_a": "Replicate()",
                "w3_lora_b": "Shard(dim=1)", "w2_lora_a": "Shard(dim=2)", "w2_lora_b": "Replicate()"}
    for which, placement in expected.items():
        p = placed[f"layers.1.feed_forward.experts.{which}"]
        assert p["placements"][p["mesh_dims"].index("tensor_parallel")] == placement, (which, p)


def test_the_replicated_adapter_factors_gradients_are_summed_once_per_step(runs):
    """The factor each tensor rank holds whole (column-wise: ``A``, row-wise: ``B``) gets a partial sum of its
    gradient on each rank: deferred (``parallel.grad_sync``) and summed in one bucketed all-reduce per optimizer step,
    not one per factor; the base weights, frozen, never; the SimpleFSDP layout's redistributes reduce them as before."""
    out = runs["2x2_sp"].rank_output(0)
    deferred = out["deferred_reductions"]
    owner = {p: "attention" if p in ("wq", "wk", "wv", "wo") else "feed_forward" for p in COLUMN_WISE + ROW_WISE}
    whole = sorted(f"layers.{i}.{owner[p]}.{p}.{'lora_a' if p in COLUMN_WISE else 'lora_b'}.weight"
                   for i in range(BLOCKS) for p in COLUMN_WISE + ROW_WISE)
    assert deferred["deferred"] == whole
    assert deferred["reductions"] == len(out["losses"]) and deferred["pending"] == 0
    assert runs["simple_fsdp_2x2"].rank_output(0)["deferred_reductions"] is None
