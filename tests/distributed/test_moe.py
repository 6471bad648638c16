"""A mixture of experts (``debug-moe``: 8 routed experts, top 2, a shared expert, dense block 0) trained under expert,
tensor, context and pipeline parallelism equals one device: 6 fp32 AdamW steps on packed documents against the
single-device ``Trainer``, in one launch of 4 CPU processes (gloo).

Layouts: expert parallel 2 × FSDP 2 (full activation checkpointing: the exchange recomputed in backward), expert
parallel 2 × tensor parallel 2 (sequence parallel; whole experts on each tensor-parallel rank), tensor parallel 2 ×
data parallel 2 without expert parallelism (the experts split by their hidden features), context parallel 2 × expert
parallel 2, pipeline 2 × expert parallel 2 (aux-loss-free balancing: the bias moves
every step), pipeline 2 × expert parallel 2 with the auxiliary loss (full activation checkpointing; against one device
accumulating the pipeline's 2 micro-batches, each its own auxiliary loss), expert parallel 4 with routing forced off 5
of the 8 experts (an idle expert on a busy rank, two idle ranks), expert parallel 4 over data 2 × tensor 2 (each
tensor rank routing its sequence slice) and expert parallel 2 × FSDP 2 under SimpleFSDP. Every job clips its
gradients, and each step's gradient norm (the total and the routed experts' own) is
the reference's: AdamW's update barely changes when a tensor's gradient is off by a constant factor (the experts'
``1 / EP`` scale, say; only its epsilon tells, on near-zero gradients), the norms show the factor itself. Besides the
losses and norms: every routed count of every layer and step (summed over the ranks holding different tokens) is the
reference's (the same routing, no token dropped: counts sum to tokens × top_k), the auxiliary loss is the reference's,
the final weights (router, experts, shared experts) and the balancing bias (a buffer) are the reference's, and the
experts' placements are asserted.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import load_weights
from tests.distributed.test_parity import LOSS_RTOL, worst_relative_error

pytestmark = pytest.mark.distributed

#: Clipped every step (the reference's norms are 2.1-2.5 × this): the norm decides each update's size.
CLIP = 0.5
COMMON = {"model": "debug-moe", "documents": True, "even_labels": True, "gradient_clip_val": CLIP}
#: What every layout records beyond a multi-rank job's default (worker.fit); the references record it anyway.
RECORD = {"grad_norms": True}
#: Aux-loss-free balancing whose bias moves fast enough to change the routing within 6 steps.
BIAS = {**COMMON, "moe_bias_rate": 0.01}
#: Experts 3-7 pushed out of every token's top 2 (a fixed bias): at EP 4, rank 1 holds a busy and an idle expert,
#: ranks 2 and 3 receive no token at all.
IDLE = {**COMMON, "moe_bias_rate": 0.0, "idle_experts": 5}
LAYOUTS = {
    "ep2_fsdp2": (dict(dp=4, tp=1, expert_parallel_size=2, activation_checkpointing="full"), COMMON),
    "ep2_tp2": (dict(dp=2, tp=2, expert_parallel_size=2), COMMON),
    "tp2_dp2": (dict(dp=2, tp=2), COMMON),
    # No gradient accumulation here: the auxiliary loss of two half batches is not the whole batch's (a product of
    # sums, as transformers' own under accumulation); the reference takes the batch at once.
    "cp2_ep2": (dict(dp=2, tp=1, nprocs=4, context_parallel_size=2, expert_parallel_size=2), COMMON),
    "pp2_ep2": (dict(dp=2, tp=1, nprocs=4, pipeline_parallel_size=2, expert_parallel_size=2), BIAS),
    # The auxiliary loss per pipeline micro-batch (2 of one row per data-parallel rank), added by the stages inside
    # the schedule: one device accumulating the same 2 micro-batches is the reference.
    "pp2_ep2_aux": (dict(dp=2, tp=1, nprocs=4, pipeline_parallel_size=2, expert_parallel_size=2,
                         activation_checkpointing="full"), COMMON),
    "ep4_idle": (dict(dp=4, tp=1, expert_parallel_size=4), IDLE),
    # Expert parallelism over the tensor-parallel ranks: 2 data ranks × 2 tensor ranks in one group of 4, each
    # routing its own sequence slice (2 experts per rank, nothing repeated).
    "ep4_over_tp2": (dict(dp=2, tp=2, expert_parallel_size=4, experts_over_tensor_parallel=True), COMMON),
    # SimpleFSDP: the experts sharded over the expert-data ranks as fully_shard shards them, gathered where read.
    "ep2_simple_fsdp": (dict(dp=4, tp=1, expert_parallel_size=2, fsdp_backend="simple_fsdp"), COMMON),
}
#: One device accumulating 2 micro-batches of 2 rows a step: micro-batch m holds row m of both data-parallel ranks'
#: batches, a 2-rank pipeline's micro-batch m (worker.fit's reference loader).
ACCUMULATED = {**COMMON, "accumulate": 2}
REFERENCES = {"common": COMMON, "bias": BIAS, "idle": IDLE, "accumulated": ACCUMULATED}
REFERENCE_OF = {"ep2_fsdp2": "common", "ep2_tp2": "common", "tp2_dp2": "common", "cp2_ep2": "common",
                "pp2_ep2": "bias", "pp2_ep2_aux": "accumulated", "ep4_idle": "idle", "ep2_simple_fsdp": "common",
                "ep4_over_tp2": "common"}
#: The layouts whose tensor-parallel ranks route their own sequence slices (every rank's tokens its own).
OVER_TP = ("ep4_over_tp2",)


def per_step(values: list, reference: str) -> list:
    """A reference's per-batch records as per optimizer step: the accumulated reference logs each micro-batch's (its
    equal-sized micro-batches' mean is the step's)."""
    if reference != "accumulated":
        return values
    return [(a + b) / 2 for a, b in zip(values[::2], values[1::2])]


@pytest.fixture(scope="module")
def runs(jobs) -> dict:
    specs = {f"reference_{key}": jobs.reference_job(**extra) for key, extra in REFERENCES.items()}
    for name, (layout, extra) in LAYOUTS.items():
        options = dict(layout)
        specs[name] = jobs.layout_job(options.pop("dp"), options.pop("tp"), **options, **extra, **RECORD)
    jobs.share("moe", list(specs.values()))
    return {key: jobs.run(name, "fit", config, nprocs=nprocs) for key, (name, config, nprocs, _) in specs.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixture_of_experts_training_equals_one_device(runs, layout):
    reference, run = runs[f"reference_{REFERENCE_OF[layout]}"], runs[layout]
    ref_out = reference.rank_output(0)
    assert min(ref_out["grad_norms"]) > CLIP  # every step clipped
    ref_losses = per_step(ref_out["losses"], REFERENCE_OF[layout])
    for rank in range(4):
        out = run.rank_output(rank)
        error = worst_relative_error(out["losses"], ref_losses)
        norm_error = worst_relative_error(out["grad_norms"], ref_out["grad_norms"])
        # The routed experts' own norm: under 1e-3 of the total's square, which a scale error of theirs barely moves.
        expert_error = worst_relative_error(out["expert_grad_norms"], ref_out["expert_grad_norms"])
        print(f"moe {layout} rank {rank}: worst relative loss error {error:.2e}, gradient norm error {norm_error:.2e},"
              f" experts' {expert_error:.2e}")
        assert error <= LOSS_RTOL
        assert norm_error <= LOSS_RTOL, (out["grad_norms"], ref_out["grad_norms"])
        assert expert_error <= LOSS_RTOL, (out["expert_grad_norms"], ref_out["expert_grad_norms"])
    ref_final, final = load_weights(reference, "final"), load_weights(run, "final")
    assert final.keys() == ref_final.keys()
    moved = [n for n, w in final.items() if ".feed_forward.experts." in n or ".router." in n]
    assert len(moved) == 3 * 4  # blocks 1-3: router + w1/w2/w3
    for name, weight in final.items():
        torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if not name.startswith("pp2_")])
def test_every_token_is_routed_as_on_one_device_and_none_is_dropped(runs, layout):
    """Per step and layer, the assignments per expert summed over the ranks holding different tokens (tensor-parallel
    rank 0 of each; every rank where each routes its own sequence slice) are the reference's: the same routing (no score flipped by another summation order) and dropless
    (tokens × top_k assignments)."""
    reference, run = runs[f"reference_{REFERENCE_OF[layout]}"], runs[layout]
    ref_counts = reference.rank_output(0)["router_counts"]
    outs = [run.rank_output(rank) for rank in range(4)]
    for step, expected in enumerate(ref_counts):
        assert sorted(expected) == ["layers.1.feed_forward", "layers.2.feed_forward", "layers.3.feed_forward"]
        for layer, counts in expected.items():
            assert sum(counts) == 4 * 32 * 2  # global batch × sequence × top_k
            summed = [0.0] * 8
            for out in outs:
                if out["tp_rank"] == 0 or layout in OVER_TP:
                    summed = [a + b for a, b in zip(summed, out["router_counts"][step][layer])]
            assert summed == counts, (layout, step, layer, summed, counts)


def test_the_auxiliary_loss_is_the_global_batchs(runs):
    """transformers' load-balancing loss is a product of sums over the whole batch: each layout logs the reference's
    (every rank the same value) and trains it (the weights above)."""
    expected = runs["reference_common"].rank_output(0)["aux_losses"]
    assert all(a > 0 for a in expected)
    for layout in ("ep2_fsdp2", "ep2_tp2", "tp2_dp2", "cp2_ep2", "ep4_over_tp2"):
        for rank in range(4):
            assert runs[layout].rank_output(rank)["aux_losses"] == pytest.approx(expected, rel=1e-5), (layout, rank)
    assert runs["reference_bias"].rank_output(0)["aux_losses"] == [None] * 6  # balanced by the bias instead


def test_under_a_pipeline_the_auxiliary_loss_is_each_micro_batchs_over_every_stage(runs):
    """Pipeline 2 × expert parallel 2 with the auxiliary loss: each micro-batch's loss over every layer of both stages
    and both data-parallel ranks (the stages pass the routing statistics with the activations and the global counts
    back with the gradients), trained and logged as one device accumulating the same micro-batches. Every rank logs
    the step's value (the micro-batches' mean), and every layer's counts of the last micro-batch, summed over the
    ranks holding the layer, are the reference's last micro-batch's. Without the term the router's final weights are
    10 % off (by hand: 1.5e-4 relative loss error, the experts' gradient norm 1e-1), and a term computed from each
    stage's own layers alone is another loss (``tests/unit/test_moe_pipeline.py``)."""
    reference = runs["reference_accumulated"].rank_output(0)
    assert len(reference["aux_losses"]) == 12 and all(a > 0 for a in reference["aux_losses"])
    expected = per_step(reference["aux_losses"], "accumulated")
    outs = [runs["pp2_ep2_aux"].rank_output(rank) for rank in range(4)]
    for rank, out in enumerate(outs):
        assert out["aux_losses"] == pytest.approx(expected, rel=1e-5), rank
    layers = set()
    for step, counts in enumerate(reference["router_counts"][1::2]):  # the last micro-batch of each step
        assert sorted(counts) == ["layers.1.feed_forward", "layers.2.feed_forward", "layers.3.feed_forward"]
        for layer, expected_counts in counts.items():
            assert sum(expected_counts) == 2 * 32 * 2  # the micro-batch's rows × sequence × top_k
            held = [out["router_counts"][step][layer] for out in outs if layer in out["router_counts"][step]]
            assert len(held) == 2, (step, layer)  # the stage's two data-parallel ranks
            layers.add(layer)
            assert [a + b for a, b in zip(*held)] == expected_counts, (step, layer, held, expected_counts)
    assert len(layers) == 3


@pytest.mark.parametrize("layout", ["pp2_ep2", "ep4_idle"])
def test_the_balancing_bias_is_the_references_on_every_rank(runs, layout):
    """``expert_bias`` is a buffer, which the final weights leave out: each rank's (under pipeline parallelism its
    stage's layers) equals the reference's bit for bit (the counts it moves by are integers, summed over the ranks)."""
    expected = runs[f"reference_{REFERENCE_OF[layout]}"].rank_output(0)["buffers"]
    assert sorted(expected) == [f"layers.{i}.feed_forward.expert_bias" for i in (1, 2, 3)]
    held = set()
    for rank in range(4):
        buffers = runs[layout].rank_output(rank)["buffers"]
        assert buffers and buffers.keys() <= expected.keys(), (rank, sorted(buffers))
        held |= buffers.keys()
        for name, bias in buffers.items():
            assert bias == expected[name], (layout, rank, name, bias, expected[name])
    assert held == expected.keys()
    if layout == "pp2_ep2":  # the bias moved: 6 updates of ± 0.01 (centered), not the zeros it started from
        assert all(any(abs(b) >= 0.005 for b in bias) for bias in expected.values()), expected


def test_routing_off_most_experts_leaves_experts_and_ranks_idle(runs):
    counts = runs["reference_idle"].rank_output(0)["router_counts"]
    for step in counts:
        for layer in step.values():
            assert all(c == 0 for c in layer[3:]) and all(c > 0 for c in layer[:3]), layer
    # The bias of the common run moved routing against the aux-loss run (the balancing did something).
    assert runs["reference_bias"].rank_output(0)["router_counts"] != runs["reference_common"].rank_output(0)["router_counts"]


def test_experts_are_split_over_the_expert_and_tensor_parallel_ranks(runs):
    expert_parallel = runs["ep2_fsdp2"].rank_output(0)["placements"]["layers.1.feed_forward.experts.w1"]
    assert expert_parallel["mesh_dims"] == ["expert_data_shard", "expert_parallel"]
    assert expert_parallel["placements"][1] == "Shard(dim=0)"  # whole experts: 4 of 8 per expert-parallel rank
    assert expert_parallel["local_shape"] == [2, 64, 128]  # and FSDP halves them
    ep4 = runs["ep4_idle"].rank_output(0)["placements"]["layers.1.feed_forward.experts.w2"]
    assert ep4["local_shape"] == [2, 128, 64]
    router = runs["ep2_fsdp2"].rank_output(0)["placements"]["layers.1.feed_forward.router.weight"]
    assert "expert_parallel" not in router["mesh_dims"]  # the router is FSDP's like every other weight
    tensor_parallel = runs["tp2_dp2"].rank_output(0)["placements"]
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        placed = tensor_parallel[f"layers.1.feed_forward.experts.{name}"]
        tp = placed["mesh_dims"].index("tensor_parallel")
        assert placed["placements"][tp] == f"Shard(dim={dim})", (name, placed)
    shared = tensor_parallel["layers.1.feed_forward.shared_experts.w1.weight"]
    assert shared["placements"][shared["mesh_dims"].index("tensor_parallel")] == "Shard(dim=0)"
    # SimpleFSDP lays the experts out as fully_shard does (a checkpoint of one loads into the other), and wraps them.
    simple = runs["ep2_simple_fsdp"].rank_output(0)
    assert simple["placements"]["layers.1.feed_forward.experts.w1"] == expert_parallel
    assert simple["data_parallel_modules"]["simple_fsdp"] > 0 and simple["data_parallel_modules"]["fully_shard"] == 0
    # Under expert × tensor parallelism the experts are whole on each tensor-parallel rank.
    both = runs["ep2_tp2"].rank_output(0)["placements"]["layers.1.feed_forward.experts.w1"]
    assert "tensor_parallel" not in both["mesh_dims"] and both["local_shape"] == [4, 64, 128]


def test_expert_parallelism_over_the_tensor_parallel_ranks_computes_each_assignment_once(runs):
    """The expert FLOPs: the rows (token assignments) every rank's routed experts computed per step, summed over the
    ranks. With the tensor-parallel ranks in the expert groups (each routing its own slice) that is the global
    batch's tokens × top_k × the MoE layers, each once; with expert parallelism over the data ranks only (today's
    EP × TP), every tensor-parallel rank computes its group's whole: twice as many. Both train as one device
    (above)."""
    once = 4 * 32 * 2 * 3  # global batch × sequence × top_k × MoE layers
    over = [sum(runs["ep4_over_tp2"].rank_output(rank)["expert_rows"][step] for rank in range(4)) for step in range(6)]
    repeated = [sum(runs["ep2_tp2"].rank_output(rank)["expert_rows"][step] for rank in range(4)) for step in range(6)]
    print(f"expert rows per step, all ranks: over the tensor ranks {over}, today's EP x TP {repeated}")
    assert over == [once] * 6 and repeated == [2 * once] * 6
    placed = runs["ep4_over_tp2"].rank_output(0)["placements"]
    experts, router = placed["layers.1.feed_forward.experts.w1"], placed["layers.1.feed_forward.router.weight"]
    assert experts["mesh_dims"][-1] == "expert_parallel" and experts["local_shape"] == [2, 64, 128]  # 8 / 4 each
    # The router replicated over the tensor-parallel ranks (its gradient summed over their slices), FSDP over data.
    assert router["mesh_dims"] == ["data_parallel", "tensor_parallel"] and router["placements"][1] == "Replicate()"


#: Checkpoints across expert-parallel sizes: a 6-step run at expert parallel 2 × FSDP 2 on real text, its experts
#: balanced by the bias (a buffer the checkpoint must carry: it routes), saves every 2 steps; its step-2 checkpoint
#: resumed at expert parallel 4 and at tensor parallel 2 × data parallel 2 (no expert parallelism: the experts split
#: by features) must reproduce its steps 3-6, and its step-4 checkpoint resumed at its own layout steps 5-6 exactly.
RESUME_SEQ_LEN, RESUME_BATCH = 64, 4


@pytest.fixture(scope="module")
def resumes(jobs, tmp_path_factory) -> dict:
    from lightning_2d.data import stdlib_sources

    root = tmp_path_factory.mktemp("moe_ckpt")
    corpus = root / "corpus"
    corpus.mkdir()
    text = "".join(p.read_text() for p in stdlib_sources()[:3])[: 12 * RESUME_SEQ_LEN]  # 3 batches per epoch
    (corpus / "text.txt").write_text(text)
    base = {"corpus": str(corpus), "cache_dir": str(root / "cache"), "seq_len": RESUME_SEQ_LEN, "max_steps": 6,
            "model": "debug-moe", "moe_bias_rate": BIAS["moe_bias_rate"]}
    saved = root / "ep2"
    runs = {
        "moe_ep2_saves": {**base, "dp": 4, "tp": 1, "batch_size": 1, "expert_parallel_size": 2,
                          "checkpoints": [{"dirpath": str(saved), "every_n_train_steps": 2, "save_top_k": -1}]},
        "moe_ep4_resumes": {**base, "dp": 4, "tp": 1, "batch_size": 1, "expert_parallel_size": 4,
                            "resume": str(saved / "epoch=0-step=2.ckpt")},
        "moe_tp2_resumes": {**base, "dp": 2, "tp": 2, "batch_size": 2, "resume": str(saved / "epoch=0-step=2.ckpt")},
        "moe_ep2_resumes": {**base, "dp": 4, "tp": 1, "batch_size": 1, "expert_parallel_size": 2,
                            "resume": str(saved / "epoch=1-step=4.ckpt")},
    }
    jobs.share("moe_resume", [(name, config, 4, 1) for name, config in runs.items()], scenario="train")
    return {name: jobs.run(name, "train", config, nprocs=4) for name, config in runs.items()}


@pytest.mark.parametrize("resumed", ["moe_ep4_resumes", "moe_tp2_resumes"])
def test_a_checkpoint_resumes_at_another_expert_parallel_size(resumes, resumed):
    saved, run = resumes["moe_ep2_saves"].rank_output(0), resumes[resumed].rank_output(0)
    assert len(saved["losses"]) == 6 and len(run["losses"]) == 4 and run["global_step"] == 6
    if resumed == "moe_ep4_resumes":  # the same data-parallel size: rank 0 gets the same batches from step 3 on
        assert run["batches"] == saved["batches"][2:]
    error = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], saved["losses"][2:]))
    print(f"{resumed}: worst relative loss error of steps 3-6 {error:.2e}")
    assert error <= LOSS_RTOL
    final, expected = load_weights(resumes[resumed], "final"), load_weights(resumes["moe_ep2_saves"], "final")
    assert any(".experts." in name for name in final)
    for name, weight in expected.items():
        torch.testing.assert_close(final[name], weight, rtol=1e-5, atol=1e-5, msg=name)
    # The bias restored, then moved by the same integer counts: the same bits at any layout.
    assert len(saved["buffers"]) == 3 and run["buffers"] == saved["buffers"]


def test_a_bias_balanced_run_resumed_at_its_own_layout_is_the_uninterrupted_run_bit_for_bit(resumes):
    """Steps 5-6 resumed from the step-4 checkpoint at the saving layout: the same losses, final weights and, on every
    rank, balancing bias (a buffer: restored from the checkpoint, not zeroed by the init), bit for bit."""
    saved, resumed = resumes["moe_ep2_saves"], resumes["moe_ep2_resumes"]
    for rank in range(4):
        before, after = saved.rank_output(rank), resumed.rank_output(rank)
        assert after["global_step"] == 6 and after["batches"] == before["batches"][4:], rank
        assert len(before["buffers"]) == 3 and after["buffers"] == before["buffers"], rank
        assert after["losses"] == before["losses"][4:], rank  # exact: no tolerance
    assert any(b != 0.0 for bias in saved.rank_output(0)["buffers"].values() for b in bias)
    final, expected = load_weights(resumed, "final"), load_weights(saved, "final")
    assert final.keys() == expected.keys()
    for name, weight in expected.items():
        assert torch.equal(final[name], weight), name
