"""``compile=True`` with a preference loss: the trained model's blocks and its frozen reference copy's are compiled
(the copy is parallelized with the trained model's options, ``compile`` included), and the run is the eager one.

One process under ``ModelParallel2DStrategy`` (a one-rank gloo world, FSDP2 over it), 2 fp32 AdamW steps of DPO on a
2-block ``debug`` Llama against its frozen copy, compiled (inductor) and eager. A compiled fit costs ~15-40 s on 2
CPU cores (two graphs), so this is the one such fit, and it is of the full suite (``distributed``: a process group in
this process, and inductor's C++ builds), not of the quick tier; the adapters-off reference under compile (LoRA's) is
checked on a block with ``aot_eager`` in ``tests/unit/test_lora.py``.
"""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy, PreferenceDataModule
from lightning_2d.data.preference.builtin import stdlib_preference_rows
from lightning_2d.parallel.modules import canonical_name

pytestmark = pytest.mark.distributed

STEPS = 2
DPO = {"loss_type": "sigmoid", "beta": 0.1}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pairs")
    rows = stdlib_preference_rows()[:8]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"paths": str(folder / "pairs.jsonl"), "tokenizer": "byte", "cache_dir": str(folder / "cache"),
            "max_length": 60, "seq_len": 128, "batch_size": 2, "val_fraction": 0}
    PreferenceDataModule(**args).prepare(num_workers=1)
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


def fit(pairs: dict, compile: bool):
    """``(module, metrics, graphs)``: the fitted module, each step's loss and TRL metrics, and the graphs dynamo
    compiled during the fit (its caches emptied first, so no earlier test's graph serves this one)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2, "vocab_size": 264}, init_seed=3,
                                  learning_rate=1e-3, warmup_steps=1, max_steps=STEPS, preference=DPO)
    metrics = Metrics()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallel2DStrategy(compile=compile),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[metrics])
    torch.manual_seed(0)
    try:
        trainer.fit(module, PreferenceDataModule(**pairs))
    finally:
        dist.destroy_process_group()
    return module, metrics.steps, counters["stats"]["unique_graphs"] - graphs


def test_compiled_blocks_and_their_compiled_frozen_copy_train_as_eager(pairs):
    from torch._dynamo.eval_frame import OptimizedModule

    eager, eager_steps, eager_graphs = fit(pairs, compile=False)
    compiled, steps, graphs = fit(pairs, compile=True)
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
