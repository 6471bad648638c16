"""``lightning-2d benchmark`` without processes: parsing, generated strategy flags, settings checks,
statistics, ratios, the report, the synthetic data; and the process launcher on tiny commands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
import typing
from pathlib import Path
from typing import Literal, Union

import lightning as L
import numpy as np
import pytest
import torch

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy, ParallelConfig
from lightning_2d.models.llama.model import ModelArgs
from lightning_2d.tools import benchmark as bench
from lightning_2d.tools.launch import launch_processes


def parse(*argv: str) -> argparse.Namespace:
    return bench.build_parser().parse_args(list(argv))


def settings(*argv: str, world_size: int | None = None) -> bench.BenchmarkSettings:
    return bench.settings_from_args(parse("--accelerator", "cpu", *argv), world_size=world_size)


# ---- defaults and parsing ------------------------------------------------------------------------
def test_defaults_are_the_reference_2d_example_on_four_processes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = bench.settings_from_args(parse())
    args = s.model_args
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size) == (256, 2, 16, 32000)
    assert (s.seq_len, s.global_batch_size, s.devices, s.num_nodes) == (256, 8, 4, 1)
    assert (s.dp, s.tp, s.accelerator, s.precision) == (2, 2, "cpu", "32-true")
    assert s.variants == ["lightning_2d"]
    assert bench.settings_from_args(parse("--compare")).variants == ["lightning_2d", "lightning", "plain"]


def test_model_flags_override_the_reference_or_a_preset():
    s = settings("--dim", "64", "--vocab-size", "256", "--n-kv-heads", "4", "--seq-len", "32")
    assert (s.model_args.dim, s.model_args.n_layers, s.model_args.kv_heads, s.model_args.vocab_size) == (64, 2, 4, 256)
    debug = settings("--model", "debug", "--n-layers", "1", "--seq-len", "32")
    assert debug.model_args == ModelArgs.from_name("debug", n_layers=1)


def test_expert_flags_reshape_the_experts_of_a_model_with_experts():
    s = settings("--model", "debug-moe", "--n-experts", "16", "--top-k", "1", "--expert-hidden-dim", "256",
                 "--seq-len", "32")
    moe = s.model_args.moe
    assert (moe.num_experts, moe.top_k, moe.hidden_dim) == (16, 1, 256)
    assert moe.num_shared_experts == ModelArgs.from_name("debug-moe").moe.num_shared_experts  # the rest: the preset's
    assert settings("--model", "debug-moe", "--seq-len", "32").model_args == ModelArgs.from_name("debug-moe")
    with pytest.raises(bench.BenchmarkConfigError, match="--n-experts need a model with experts"):
        settings("--model", "debug", "--n-experts", "16", "--seq-len", "32")
    with pytest.raises(bench.BenchmarkConfigError, match="top_k"):
        settings("--model", "debug-moe", "--top-k", "9", "--seq-len", "32")


def test_loss_flags_reach_the_lightning_2d_module():
    assert settings().module_options == {"fused_loss": True, "loss_chunk_size": None}  # None: sized by memory (#47)
    assert settings("--no-fused-loss", "--loss-chunk-size", "64").module_options == {
        "fused_loss": False, "loss_chunk_size": 64}
    with pytest.raises(bench.BenchmarkConfigError, match="--loss-chunk-size must be a positive number of tokens, got 0"):
        settings("--loss-chunk-size", "0")


def test_the_report_names_the_loss_chunk_the_run_uses():
    from lightning_2d.tools.benchmark.report import loss_chunk_words

    # debug: vocabulary 256 at tp 2, 4 sequences × 256 tokens per replica: the micro-batch in one chunk.
    assert loss_chunk_words(settings("--model", "debug")) == "auto: 1024 tokens per chunk (one chunk per micro-batch)"
    # 64000 / tp 2 = 32000 rows: 2**24 // 32000 < 1024, so 1024 tokens; 4 × 1024 tokens per replica.
    assert loss_chunk_words(settings("--vocab-size", "64000", "--seq-len", "1024")) == \
        "auto: 1024 tokens per chunk (4 chunks per micro-batch)"
    assert loss_chunk_words(settings("--loss-chunk-size", "64")) == "64 tokens per chunk"


def test_every_parallel_config_field_is_a_flag_with_its_docstring():
    parser = bench.build_parser()
    actions = {a.dest: a for a in parser._actions}
    docs = bench.field_docs(ParallelConfig)
    assert docs["sequence_parallel"].startswith("Shard norms and residual activations along the sequence")
    for f in dataclasses.fields(ParallelConfig):
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        if f.name in docs:
            assert docs[f.name] in action.help.replace("%%", "%")
        if typing.get_type_hints(ParallelConfig)[f.name] is bool:
            assert "--no-" + f.name.replace("_", "-") in action.option_strings


def test_strategy_flags_parse_to_config_values_and_build_the_strategy():
    args = parse(
        "--no-sequence-parallel", "--loss-parallel", "--activation-checkpointing", "selective",
        "--selective-ac-option", "2", "--param-dtype", "bf16", "--reduce-dtype", "none",
        "--data-parallel-size", "auto", "--tensor-parallel-size", "4",
    )
    options = bench.strategy_options(args)
    assert options == {
        "data_parallel_size": "auto", "tensor_parallel_size": 4, "sequence_parallel": False, "loss_parallel": True,
        "activation_checkpointing": "selective", "selective_ac_option": 2, "param_dtype": "bf16",
    }  # reduce_dtype "none" is ParallelConfig's default None: not passed
    config = ModelParallel2DStrategy(**options).parallel_config
    assert (config.sequence_parallel, config.selective_ac_option, config.param_dtype) == (False, 2, torch.bfloat16)
    # Unset flags keep the strategy's defaults, except the benchmark's tensor_parallel_size=2.
    assert bench.strategy_options(parse()) == {"data_parallel_size": "auto", "tensor_parallel_size": 2}
    s = settings("--tensor-parallel-size", "4", "--no-sequence-parallel")
    assert s.strategy_kwargs() == {"data_parallel_size": 1, "tensor_parallel_size": 4, "sequence_parallel": False}


def test_option_converter_follows_the_annotation():
    size = bench.option_converter(Union[int, Literal["auto"]])
    assert size("auto") == "auto" and size("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match=r"'x' is not one of: int, 'auto'"):
        size("x")
    optional_dtype = bench.option_converter(Union[torch.dtype, str, None])
    assert optional_dtype("None") is None and optional_dtype("bfloat16") == "bfloat16"
    assert bench.option_converter(Union[str, int])("op") == "op"
    flag_or_mode = bench.option_converter(Union[bool, str])  # e.g. float8: True, False or "emulate"
    assert flag_or_mode("true") is True and flag_or_mode("False") is False and flag_or_mode("emulate") == "emulate"
    assert bench.option_converter(int | None)("none") is None
    assert bench.option_converter(float)("0.5") == 0.5


def test_bad_flag_value_is_a_parse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--tensor-parallel-size", "two")
    assert exit_.value.code == 2
    assert "argument --tensor-parallel-size: 'two' is not one of: int, 'auto'" in capsys.readouterr().err


# ---- impossible settings, before any process ------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tensor-parallel-size", "3"],
         (r"data_parallel_size × tensor_parallel_size \(1 × 3 = 3\) must equal the world size \(4 = .*"
          r"valid \(dp, tp\) pairs: \(1, 4\), \(2, 2\), \(4, 1\)")),
        (["--global-batch-size", "7"],
         r"--global-batch-size \(7\) must be divisible by the data-parallel size \(2\).*try 6 or 8"),
        (["--n-heads", "6", "--dim", "96", "--tensor-parallel-size", "4"],
         r"tensor_parallel_size \(4\) must divide n_heads \(6\); try 1 or 2"),
        (["--seq-len", "33"], r"sequence length \(33\) must be divisible by tensor_parallel_size \(2\)"),
        (["--seq-len", "33", "--no-sequence-parallel", "--compare"],
         r"under --compare the lightning and plain variants use sequence parallelism: sequence length \(33\)"),
        (["--pipeline-parallel-size", "2", "--tensor-parallel-size", "1", "--compare"],
         r"--pipeline-parallel-size 2 has no counterpart in the hand-written Lightning and plain torch variants"),
        (["--context-parallel-size", "2", "--tensor-parallel-size", "1", "--compare"],
         r"--context-parallel-size 2 has no counterpart in the hand-written Lightning and plain torch variants"),
        (["--context-parallel-size", "2", "--seq-len", "36"],
         r"sequence length \(36\) must be a multiple of 2 × context_parallel_size \(2\) × tensor_parallel_size"),
        (["--data-parallel-replicate-size", "2", "--tensor-parallel-size", "1", "--compare"],
         r"--data-parallel-replicate-size 2 \(HSDP\) has no counterpart in the hand-written Lightning and plain"),
        (["--seq-len", "8192"], r"--seq-len \(8192\) exceeds the model's max_seq_len \(4096\)"),
        (["--dim", "100"], r"model: n_heads \(16\) must divide dim \(100\)"),
        (["--steps", "0"], r"--steps must be at least 1, got 0"),
        (["--warmup", "-1"], r"--warmup must be at least 0, got -1"),
        (["--rounds", "0"], r"--rounds must be at least 1, got 0"),
        (["--collectives", "--warmup", "0"], r"--collectives breaks down the last warm-up step's collectives: it"
         r" needs --warmup 1 or more, got 0"),
        (["--activation-checkpointing", "sometimes"],
         r"activation_checkpointing='sometimes' is not a mode; choose one of 'none', 'full', 'selective'"),
    ],
)
def test_impossible_settings_name_the_values_and_the_fix(argv, message):
    with pytest.raises(bench.BenchmarkConfigError, match=message):
        settings(*argv)


def test_every_problem_is_listed_at_once():
    with pytest.raises(bench.BenchmarkConfigError) as err:
        settings("--steps", "0", "--rounds", "0", "--global-batch-size", "5")
    assert len(err.value.problems) == 3


def test_in_place_world_size_must_match_devices_and_nodes():
    message = r"started with WORLD_SIZE=8, but --devices 4 × --num-nodes 1 = 4"
    with pytest.raises(bench.BenchmarkConfigError, match=message):
        settings(world_size=8)
    assert settings("--devices", "4", "--num-nodes", "2", world_size=8).dp == 4


def test_gpu_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bench.BenchmarkConfigError, match="--accelerator gpu, but CUDA is not available here"):
        bench.settings_from_args(parse("--accelerator", "gpu"))


def test_an_option_the_strategy_does_not_accept_is_refused(monkeypatch):
    monkeypatch.setattr(bench.settings, "_strategy_accepts", lambda: {"data_parallel_size", "tensor_parallel_size"})
    message = r"does not accept the ParallelConfig option\(s\) loss_parallel"
    with pytest.raises(bench.BenchmarkConfigError, match=message):
        settings("--loss-parallel")


def test_main_reports_bad_settings_before_starting_processes(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("processes started despite impossible settings")

    monkeypatch.setattr(bench.cli, "run_spawned", must_not_run)  # where main looks it up
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--accelerator", "cpu", "--global-batch-size", "3"])
    assert exit_.value.code == 2
    assert "--global-batch-size (3) must be divisible by the data-parallel size (2)" in capsys.readouterr().err


def test_lightning_2d_command_dispatches_benchmark_and_help_mentions_it(monkeypatch, capsys):
    from lightning_2d.tools import cli

    monkeypatch.setattr(sys, "argv", ["lightning-2d", "benchmark", "--accelerator", "cpu", "--steps", "0"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    assert "lightning-2d benchmark: error" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["lightning-2d", "--help"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  benchmark ") and "--compare" in line for line in lines)


def test_settings_round_trip_through_json():
    s = settings("--compare", "--param-dtype", "bf16", "--seed", "3")
    assert bench.BenchmarkSettings.from_json(s.to_json()) == s


# ---- shared pieces of the variants --------------------------------------------------------------
def test_synthetic_tokens_split_the_global_batch_by_data_parallel_rank():
    s = settings("--dim", "64", "--vocab-size", "256", "--seq-len", "16", "--steps", "2", "--warmup", "1")
    loaders = [list(bench.synthetic_loader(s, rank)) for rank in range(4)]  # (dp, tp) = (2, 2)
    assert len(loaders[0]) == s.total_steps == 3
    for step in range(3):
        first, second = (loaders[r][step]["input_ids"] for r in (0, 2))
        assert first.shape == (4, 16)
        assert torch.equal(first, loaders[1][step]["input_ids"])  # same tensor-parallel group
        assert not torch.equal(first, second)  # another replica
        batch = loaders[0][step]
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # labels are the next tokens
    # The global batch does not depend on the layout: dp = 1 sees both replicas' samples in order.
    whole = bench.synthetic_loader(dataclasses.replace(s, dp=1, tp=4), 0)
    for step, batch in enumerate(whole):
        expected = torch.cat([loaders[0][step]["input_ids"], loaders[2][step]["input_ids"]])
        assert torch.equal(batch["input_ids"], expected)
    assert int(max(b["input_ids"].max() for b in loaders[0])) < 256


def test_step_clock_times_steps_and_records_losses():
    clock = bench.StepClock(torch.device("cpu"))
    clock.start()
    for loss in (3.0, 2.5):
        time.sleep(0.01)
        clock.tick(torch.tensor(loss))
    assert clock.losses == [3.0, 2.5]
    assert len(clock.step_times) == 2 and all(t >= 0.01 for t in clock.step_times)


def test_hand_written_variants_use_the_modules_optimizer_hyperparameters():
    hp = LlamaLightningModule().hparams
    defaults = bench.adamw_defaults()
    for name in ("learning_rate", "weight_decay", "betas", "eps", "fused", "min_lr_ratio"):
        assert defaults[name] == hp[name], name
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer, scheduler = bench.build_adamw(model, torch.device("cpu"), settings("--warmup", "2"))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == hp["weight_decay"] and no_decay["weight_decay"] == 0.0
    assert [p.ndim for p in decay["params"]] == [2] and len(no_decay["params"]) == 3
    assert decay["fused"] is True and not decay["foreach"]  # CPU: fused, as the module's (fused_adamw)
    meta, _ = bench.build_adamw(model.to("meta"), torch.device("meta"), settings("--warmup", "2"))
    assert meta.param_groups[0]["foreach"] is True and not meta.param_groups[0]["fused"]  # elsewhere: foreach
    assert scheduler.get_last_lr()[0] == pytest.approx(hp["learning_rate"] / 2)  # step 1 of a 2-step warm-up


# ---- statistics, ratios, report -------------------------------------------------------------------
def rank_record(
    rank: int, step_times: list[float], first_loss: float, memory: float = 1.0, peak: float | None = None
) -> dict:
    return {"rank": rank, "step_times": step_times, "losses": [first_loss, first_loss - 1], "peak_memory_gib": memory,
            "peak_tflops": peak, "compute_dtype": "float32"}


def test_step_times_take_the_slowest_rank_and_drop_each_runs_warmup():
    per_rank = [[5.0, 1.0, 2.0], [4.0, 1.5, 1.0]]
    assert bench.slowest_rank_step_times(per_rank) == [5.0, 1.5, 2.0]
    runs = [{"ranks": [rank_record(0, [9.0, 1.0, 2.0], 0), rank_record(1, [9.0, 3.0, 1.0], 0)]},
            {"ranks": [rank_record(0, [8.0, 4.0, 1.0], 0), rank_record(1, [7.0, 0.5, 1.0], 0)]}]
    assert bench.steady_step_times(runs, warmup=1) == [3.0, 2.0, 4.0, 1.0]
    with pytest.raises(ValueError, match=r"ranks recorded different numbers of steps: \[3, 2\]"):
        bench.slowest_rank_step_times([[1.0, 2.0, 3.0], [1.0, 2.0]])


def test_variant_summary_arithmetic():
    s = settings("--dim", "64", "--vocab-size", "256", "--seq-len", "32", "--warmup", "1")
    runs = [{"ranks": [rank_record(r, [10.0, 0.2, 0.4, 0.3], 5.0 + r, memory=1.0 + r, peak=100.0) for r in range(4)]}]
    summary = bench.variant_summary(s, runs)
    assert summary["median_step_s"] == 0.3
    tokens = 8 * 32
    assert summary["tokens_per_sec"] == pytest.approx(tokens / 0.3)
    assert summary["tokens_per_sec_per_device"] == pytest.approx(tokens / 0.3 / 4)
    tflops = s.model_args.flops_per_token(32) * tokens / 0.3 / 4 / 1e12
    assert summary["tflops_per_device"] == pytest.approx(tflops)
    assert summary["mfu_percent"] == pytest.approx(100 * tflops / 100.0)
    assert summary["peak_memory_gib_per_device"] == 4.0
    assert summary["first_loss"] == statistics.fmean([5.0, 6.0, 7.0, 8.0])
    assert summary["ranks"] == [0, 1, 2, 3]
    no_peak = [{"ranks": [rank_record(r, [1.0, 0.2], 5.0) for r in range(4)]}]
    assert bench.variant_summary(s, no_peak)["mfu_percent"] is None  # CPU: no MFU


def test_ratios_are_ours_over_each_other_variant():
    ratios = bench.step_time_ratios({"lightning_2d": 2.0, "lightning": 4.0, "plain": 1.0})
    assert ratios == {"lightning": 0.5, "plain": 2.0}


def test_report_prints_medians_and_ratios():
    s = settings("--compare", "--dim", "64", "--vocab-size", "256", "--seq-len", "32", "--warmup", "0", "--rounds", "1")
    medians = {"lightning_2d": 0.062, "lightning": 0.1, "plain": 0.064}
    runs = [{"variant": v, "round": 0, "ranks": [rank_record(r, [m, m, m], 5.5) for r in range(4)]}
            for v, m in medians.items()]
    report = bench.summarize(s, runs)
    text = bench.format_report(report)
    assert "(dp, tp) = (2, 2) on 4 cpu process(es)" in text
    assert "ours / lightning = 0.620x step time (1.613x the throughput)" in text
    assert "ours / plain = 0.969x step time" in text
    assert report["backends"] is None and "simple_fsdp /" not in text  # --compare-backends not given
    row = next(line for line in text.splitlines() if line.startswith("lightning_2d "))
    assert re.split(r"\s+", row)[1:3] == ["62.00", "4,129"]
    assert "in place on CPU" not in text
    in_place = bench.format_report(bench.summarize(s, runs, in_place=True))
    # Where the resident peak can be reset (Linux) every run's peak is its own; elsewhere say so.
    resettable = Path("/proc/self/clear_refs").exists()
    assert ("in place on CPU: a variant's peak memory" in in_place) == (not resettable)
    json.dumps(report)  # everything in the report can go to --json


def test_compare_backends_runs_lightning_2d_under_each_fsdp_backend():
    s = settings("--compare-backends")
    assert s.variants == ["lightning_2d", "simple_fsdp"]
    assert s.strategy_kwargs("lightning_2d")["fsdp_backend"] == "fully_shard"
    assert s.strategy_kwargs("simple_fsdp")["fsdp_backend"] == "simple_fsdp"
    assert settings("--compare-backends", "--compare").variants == ["lightning_2d", "simple_fsdp", "lightning", "plain"]
    assert settings("--fsdp-backend", "simple_fsdp").strategy_kwargs()["fsdp_backend"] == "simple_fsdp"  # alone: as given
    with pytest.raises(bench.BenchmarkConfigError, match=r"--fsdp-backend simple_fsdp with --compare-backends, which"
                                                         r" runs both backends .*drop --fsdp-backend"):
        settings("--compare-backends", "--fsdp-backend", "simple_fsdp")
    # What SimpleFSDP refuses is named before any process starts, as the simple_fsdp variant's.
    with pytest.raises(bench.BenchmarkConfigError, match=r"--compare-backends \(the simple_fsdp variant\):"
                                                         r" fsdp_backend='simple_fsdp' with reshard_after_forward="
                                                         r"'always' and activation_checkpointing='none'"):
        settings("--compare-backends", "--reshard-after-forward", "always")


def test_backend_ratios_and_collectives_are_reported():
    s = settings("--compare-backends", "--dim", "64", "--vocab-size", "256", "--seq-len", "32", "--warmup", "0",
                 "--rounds", "1")
    medians, memory = {"lightning_2d": 0.1, "simple_fsdp": 0.08}, {"lightning_2d": 2.0, "simple_fsdp": 3.0}
    counts = {"lightning_2d": {"all_gather": 14, "reduce_scatter": 12, "all_reduce": 1, "other": 0},
              "simple_fsdp": {"all_gather": 29, "reduce_scatter": 29, "all_reduce": 1, "other": 2}}
    runs = [{"variant": v, "round": 0, "ranks": [{**rank_record(r, [m, m, m], 5.5, memory=memory[v]),
                                                  "collectives": counts[v] if r == 0 else None} for r in range(4)]}
            for v, m in medians.items()]
    report = bench.summarize(s, runs)
    assert report["backends"] == {"step_time": pytest.approx(0.8), "peak_memory": pytest.approx(1.5)}
    assert report["ratios"] == {}  # the hand-written variants did not run
    assert report["variants"]["simple_fsdp"]["collectives_per_step"] == counts["simple_fsdp"]
    text = bench.format_report(report)
    assert "simple_fsdp / lightning_2d (fully_shard) = 0.800x step time, 1.500x peak memory per device" in text
    row = next(line for line in text.splitlines() if line.startswith("simple_fsdp "))
    assert row.endswith("29/29/1 +2")
    assert next(line for line in text.splitlines() if line.startswith("lightning_2d ")).endswith("14/12/1")


def test_compare_lora_runs_lora_beside_full_fine_tuning_and_reports_the_ratios():
    s = settings("--compare-lora", "8", "--dim", "64", "--vocab-size", "256", "--seq-len", "32", "--warmup", "0",
                 "--rounds", "1")
    assert s.variants == ["lightning_2d", "lora"] and s.compared == {"lora": 8}
    assert settings().compared == {} and "lora" not in settings("--compare").variants
    with pytest.raises(bench.BenchmarkConfigError, match=r"--compare-lora takes the adapters' rank, a positive"
                                                         r" integer; got 0"):
        settings("--compare-lora", "0")
    # The variant's module and layout are checked as its strategy checks them, before any process starts.
    # A mixture of experts takes adapters on its routed experts too (#46).
    assert settings("--compare-lora", "8", "--model", "debug-moe", "--tensor-parallel-size", "1").compared == {"lora": 8}
    with pytest.raises(bench.BenchmarkConfigError, match=r"--compare-lora \(the lora variant\): float8=True with LoRA"
                                                         r" adapters \(LlamaLightningModule\(lora=...\)\)"):
        settings("--compare-lora", "8", "--float8", "true")
    medians, memory = {"lightning_2d": 0.1, "lora": 0.09}, {"lightning_2d": 2.0, "lora": 1.5}
    runs = [{"variant": v, "round": 0, "ranks": [rank_record(r, [m, m, m], 5.5, memory=memory[v]) for r in range(4)]}
            for v, m in medians.items()]
    report = bench.summarize(s, runs)
    assert report["lora"] == {"step_time": pytest.approx(0.9), "peak_memory": pytest.approx(0.75)}
    assert report["ratios"] == {} and report["backends"] is None
    text = bench.format_report(report)
    assert "lora (rank 8) / lightning_2d (full fine-tuning) = 0.900x step time, 0.750x peak memory per device" in text
    # The variant trains the adapters: its module gets lora= (what RUNNERS["lora"] builds), lightning_2d's none.
    assert s.module_kwargs("lora") == {**s.module_options, "lora": {"rank": 8}}
    assert s.module_kwargs("lightning_2d") == s.module_options and s.strategy_kwargs("lora") == s.strategy_kwargs()


def test_compare_expert_parallel_runs_both_sizes_side_by_side_and_reports_the_ratios():
    s = settings("--model", "debug-moe", "--compare-expert-parallel", "2", "--data-parallel-size", "4",
                 "--tensor-parallel-size", "1", "--seq-len", "32", "--warmup", "0", "--rounds", "1")
    assert s.variants == ["lightning_2d", "expert_parallel"] and s.compared == {"expert_parallel": 2}
    assert s.strategy_kwargs("expert_parallel")["expert_parallel_size"] == 2
    assert s.strategy_kwargs("lightning_2d")["expert_parallel_size"] == 1
    assert "expert_parallel_size" not in settings().strategy_kwargs()
    with pytest.raises(bench.BenchmarkConfigError, match=r"--compare-expert-parallel 2 needs a model with experts"):
        settings("--compare-expert-parallel", "2")
    with pytest.raises(bench.BenchmarkConfigError, match=r"--compare-expert-parallel \(the expert_parallel variant\):"
                                                         r" expert_parallel_size \(3\) must divide"):
        settings("--model", "debug-moe", "--compare-expert-parallel", "3", "--data-parallel-size", "4",
                 "--tensor-parallel-size", "1")
    medians, memory = {"lightning_2d": 0.1, "expert_parallel": 0.12}, {"lightning_2d": 2.0, "expert_parallel": 1.0}
    runs = [{"variant": v, "round": 0, "ranks": [rank_record(r, [m, m, m], 5.5, memory=memory[v]) for r in range(4)]}
            for v, m in medians.items()]
    report = bench.summarize(s, runs)
    assert report["expert_parallel"] == {"step_time": pytest.approx(1.2), "peak_memory": pytest.approx(0.5)}
    assert report["ratios"] == {}
    text = bench.format_report(report)
    assert ("expert_parallel (expert_parallel_size 2) / lightning_2d (expert_parallel_size 1) = 1.200x step time,"
            " 0.500x peak memory per device") in text
    assert s.module_kwargs("expert_parallel") == s.module_kwargs("lightning_2d")  # the strategy's options differ


# ---- --preference: synthetic packed pairs, the three reference modes side by side ------------------------------
PAIRS = ("--model", "debug", "--n-layers", "1", "--preference", "sigmoid", "--warmup", "0", "--rounds", "1")


def sequences_of(sample: dict) -> list[slice]:
    """The positions of each sequence of a window (``sequence_ids`` runs), in order."""
    ids = sample["sequence_ids"].tolist()
    starts = [t for t in range(len(ids)) if ids[t] >= 0 and (t == 0 or ids[t] != ids[t - 1])]
    return [slice(start, start + ids.count(ids[start])) for start in starts]


@pytest.mark.parametrize("seq_len, pairs", [(32, 1), (256, 2)])
def test_synthetic_pairs_pack_whole_pairs_as_the_preference_data_does(seq_len, pairs):
    s = settings(*PAIRS, "--seq-len", str(seq_len), "--steps", "2")
    data = [bench.SyntheticPairs(s, dp_rank) for dp_rank in (0, 1)]  # (dp, tp) = (2, 2)
    for dp_rank, loader in enumerate(d.train_dataloader() for d in data):
        batches = list(loader)
        assert len(batches) == s.total_steps == 2
        for step, batch in enumerate(batches):
            assert batch["input_ids"].shape == (s.local_batch_size, seq_len) == (4, seq_len)
            assert batch["pairs"].tolist() == [pairs] * 4
            assert batch["step_pairs"].dtype == torch.float32 and float(batch["step_pairs"]) == 4 * pairs
            for j in range(4):
                sample = {key: value[j] for key, value in batch.items() if key != "step_pairs"}
                runs = sequences_of(sample)
                ids, positions = sample["sequence_ids"], sample["position_ids"]
                # Whole pairs: chosen 2p then rejected 2p + 1, each its own document, then padding (-1, positions
                # from 0); the stream's numbering of window i's pair p is 2(i · pairs + p) (+ 1).
                assert [int(ids[r.start]) for r in runs] == list(range(2 * pairs))
                assert (ids[runs[-1].stop:] == -1).all() and int((ids >= 0).sum()) == runs[-1].stop
                assert torch.equal(positions[runs[-1].stop:], torch.arange(seq_len - runs[-1].stop))
                window = step * s.global_batch_size + dp_rank * 4 + j
                for number, run in enumerate(runs):
                    assert torch.equal(positions[run], torch.arange(run.stop - run.start))
                    assert (sample["sequence_numbers"][run] == 2 * window * pairs + number).all()
                assert (sample["sequence_numbers"][runs[-1].stop:] == -1).all()
                for chosen, rejected in zip(runs[0::2], runs[1::2]):
                    trained = [(sample["labels"][run] != -100).nonzero().flatten() for run in (chosen, rejected)]
                    prompt = int(trained[0][0])  # positions before the completion: the prompt's tokens less one
                    assert int(trained[1][0]) == prompt  # one prompt, shared
                    assert torch.equal(sample["input_ids"][chosen][: prompt + 1],
                                       sample["input_ids"][rejected][: prompt + 1])
                    for run, targets in zip((chosen, rejected), trained):
                        # the completion is the sequence's tail: labels are the next tokens from the prompt's end on
                        assert torch.equal(targets, torch.arange(prompt, run.stop - run.start))
                        assert torch.equal(sample["labels"][run][prompt:-1], sample["input_ids"][run][prompt + 1:])
                assert int(sample["input_ids"].max()) < s.model_args.vocab_size
    # The same windows whatever the layout: one replica holds both replicas' samples in order.
    whole = bench.SyntheticPairs(dataclasses.replace(s, dp=1, tp=4), 0).train_dataloader()
    for step, batch in enumerate(whole):
        halves = [list(d.train_dataloader())[step]["input_ids"] for d in data]
        assert torch.equal(batch["input_ids"], torch.cat(halves))
        assert float(batch["step_pairs"]) == 8 * pairs


def test_synthetic_pairs_give_precompute_reference_its_values_without_a_pass():
    s = settings(*PAIRS, "--seq-len", "64", "--steps", "1", "--compare-precomputed-reference")
    data = bench.SyntheticPairs(s, dp_rank=1)
    assert data.sequence_count == s.total_steps * s.global_batch_size * 2  # one pair a window of 64
    assert (data.seq_len, data.batch_size, data.document_mask, data.preference_units) == (64, 4, True, "pairs")
    values = data.load_reference_log_probs("any reference")  # never None: no reference pass runs
    assert values.shape == (data.sequence_count,) and values.dtype == np.float32
    assert "reference_logps" not in next(iter(data.train_dataloader()))
    data.set_reference_log_probs(values)
    (covered,) = data.reference_loaders()
    for batch in (next(iter(data.train_dataloader())), next(iter(covered))):
        for j in range(4):
            sample = {key: value[j] for key, value in batch.items() if value.ndim}
            for run in sequences_of(sample):
                number = int(sample["sequence_numbers"][run.start])
                completion = int((sample["labels"][run] != -100).sum())
                reference = sample["reference_logps"][run]
                # a uniform model's log-probability of the completion, at the sequence's first position only
                assert float(reference[0]) == pytest.approx(-completion * math.log(256), rel=1e-6)
                assert float(reference[0]) == values[number] and not reference[1:].any()
    with pytest.raises(ValueError, match=r"reference log-probabilities of shape \(3,\) for 16 sequences"):
        data.set_reference_log_probs(np.zeros(3, dtype=np.float32))
    data.save_reference_log_probs("k", values + 1, {})  # a pass's values, kept for its key
    assert np.array_equal(data.load_reference_log_probs("k"), values + 1)


def test_precomputed_reference_fits_one_device_on_synthetic_pairs_without_a_pass(monkeypatch):
    """The variant's module and data together, as a rank runs them: the values come from the data (the pass is
    never called), found before the frozen copy is built (it never is), and the steps read the values from batches."""
    from lightning_2d.integration import preference_module

    def no_pass(*args, **kwargs):
        raise AssertionError("a reference pass ran")

    monkeypatch.setattr(preference_module, "reference_pass", no_pass)
    s = settings(*PAIRS, "--devices", "1", "--tensor-parallel-size", "1", "--seq-len", "32", "--global-batch-size",
                 "2", "--steps", "2", "--compare-precomputed-reference")
    held: list[int] = []
    seen: list[bool] = []

    class Batches(L.Callback):
        def on_fit_start(self, trainer, pl_module) -> None:  # before the module's own: a copy built would be held
            held.append(len(pl_module.frozen_models()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append("reference_logps" in batch and pl_module.frozen_models() == [])

    module = LlamaLightningModule(model=s.model_args, init_seed=s.seed, max_steps=s.total_steps,
                                  **s.module_kwargs("precomputed_reference"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=s.total_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Batches()])
    trainer.fit(module, datamodule=bench.SyntheticPairs(s, dp_rank=0))
    assert held == [0] and seen == [True, True]
    assert np.isfinite(float(trainer.callback_metrics["train_loss"]))


def test_preference_trains_every_variant_against_its_reference():
    s = settings(*PAIRS, "--compare-lora", "8", "--compare-precomputed-reference")
    assert s.variants == ["lightning_2d", "lora", "precomputed_reference"]
    assert s.preference == {"loss_type": "sigmoid"} and settings().preference is None
    loss = {"fused_loss": True, "loss_chunk_size": None}
    assert s.module_kwargs("lightning_2d") == {**loss, "preference": {"loss_type": "sigmoid"}}
    assert s.module_kwargs("lora") == {**loss, "preference": {"loss_type": "sigmoid"}, "lora": {"rank": 8}}
    assert s.module_kwargs("precomputed_reference") == {
        **loss, "preference": {"loss_type": "sigmoid", "precompute_reference": True}}
    assert [s.reference_label(v) for v in s.variants] == [
        "reference copy", "reference adapters_off", "reference copy, precomputed"]
    assert settings("--compare-lora", "8").reference_label("lora") is None
    assert settings(*PAIRS, "--compare-lora", "8").strategy_kwargs("lora") == s.strategy_kwargs()
    simpo = settings("--model", "debug", "--preference", "simpo", "--compare-lora", "8")
    assert [simpo.reference_label(v) for v in simpo.variants] == ["no reference", "no reference"]
    assert bench.BenchmarkSettings.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compare-precomputed-reference"],
         r"--compare-precomputed-reference compares a preference loss's reference precomputed with its frozen copy,"
         r" but nothing trains a preference loss; add --preference LOSS \(sigmoid, ipo, hinge, robust\)"),
        (["--preference", "orpo", "--compare-precomputed-reference"],
         r"--compare-precomputed-reference with --preference orpo, which uses no reference model: nothing to"
         r" precompute; use a loss against a reference \(sigmoid, ipo, hinge, robust\) or drop"),
        (["--preference", "kto"],
         r"--preference kto scores unpaired examples, but the benchmark's synthetic data are pairs \(SyntheticPairs\);"
         r" use a pairwise loss \(sigmoid, ipo, hinge, robust, simpo, orpo\)"),
        (["--preference", "sigmoid", "--compare"],
         r"--preference sigmoid has no counterpart in the hand-written Lightning and plain torch variants of"
         r" --compare \(they train next tokens\); drop --compare"),
        (["--preference", "sigmoid", "--seq-len", "1", "--tensor-parallel-size", "1"],
         r"--preference packs whole pairs .* needs at least 2 positions; got 1"),
    ],
)
def test_impossible_preference_settings_are_refused_before_any_process(argv, message):
    with pytest.raises(bench.BenchmarkConfigError, match=message):
        settings(*argv)


def test_a_teacher_distils_lightning_2d_and_the_compared_variant_trains_without_it():
    """``--teacher`` and ``--distillation`` reach the module as ``teacher=`` and ``distillation=``; the
    ``no_teacher`` row drops both (next-token training at the same layout), the rest of its options unchanged."""
    s = settings("--model", "debug", "--teacher", "debug", "--distillation", "jsd", "--compare-no-teacher")
    assert s.variants == ["lightning_2d", "no_teacher"] and s.compared == {"no_teacher": True}
    loss = {"fused_loss": True, "loss_chunk_size": None}
    assert s.module_kwargs("lightning_2d") == {**loss, "teacher": "debug", "distillation": {"loss": "jsd"}}
    assert s.module_kwargs("no_teacher") == {**loss, "teacher": None, "distillation": None}
    assert s.strategy_kwargs("no_teacher") == s.strategy_kwargs()
    assert settings("--model", "debug", "--teacher", "debug").module_kwargs()["distillation"] == {"loss": "forward_kl"}
    assert bench.BenchmarkSettings.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compare-no-teacher"],
         r"--compare-no-teacher times the step without distillation's teacher, but nothing has one; add"
         r" --teacher MODEL"),
        (["--distillation", "jsd"], r"--distillation jsd distils from a teacher: give it with --teacher MODEL"),
        (["--teacher", "debug", "--compare"],
         r"--teacher debug has no counterpart in the hand-written Lightning and plain torch variants of --compare"),
        (["--teacher", "debug", "--preference", "sigmoid"], r"distillation= with preference=.*one step trains one"),
        (["--teacher", "debug", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "1"],
         r"distillation with pipeline_parallel_size=2 is not supported yet"),
        (["--teacher", "llama3-8b"], r"the teacher \(preset 'llama3-8b'\) has a vocabulary of 128256 tokens"),
    ],
)
def test_impossible_distillation_settings_are_refused_before_any_process(argv, message):
    with pytest.raises(bench.BenchmarkConfigError, match=message):
        settings("--model", "debug", *argv)


def test_a_frozen_copy_under_a_pipeline_is_checked_as_the_strategy_checks_it():
    """The whole model against its frozen copy at pipeline 2 (the copy split beside the stages): accepted, as the
    strategy's checks accept it (once refused by them, and so by the benchmark)."""
    s = settings("--model", "debug", "--preference", "ipo", "--pipeline-parallel-size", "2",
                 "--tensor-parallel-size", "1")
    assert s.preference == {"loss_type": "ipo"} and s.reference_label("lightning_2d") == "reference copy"


