"""``PreferenceLoss(precompute_reference=True)``: one pass of the reference over every pair before training, its
values kept in the data cache, then no reference model: the same training as the live reference, on one device.

Each test fits the ``debug`` Llama (2 blocks) with a plain single-device ``Trainer`` on a few of the built-in pairs,
with the live reference and with the precomputed one, and compares every step's loss and the final weights; the
distributed equalities (2×2, context parallel) are in ``tests/distributed/test_preference.py``.
"""

from __future__ import annotations

import gc
import json
import weakref

import lightning as L
import numpy as np
import pytest
import torch

from lightning_2d import LlamaLightningModule, PreferenceDataModule, PreferenceLoss
from lightning_2d.data.preference.builtin import stdlib_preference_rows
from lightning_2d.data.preference.datamodule import ReferenceCover
from lightning_2d.integration import preference_module as module_file
from lightning_2d.integration.preference import reference_pass
from lightning_2d.ops.preference import PreferenceConfigError

STEPS, SEQ_LEN = 4, 128
DPO = {"loss_type": "sigmoid", "beta": 0.2}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pairs")
    rows = stdlib_preference_rows()[:24]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"paths": str(folder / "pairs.jsonl"), "tokenizer": "byte", "cache_dir": str(folder / "cache"),
            "max_length": 60, "seq_len": SEQ_LEN, "batch_size": 2, "val_fraction": 0.2}
    PreferenceDataModule(**args).prepare(num_workers=1)
    return args


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.saw_reference_values: list[bool] = []
        self.copy: list[weakref.ref] = []

    def on_fit_start(self, trainer, pl_module) -> None:  # before the module's own: the copy is still held
        self.copy = [weakref.ref(p) for frozen in pl_module.frozen_models() for p in frozen.frozen().parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.saw_reference_values.append("reference_logps" in batch)


def fit(pairs: dict, lora: bool, precompute: bool, init_seed: int = 3, steps: int = STEPS, strategy="auto"):
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2, "vocab_size": 264}, init_seed=init_seed,
                                  learning_rate=1e-3, warmup_steps=1, max_steps=steps,
                                  lora={"rank": 4, "alpha": 8.0} if lora else None,
                                  preference={**DPO, "precompute_reference": precompute})
    data = PreferenceDataModule(**pairs)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                        limit_val_batches=1, val_check_interval=steps, callbacks=[losses], strategy=strategy)
    torch.manual_seed(0)
    try:
        trainer.fit(module, data)
    finally:
        if torch.distributed.is_initialized():  # the 2D strategy's one-rank process group
            torch.distributed.destroy_process_group()
    weights = {name: p.detach().clone() for name, p in module.model.named_parameters() if p.requires_grad}
    return module, data, losses, weights


@pytest.mark.parametrize("lora", [True, False], ids=["adapters_off", "copy"])
def test_precomputed_reference_trains_as_the_live_one_and_holds_no_reference_model(pairs, lora, tmp_path):
    _, _, live, live_weights = fit(pairs, lora, precompute=False)
    module, data, pre, weights = fit(pairs, lora, precompute=True)
    assert pre.saw_reference_values == [True] * STEPS and live.saw_reference_values == [False] * STEPS
    np.testing.assert_allclose(pre.losses, live.losses, rtol=1e-6, atol=0)
    for name, value in live_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert module.frozen_models() == []  # the copy released once the values were computed
    gc.collect()
    assert len(pre.copy) == (0 if lora else 2 * 9 + 3) and all(ref() is None for ref in pre.copy)  # and freed
    saved = data.load_reference_log_probs(module._reference_precomputed)
    assert saved is not None and saved.shape == (data.sequence_count,)
    # Every pair of both splits was scored (a sequence's log-probability is negative), the dropped ones too are
    # kept at 0 (none here: every pair fits the window).
    scored = np.concatenate([2 * split.conversations[:, None] + np.arange(2)
                             for split in (data.train_dataset, data.val_dataset)]).ravel()
    assert (saved[scored] < 0).all() and len(np.unique(scored)) == len(scored)
    identity = json.loads(data.reference_file(module._reference_precomputed).with_suffix(".json").read_text())
    assert identity["mode"] == ("adapters_off" if lora else "copy") and identity["init_seed"] == 3


