"""``compile=True`` fits in one process, compiled (inductor) against eager under ``ModelParallel2DStrategy`` (a
one-rank gloo world, FSDP2 over it): a frozen model beside the trained one, whose blocks are compiled too (a frozen
model is parallelized with the trained model's options, ``compile`` included), and mixture-of-experts blocks.

- DPO of a 2-block ``debug`` Llama against its frozen copy, and distillation from a wider teacher (its own blocks,
  its own graph; run inside the student's head without a graph), 2 fp32 AdamW steps each;
- ``debug-moe`` cut to its dense block 0 and sparse block 1, in bf16-mixed under full activation checkpointing with
  bias balancing (no break: the whole block compiled). Its float32 path (the experts' call eager: one graph break) is
  a unit test on one block (``tests/unit/test_moe_model.py``, ``aot_eager``).

A compiled fit costs ~10-40 s on 2 CPU cores, so these are the only such fits, and they are of the full suite
(``distributed``: a process group in this process, and inductor's C++ builds), not of the quick tier; the
adapters-off reference under compile (LoRA's) is checked on a block with ``aot_eager`` in ``tests/unit/test_lora.py``.
"""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy, PreferenceDataModule, TextDataModule
from lightning_2d.data import stdlib_sources
from lightning_2d.data.preference.builtin import stdlib_preference_rows
from lightning_2d.parallel.modules import canonical_name

pytestmark = pytest.mark.distributed

STEPS = 2
DPO = {"loss_type": "sigmoid", "beta": 0.1}
#: A teacher of another shape than the student's (2 blocks of dim 128): 2 blocks of dim 256.
TEACHER = {"model": "debug", "model_overrides": {"dim": 256, "n_layers": 2}}
JSD = {"loss": "jsd", "beta": 0.5, "temperature": 2.0, "alpha": 0.5}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pairs")
    rows = stdlib_preference_rows()[:8]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"paths": str(folder / "pairs.jsonl"), "tokenizer": "byte", "cache_dir": str(folder / "cache"),
            "max_length": 60, "seq_len": 128, "batch_size": 2, "val_fraction": 0}
    PreferenceDataModule(**args).prepare(num_workers=1)
    return args


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("text")
    for path in stdlib_sources()[:2]:
        (folder / path.name).write_bytes(path.read_bytes()[:20_000])
    args = {"paths": str(folder), "seq_len": 64, "batch_size": 2, "val_fraction": 0, "cache_dir": str(folder / "c")}
    TextDataModule(**args).prepare(num_workers=1)
    return args


class Metrics(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()
                           if k == "train_loss" or "/" in k})


@pytest.fixture(autouse=True)
def environment_as_found():
    """The fits' Trainer sets the launcher's variables in this process (``MASTER_PORT`` …), and its store may keep the
    port: a later test launching a job from this environment (``test_recipe_scripts.py``'s Lightning launcher) would
    then rendezvous on that port and fail with EADDRINUSE. Put the environment back as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def fit(data: L.LightningDataModule, compile: bool, precision: str = "32-true", activation_checkpointing: str = "none",
        **options):
    """``(module, metrics, graphs)``: the fitted module, each step's loss and logged metrics, and the graphs dynamo
    compiled during the fit (its caches emptied first, so no earlier test's graph serves this one)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = counters["stats"]["unique_graphs"]
    model = options.pop("model", "debug")
    overrides = {"n_layers": 2, "vocab_size": options.pop("vocab", 264), **options.pop("model_overrides", {})}
    module = LlamaLightningModule(model, model_overrides=overrides, init_seed=3, learning_rate=1e-3, warmup_steps=1,
                                  max_steps=STEPS, **options)
    metrics = Metrics()
    strategy = ModelParallel2DStrategy(compile=compile, activation_checkpointing=activation_checkpointing)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[metrics])
    torch.manual_seed(0)
    try:
        trainer.fit(module, data)
    finally:
        dist.destroy_process_group()
    fit.graph_breaks = sum(counters["graph_break"].values())  # this fit's (the counters were emptied above)
    return module, metrics.steps, counters["stats"]["unique_graphs"] - graphs