def test_preference_report_names_each_variants_reference():
    s = settings(*PAIRS, "--seq-len", "256", "--compare-lora", "8", "--compare-precomputed-reference")
    medians = {"lightning_2d": 0.2, "lora": 0.16, "precomputed_reference": 0.15}
    memory = {"lightning_2d": 2.0, "lora": 1.2, "precomputed_reference": 1.5}
    runs = [{"variant": v, "round": 0, "ranks": [rank_record(r, [m, m, m], 0.69, memory=memory[v]) for r in range(4)]}
            for v, m in medians.items()]
    report = bench.summarize(s, runs)
    assert report["precomputed_reference"] == {"step_time": pytest.approx(0.75), "peak_memory": pytest.approx(0.75)}
    text = bench.format_report(report)
    assert ("preference (every variant): sigmoid on synthetic packed pairs (2 per window of 256), reference copy for"
            " lightning_2d") in text
    assert ("lora (rank 8, reference adapters_off) / lightning_2d (full fine-tuning, reference copy) = 0.800x step"
            " time, 0.600x peak memory per device") in text
    assert ("precomputed_reference (reference copy, precomputed) / lightning_2d (reference copy) = 0.750x step time,"
            " 0.750x peak memory per device") in text
    assert "preference" not in bench.format_report(bench.summarize(settings("--compare-lora", "8"), runs[:2]))