def test_a_second_run_reads_the_saved_values_never_builds_the_copy_and_other_weights_or_data_miss(
        pairs, monkeypatch, tmp_path):
    """A run whose reference values the cache holds finds them before its frozen copy is built: no copy is
    materialized, no pass runs. Another seed (other weights) or other pairs (another cache) miss: the copy is built
    and a pass computes the values."""
    from lightning_2d.integration import module as lightning_module

    module, data, _, _ = fit(pairs, lora=False, precompute=True)
    key = module._reference_precomputed
    # Saved values the pass would not give: every chosen sequence's 1 lower. At the first step the model is the
    # reference, so the DPO logit is β·(0 - (-1)) and the loss softplus(-β), if (and only if) they are read.
    values = data.load_reference_log_probs(key)
    shifted = values.copy()
    shifted[0::2] -= 1.0
    data.save_reference_log_probs(key, shifted, {"test": "chosen shifted"})
    passes, built = [], []
    monkeypatch.setattr(module_file, "reference_pass", lambda *a, **k: passes.append(1) or reference_pass(*a, **k))
    real_materialize = lightning_module.materialize_frozen
    monkeypatch.setattr(lightning_module, "materialize_frozen",
                        lambda frozen, *a, **k: built.append(frozen) or real_materialize(frozen, *a, **k))
    again, data2, losses, _ = fit(pairs, lora=False, precompute=True, steps=1)
    assert again._reference_precomputed == key and passes == []  # the same weights and data: read, not computed
    assert built == [] and losses.copy == [] and again.frozen_models() == []  # and the copy never built
    np.testing.assert_array_equal(data2.train_dataset.reference_logps, shifted)
    assert losses.losses[0] == pytest.approx(float(torch.nn.functional.softplus(torch.tensor(-DPO["beta"]))),
                                             rel=1e-6)
    # The 2D strategy (one rank) asks before parallelizing the copy, and finds them too.
    from lightning_2d import ModelParallel2DStrategy
    from lightning_2d.integration import strategy_base

    parallelized = []
    monkeypatch.setattr(strategy_base, "parallelize_frozen", lambda frozen, *a, **k: parallelized.append(frozen))
    again, _, losses, _ = fit(pairs, lora=False, precompute=True, steps=1, strategy=ModelParallel2DStrategy())
    assert again._reference_precomputed == key and passes == [] and parallelized == [] and losses.copy == []
    assert losses.losses[0] == pytest.approx(float(torch.nn.functional.softplus(torch.tensor(-DPO["beta"]))),
                                             rel=1e-6)
    # Another seed is another reference: another key, the copy built, a pass of its own.
    other, _, losses, _ = fit(pairs, lora=False, precompute=True, init_seed=4, steps=1)
    assert other._reference_precomputed != key and passes == [1] and len(built) == 1 and len(losses.copy) == 2 * 9 + 3
    # Other pairs (fewer rows: another cache folder) with the first run's weights miss as well.
    rows = stdlib_preference_rows()[:20]
    (tmp_path / "fewer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fewer = {**pairs, "paths": str(tmp_path / "fewer.jsonl")}
    PreferenceDataModule(**fewer).prepare(num_workers=1)
    _, data3, _, _ = fit(fewer, lora=False, precompute=True, steps=1)
    assert passes == [1, 1] and len(built) == 2 and data3.sequence_count < data.sequence_count


def test_a_cover_gives_every_window_once_in_even_batches():
    class Windows:
        def __len__(self):
            return 7

        def __getitem__(self, index):
            return {"sequence_numbers": torch.full((4,), index)}

    seen = []
    for rank in range(2):
        cover = ReferenceCover(Windows(), replicas=2, rank=rank, batch_size=3)
        assert len(cover) == 6  # 7 windows over 2 replicas in batches of 3: 2 batches each, 5 padding windows
        numbers = [int(cover[i]["sequence_numbers"][0]) for i in range(len(cover))]
        seen += [n for n in numbers if n >= 0]
        assert all(int(cover[i]["sequence_numbers"].max()) == -1 for i in range(len(cover)) if cover.indices[i] < 0)
    assert sorted(seen) == list(range(7))


def test_precompute_needs_a_reference_and_preference_data(pairs):
    with pytest.raises(PreferenceConfigError, match="uses no reference model: nothing to precompute"):
        PreferenceLoss(loss_type="simpo", precompute_reference=True)
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2, "vocab_size": 264},
                                  preference={**DPO, "precompute_reference": True}, max_steps=1)
    data = PreferenceDataModule(**pairs)
    data.setup("fit")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with pytest.raises(PreferenceConfigError, match="pass a lightning_2d.PreferenceDataModule"):
        trainer.fit(module, train_dataloaders=data.train_dataloader())


def test_a_resume_whose_frozen_copy_would_come_from_another_seed_is_refused(pairs, tmp_path):
    """Without ``init_seed`` each run draws the seed of its initial weights, and the frozen copy is made from it, not
    from the checkpoint: the checkpoint records it, and a resume that would build the copy from another is refused
    (it would compare with another model)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_2d.errors import CheckpointError
    from lightning_2d.integration.preference_module import PreferenceTuning

    def trainer(steps: int) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)])

    def module() -> LlamaLightningModule:
        return LlamaLightningModule("debug", model_overrides={"n_layers": 2, "vocab_size": 264}, preference=DPO,
                                    max_steps=2)

    torch.manual_seed(11)
    trainer(1).fit(module(), PreferenceDataModule(**pairs))
    (saved,) = (tmp_path / "ckpt").glob("*.ckpt")
    record = torch.load(saved, weights_only=True)[PreferenceTuning.REFERENCE_RECORD_KEY]
    assert record == {"init_seed": 11}
    torch.manual_seed(12)  # another run, another drawn seed
    with pytest.raises(CheckpointError, match=r"came from \{'init_seed': 11\}; this run's would come from"
                                              r" \{'init_seed': 12\}.*Set init_seed=11 to resume it"):
        trainer(2).fit(module(), PreferenceDataModule(**pairs), ckpt_path=str(saved))
