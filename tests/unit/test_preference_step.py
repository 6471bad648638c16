"""A preference step on packed windows (``integration/preference.py``) equals scoring each sequence on its own.

The pairs of a batch are packed several to a window (``PreferenceDataModule``'s contract: each sequence its own
document, ``sequence_ids`` naming it); the step sums each sequence's log-probabilities from the fused head. The
reference here runs every sequence alone, unpacked, through the model's logits and ``log_softmax``, and the loss
formula of ``PreferenceLoss`` (checked against TRL's code in ``test_preference_losses.py``): the losses, the
metrics and the adapters' gradients must agree.
"""

from __future__ import annotations

import pytest
import torch

from lightning_2d import LlamaLightningModule, PreferenceLoss
from lightning_2d.ops.lora import adapters_disabled
from lightning_2d.ops.preference import PreferenceConfigError

T = 40
#: Windows of (prompt length, chosen completion length, rejected completion length) pairs.
WINDOWS = [[(5, 6, 4), (3, 7, 5)], [(6, 9, 8)]]


#: QLoRA's model: every projection a whole number of NF4 scaler groups (16,384 elements).
QLORA_MODEL = {"n_layers": 2, "dim": 256, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 256}


def _module(preference: dict, lora: bool = True, quantize_base: str | None = None) -> LlamaLightningModule:
    adapters = {"rank": 4, **({"quantize_base": quantize_base} if quantize_base else {})} if lora else None
    module = LlamaLightningModule("debug", model_overrides=QLORA_MODEL if quantize_base else {"n_layers": 2},
                                  init_seed=3, loss_chunk_size=16, lora=adapters, preference=preference)
    module.configure_model()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # adapters that change the model (B starts at zero: the reference would be the model)
        for name, param in module.model.named_parameters():
            if "lora_b" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return module


def _batch(vocab: int):
    """The packed windows, and each sequence alone: (ids, number of prompt tokens) in chosen/rejected order."""
    g = torch.Generator().manual_seed(4)
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "sequence_ids": []}
    alone = []
    for window in WINDOWS:
        ids, labels, positions, sequences = [], [], [], []
        for p, (prompt, *completions) in enumerate(window):
            prompt_ids = torch.randint(0, vocab, (prompt,), generator=g)
            for side, length in enumerate(completions):
                seq = torch.cat([prompt_ids, torch.randint(0, vocab, (length,), generator=g)])
                alone.append((seq, prompt))
                target = seq[1:].clone()
                target[: prompt - 1] = -100  # the prompt's tokens are not scored, the completion's are
                ids.append(seq[:-1]), labels.append(target), positions.append(torch.arange(len(seq) - 1))
                sequences.append(torch.full((len(seq) - 1,), 2 * p + side))
        pad = T - sum(map(len, ids))
        ids.append(torch.zeros(pad, dtype=torch.long)), labels.append(torch.full((pad,), -100))
        positions.append(torch.arange(pad)), sequences.append(torch.full((pad,), -1))
        for key, parts in zip(rows, (ids, labels, positions, sequences)):
            rows[key].append(torch.cat(parts))
    batch = {key: torch.stack(value) for key, value in rows.items()}
    batch["pairs"] = torch.tensor([len(w) for w in WINDOWS])
    return batch, alone


def _alone_log_probs(module, alone, reference: bool):
    sums, tokens = [], []
    for seq, prompt in alone:
        context = adapters_disabled(module.model) if reference else torch.enable_grad()
        with context:
            logits = module.model(seq[None, :-1])[0]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, seq[1:, None])[:, 0]
        sums.append(log_probs[prompt - 1:].sum())
        tokens.append(len(seq) - prompt)
    return torch.stack(sums), torch.tensor(tokens, dtype=torch.float32)