def test_a_feature_compared_with_lightning_2d_is_one_row_of_the_table(monkeypatch):
    """``--compare-backends``, ``--compare-lora`` and ``--compare-expert-parallel`` are rows of ``COMPARISONS``: a new
    row gets its flag, its variant's arguments and checks (as lightning_2d's, named after the flag) and its ratio line,
    nothing else changed; every variant has its runner."""
    assert set(bench.RUNNERS) == set(bench.VARIANTS) == {"lightning_2d", "lightning", "plain",
                                                         *(row.name for row in bench.COMPARISONS)}
    row = bench.Comparison(
        name="selective_ac", flag="--compare-selective-ac", metavar="N", help="checkpoint every N-th block",
        report_key="selective_ac", baseline={"activation_checkpointing": "none"}, label="every {value}",
        strategy=lambda n: {"activation_checkpointing": "selective", "selective_ac_option": n},
        baseline_label="no checkpointing",
    )
    table = (*bench.COMPARISONS, row)
    monkeypatch.setattr(bench.comparisons, "COMPARISONS", table)
    monkeypatch.setattr(bench.comparisons, "BY_NAME", {r.name: r for r in table})
    s = settings("--compare-selective-ac", "2", "--compare-lora", "4", "--dim", "64", "--vocab-size", "256",
                 "--seq-len", "32", "--warmup", "0", "--rounds", "1")
    assert s.variants == ["lightning_2d", "lora", "selective_ac"] and s.compared == {"lora": 4, "selective_ac": 2}
    assert s.strategy_kwargs("selective_ac")["selective_ac_option"] == 2
    assert {s.strategy_kwargs(v)["activation_checkpointing"] for v in ("lightning_2d", "lora")} == {"none"}
    assert s.module_kwargs("selective_ac") == s.module_options
    with pytest.raises(bench.BenchmarkConfigError, match=r"--compare-selective-ac \(the selective_ac variant\):"
                                                         r" selective_ac_option=0 is invalid"):
        settings("--compare-selective-ac", "0")
    medians = {"lightning_2d": 0.1, "lora": 0.09, "selective_ac": 0.13}
    runs = [{"variant": v, "round": 0, "ranks": [rank_record(r, [m, m, m], 5.5) for r in range(4)]}
            for v, m in medians.items()]
    report = bench.summarize(s, runs)
    assert report["selective_ac"] == {"step_time": pytest.approx(1.3), "peak_memory": pytest.approx(1.0)}
    text = bench.format_report(report)
    assert "selective_ac (every 2) / lightning_2d (no checkpointing) = 1.300x step time, 1.000x peak memory" in text
    assert "lora (rank 4) / lightning_2d (full fine-tuning) = 0.900x step time" in text


