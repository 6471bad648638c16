"""Checkpoints never lose work: exact resume, resharding, full files, async saves, crashes.

One 6-step (2, 2) run on a small real-text corpus (3 steps per epoch) saves sharded checkpoints
every 2 steps and at every epoch end; the other jobs resume from them and must reproduce its
losses, batches and random draws. The runs train 2 of the debug model's 4 blocks (``SMALL``), but for the pipeline
chain: its interleaved resume splits 4 blocks into 4 stages, from a 4-block run of its own.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from lightning_2d.checkpoint.discovery import is_complete
from lightning_2d.data import stdlib_sources
from tests.distributed.conftest import SMALL, load_weights
from tests.unit.test_checkpoint_digests import flip_exponent_bits

pytestmark = pytest.mark.distributed

SEQ_LEN, GLOBAL_BATCH = 64, 4
#: The blocks of every run but the pipeline chain's and those started from a folder (its config's).
BLOCKS = SMALL["blocks"]


#: The same-layout resumes: (checkpoint of the reference run, steps done by then).
SAME_LAYOUT_RESUMES = [("epoch=0-step=2.ckpt", 2), ("end-epoch=0-step=3.ckpt", 3)]
#: The resharded resumes of the reference's step-4 checkpoint: (dp, tp, replicate).
RESHARDS = [(4, 1, 1), (1, 4, 1), (4, 1, 2)]
#: The adapters of the LoRA runs.
LORA = {"rank": 4, "alpha": 8.0}
LLAMA_TO_HF_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: QLoRA: the same adapters over NF4 bases, on an init_from folder (``saved_qlora_base``) whose every projection
#: splits into 4 row shards of whole NF4 scaler groups (16,384 elements): 256 × 256 attention, 768 × 256 MLP weights.
QLORA = {**LORA, "quantize_base": "nf4"}
QLORA_BASE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}
#: Our names of the adapted projections → transformers' (the seven of every block).
QLORA_PROJECTIONS = {
    f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}"
    for i in range(QLORA_BASE["num_hidden_layers"])
    for ours, theirs in (("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
                         ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
                         ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w2", "mlp.down_proj"),
                         ("feed_forward.w3", "mlp.up_proj"))
}


def saved_qlora_base(folder):
    """A seeded random transformers Llama (``QLORA_BASE``, float32) saved to ``folder``: a QLoRA run's init_from."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", tie_word_embeddings=False, **QLORA_BASE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    corpus = root / "corpus"
    corpus.mkdir()
    # 12 windows of 64 tokens: 3 global batches of 4 per epoch.
    text = "".join(p.read_text() for p in stdlib_sources()[:3])[: 12 * SEQ_LEN]
    (corpus / "text.txt").write_text(text)
    base = {"corpus": str(corpus), "cache_dir": str(root / "cache"), "seq_len": SEQ_LEN, "max_steps": 6}

    def job(name, dp, tp, pp=1, cp=1, **extra):
        """``(name, config, nprocs, 1)`` of a ``train`` run (what ``Jobs.share`` takes)."""
        config = {**base, **({} if "init_from" in extra else SMALL), "dp": dp, "tp": tp,
                  "batch_size": GLOBAL_BATCH // dp, **extra}
        if pp > 1:
            config["pipeline_parallel_size"] = pp
        if cp > 1:
            config["context_parallel_size"] = cp
        return name, config, dp * tp * pp * cp, 1

    def run(name, dp, tp, expect_ok=True, kill_on_failure=True, pp=1, cp=1, **extra):
        name, config, nprocs, _ = job(name, dp, tp, pp=pp, cp=cp, **extra)
        return jobs.run(name, "train", config, nprocs=nprocs, expect_ok=expect_ok, kill_on_failure=kill_on_failure)

    ckpt_dir = root / "sharded"
    checkpoints = [
        {"dirpath": str(ckpt_dir), "every_n_train_steps": 2, "save_top_k": -1, "save_last": "link"},
        {"dirpath": str(ckpt_dir), "every_n_epochs": 1, "save_on_train_epoch_end": True, "save_top_k": -1,
         "filename": "end-{epoch}-{step}"},
    ]
    # The reference and every resume that needs nothing of its own (no crash, no async write, no failure, no file
    # prepared by its test) share one 4-process launch and one 1-process launch, one run after another in the
    # same processes, each resume after the run that saved its checkpoint: each launch's start-up and cold first
    # step are paid once, not 16 times. Each test still calls run() with its own arguments and reads its own
    # folder; arguments other than these here are an error naming both (Jobs.run).
    step4 = str(ckpt_dir / "epoch=1-step=4.ckpt")
    # The pipeline chain's own uninterrupted run, of the debug model's 4 blocks, saving at step 4.
    four_blocks = {"blocks": 4, "weights_at_steps": [4], "checkpoints": [
        {"dirpath": str(root / "sharded_4_blocks"), "every_n_train_steps": 4, "save_top_k": -1}]}
    context, pipeline, simple, untrusted = root / "context", root / "pipeline", root / "simple_fsdp", root / "untrusted"
    qlora = qlora_jobs(job, root)
    jobs.share("ckpt_resumes", [
        job("ckpt_reference", 2, 2, checkpoints=checkpoints, weights_at_steps=[4]),
        *(job(f"resume_{done}", 2, 2, resume=str(ckpt_dir / name)) for name, done in SAME_LAYOUT_RESUMES),
        *(job(f"reshard_dp{dp}_tp{tp}_r{r}", dp, tp, replicate=r, resume=step4) for dp, tp, r in RESHARDS),
        job("cp2_dp2_from_2x2", 2, 1, cp=2, resume=str(ckpt_dir / "epoch=0-step=2.ckpt"),
            checkpoints=[{"dirpath": str(context), "every_n_train_steps": 2, "save_top_k": -1}],
            weights_at_steps=[4]),
        job("cp4_from_cp2", 1, 1, cp=4, resume=str(context / "epoch=1-step=4.ckpt")),
        job("2x2_from_cp2", 2, 2, resume=str(context / "epoch=1-step=4.ckpt")),
        job("ckpt_reference_4_blocks", 2, 2, **four_blocks),
        job("pp2_dp2_from_2x2", 2, 1, pp=2, pipeline_schedule="GPipe", reduce_every_micro_batch=True, blocks=4,
            resume=str(root / "sharded_4_blocks" / "epoch=1-step=4.ckpt"),
            checkpoints=[{"dirpath": str(pipeline), "every_n_train_steps": 1, "save_top_k": -1}]),
        job("pp2_tp2_interleaved_from_pp2_dp2", 1, 2, pp=2, pipeline_schedule="Interleaved1F1B", blocks=4,
            resume=str(pipeline / "epoch=1-step=5.ckpt")),
        # Across the data-parallel backends: FSDP2's step-2 checkpoint into SimpleFSDP, which saves at step 4;
        # that resumed under SimpleFSDP at the same layout, and under FSDP2 at another.
        job("simple_from_fsdp2", 2, 2, fsdp_backend="simple_fsdp", resume=str(ckpt_dir / "epoch=0-step=2.ckpt"),
            checkpoints=[{"dirpath": str(simple), "every_n_train_steps": 2, "save_top_k": -1}],
            weights_at_steps=[4]),
        job("simple_from_simple", 2, 2, fsdp_backend="simple_fsdp", resume=str(simple / "epoch=1-step=4.ckpt")),
        job("fsdp2_dp4_from_simple", 4, 1, resume=str(simple / "epoch=1-step=4.ckpt")),
        job("hsdp_save", 2, 2, replicate=2, max_steps=4, weights_at_steps=[4],
            checkpoints=[{"dirpath": str(root / "hsdp"), "every_n_train_steps": 4, "save_top_k": -1}]),
        job("full_save", 2, 2, save_distributed=False, max_steps=3,
            checkpoints=[{"dirpath": str(root / "full"), "every_n_train_steps": 3, "save_top_k": -1}]),
        job("full_resume", 4, 1, resume=str(root / "full" / "epoch=0-step=3.ckpt")),
        # LoRA: adapters-only checkpoints, resumed at the same layout and at another; one refused for another base.
        job("lora_reference", 2, 2, lora=LORA, checkpoints=[{"dirpath": str(root / "lora"), "every_n_train_steps": 2,
                                                             "save_top_k": -1}]),
        job("lora_resume_2x2", 2, 2, lora=LORA, resume=str(root / "lora" / "epoch=1-step=4.ckpt")),
        job("lora_reshard_1x4", 1, 4, lora=LORA, resume=str(root / "lora" / "epoch=0-step=2.ckpt")),
        job("lora_other_base", 2, 2, lora=LORA, init_seed=8, max_steps=1, refuse=str(root / "lora" / "epoch=1-step=4.ckpt")),
        # A "last" whose checkpoint changed after its save (in rank 3's shard): the ranks' check falls back to the
        # intact step 2; then checkpoints carrying a payload, loaded as fit/validate/test/predict would: refused.
        job("untrusted", 2, 2, resume=str(untrusted / "last" / "last.ckpt"), prepare=untrusted_files(root, step4),
            refusals=untrusted_loads(root)),
        # QLoRA: 4 steps at FSDP 4 saving at step 2, resumed from it at FSDP 4 (and on one process, below).
        qlora["qlora_reference"], qlora["qlora_resume_dp4"],
        # One process: a pipelined and an HSDP checkpoint resumed without either.
        job("single_from_pp2_dp2", 1, 1, blocks=4, resume=str(pipeline / "epoch=1-step=5.ckpt")),
        job("hsdp_resume_single", 1, 1, resume=str(root / "hsdp" / "epoch=1-step=4.ckpt")),
        qlora["qlora_resume_single"],
    ], scenario="train")
    reference = run("ckpt_reference", 2, 2, checkpoints=checkpoints, weights_at_steps=[4])
    return {"root": root, "run": run, "reference": reference, "dir": ckpt_dir, "checkpoints": checkpoints,
            "reference_4_blocks": run("ckpt_reference_4_blocks", 2, 2, **four_blocks),
            "qlora": lambda name: jobs.run(name, "train", qlora[name][1], nprocs=qlora[name][2])}


def qlora_jobs(job, root):
    """The QLoRA runs (``job`` tuples by name), on a base folder written now: 4 steps at FSDP 4 saving every 2 steps
    (its adapters, their optimizer state and its NF4 bits recorded at the end), and its step-2 checkpoint resumed at
    FSDP 4 and on one process (where FSDP leaves the NF4 weights alone)."""
    base, saved = saved_qlora_base(root / "qlora_base"), root / "qlora"
    common = {"lora": QLORA, "init_from": str(base), "max_steps": 4, "save_trained_state": True}
    step2 = str(saved / "epoch=0-step=2.ckpt")
    return {"qlora_reference": job("qlora_reference", 4, 1, **common, checkpoints=[
                {"dirpath": str(saved), "every_n_train_steps": 2, "save_top_k": -1}]),
            "qlora_resume_dp4": job("qlora_resume_dp4", 4, 1, **common, resume=step2),
            "qlora_resume_single": job("qlora_resume_single", 1, 1, **common, resume=step2)}


#: Where the payload planted in the untrusted run's checkpoints would create its file.
PAYLOAD_MARKER = "payload_ran"
#: The weight whose bits are flipped in rank 3's shard of the "last" checkpoint.
CHANGED_WEIGHT = "state_dict.model.layers.0.attention.wq.weight"


def untrusted_files(root, step4):
    """What rank 0 of the untrusted run makes before it starts (``worker.prepare_files``): a folder whose last.ckpt
    links to a copy of step 4 with bits flipped in rank 3's shard (and an intact step 2), a step-4 copy whose
    meta.pt holds the payload (its digest recorded again, and not), and a full file holding it."""
    untrusted, marker = root / "untrusted", str(root / PAYLOAD_MARKER)
    return [
        {"op": "changed_last", "from_dir": str(root / "sharded"), "to_dir": str(untrusted / "last"),
         "keep": ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"], "last": "epoch=1-step=4.ckpt", "fqn": CHANGED_WEIGHT,
         "file": "__3_0.distcp"},
        {"op": "plant_meta", "from": step4, "to": str(untrusted / "meta" / "epoch=1-step=4.ckpt"), "marker": marker,
         "redigested": True},
        {"op": "plant_meta", "from": step4, "to": str(untrusted / "changed" / "epoch=1-step=4.ckpt"), "marker": marker,
         "redigested": False},
        {"op": "plant_full", "from": str(root / "full" / "epoch=0-step=3.ckpt"),
         "to": str(untrusted / "full" / "epoch=0-step=3.ckpt"), "marker": marker},
    ]


def untrusted_loads(root):
    """``[label, checkpoint, Trainer function]`` of each load the untrusted run tries after its fit."""
    untrusted = root / "untrusted"
    meta, full = untrusted / "meta" / "epoch=1-step=4.ckpt", untrusted / "full" / "epoch=0-step=3.ckpt"
    return [*([f"meta_{fn}", str(meta), fn] for fn in ("fit", "validate", "test", "predict")),
            *([f"full_{fn}", str(full), fn] for fn in ("fit", "validate")),
            ["meta_changed_fit", str(untrusted / "changed" / "epoch=1-step=4.ckpt"), "fit"]]


def outputs(job, n):
    return [job.rank_output(r) for r in range(n)]


def test_reference_run_saved_complete_checkpoints(setup):
    names = sorted(p.name for p in setup["dir"].iterdir())
    assert names == ["end-epoch=0-step=3.ckpt", "end-epoch=1-step=6.ckpt", "epoch=0-step=2.ckpt",
                     "epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert all(is_complete(setup["dir"] / n) for n in names)
    assert (setup["dir"] / "last.ckpt").resolve().name == "end-epoch=1-step=6.ckpt" or (
        setup["dir"] / "last.ckpt").resolve().name == "epoch=1-step=6.ckpt"


@pytest.mark.parametrize(("checkpoint", "done"), SAME_LAYOUT_RESUMES, ids=["mid-epoch", "epoch-end"])
def test_resume_at_the_same_layout_is_bit_identical(setup, checkpoint, done):
    resumed = setup["run"](f"resume_{done}", 2, 2, resume=str(setup["dir"] / checkpoint))
    for ref, out in zip(outputs(setup["reference"], 4), outputs(resumed, 4)):
        assert out["global_step"] == 6
        assert out["losses"] == ref["losses"][done:]  # exact: no tolerance
        assert out["batches"] == ref["batches"][done:]
        assert out["draws"] == ref["draws"][done:]  # per-process random state restored


# One process: test_checkpoints_move_into_and_across_pipeline_layouts (a sharded checkpoint resumed without one).
@pytest.mark.parametrize(("dp", "tp", "replicate"), RESHARDS, ids=["dp4", "tp4", "hsdp-2x2x1"])
def test_resharded_resume_matches_the_uninterrupted_run(setup, dp, tp, replicate):
    """From the (2, 2) FSDP × TP checkpoint to other layouts, HSDP included."""
    resumed = setup["run"](f"reshard_dp{dp}_tp{tp}_r{replicate}", dp, tp, replicate=replicate,
                           resume=str(setup["dir"] / "epoch=1-step=4.ckpt"))
    saved, restored = load_weights(setup["reference"], "weights_step4"), load_weights(resumed, "initial")
    assert restored.keys() == saved.keys()
    for name, weight in restored.items():
        assert torch.equal(weight, saved[name]), name  # resharding is a copy: bit-equal full tensors
    ref_losses = setup["reference"].rank_output(0)["losses"][4:]
    for out in outputs(resumed, dp * tp):
        assert out["global_step"] == 6
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=0)


def test_a_context_parallel_checkpoint_resumes_without_context_parallelism_and_at_context_4(setup):
    """The (2, 2) checkpoint of step 2 resumed at context 2 × data 2, which saves at step 4; that checkpoint
    resumed at context 4 and at (2, 2) without context parallelism. Each restores the saved weights bit for bit
    and continues the uninterrupted run's losses."""
    cp_dir = setup["root"] / "context"
    cp2 = setup["run"]("cp2_dp2_from_2x2", 2, 1, cp=2, resume=str(setup["dir"] / "epoch=0-step=2.ckpt"),
                       checkpoints=[{"dirpath": str(cp_dir), "every_n_train_steps": 2, "save_top_k": -1}],
                       weights_at_steps=[4])
    reference = setup["reference"].rank_output(0)["losses"]
    for out in outputs(cp2, 4):
        assert out["global_step"] == 6 and out["losses"] == pytest.approx(reference[2:], rel=1e-5, abs=0)
    saved = load_weights(cp2, "weights_step4")
    for name, weight in load_weights(setup["reference"], "weights_step4").items():
        torch.testing.assert_close(saved[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    step4 = str(next(cp_dir.glob("*step=4*")))
    for name, dp, tp, cp in (("cp4_from_cp2", 1, 1, 4), ("2x2_from_cp2", 2, 2, 1)):
        resumed = setup["run"](name, dp, tp, cp=cp, resume=step4)
        restored = load_weights(resumed, "initial")
        assert restored.keys() == saved.keys()
        for weight_name, weight in restored.items():
            assert torch.equal(weight, saved[weight_name]), (name, weight_name)  # resharding is a copy
        for out in outputs(resumed, 4):
            assert out["global_step"] == 6 and out["losses"] == pytest.approx(reference[4:], rel=1e-5, abs=0)


def test_checkpoints_move_between_the_fully_shard_and_simple_fsdp_backends(setup):
    """FSDP2's (2, 2) checkpoint of step 2 resumed under SimpleFSDP (the same parameter layout): the saved weights
    bit for bit, then the uninterrupted run's losses. Its own step-4 checkpoint resumed under SimpleFSDP at the
    same layout continues it exactly; under FSDP2 at (4, 1) it continues the reference's losses."""
    simple_dir = setup["root"] / "simple_fsdp"
    reference = setup["reference"].rank_output(0)["losses"]
    into = setup["run"]("simple_from_fsdp2", 2, 2, fsdp_backend="simple_fsdp",
                        resume=str(setup["dir"] / "epoch=0-step=2.ckpt"),
                        checkpoints=[{"dirpath": str(simple_dir), "every_n_train_steps": 2, "save_top_k": -1}],
                        weights_at_steps=[4])
    for out in outputs(into, 4):
        assert out["global_step"] == 6 and out["losses"] == pytest.approx(reference[2:], rel=1e-5, abs=0)
    saved = load_weights(into, "weights_step4")
    for name, weight in load_weights(setup["reference"], "weights_step4").items():
        torch.testing.assert_close(saved[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    step4 = str(simple_dir / "epoch=1-step=4.ckpt")
    same = setup["run"]("simple_from_simple", 2, 2, fsdp_backend="simple_fsdp", resume=step4)
    for before, out in zip(outputs(into, 4), outputs(same, 4)):
        assert out["global_step"] == 6 and out["losses"] == before["losses"][2:]  # exact: no tolerance
    back = setup["run"]("fsdp2_dp4_from_simple", 4, 1, resume=step4)
    restored = load_weights(back, "initial")
    assert restored.keys() == saved.keys()
    for name, weight in restored.items():
        assert torch.equal(weight, saved[name]), name  # a copy across backends and layouts
    for out in outputs(back, 4):
        assert out["global_step"] == 6 and out["losses"] == pytest.approx(reference[4:], rel=1e-5, abs=0)


def test_checkpoints_move_into_and_across_pipeline_layouts(setup):
    """The (2, 2) checkpoint of step 4 (of a 4-block run) resumed as 2 pipeline stages × 2 data-parallel ranks
    (GPipe, reducing after every micro-batch), which
    saves at steps 5 and 6 (each stage writes its part); its step-5 checkpoint resumed as 4 stages
    interleaved on 2 pipeline ranks × 2 tensor-parallel ranks (another split of the blocks), and on one
    process without a pipeline. All continue the uninterrupted run: the same weights, batches and losses."""
    pp_dir, uninterrupted = setup["root"] / "pipeline", setup["reference_4_blocks"]
    into = setup["run"]("pp2_dp2_from_2x2", 2, 1, pp=2, pipeline_schedule="GPipe", reduce_every_micro_batch=True,
                        blocks=4, resume=str(setup["root"] / "sharded_4_blocks" / "epoch=1-step=4.ckpt"),
                        checkpoints=[{"dirpath": str(pp_dir), "every_n_train_steps": 1, "save_top_k": -1}])
    saved, restored = load_weights(uninterrupted, "weights_step4"), load_weights(into, "initial")
    assert restored.keys() == saved.keys()
    for name, weight in restored.items():
        assert torch.equal(weight, saved[name]), name
    reference = uninterrupted.rank_output(0)
    batches_by_dp_rank = {out["dp_rank"]: out["batches"] for out in outputs(uninterrupted, 4)}
    for out in outputs(into, 4):
        assert out["global_step"] == 6
        assert out["batches"] == batches_by_dp_rank[out["dp_rank"]][4:]
        assert out["losses"] == pytest.approx(reference["losses"][4:], rel=1e-5, abs=0)
        # reduce_every_micro_batch: each of the 2 micro-batches reduce-scatters each of the stage's 3 units
        # (embedding or [norm, output], and 2 blocks), in each of the 2 steps.
        assert out["reduce_scatters"] == 2 * 3 * 2
    assert is_complete(pp_dir / "epoch=1-step=5.ckpt") and is_complete(pp_dir / "epoch=1-step=6.ckpt")

    across = setup["run"]("pp2_tp2_interleaved_from_pp2_dp2", 1, 2, pp=2, pipeline_schedule="Interleaved1F1B",
                          blocks=4, resume=str(pp_dir / "epoch=1-step=5.ckpt"))
    for out in outputs(across, 4):  # one data-parallel rank now: its batch is the global batch
        assert out["global_step"] == 6
        assert out["losses"] == pytest.approx(reference["losses"][5:], rel=1e-5, abs=0)
    final, expected = load_weights(across, "final"), load_weights(uninterrupted, "final")
    for name, weight in final.items():
        torch.testing.assert_close(weight, expected[name], rtol=1e-5, atol=1e-5, msg=name)

    # And out of the pipeline: the same checkpoint on one process (what export and inference use).
    single = setup["run"]("single_from_pp2_dp2", 1, 1, blocks=4, resume=str(pp_dir / "epoch=1-step=5.ckpt"))
    out = single.rank_output(0)
    assert out["global_step"] == 6
    assert out["losses"] == pytest.approx(reference["losses"][5:], rel=1e-5, abs=0)


def test_an_hsdp_checkpoint_resumes_without_hsdp(setup):
    """Saved under HSDP (replicate, shard, tp) = (2, 1, 2), resumed on one process: the same weights, and
    the run continues as the uninterrupted (2, 2) one."""
    hsdp_dir = setup["root"] / "hsdp"
    spec = [{"dirpath": str(hsdp_dir), "every_n_train_steps": 4, "save_top_k": -1}]
    saving = setup["run"]("hsdp_save", 2, 2, replicate=2, checkpoints=spec, max_steps=4, weights_at_steps=[4])
    reference = setup["reference"].rank_output(0)["losses"]
    assert saving.rank_output(0)["losses"] == pytest.approx(reference[:4], rel=1e-5, abs=0)
    resumed = setup["run"]("hsdp_resume_single", 1, 1, resume=str(hsdp_dir / "epoch=1-step=4.ckpt"))
    saved, restored = load_weights(saving, "weights_step4"), load_weights(resumed, "initial")
    assert restored.keys() == saved.keys()
    assert all(torch.equal(weight, saved[name]) for name, weight in restored.items())
    assert resumed.rank_output(0)["losses"] == pytest.approx(reference[4:], rel=1e-5, abs=0)


def test_full_single_file_checkpoint_resumes_at_another_layout(setup):
    full_dir = setup["root"] / "full"
    spec = [{"dirpath": str(full_dir), "every_n_train_steps": 3, "save_top_k": -1}]
    saving = setup["run"]("full_save", 2, 2, checkpoints=spec, save_distributed=False, max_steps=3)
    file = full_dir / "epoch=0-step=3.ckpt"
    assert file.is_file() and not any(p.name.startswith(".") for p in full_dir.iterdir())
    assert saving.rank_output(0)["losses"] == setup["reference"].rank_output(0)["losses"][:3]
    resumed = setup["run"]("full_resume", 4, 1, resume=str(file))
    assert resumed.rank_output(0)["losses"] == pytest.approx(
        setup["reference"].rank_output(0)["losses"][3:], rel=1e-5, abs=0
    )


#: How long an observed write may wait for the next training step: a background write is released within
#: a step (well under a second here); a synchronous one blocks that step and is released only by this.
WRITE_RELEASE_TIMEOUT_S = 20


def test_async_checkpoints_hold_the_state_of_their_step(setup):
    """Each rank's shard write waits (worker.WriteObserver) until training has started the next step, so a
    save that really runs in the background is written while steps 3-4 / 5-6 change the weights; a
    synchronous save could not let the next step start and would be released by the timeout instead."""
    async_dir = setup["root"] / "async"
    spec = [{"dirpath": str(async_dir), "every_n_train_steps": 2, "save_top_k": -1}]
    run = setup["run"]("async_save", 2, 2, checkpoints=spec, async_checkpoint=True,
                       observe_writes_timeout_s=WRITE_RELEASE_TIMEOUT_S)
    assert run.rank_output(0)["losses"] == setup["reference"].rank_output(0)["losses"]
    for rank, out in enumerate(outputs(run, 4)):
        writes = out["writes"]  # the saves of steps 2, 4 and 6, in order
        # Steps 2 and 4: the next step started while the write was waiting; step 6: the fit ended first.
        assert [w["released_by"] for w in writes] == ["next_batch", "next_batch", "train_end"], (rank, writes)
        assert not any(w["main_thread"] for w in writes), (rank, writes)
        for w in writes[:2]:
            assert any(w["started"] < t < w["ended"] for t in out["batch_started_at"]), (rank, w)
    for step in (2, 4, 6):
        assert is_complete(async_dir / f"epoch={(step - 1) // 3}-step={step}.ckpt")
    # Written while steps 3 and 4 ran, the step-2 checkpoint still resumes bit-exactly.
    # Its digests were written by the background writer: a copy with 100 flipped exponent bits in rank 1's
    # shard is refused by the same launch (each rank checks a quarter of the items), naming file, tensor, step.
    changed = setup["root"] / "async_changed" / "epoch=0-step=2.ckpt"
    shutil.copytree(async_dir / "epoch=0-step=2.ckpt", changed)
    weight = "state_dict.model.layers.0.attention.wq.weight"
    flip_exponent_bits(changed, weight, file_name="__1_0.distcp")
    resumed = setup["run"]("async_resume", 2, 2, resume=str(async_dir / "epoch=0-step=2.ckpt"), refuse=str(changed))
    assert resumed.rank_output(0)["losses"] == setup["reference"].rank_output(0)["losses"][2:]
    for out in outputs(resumed, 4):
        assert out["refused"] is not None and out["refused"].startswith(
            f"Checkpoint {changed} is damaged: its bytes changed after it was saved at step 2 (__1_0.distcp: {weight}"
        ), out["refused"]


def test_a_changed_last_falls_back_at_2x2_and_no_payload_runs_on_any_load(setup):
    """The ranks split the digests: rank 3 finds the flipped bits of "last"'s step 4, so every rank resumes the intact
    step 2 (rank 0 says why) and continues as the reference did. Then checkpoints carrying a pickled ``os.system``
    (in ``meta.pt`` with its digest recorded again, in a full file) are refused on every rank in one line for every
    Trainer function, and one whose ``meta.pt`` changed since its save is refused by its digest before it is read;
    the payload's file never appears."""
    root = setup["root"]
    run = setup["run"]("untrusted", 2, 2, resume=str(root / "untrusted" / "last" / "last.ckpt"),
                       prepare=untrusted_files(root, str(setup["dir"] / "epoch=1-step=4.ckpt")),
                       refusals=untrusted_loads(root))
    last, step2 = root / "untrusted" / "last" / "last.ckpt", root / "untrusted" / "last" / "epoch=0-step=2.ckpt"
    assert (f"Checkpoint {last} is damaged: its bytes changed after it was saved at step 4 (__3_0.distcp:"
            f" {CHANGED_WEIGHT}") in run.logs[0]
    assert f"resuming from the newest complete checkpoint instead: {step2}" in run.logs[0]
    reference = setup["reference"].rank_output(0)["losses"]
    for out in outputs(run, 4):
        assert out["losses"] == reference[2:]  # resumed from step 2 exactly
        refusals = out["refusals"]
        assert sorted(refusals) == sorted(label for label, _, _ in untrusted_loads(root))
        for label, message in refusals.items():
            assert message is not None and "\n" not in message, (label, message)
            if label.startswith(("meta_fit", "meta_validate", "meta_test", "meta_predict", "full_")):
                assert message.startswith("UnsafeCheckpointError: "), message
                assert " holds a pickled posix.system, which a weights-only load refuses" in message, message
                assert "the file was not loaded" in message, message
        assert refusals["meta_fit"].startswith(f"UnsafeCheckpointError: {root / 'untrusted' / 'meta'}"), refusals
        assert re.search(r"is damaged \(meta\.pt changed after it was saved: it is [\d,]+ bytes long",
                         refusals["meta_changed_fit"]), refusals
    assert not (root / PAYLOAD_MARKER).exists()


def test_a_save_killed_midway_is_never_resumed_from(setup):
    crash_dir = setup["root"] / "crash"
    spec = [{"dirpath": str(crash_dir), "every_n_train_steps": 2, "save_top_k": -1, "save_last": "link"}]
    # The launcher does not end the job when rank 1 dies: the other ranks' watchdogs do, naming it.
    crashed = setup["run"]("crash", 2, 2, expect_ok=False, checkpoints=spec, crash={"save": 2, "rank": 1},
                           kill_on_failure=False, timeout_s=20, watchdog_timeout_s=20)
    assert not crashed.timed_out, crashed.describe()
    assert crashed.returncodes == [75, -9, 75, 75], crashed.describe()  # rank 1 killed while writing step 4's
    for rank in (0, 2, 3):
        assert re.search(rf"Stopping rank {rank} \(exit code 75\): rank 1 \(pid \d+ on .+\) died: its process is gone",
                         crashed.logs[rank]), crashed.describe()
    spread = max(crashed.exit_times) - min(crashed.exit_times)
    print(f"[crash] return codes {crashed.returncodes}; the last rank ended {spread:.1f} s after rank 1 died")
    assert spread < 20  # a dead local rank is found within a round (measured ~5 s)
    assert is_complete(crash_dir / "epoch=0-step=2.ckpt")
    broken = crash_dir / "epoch=1-step=4.ckpt"
    assert (broken / "__1_0.distcp").is_file() and not is_complete(broken)  # shards written, never finished
    shutil.copytree(crash_dir, setup["root"] / "crash_copy", symlinks=True)  # as the crash left it

    # Resuming from "last" lands on step 2 and names the interrupted save.
    resumed = setup["run"]("crash_resume_last", 2, 2, checkpoints=spec, resume="last")
    assert resumed.rank_output(0)["losses"] == setup["reference"].rank_output(0)["losses"][2:]
    assert "epoch=1-step=4.ckpt is incomplete" in resumed.logs[0]

    # Asking for the broken checkpoint itself is an error naming it (never a silent resume from another
    # step), raised on every rank before anything is loaded, with the newest complete one as the way on.
    broken = setup["root"] / "crash_copy" / "epoch=1-step=4.ckpt"
    # The launcher kills no rank (kill_on_failure=False): every rank must raise it by itself.
    refused = setup["run"]("crash_resume_broken", 2, 2, resume=str(broken), expect_ok=False, kill_on_failure=False)
    assert not refused.ok and not refused.timed_out
    log = refused.logs[refused.failed_rank()]
    assert f"CheckpointError: Checkpoint {broken} is incomplete (an interrupted save). Not resuming" in log
    assert f"the newest complete one there is {broken.parent / 'epoch=0-step=2.ckpt'}" in log
    assert not list(refused.out_dir.glob("rank*.json"))  # nothing trained
    assert refused.returncodes == [1, 1, 1, 1], refused.describe()  # each raised it (not 75: ended by another)
    for rank in range(4):
        assert f"CheckpointError: Checkpoint {broken} is incomplete" in refused.logs[rank], refused.describe([rank])


def test_export_to_hugging_face_and_start_a_2d_run_from_it(setup):
    import transformers

    from lightning_2d import Transformer
    from lightning_2d.hf import hf_to_meta, model_args_from_hf
    from lightning_2d.tools.cli import main

    checkpoint, out = setup["dir"] / "epoch=1-step=4.ckpt", setup["root"] / "hf_export"
    main(["export", str(checkpoint), str(out)])  # the command's own code, in this process (a fresh one: +4 s)
    saved = load_weights(setup["reference"], "weights_step4")

    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    q = hf.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(hf_to_meta(q, 8), saved["layers.1.attention.wq.weight"])  # the RoPE permutation
    ours = Transformer(model_args_from_hf(out))
    ours.load_state_dict(saved, strict=False)
    ours.init_buffers()
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)

    # Each rank of a (2, 2) run reads its blocks of the export: the full weights come back bit-equal. The run is
    # SimpleFSDP's (init_from fills its stored shards as FSDP2's: test_downloaded_checkpoints loads under FSDP2).
    started = setup["run"]("init_from_hf", 2, 2, init_from=str(out), max_steps=1, fsdp_backend="simple_fsdp")
    assert started.rank_output(0)["data_parallel_modules"]["simple_fsdp"] > 0
    for name, weight in load_weights(started, "initial").items():
        assert torch.equal(weight, saved[name]), name


def test_lora_saves_only_its_adapters_and_resumes_them_at_any_layout_on_the_same_base(setup):
    """A LoRA run's checkpoints hold the adapters, their optimizer state and the loop's position, and record the
    base (here the seeded init); resumed at the same layout it continues exactly, at 1×4 within 1e-5, the base
    rebuilt bit for bit. A run on another base is refused before anything is read."""
    from lightning_2d.checkpoint.dcp_metadata import read_dcp_metadata, stored_shapes
    from lightning_2d.checkpoint.subset import adapter_record
    from lightning_2d.ops.lora import is_adapter_parameter

    root = setup["root"]
    lora_dir, full_dir = root / "lora", setup["dir"]
    reference = setup["run"]("lora_reference", 2, 2, lora=LORA, checkpoints=[
        {"dirpath": str(lora_dir), "every_n_train_steps": 2, "save_top_k": -1}])
    step4 = lora_dir / "epoch=1-step=4.ckpt"
    stored = stored_shapes(step4, "state_dict")
    assert stored and all(is_adapter_parameter(n) for n in stored) and len(stored) == BLOCKS * 7 * 2
    optimizer_items = [n for n in read_dcp_metadata(step4).state_dict_metadata if n.startswith("optimizer_0.state.")]
    assert optimizer_items and all(is_adapter_parameter(n.split(".", 2)[2].rpartition(".")[0]) for n in optimizer_items)
    assert adapter_record(step4) == {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": None, "rslora": False},
                                     "base": {"init_from": None, "init_seed": 7}}
    size = sum(f.stat().st_size for f in step4.iterdir())
    full_size = sum(f.stat().st_size for f in (full_dir / "epoch=1-step=4.ckpt").iterdir())
    print(f"LoRA checkpoint {size} bytes, full {full_size} bytes: {size / full_size:.3f}")
    assert size < full_size / 4
    ref_losses, ref_final = reference.rank_output(0)["losses"], load_weights(reference, "final")
    initial = load_weights(reference, "initial")
    for name, weight in ref_final.items():
        assert is_adapter_parameter(name) or torch.equal(weight, initial[name]), name  # the base never moved
    same = setup["run"]("lora_resume_2x2", 2, 2, lora=LORA, resume=str(step4))
    for out in outputs(same, 4):
        assert out["global_step"] == 6 and out["losses"] == ref_losses[4:]  # exact: no tolerance
    for name, weight in load_weights(same, "final").items():
        assert torch.equal(weight, ref_final[name]), name
    other = setup["run"]("lora_reshard_1x4", 1, 4, lora=LORA, resume=str(lora_dir / "epoch=0-step=2.ckpt"))
    for out in outputs(other, 4):
        assert out["global_step"] == 6 and out["losses"] == pytest.approx(ref_losses[2:], rel=1e-5, abs=0)
    for name, weight in load_weights(other, "final").items():
        if is_adapter_parameter(name):
            torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(weight, ref_final[name]), name
    refused = setup["run"]("lora_other_base", 2, 2, lora=LORA, init_seed=8, max_steps=1, refuse=str(step4))
    for out in outputs(refused, 4):
        assert re.search(r"holds LoRA adapters that do not belong to this run:\n  - its adapters were trained on the"
                         r" base initialized from seed 7; this run's base is from seed 8: set init_seed=7",
                         out["refused"]), out["refused"]


def test_a_sharded_lora_checkpoint_exports_merged_on_its_seeded_base_and_for_peft(setup, tmp_path):
    """The LoRA run's last sharded checkpoint (its base the seeded init, drawn again by the export): merged, a
    transformers Llama whose logits are those of our model with the run's final weights; for peft, one file with
    the 28 adapter weights (2 blocks × 7 projections × A, B) under peft's names."""
    import json

    import transformers
    from safetensors.torch import load_file

    from lightning_2d.hf import export_hf
    from lightning_2d.models.lora_targets import HF_TO_LLAMA, LLAMA_TARGETS
    from lightning_2d.models.llama.model import ModelArgs, Transformer
    from lightning_2d.ops.lora import LoRA, add_lora

    reference = setup["run"]("lora_reference", 2, 2, lora=LORA, checkpoints=[
        {"dirpath": str(setup["root"] / "lora"), "every_n_train_steps": 2, "save_top_k": -1}])
    step6 = setup["root"] / "lora" / "epoch=1-step=6.ckpt"
    ours = Transformer(ModelArgs.from_name("debug", n_layers=BLOCKS))
    add_lora(ours, LoRA(**LORA), LLAMA_TARGETS, HF_TO_LLAMA)
    ours.load_state_dict(load_weights(reference, "final"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(export_hf(step6, tmp_path / "merged", merge_lora=True,
                                                                         log=lambda line: None))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
    folder = export_hf(step6, tmp_path / "peft", log=lambda line: None)
    tensors = load_file(folder / "adapter_model.safetensors")
    assert len(tensors) == BLOCKS * 7 * 2
    assert f"base_model.model.model.layers.{BLOCKS - 1}.mlp.down_proj.lora_B.weight" in tensors
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(LLAMA_TO_HF_NAMES) and config["base_model_name_or_path"] is None


def _rotary_heads(module: str):
    """The heads whose rows our layout orders otherwise than transformers' (``wq``, ``wk``), else ``None``."""
    heads = {"wq": QLORA_BASE["num_attention_heads"], "wk": QLORA_BASE["num_key_value_heads"]}
    return heads.get(module.rsplit(".")[-1])


def _original_in_our_layout(original: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The init_from file's weight of an adapted projection in our layout (``wq``/``wk``: Meta's rotary row order)."""
    from lightning_2d.hf import hf_to_meta

    weight, heads = original[QLORA_PROJECTIONS[module] + ".weight"], _rotary_heads(module)
    return hf_to_meta(weight, heads) if heads else weight


def test_qlora_saves_its_adapters_and_resumes_them_at_any_layout_over_the_same_nf4_bits(setup):
    """A QLoRA run at FSDP 4 (init_from a Hugging Face folder, NF4 bases) checkpoints its adapters only, with a record
    of its settings and base; its step-2 checkpoint resumed at FSDP 4 continues it exactly (losses, adapters, their
    AdamW state), on one process within 1e-5. Every run's NF4 bits are one device's quantization of the original
    weights, after training as before it."""
    from safetensors.torch import load_file

    from lightning_2d.checkpoint.dcp_metadata import read_dcp_metadata, stored_shapes
    from lightning_2d.checkpoint.subset import adapter_record
    from lightning_2d.ops.lora import is_adapter_parameter
    from lightning_2d.ops.nf4 import nf4_state, to_nf4_weight

    root = setup["root"]
    reference = setup["qlora"]("qlora_reference")
    step2 = root / "qlora" / "epoch=0-step=2.ckpt"
    adapters = sorted(f"{m}.{ab}.weight" for m in QLORA_PROJECTIONS for ab in ("lora_a", "lora_b"))
    assert sorted(stored_shapes(step2, "state_dict")) == [f"model.{name}" for name in adapters]  # no NF4 base
    optimizer_items = [n for n in read_dcp_metadata(step2).state_dict_metadata if n.startswith("optimizer_0.state.")]
    assert optimizer_items and all(is_adapter_parameter(n.split(".", 2)[2].rpartition(".")[0]) for n in optimizer_items)
    assert adapter_record(step2) == {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": None, "rslora": False,
                                              "quantize_base": "nf4"},
                                     "base": {"init_from": str((root / "qlora_base").resolve()), "init_seed": None}}

    original = load_file(root / "qlora_base" / "model.safetensors")
    one_device = {f"{module}.weight": nf4_state(to_nf4_weight(_original_in_our_layout(original, module)))
                  for module in QLORA_PROJECTIONS}  # each original weight quantized whole, on one device
    ref_losses, ref_final = reference.rank_output(0)["losses"], load_weights(reference, "final")
    ref_optimizer = torch.load(reference.out_dir / "final_optimizer.pt")
    assert sorted(ref_optimizer) == adapters  # the adapters, and only they, hold AdamW state
    same, single = setup["qlora"]("qlora_resume_dp4"), setup["qlora"]("qlora_resume_single")
    for run in (reference, same, single):
        nf4 = torch.load(run.out_dir / "final_nf4.pt")
        assert nf4.keys() == one_device.keys()
        for name, bits in one_device.items():
            for part, value in bits.items():
                assert torch.equal(nf4[name][part], value), (run.out_dir.name, name, part)
    for out in outputs(same, 4):
        assert out["global_step"] == 4 and out["losses"] == ref_losses[2:]  # exact: no tolerance
    for name, weight in load_weights(same, "final").items():
        assert torch.equal(weight, ref_final[name]), name
    for name, state in torch.load(same.out_dir / "final_optimizer.pt").items():
        assert state.keys() == ref_optimizer[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert torch.equal(value, ref_optimizer[name][key]), (name, key)
    out = single.rank_output(0)
    assert out["global_step"] == 4 and out["losses"] == pytest.approx(ref_losses[2:], rel=1e-5, abs=0)
    for name, weight in load_weights(single, "final").items():
        if is_adapter_parameter(name):
            torch.testing.assert_close(weight, ref_final[name], rtol=1e-5, atol=1e-6, msg=name)
        else:  # the NF4 bases (dequantized), the norms, the embedding and the head: the same base
            assert torch.equal(weight, ref_final[name]), name
    for name, state in torch.load(single.out_dir / "final_optimizer.pt").items():
        assert torch.equal(state["step"], ref_optimizer[name]["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(ref_optimizer[name][key].abs().max())
            torch.testing.assert_close(state[key], ref_optimizer[name][key], rtol=1e-5, atol=1e-5 * scale,
                                       msg=f"{name} {key}")


def test_a_qlora_checkpoint_merges_into_its_original_init_from_weights_and_exports_for_peft(setup, tmp_path):
    """``lightning-2d export --merge-lora`` of the QLoRA run's last checkpoint writes, for each adapted projection, the
    init_from file's own weight plus ``(alpha/r) · B A`` (not the dequantized NF4 weight the run trained over), every
    other weight that file's bit for bit; the peft folder on the original base computes what the merged model does."""
    import json

    import peft
    import transformers
    from safetensors.torch import load_file

    from lightning_2d.hf import export_hf, meta_to_hf
    from lightning_2d.tools.export import main as export_main

    reference = setup["qlora"]("qlora_reference")
    step4, base = setup["root"] / "qlora" / "epoch=1-step=4.ckpt", setup["root"] / "qlora_base"
    adapters = load_weights(reference, "final")  # the run's adapters at step 4, gathered from the live model
    original = load_file(base / "model.safetensors")
    scale = QLORA["alpha"] / QLORA["rank"]
    export_main([str(step4), str(tmp_path / "merged"), "--merge-lora"])
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged.keys() == original.keys()
    for module, hf in QLORA_PROJECTIONS.items():
        delta = scale * (adapters[f"{module}.lora_b.weight"] @ adapters[f"{module}.lora_a.weight"])
        heads = _rotary_heads(module)
        expected = original[hf + ".weight"] + (meta_to_hf(delta, heads) if heads else delta)
        assert delta.abs().max() > 1e-4, module  # the adapters moved: the merge has something to show
        off = float((merged[hf + ".weight"] - expected).abs().max())
        assert torch.equal(merged[hf + ".weight"], expected), f"{hf}: off by up to {off:.3g}"
    adapted = {hf + ".weight" for hf in QLORA_PROJECTIONS.values()}
    for name, weight in original.items():
        if name not in adapted:
            off = float((merged[name] - weight).abs().max())
            assert torch.equal(merged[name], weight), f"{name}: off by up to {off:.3g}"  # the file's bits

    folder = export_hf(step4, tmp_path / "peft", log=lambda line: None)
    tensors = load_file(folder / "adapter_model.safetensors")
    assert len(tensors) == len(QLORA_PROJECTIONS) * 2
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(LLAMA_TO_HF_NAMES) and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == str(base.resolve())
    on_base = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), folder).eval()
    alone = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(on_base(tokens).logits, alone(tokens).logits, rtol=1e-5, atol=1e-5)