def _adapter_grads(module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
    module.model.zero_grad()
    return grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo", "orpo"])
def test_a_packed_batch_scores_each_sequence_as_it_would_alone(loss_type):
    module = _module({"loss_type": loss_type, "beta": 0.5})
    batch, alone = _batch(module.vocab_size)
    loss, mean, pairs, metrics = module._preference_step(module.preference, batch, train=False)
    assert float(pairs) == sum(map(len, WINDOWS))
    loss.backward()
    packed_grads = _adapter_grads(module)

    logps, tokens = _alone_log_probs(module, alone, reference=False)
    with torch.no_grad():
        ref, _ = _alone_log_probs(module, alone, reference=True)
    terms = module.preference.pair_terms(logps[0::2], logps[1::2], tokens[0::2], tokens[1::2], ref[0::2], ref[1::2])
    want = terms.losses.mean()
    if loss_type == "orpo":
        want = want - logps[0::2].sum() / tokens[0::2].sum()
    want.backward()
    alone_grads = _adapter_grads(module)

    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["logps/chosen"], terms.chosen_logps.mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/margins"], (terms.chosen_rewards - terms.rejected_rewards).mean(),
                               rtol=1e-5, atol=1e-6)
    assert set(packed_grads) == set(alone_grads) and all("lora_" in n for n in packed_grads)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    if loss_type in ("sigmoid", "ipo"):  # the reference is the base: the adapters make the rewards non-zero
        assert float(metrics["rewards/chosen"].abs()) > 0


def test_the_reference_is_the_base_with_its_adapters_off():
    module = _module({"loss_type": "sigmoid"})
    batch, _ = _batch(module.vocab_size)
    with torch.no_grad():
        reference = module.reference_log_probs(batch)
        trained = module.token_log_probs(batch)
        for name, param in module.model.named_parameters():
            if "lora_b" in name:
                param.zero_()
        base = module.token_log_probs(batch)
    assert not torch.equal(reference, trained)
    torch.testing.assert_close(reference, base, rtol=0, atol=0)


def test_under_qlora_the_reference_is_the_nf4_base_with_its_adapters_off():
    """QLoRA (``quantize_base="nf4"``): the reference is the model with its adapters off, computing with its NF4
    bases: the log-probabilities of a plain model (no adapters) holding those bases' dequantized values, bit for bit;
    not those of the weights before quantization (the seeded init a frozen copy would hold), nor the trained model's."""
    from lightning_2d import Transformer
    from lightning_2d.ops.nf4 import dequantize, is_nf4

    module = _module({"loss_type": "sigmoid"}, quantize_base="nf4")
    assert module.frozen_models() == []  # no copy: the adapters' base is the reference
    quantized = {name: p for name, p in module.model.named_parameters() if is_nf4(p)}
    assert len(quantized) == 2 * 7  # the seven projections of both blocks
    batch, _ = _batch(module.vocab_size)
    base, unquantized = Transformer(module.model_args, loss_chunk_size=16), Transformer(module.model_args)
    base.init_weights(3), unquantized.init_weights(3)  # the seeded init, as the module's base was drawn
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name in quantized:
                assert not torch.equal(param, dequantize(quantized[name]))  # quantizing moved the values
                param.copy_(dequantize(quantized[name]))
        reference = module.reference_log_probs(batch)
        trained = module.token_log_probs(batch)
        positions = {"position_ids": batch["position_ids"]}
        nf4_base = base(batch["input_ids"], labels=batch["labels"], per_token=True, **positions)
        before_quantizing = unquantized(batch["input_ids"], labels=batch["labels"], per_token=True, **positions)
    scored = batch["labels"] != -100
    torch.testing.assert_close(reference, nf4_base, rtol=0, atol=0)
    assert (reference - trained)[scored].abs().max() > 1e-3  # the adapters change the model
    assert (reference - before_quantizing)[scored].abs().max() > 1e-3