class _Event:
    def __init__(self, name, parent=None):
        self.name, self.cpu_parent = name, parent


def test_collectives_are_counted_by_kind_once_each():
    from lightning_2d.tools.benchmark.collectives import collective_kind, count_collectives

    assert collective_kind("c10d::_allgather_base_") == "all_gather"
    assert collective_kind("_c10d_functional::all_gather_into_tensor") == "all_gather"
    assert collective_kind("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert collective_kind("_c10d_functional::reduce_scatter_tensor") == "reduce_scatter"
    assert collective_kind("c10d::allreduce_") == "all_reduce"
    assert collective_kind("c10d::broadcast_") == "other"
    assert collective_kind("_c10d_functional::wait_tensor") is None
    assert collective_kind("_c10d_functional::_wrap_tensor_autograd") is None  # bookkeeping: 184 per step at 2x2
    assert collective_kind("aten::mm") is None
    outer = _Event("_c10d_functional::all_gather_into_tensor")
    events = [outer, _Event("c10d::_allgather_base_", _Event("record_param_comms", outer)),  # inside: not again
              _Event("c10d::_reduce_scatter_base_"), _Event("c10d::allreduce_"), _Event("aten::add")]
    assert count_collectives(events) == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1, "other": 0}


TORCH = "/venv/lib/python3.11/site-packages/torch/"
OURS = "/repo/lightning_2d/"


