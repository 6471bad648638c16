"""The preference losses (``lightning_2d.ops.preference``) equal TRL 1.16's own code on the same log-probabilities.

TRL's loss code runs here as TRL ships it: ``DPOTrainer._compute_loss`` (every DPO loss type, its reward metrics),
the experimental ``CPOTrainer.cpo_loss`` (SimPO) and ``ORPOTrainer.odds_ratio_loss``, and ``KTOTrainer._compute_loss``;
each on a stand-in for the trainer's state and model that returns the chosen per-token log-probabilities (a stand-in
for the network only: the arithmetic compared is TRL's). The whole-model comparison (TRL's trainers on a tiny
transformers model against the module's first step) is the module's test.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lightning_2d.ops.preference import LOSSES, PreferenceConfigError, PreferenceLoss

trl = pytest.importorskip("trl", reason="trl is in the test extra (pip install -e '.[test]')")

P, T = 6, 9  # pairs, tokens per completion row


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather


def _stand_in(cls, **attrs):
    """An instance of TRL's trainer class with only the state its loss code reads."""
    trainer = cls.__new__(cls)
    trainer.__dict__.update(accelerator=_Accelerator(), _metrics={"train": defaultdict(list)}, **attrs)
    return trainer


def _completions(seed: int):
    """Per-token log-probabilities of 2P completion rows ([chosen; rejected], TRL's batch order), 0 off the
    completion, and the completion mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * P, T, dtype=torch.long)
    for row, length in enumerate(torch.randint(1, T, (2 * P,), generator=g).tolist()):
        mask[row, T - length:] = 1
    per_token = (-torch.rand(2 * P, T, generator=g) * 3).double() * mask
    ref = (-torch.rand(2 * P, T, generator=g) * 3).double() * mask
    return per_token, ref, mask


def _trl_dpo(loss_type: str, beta: float, label_smoothing: float, per_token, ref, mask):
    from trl import DPOTrainer

    model = lambda **kwargs: SimpleNamespace(  # noqa: E731: the network's outputs TRL reads
        log_probs=per_token[:, 1:], entropy=torch.zeros_like(per_token[:, 1:]),
        mean_logits=torch.zeros_like(per_token[:, 1:]), is_top1=torch.zeros_like(mask[:, 1:], dtype=torch.bool))
    trainer = _stand_in(
        DPOTrainer, model=SimpleNamespace(training=True), ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, aux_loss_enabled=False, _total_train_tokens=0, _tp_size=1)
    # The first token is a prompt token (TRL shifts the mask by one): the completion is the rest of the row.
    mask = torch.cat([torch.zeros(2 * P, 1, dtype=mask.dtype), mask[:, 1:]], dim=1)
    ref_logps = ref[:, 1:].sum(1)
    inputs = {"input_ids": torch.zeros(2 * P, T, dtype=torch.long), "attention_mask": torch.ones(2 * P, T),
              "completion_mask": mask, "ref_chosen_logps": ref_logps[:P], "ref_rejected_logps": ref_logps[P:]}
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(loss: PreferenceLoss, per_token, ref, mask):
    logps, ref_logps, tokens = per_token[:, 1:].sum(1), ref[:, 1:].sum(1), mask[:, 1:].sum(1)
    terms = loss.pair_terms(logps[:P], logps[P:], tokens[:P], tokens[P:], ref_logps[:P], ref_logps[P:])
    metrics = {
        "rewards/chosen": terms.chosen_rewards.mean().item(), "rewards/rejected": terms.rejected_rewards.mean().item(),
        "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).double().mean().item(),
        "rewards/margins": (terms.chosen_rewards - terms.rejected_rewards).mean().item(),
        "logps/chosen": terms.chosen_logps.mean().item(), "logps/rejected": terms.rejected_logps.mean().item(),
    }
    return terms.losses.mean(), metrics


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0),
                                                        ("robust", 0.2)])
def test_dpo_losses_and_their_reward_metrics_equal_trl(loss_type, label_smoothing):
    per_token, ref, mask = _completions(seed=len(loss_type))
    mask[:, 0] = 0  # TRL's row starts with a prompt token
    per_token, ref = per_token * mask, ref * mask
    want, want_metrics = _trl_dpo(loss_type, 0.3, label_smoothing, per_token, ref, mask)
    got, metrics = _ours(PreferenceLoss(loss_type, beta=0.3, label_smoothing=label_smoothing), per_token, ref, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    for name, value in metrics.items():
        assert value == pytest.approx(want_metrics[name], rel=1e-6, abs=1e-9), name


def test_label_smoothing_gives_the_conservative_dpo_of_trl_before_1_0():
    """ε > 0 with ``sigmoid``: cDPO, -(1-ε)·log σ(βΔ) - ε·log σ(-βΔ) (TRL 1.16 dropped it from ``sigmoid``;
    its ``robust`` is the unbiased form of the same assumption)."""
    per_token, ref, mask = _completions(seed=3)
    plain, _ = _ours(PreferenceLoss("sigmoid", beta=0.3), per_token, ref, mask)
    smoothed, _ = _ours(PreferenceLoss("sigmoid", beta=0.3, label_smoothing=0.1), per_token, ref, mask)
    flipped, _ = _ours(PreferenceLoss("sigmoid", beta=0.3), per_token[torch.arange(2 * P).roll(P)],
                       ref[torch.arange(2 * P).roll(P)], mask[torch.arange(2 * P).roll(P)])
    torch.testing.assert_close(smoothed, 0.9 * plain + 0.1 * flipped)


def test_simpo_and_orpo_equal_trls_cpo_and_orpo_terms():
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    per_token, _, mask = _completions(seed=4)
    tokens = mask.sum(1)
    mean = per_token.sum(1) / tokens  # CPO (simpo) and ORPO score per token
    cpo = _stand_in(CPOTrainer, alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=0.1)
    want, want_chosen, want_rejected = cpo.cpo_loss(mean[:P], mean[P:])
    terms = PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.1).pair_terms(
        per_token.sum(1)[:P], per_token.sum(1)[P:], tokens[:P], tokens[P:])
    torch.testing.assert_close(terms.losses, want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(terms.chosen_rewards, want_chosen)
    torch.testing.assert_close(terms.rejected_rewards, want_rejected)

    orpo = _stand_in(ORPOTrainer, beta=0.25)
    odds, want_chosen, want_rejected, _, _ = orpo.odds_ratio_loss(mean[:P], mean[P:])
    terms = PreferenceLoss("orpo", beta=0.25).pair_terms(per_token.sum(1)[:P], per_token.sum(1)[P:], tokens[:P],
                                                         tokens[P:])
    # TRL: loss = nll - mean(odds term), computed in fp32
    torch.testing.assert_close(terms.losses.float(), -odds, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(terms.chosen_rewards.float(), want_chosen)
    torch.testing.assert_close(terms.rejected_rewards.float(), want_rejected)


def test_kto_equals_trl_on_desirable_and_undesirable_examples():
    """KTO's losses (mean over the examples) and reward metrics, its reference point the KL estimate of the
    mismatched completions, as ``KTOTrainer._compute_loss`` computes them."""
    from trl import KTOTrainer

    g = torch.Generator().manual_seed(8)
    n = 7
    logps, ref_logps, kl_logps, ref_kl_logps = (-torch.rand(n, generator=g).double() * 20 for _ in range(4))
    desirable = torch.tensor([True, False, True, True, False, False, True])
    per_token = torch.zeros(n, T - 1, dtype=torch.double)
    per_token[:, 0] = logps  # each row's completion log-probability, as the network would sum it
    model = lambda **kwargs: SimpleNamespace(  # noqa: E731
        log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=torch.zeros_like(per_token))
    trainer = _stand_in(KTOTrainer, model=SimpleNamespace(training=True), beta=0.2, desirable_weight=1.5,
                        undesirable_weight=0.8, loss_type="kto", calculate_KL=True, precompute_ref_logps=True,
                        aux_loss_enabled=False, _total_train_tokens=0, _tp_size=1,
                        _compute_kl_logps=lambda model, batch: kl_logps)
    batch = {"label": desirable, "input_ids": torch.zeros(n, T, dtype=torch.long), "attention_mask": torch.ones(n, T),
             "completion_mask": torch.ones(n, T, dtype=torch.long), "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
    want = trainer._compute_loss(model, batch, return_outputs=False)
    want_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    loss = PreferenceLoss("kto", beta=0.2, desirable_weight=1.5, undesirable_weight=0.8)
    losses, rewards = loss.kto_terms(logps, ref_logps, desirable, (kl_logps - ref_kl_logps).mean())
    torch.testing.assert_close(losses.mean(), want.double(), rtol=1e-6, atol=1e-9)  # TRL casts to fp32
    assert rewards[desirable].mean().item() == pytest.approx(want_metrics["rewards/chosen"], rel=1e-6)
    assert rewards[~desirable].mean().item() == pytest.approx(want_metrics["rewards/rejected"], rel=1e-6)


def test_settings_that_cannot_train_are_refused_with_every_problem_named():
    with pytest.raises(PreferenceConfigError) as err:
        PreferenceLoss("dpo", beta=0.0, label_smoothing=0.6)
    message = str(err.value)
    assert f"preference loss_type must be one of {', '.join(LOSSES)}; got 'dpo'" in message
    assert "preference beta must be a positive number, got 0.0" in message
    assert "preference label_smoothing must be in [0, 0.5) (the fraction of flipped labels), got 0.6" in message
    with pytest.raises(PreferenceConfigError, match="label_smoothing applies to sigmoid, robust and simpo, not 'ipo'"):
        PreferenceLoss("ipo", label_smoothing=0.1)
    with pytest.raises(PreferenceConfigError, match="the sigmoid loss needs the reference model's log-probabilities"):
        PreferenceLoss().pair_terms(*(torch.zeros(2) for _ in range(4)))
    assert not PreferenceLoss("simpo").needs_reference and PreferenceLoss("ipo").needs_reference
    assert not PreferenceLoss("kto").paired