def test_a_whole_model_compares_with_a_frozen_copy_of_its_initial_weights():
    """Without adapters the reference is a frozen copy (``reference="auto"``): built and materialized beside the
    model with its initial values, outside the module's parameters and state dict (no optimizer state, in no
    checkpoint); training the model leaves it as it was."""
    module = _module({"loss_type": "sigmoid", "beta": 0.5}, lora=False)
    (reference,) = module.frozen_models()
    frozen = reference.frozen()
    assert all(not p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert {id(p) for p in module.parameters()}.isdisjoint(id(p) for p in frozen.parameters())
    assert not any("reference" in key or key.startswith("_") for key in module.state_dict())
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    for name, param in frozen.named_parameters():
        assert torch.equal(param, start[name]), name
    batch, _ = _batch(module.vocab_size)
    loss, _, _, metrics = module._preference_step(module.preference, batch, train=False)
    assert float(metrics["rewards/margins"]) == 0.0 and float(metrics["rewards/accuracies"]) == 0.0
    loss.backward()
    with torch.no_grad():
        for param in module.model.parameters():
            param.sub_(0.1 * param.grad)
    _, _, _, metrics = module._preference_step(module.preference, batch, train=False)
    assert float(metrics["rewards/margins"]) > 0  # one step down the loss: the chosen gain on the rejected
    for name, param in frozen.named_parameters():
        assert torch.equal(param, start[name]), name


def test_references_that_cannot_be_are_refused_at_construction():
    with pytest.raises(PreferenceConfigError, match="reference='adapters_off' needs adapters to switch off"):
        LlamaLightningModule("debug", preference={"loss_type": "sigmoid", "reference": "adapters_off"})
    with pytest.raises(PreferenceConfigError, match="reference='copy' with lora="):
        LlamaLightningModule("debug", preference={"reference": "copy"}, lora={"rank": 4})
    with pytest.raises(PreferenceConfigError, match="preference has no field"):
        LlamaLightningModule("debug", preference={"loss": "sigmoid"})
    assert LlamaLightningModule("debug", preference=PreferenceLoss("simpo")).preference.loss_type == "simpo"
    assert LlamaLightningModule("debug", preference={}).frozen_models() == []  # declared when the model is


#: Windows of unpaired examples: (prompt length, completion length, desirable).
EXAMPLE_WINDOWS = [[(4, 4, True), (3, 5, False), (3, 3, True)], [(6, 9, False)]]


def _kto_batch(vocab: int):
    """Packed windows of unpaired examples, each followed by its KL sequence (its prompt, the window's previous
    example's completion; none in a window of one), and each sequence alone: (ids, prompt tokens, is a KL one)."""
    g = torch.Generator().manual_seed(7)
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "sequence_ids": []}
    alone, desirable = [], []
    for window in EXAMPLE_WINDOWS:
        parts = [(torch.randint(0, vocab, (p,), generator=g), torch.randint(0, vocab, (c,), generator=g))
                 for p, c, _ in window]
        ids, labels, positions, sequences = [], [], [], []
        for e, (prompt, completion) in enumerate(parts):
            kinds = [(completion, False)] + ([(parts[e - 1][1], True)] if len(parts) > 1 else [])
            for side, (answer, kl) in enumerate(kinds):
                seq = torch.cat([prompt, answer])
                alone.append((seq, len(prompt), kl))
                target = seq[1:].clone()
                target[: len(prompt) - 1] = -100
                ids.append(seq[:-1]), labels.append(target), positions.append(torch.arange(len(seq) - 1))
                sequences.append(torch.full((len(seq) - 1,), 2 * e + side))
        pad = T - sum(map(len, ids))
        ids.append(torch.zeros(pad, dtype=torch.long)), labels.append(torch.full((pad,), -100))
        positions.append(torch.arange(pad)), sequences.append(torch.full((pad,), -1))
        for key, values in zip(rows, (ids, labels, positions, sequences)):
            rows[key].append(torch.cat(values))
        desirable.append(torch.tensor([d for *_, d in window] + [False] * (T // 2 - len(window))))
    batch = {key: torch.stack(value) for key, value in rows.items()}
    batch["examples"] = torch.tensor([len(w) for w in EXAMPLE_WINDOWS])
    batch["desirable"] = torch.stack(desirable)
    return batch, alone


def test_kto_on_packed_examples_scores_each_as_alone_and_its_kl_sequences_give_no_gradient():
    module = _module({"loss_type": "kto", "beta": 0.5, "desirable_weight": 1.5})
    batch, alone = _kto_batch(module.vocab_size)
    loss, mean, examples, metrics = module._preference_step(module.preference, batch, train=False)
    assert float(examples) == 4
    loss.backward()
    packed_grads = _adapter_grads(module)

    logps, _ = _alone_log_probs(module, [(s, p) for s, p, _ in alone], reference=False)
    with torch.no_grad():
        ref, _ = _alone_log_probs(module, [(s, p) for s, p, _ in alone], reference=True)
    is_kl = torch.tensor([kl for *_, kl in alone])
    kl = (logps[is_kl] - ref[is_kl]).mean().detach()  # the window of one example has none
    assert float(kl) > 0  # the estimate matters: clamped at 0 it would not
    desirable = torch.tensor([d for window in EXAMPLE_WINDOWS for *_, d in window])
    losses, rewards = module.preference.kto_terms(logps[~is_kl], ref[~is_kl], desirable, kl)
    want = losses.mean()
    want.backward()
    alone_grads = _adapter_grads(module)

    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean, want.detach(), rtol=1e-5, atol=1e-6)
    # The KL estimate and the rewards are differences of two sums of ~-30 (fused head vs log_softmax): a few ulps.
    torch.testing.assert_close(metrics["kl"], kl, rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/chosen"], rewards[desirable].mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/rejected"], rewards[~desirable].mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["logps/rejected"], logps[~is_kl][~desirable].mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/margins"], rewards[desirable].mean() - rewards[~desirable].mean(),
                               rtol=0, atol=1e-5)
    assert set(packed_grads) == set(alone_grads) and all("lora_" in n for n in packed_grads)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_batch_of_the_other_kind_is_refused_by_the_step():
    module = _module({"loss_type": "kto"})
    pairs, _ = _batch(module.vocab_size)
    with pytest.raises(PreferenceConfigError, match=r"loss_type='kto' scores unpaired examples .* but the batch holds"
                                                    r" pairs"):
        module._preference_step(module.preference, pairs, train=False)
    examples, _ = _kto_batch(module.vocab_size)
    with pytest.raises(PreferenceConfigError, match=r"loss_type='sigmoid' compares a chosen and a rejected completion"
                                                    r" of one prompt, but the batch holds unpaired examples"):
        module._preference_step(PreferenceLoss("sigmoid"), examples, train=False)

def test_a_parallelized_frozen_copy_is_stored_in_the_dtype_fsdp_computes_in(tmp_path):
    """``parallelize_frozen`` under ``bf16-mixed`` (a one-rank gloo world): the copy's parameters are bf16, the fp32
    seeded init cast (a tied weight still one parameter, the rotary table fp32, nothing requiring a gradient), and its
    forward is bit for bit that of the model stored in fp32 (FSDP casts those to bf16 before gathering): the same
    reference at half the memory."""
    import torch.distributed as dist

    from lightning_2d import ModelArgs, Transformer
    from lightning_2d.models import registry
    from lightning_2d.models.llama.plan import llama_plan
    from lightning_2d.parallel.config import ParallelConfig
    from lightning_2d.parallel.dims import ParallelDims
    from lightning_2d.parallel.frozen import parallelize_frozen
    from lightning_2d.parallel.parallelize import parallelize_and_materialize

    args = ModelArgs.from_name("debug", n_layers=2, tie_word_embeddings=True)
    config = ParallelConfig(data_parallel_size=1, tensor_parallel_size=1)
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        meshes, models = ParallelDims(1, 1, 1).build_mesh("cpu"), []
        for parallelize in (parallelize_frozen, parallelize_and_materialize):
            with torch.device("meta"):
                model = Transformer(args).requires_grad_(False)
            parallelize(model, meshes, config, llama_plan(args, config), "bf16-mixed", torch.device("cpu"),
                        seed=lambda: 7, known_init_hooks=registry.known_init_hooks)
            models.append(model)
        copy, stored_fp32 = models
        assert {p.dtype for p in copy.parameters()} == {torch.bfloat16} and copy.rope.dtype == torch.float32
        assert {p.dtype for p in stored_fp32.parameters()} == {torch.float32}
        assert copy.output.weight is copy.tok_embeddings.weight and not any(p.requires_grad for p in copy.parameters())
        stored = {name: param.full_tensor() for name, param in copy.named_parameters()}
        with torch.no_grad():
            log_probs = [m(tokens[:, :-1], labels=tokens[:, 1:], per_token=True) for m in models]
        assert torch.equal(*log_probs)
    finally:
        dist.destroy_process_group()
    initial = Transformer(args)
    initial.init_weights(7)
    assert stored.keys() == dict(initial.named_parameters()).keys()
    for name, param in initial.named_parameters():
        assert torch.equal(stored[name], param.detach().to(torch.bfloat16)), name


class OneDevicePipeline:
    """What ``pipelined_preference_step`` and ``pipelined_kto_step`` ask of a ``Pipeline``, on one device: forward-only
    token log-probabilities of the whole model, and an objective step that splits its inputs and ``target`` into
    micro-batches with torch's own splitter (``split_args_kwargs_into_chunks``: along the batch, as the schedules
    split ``target``), so each micro-batch holds whole windows."""

    last_stage_rank, pp_group = 0, None

    def __init__(self, module, microbatches: int) -> None:
        self.module, self.microbatches, self.windows = module, microbatches, []

    def token_log_probs(self, tokens, labels, position_ids=None):
        with torch.no_grad():
            return self.module.token_log_probs({"input_ids": tokens, "labels": labels, "position_ids": position_ids})

    def objective_step(self, objective, tokens, labels, target, train, grad_scale=1.0, position_ids=None):
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        chunks, _ = split_args_kwargs_into_chunks((tokens, labels, position_ids, target), {}, self.microbatches)
        for t, l, p, micro_target in chunks:
            self.windows.append(t.shape[0])
            loss = objective(self.module.token_log_probs({"input_ids": t, "labels": l, "position_ids": p}),
                             micro_target) * grad_scale
            if train:
                loss.backward()


@pytest.fixture
def one_rank_world(tmp_path):
    """A one-rank gloo world: FSDP2 on one rank; the pipelined steps broadcast their metrics from the last stage."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo", "kto"])
def test_the_pipelined_objectives_per_micro_batch_of_whole_windows_equal_the_batchs_step(loss_type, one_rank_world):
    """Under a pipeline the last stage scores each micro-batch alone (``PipelinedPairs``, KTO's ``PipelinedExamples``):
    the schedule splits the batch and the ``target`` by windows, and a window holds whole pairs (an example with its KL
    sequence), so one window per micro-batch gives the whole batch's loss, metrics and gradients. KTO's KL estimate,
    a mean over every window's KL sequences, comes from a forward-only pass before the micro-batches (in the target)."""
    from lightning_2d.integration.preference import (
        kto_step, pipelined_kto_step, pipelined_preference_step, preference_step,
    )

    module = _module({"loss_type": loss_type, "beta": 0.5, "desirable_weight": 1.5})
    batch, _ = (_kto_batch if loss_type == "kto" else _batch)(module.vocab_size)
    step, pipelined = (kto_step, pipelined_kto_step) if loss_type == "kto" else (preference_step,
                                                                                  pipelined_preference_step)
    loss, mean, units, metrics = step(module.preference, batch, module.token_log_probs, module.reference_log_probs,
                                      None)
    loss.backward()
    whole = _adapter_grads(module)
    pipeline = OneDevicePipeline(module, microbatches=2)
    got = pipelined(pipeline, module.preference, batch, module.reference_log_probs, None, train=True)
    split = _adapter_grads(module)
    assert pipeline.windows == [1, 1]  # two micro-batches of one window each (the pairs of a window stay together)
    torch.testing.assert_close(got[1], mean, rtol=1e-5, atol=1e-7)
    assert float(got[2]) == float(units)
    assert got[3].keys() == metrics.keys()
    for name, value in metrics.items():
        torch.testing.assert_close(got[3][name], value, rtol=1e-5, atol=1e-6, msg=name)
    if loss_type == "kto":
        assert float(metrics["kl"]) > 0  # the estimate matters (clamped at 0 it would not)
    assert split.keys() == whole.keys() and whole
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_a_parallelized_frozen_model_reshards_every_unit_after_its_forward(one_rank_world):
    """A frozen model has no backward to free what FSDP2 keeps gathered for it: ``parallelize_frozen`` reshards every
    unit after its forward (set on the units once built, so the zero-bubble schedules' refusal of the option for the
    trained model does not apply), where the trained model's ``"default"`` policy keeps the output unit (final norm and
    head) and the last block gathered after a no-grad forward (on one CPU rank: plain tensors in place of the sharded
    parameters)."""
    from torch.distributed.tensor import DTensor

    from lightning_2d import ModelArgs, Transformer
    from lightning_2d.models import registry
    from lightning_2d.models.llama.plan import llama_plan
    from lightning_2d.parallel.config import ParallelConfig
    from lightning_2d.parallel.dims import ParallelDims
    from lightning_2d.parallel.frozen import parallelize_frozen
    from lightning_2d.parallel.parallelize import parallelize_and_materialize

    args = ModelArgs.from_name("debug", n_layers=2)
    config = ParallelConfig(data_parallel_size=1, tensor_parallel_size=1)
    meshes = ParallelDims(1, 1, 1).build_mesh("cpu")
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    gathered = {}
    for parallelize in (parallelize_frozen, parallelize_and_materialize):
        with torch.device("meta"):
            model = Transformer(args).requires_grad_(False)
        parallelize(model, meshes, config, llama_plan(args, config), "32-true", torch.device("cpu"), seed=lambda: 7,
                    known_init_hooks=registry.known_init_hooks)
        with torch.no_grad():
            model(tokens[:, :-1], labels=tokens[:, 1:], per_token=True)
        gathered[parallelize.__name__] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    last_block = [n for n, _ in model.named_parameters() if n.startswith("layers.1.")]
    assert len(last_block) == 9
    assert gathered == {"parallelize_frozen": [], "parallelize_and_materialize": [*last_block, "norm.weight",
                                                                                  "output.weight"]}