@pytest.mark.parametrize(
    ("frames", "kind", "unit", "issuer"),
    [
        ([(OURS + "integration/module.py", "training_step"), (OURS + "models/llama/model.py", "forward"),
          (TORCH + "distributed/fsdp/_fully_shard/_fsdp_state.py", "_pre_forward"),
          (TORCH + "distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather")],
         "all_gather", "layers.0", "FSDP2 all-gather (unit layers.0)"),
        ([(TORCH + "autograd/graph.py", "_engine_run_backward"),
          (TORCH + "distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce")],
         "reduce_scatter", "", "FSDP2 reduce-scatter (unit root)"),
        ([(TORCH + "distributed/fsdp/_fully_shard/_fsdp_param.py", "_get_grad_inner_tensor"),
          (TORCH + "distributed/tensor/_api.py", "redistribute")],
         "all_reduce", None, "DTensor Partial→Replicate grad (FSDP2 _get_grad_inner_tensor)"),
        ([(OURS + "integration/module.py", "training_step"), (OURS + "parallel/loss.py", "normalize_by_global_tokens"),
          (OURS + "parallel/loss.py", "_normalized")], "all_reduce", None,
         "global token count (normalize_by_global_tokens)"),
        ([(OURS + "parallel/loss.py", "fused_cross_entropy"), (OURS + "parallel/loss.py", "<lambda>")],
         "all_reduce", None, "vocab-parallel loss statistics (parallel/loss.py)"),
        ([(OURS + "integration/step_guard.py", "check"), (OURS + "parallel/guard.py", "all_finite")],
         "all_reduce", None, "non-finite guard (parallel/guard.py)"),
        ([(OURS + "integration/strategy_base.py", "finish_gradients"), (OURS + "parallel/grad_sync.py", "finish")],
         "all_reduce", None, "deferred tensor-parallel gradient sums (parallel/grad_sync.py)"),
        ([(OURS + "integration/step_guard.py", "check_first_loss")], "all_reduce", None,
         "first-step loss check (integration/step_guard.py)"),
        ([(OURS + "parallel/grad_norm.py", "total_grad_norm"), (TORCH + "distributed/tensor/_api.py", "full_tensor")],
         "all_reduce", None, "gradient clipping (parallel/grad_norm.py)"),
        # The loss calls the tensor-parallel head: its redistribute is the layer's, not the loss's.
        ([(OURS + "parallel/loss.py", "fused_cross_entropy"), (OURS + "models/llama/model.py", "forward"),
          (TORCH + "distributed/tensor/parallel/style.py", "_prepare_input_fn"),
          (TORCH + "distributed/tensor/_redistribute.py", "redistribute_local_tensor")],
         "all_gather", None, "TP/SP layer (DTensor redistribute)"),
        ([(TORCH + "autograd/function.py", "apply"), (TORCH + "distributed/tensor/_redistribute.py", "backward")],
         "reduce_scatter", None, "DTensor redistribute in backward"),  # the group column says which
        ([(OURS + "parallel/simple_fsdp.py", "forward"), (TORCH + "distributed/tensor/_api.py", "redistribute")],
         "all_gather", None, "SimpleFSDP all-gather"),
        ([("/x/site-packages/lightning/pytorch/strategies/model_parallel.py", "reduce_boolean_decision")],
         "all_reduce", None, "lightning/pytorch/strategies/model_parallel.py:reduce_boolean_decision"),
        ([(OURS + "parallel/dims.py", "check_world"), (TORCH + "distributed/distributed_c10d.py", "all_reduce")],
         "all_reduce", None, "torch/distributed/distributed_c10d.py:all_reduce"),
        ([("/elsewhere/script.py", "main")], "other", None, "unknown (script.py:main)"),
    ],
)
def test_the_issuer_of_a_collective_is_classified_from_its_stack(frames, kind, unit, issuer):
    from lightning_2d.tools.benchmark.collectives import classify_issuer

    assert classify_issuer(frames, kind, unit) == issuer


