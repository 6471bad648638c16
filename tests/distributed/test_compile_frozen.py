"""``compile=True`` with a frozen model beside the trained one: the trained model's blocks and the frozen model's are
compiled (a frozen model is parallelized with the trained model's options, ``compile`` included), and the run is the
eager one.

One process under ``ModelParallel2DStrategy`` (a one-rank gloo world, FSDP2 over it), 2 fp32 AdamW steps of a
2-block ``debug`` Llama, compiled (inductor) and eager: DPO against its frozen copy, and distillation from a wider
teacher (its own blocks, its own graph; run inside the student's head without a graph). A compiled fit costs ~15-40 s
on 2 CPU cores (two graphs), so these are the only such fits, and they are of the full suite (``distributed``: a
process group in this process, and inductor's C++ builds), not of the quick tier; the adapters-off reference under
compile (LoRA's) is checked on a block with ``aot_eager`` in ``tests/unit/test_lora.py``.
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


def fit(data: L.LightningDataModule, compile: bool, **options):
    """``(module, metrics, graphs)``: the fitted module, each step's loss and logged metrics, and the graphs dynamo
    compiled during the fit (its caches emptied first, so no earlier test's graph serves this one)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2, "vocab_size": options.pop("vocab", 264)},
                                  init_seed=3, learning_rate=1e-3, warmup_steps=1, max_steps=STEPS, **options)
    metrics = Metrics()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallel2DStrategy(compile=compile),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[metrics])
    torch.manual_seed(0)
    try:
        trainer.fit(module, data)
    finally:
        dist.destroy_process_group()
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