def test_compiled_blocks_and_their_compiled_frozen_copy_train_as_eager(pairs):
    from torch._dynamo.eval_frame import OptimizedModule

    eager, eager_steps, eager_graphs = fit(PreferenceDataModule(**pairs), compile=False, preference=DPO)
    compiled, steps, graphs = fit(PreferenceDataModule(**pairs), compile=True, preference=DPO)
    (copy,) = compiled.frozen_models()
    for model in (compiled.model, copy.frozen()):  # the trained blocks and the copy's: torch.compile's wrappers
        assert all(isinstance(block, OptimizedModule) for block in model.layers.values()), model.layers
    assert not any(isinstance(block, OptimizedModule) for block in eager.model.layers.values()) and eager_graphs == 0
    # Two graphs, each compiled once for every block and step: the trained blocks' (forward and backward) and the
    # copy's (a forward without grad). A copy left eager would make one; a recompile per step or per block, more.
    assert graphs == 2, graphs
    # Inductor fuses the blocks' pointwise work (RMSNorm, rotary, SwiGLU) and so rounds otherwise than eager: fp32
    # over 128-wide reductions, a few 1e-7 relative per value (K · eps); a sequence's log-probability, a sum of ~60 of
    # them, moves by a few ulps (measured: 1 ulp of -264, 1.2e-7 relative), a reward (β times the difference of two
    # such sums) by ~1e-6 (measured: equal), where a wrong reference is off by the reward itself (0.09 at step 2).
    assert len(steps) == len(eager_steps) == STEPS
    for got, want in zip(steps, eager_steps):
        assert got.keys() == want.keys()
        for name, value in want.items():
            tolerance = {"rel": 1e-5} if name.startswith("logps/") or name == "train_loss" else {"abs": 1e-5}
            assert got[name] == pytest.approx(value, **tolerance), (name, got[name], value)
    # The first step's model is its reference: the copy's compiled forward gives the trained blocks' values.
    assert abs(steps[0]["rewards/chosen"]) < 1e-5 and abs(steps[0]["rewards/rejected"]) < 1e-5, steps[0]
    assert abs(steps[-1]["rewards/margins"]) > 1e-3  # trained: the copy is not the model any more
    trained = {canonical_name(name): param for name, param in compiled.model.named_parameters()}  # no _orig_mod.
    assert trained.keys() == dict(eager.model.named_parameters()).keys()
    # AdamW turns those ulps of a near-zero gradient into up to a step's difference (measured: 3e-6 at lr 1e-3).
    for name, param in eager.model.named_parameters():
        torch.testing.assert_close(trained[name].full_tensor(), param.full_tensor(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_compiled_student_and_compiled_teacher_distil_as_eager(text):
    """Distillation under ``compile=True``: the student's blocks and the teacher's (its own plan, compiled as a frozen
    model's: a forward without grad, run inside the student's head) are torch.compile's; two graphs, none recompiled;
    the losses, the logged divergence and next-token loss and the student's weights equal the eager run's, and the
    teacher ends as it started."""
    from torch._dynamo.eval_frame import OptimizedModule

    options = {"teacher": TEACHER, "distillation": JSD, "vocab": 256}
    eager, eager_steps, eager_graphs = fit(TextDataModule(**text), compile=False, **options)
    compiled, steps, graphs = fit(TextDataModule(**text), compile=True, **options)
    teacher = compiled.teacher.frozen()
    for model in (compiled.model, teacher):
        assert all(isinstance(block, OptimizedModule) for block in model.layers.values()), model.layers
    assert teacher.layers["0"]._orig_mod.feed_forward.w1.weight.shape[1] == 256  # the teacher's own shape
    assert eager_graphs == 0
    # The student's blocks (forward and backward) and the teacher's (another shape, a forward without grad): two.
    assert graphs == 2, graphs
    assert len(steps) == len(eager_steps) == STEPS
    for got, want in zip(steps, eager_steps):
        assert got.keys() == want.keys() and {"distill/jsd", "distill/next_token_loss"} <= got.keys()
        for name, value in want.items():  # inductor's fused pointwise work rounds otherwise: a few ulps (see above)
            assert got[name] == pytest.approx(value, rel=1e-5), (name, got[name], value)
    trained = {canonical_name(name): param for name, param in compiled.model.named_parameters()}
    for name, param in eager.model.named_parameters():
        torch.testing.assert_close(trained[name].full_tensor(), param.full_tensor(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # The teacher: its seeded init (the student's seed) in both runs, untouched by training.
    frozen = {canonical_name(name): p.full_tensor() for name, p in teacher.named_parameters()}
    for name, param in eager.teacher.frozen().named_parameters():
        assert not param.requires_grad and torch.equal(frozen[name], param.full_tensor()), name


#: debug-moe's experts (8, top 2, a shared one) on its sparse block 1, the aux loss or the balancing bias.
def moe(balancing: str) -> dict:
    return {"model": "debug-moe", "vocab": 256, "model_overrides": {"moe": {
        "num_experts": 8, "top_k": 2, "hidden_dim": 64, "num_shared_experts": 1, "aux_loss_coef": 0.01,
        "load_balancing": balancing, "bias_update_rate": 0.01}}}


def test_a_bf16_mixture_of_experts_block_compiles_whole_under_activation_checkpointing(text):
    """bf16-mixed with full activation checkpointing and bias balancing: no break, the sparse block compiled whole
    (two graphs: the dense block's and the sparse one's), the routing counts its forward writes not written again by
    the compiled recompute: the balancing bias (moved by integer counts) equals eager's bit for bit, and the losses
    are within bf16's rounding of eager's (inductor fuses otherwise: 7e-5 relative measured)."""
    from torch._dynamo.eval_frame import OptimizedModule

    options = {**moe("bias"), "precision": "bf16-mixed", "activation_checkpointing": "full"}
    eager, eager_steps, _ = fit(TextDataModule(**text), compile=False, **options)
    compiled, steps, graphs = fit(TextDataModule(**text), compile=True, **options)
    assert all(isinstance(block, OptimizedModule) for block in compiled.model.layers.values())
    assert fit.graph_breaks == 0 and graphs == 2, (fit.graph_breaks, graphs)
    for got, want in zip(steps, eager_steps, strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=5e-4)
    bias, eager_bias = (m.model.layers["1"].feed_forward.expert_bias for m in (compiled, eager))
    assert bias.abs().sum() > 0 and torch.equal(bias, eager_bias), (bias, eager_bias)