def test_one_step_is_counted_and_broken_down_by_issuer_the_same_way_for_every_variant():
    """``counted_collectives`` (the callback's and the plain loop's) on a fake world of 4 ranks in this process: the
    profile counts each kind once; the wrapped entry points name each call's issuer, group and size, and are
    restored afterwards."""
    import types

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_2d._compat import functional_collectives
    from lightning_2d.tools.benchmark.collectives import UNSEEN, CollectiveCountCallback, counted_collectives, \
        issuer_table
    from lightning_2d.tools.planner import fake_world

    funcol = functional_collectives()
    originals = (dist.all_reduce, funcol.all_gather_single)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        sharded = DTensor.from_local(torch.ones(3, 5), mesh["tensor_parallel"], [Shard(0)], run_check=False)
        with counted_collectives(by_issuer=True) as step:
            dist.all_reduce(torch.ones(7), group=mesh.get_group("data_parallel"))
            sharded.full_tensor().sum()  # DTensor's all-gather over tensor_parallel (.sum(): waited on)
            assert step.counts is None  # until the step ends
        callback = CollectiveCountCallback(step=1)
        for global_step in (0, 1, 2):
            trainer = types.SimpleNamespace(global_step=global_step)
            callback.on_train_batch_start(trainer, None, None, 0)
            funcol.all_reduce(torch.ones(2), "sum", (mesh, 0)).sum()
            callback.on_train_batch_end(trainer, None, None, None, 0)
    assert (dist.all_reduce, funcol.all_gather_single) == originals
    assert step.counts == {"all_gather": 1, "reduce_scatter": 0, "all_reduce": 1, "other": 0}
    assert {(r["issuer"].split(" (")[0], r["kind"], r["group"], r["count"], r["elements"], r["bytes"])
            for r in step.issuers} == {
        ("unknown", "all_reduce", "data_parallel×2", 1, 7, 28),
        ("DTensor redistribute", "all_gather", "tensor_parallel×2", 1, 3 * 5, 3 * 5 * 4)}  # its input: the shard
    # The callback counted step 1 only, and without by_issuer recorded no issuers.
    assert callback.counts == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1, "other": 0}
    assert callback.issuers is None
    # What the profile saw that no entry point did (an autograd backward's collective) is one row of its own.
    table = issuer_table(step.calls, {**step.counts, "reduce_scatter": 2})
    assert table[-1] == {"issuer": UNSEEN, "kind": "reduce_scatter", "group": "?", "count": 2, "elements": None,
                         "bytes": None}


def test_collectives_flag_reports_each_variants_issuers():
    s = settings("--compare", "--collectives", "--dim", "64", "--vocab-size", "256", "--seq-len", "32",
                 "--warmup", "1", "--rounds", "1")
    assert s.collectives_by_issuer and not settings("--compare").collectives_by_issuer
    counts = {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 1, "other": 1}
    issuers = [{"issuer": "FSDP2 all-gather (unit layers.0)", "kind": "all_gather", "group": "data_parallel×2",
                "count": 3, "elements": 3000, "bytes": 12000},
               {"issuer": "no Python call seen (autograd backward, compiled graph)", "kind": "all_reduce",
                "group": "?", "count": 1, "elements": None, "bytes": None}]
    runs = [{"variant": v, "round": 0, "ranks": [{**rank_record(r, [0.1, 0.1], 5.5), "collectives": counts,
                                                  "collective_issuers": issuers} for r in range(4)]}
            for v in ("lightning_2d", "lightning", "plain")]
    report = bench.summarize(s, runs)
    assert report["variants"]["plain"]["collectives_by_issuer"] == issuers  # in --json too
    lines = bench.format_report(report).splitlines()
    for variant in ("lightning_2d", "lightning", "plain"):
        assert next(line for line in lines if line.startswith(f"{variant} ")).endswith("3/2/1 +1")
        start = lines.index(f"collectives of {variant} by issuer (4 in the counted step of rank 0):")
        assert lines[start + 1].split() == ["issuer", "kind", "group", "count", "input", "elements", "MB"]
        assert lines[start + 2].split()[-4:] == ["data_parallel×2", "3", "3,000", "0.012"]
        assert lines[start + 3].split()[-5:] == ["all_reduce", "?", "1", "-", "-"]


# ---- the process launcher -------------------------------------------------------------------------
RANK_SCRIPT = """
import json, os, sys, time
rank = int(os.environ["RANK"])
keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA")
json.dump({k: os.environ.get(k) for k in keys}, open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
mode = sys.argv[2]
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(60)
"""


@pytest.mark.distributed  # starts real processes
def test_launcher_sets_the_cluster_environment(tmp_path):
    job = launch_processes([sys.executable, "-c", RANK_SCRIPT, str(tmp_path), "ok"], tmp_path, nprocs=4, num_nodes=2,
                           timeout=60, env={"EXTRA": "x"})
    assert job.ok, job.describe()
    envs = [job.rank_output(r) for r in range(4)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "0", "4"), ("1", "1", "0", "4"), ("2", "0", "1", "4"), ("3", "1", "1", "4")]
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and all(e["EXTRA"] == "x" for e in envs)


@pytest.mark.distributed  # starts real processes
def test_launcher_kills_the_job_when_a_rank_fails(tmp_path):
    start = time.monotonic()
    job = launch_processes([sys.executable, "-c", RANK_SCRIPT, str(tmp_path), "fail"], tmp_path, nprocs=3, timeout=60)
    assert time.monotonic() - start < 30
    assert not job.ok and job.failed_rank() == 1 and job.returncodes[1] == 3
    assert job.returncodes[0] == job.returncodes[2] == -9  # killed, not left waiting


@pytest.mark.distributed  # starts real processes
def test_launcher_kills_the_job_at_its_timeout(tmp_path):
    job = launch_processes([sys.executable, "-c", RANK_SCRIPT, str(tmp_path), "hang"], tmp_path, nprocs=2, timeout=2)
    assert job.timed_out and not job.ok and job.failed_rank() is None
    assert "timed out after 2s" in job.logs[0]


def test_launcher_refuses_uneven_nodes(tmp_path):
    with pytest.raises(ValueError, match=r"nprocs \(3\) must be a positive multiple of num_nodes \(2\)"):
        launch_processes([sys.executable, "-c", "pass"], tmp_path, nprocs=3, num_nodes=2)


def test_a_failed_rank_stops_the_benchmark_with_its_log(monkeypatch, tmp_path):
    import lightning_2d.tools.launch

    def failed_job(argv, out_dir, nprocs, num_nodes, timeout, env):
        assert argv[1:5] == ["-m", "lightning_2d.tools.benchmark", "--worker", "plain"] and nprocs == 4
        logs = ["", "Traceback ...\nRuntimeError: boom", "", ""]
        return lightning_2d.tools.launch.JobResult([-9, 1, -9, -9], logs, out_dir)

    monkeypatch.setattr(lightning_2d.tools.launch, "launch_processes", failed_job)
    with pytest.raises(bench.BenchmarkJobError, match=r"(?s)variant 'plain': rank 1 failed.*RuntimeError: boom"):
        bench.run_job("plain", settings("--compare"), tmp_path / "settings.json", tmp_path)
