"""The lightning-2d CLI in one process: subcommands, the strategy by name, early errors."""

from __future__ import annotations

import re
import shutil
import sys

import pytest

from lightning_2d import ModelParallel2DStrategy
from lightning_2d.data import DataError, stdlib_sources
from lightning_2d.integration.strategy_options import OPTIONS
from lightning_2d.tools.cli import cli_main


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-2d"])
    folder = tmp_path / "corpus"
    folder.mkdir()
    for path in stdlib_sources()[:8]:
        shutil.copy(path, folder / path.name)
    return folder


def common(tmp_path, corpus) -> list[str]:
    return [
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        f"--data.paths={corpus}", "--data.seq_len=32", "--data.batch_size=2", "--data.val_fraction=0.1",
        f"--data.cache_dir={tmp_path / 'cache'}", f"--trainer.default_root_dir={tmp_path}",
    ]


def test_fit_validate_test_and_predict(tmp_path, corpus):
    args = common(tmp_path, corpus)
    fit = cli_main(["fit", *args, "--trainer.max_steps=3", "--trainer.limit_val_batches=1"])
    assert fit.trainer.global_step == 3 and "train_loss" in fit.trainer.callback_metrics
    validate = cli_main(["validate", *args, "--trainer.limit_val_batches=2"])
    assert validate.trainer.callback_metrics["val_perplexity"] > 1
    test = cli_main(["test", *args, "--trainer.limit_test_batches=2"])
    assert test.trainer.callback_metrics["test_loss"] > 0
    predict = cli_main(["predict", *args, "--trainer.limit_predict_batches=2"])
    predictions = predict.trainer.predict_loop.predictions
    assert len(predictions) == 2 and predictions[0]["next_token"].shape == (2, 32)
    assert predictions[0]["nll"].shape == (2,)


def test_strategy_by_name_and_by_class_path(tmp_path, corpus):
    # run=False: no subcommand, the classes are only instantiated
    by_name = cli_main(["--trainer.strategy=model_parallel_2d", "--trainer.accelerator=cpu",
                        "--trainer.devices=2", "--trainer.logger=false"], run=False)
    assert isinstance(by_name.trainer.strategy, ModelParallel2DStrategy)
    by_path = cli_main([
        "--trainer.accelerator=cpu", "--trainer.devices=4", "--trainer.logger=false",
        "--trainer.strategy=lightning_2d.ModelParallel2DStrategy",
        "--trainer.strategy.tensor_parallel_size=2", "--trainer.strategy.activation_checkpointing=full",
    ], run=False)
    strategy = by_path.trainer.strategy
    assert strategy.parallel_config.tensor_parallel_size == 2
    assert strategy.parallel_config.activation_checkpointing == "full"


def test_vocabulary_mismatch_fails_before_training(tmp_path, corpus):
    with pytest.raises(DataError, match=r"vocab_size \(128\) is smaller than the tokenizer's \(256\)"):
        cli_main(["fit", *common(tmp_path, corpus), "--model.model_overrides={vocab_size: 128}"])


def test_rope_scaling_from_yaml_from_an_override_and_from_a_preset(tmp_path, monkeypatch):
    from lightning_2d import RopeScaling

    monkeypatch.setattr(sys, "argv", ["lightning-2d"])
    base = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
    config = tmp_path / "scaled.yaml"
    config.write_text(
        "model:\n  model:\n    dim: 64\n    n_layers: 1\n    n_heads: 4\n    vocab_size: 256\n"
        "    rope_scaling:\n      rope_type: llama3\n      factor: 8.0\n      original_max_position_embeddings: 32\n"
    )
    from_yaml = cli_main([f"--config={config}", *base], run=False).model
    assert from_yaml.model_args.rope_scaling == RopeScaling(factor=8.0, original_max_position_embeddings=32)
    overridden = cli_main([*base, "--model.model=debug",
                           "--model.model_overrides={rope_scaling: {rope_type: llama3, factor: 4.0}}"], run=False).model
    assert overridden.model_args.rope_scaling == RopeScaling(factor=4.0)
    preset = cli_main([*base, "--model.model=llama3.1-8b"], run=False).model
    assert preset.model_args.rope_scaling == RopeScaling() and preset.model_args.max_seq_len == 131072


def test_bad_strategy_option_fails_at_parse_time(tmp_path, corpus, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main([*common(tmp_path, corpus), "--trainer.strategy=lightning_2d.ModelParallel2DStrategy",
                  "--trainer.strategy.activation_checkpointing=sometimes"], run=False)
    assert exit_.value.code == 2
    # The parser checks the option's Literal type: it names the key, the valid values and the bad one.
    err = capsys.readouterr().err
    assert 'Parser key "activation_checkpointing"' in err
    assert "Expected a typing.Literal['none', 'full', 'selective']. Got value: sometimes" in err


def test_a_big_corpus_without_cache_fails_before_training(tmp_path, corpus):
    import re

    with pytest.raises(DataError, match=re.compile(r"larger than max_unprepared_mb \(0\.001 MB\).*lightning-2d prepare-data --data\.paths=", re.S)):
        cli_main(["fit", *common(tmp_path, corpus), "--data.max_unprepared_mb=0.001"])
    assert not (tmp_path / "cache").exists()


def test_strategy_help_shows_every_option_with_its_docstring_type_and_default(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lightning-2d"])
    with pytest.raises(SystemExit) as exit_:
        cli_main(["fit", "--trainer.strategy.help", "lightning_2d.ModelParallel2DStrategy"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    body = out[out.index("Help for --trainer.strategy.help"):]
    # argparse wraps (and may break words): compare without whitespace.
    entries = {
        m.group(1): "".join(m.group(2).split())
        for m in re.finditer(r"\n  --trainer\.strategy\.(\w+) [A-Z_{]\S*(.*?)(?=\n  --|\Z)", body, re.S)
    }
    for opt in OPTIONS:
        assert opt.name in entries, f"--trainer.strategy.{opt.name} is missing from the strategy's help"
        help_text = entries[opt.name]
        assert "".join(opt.doc.split()) in help_text, f"{opt.name}: its docstring is not its help"
        assert "(type:" in help_text and "default:" in help_text, f"{opt.name}: no type or default in its help"


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_the_library_torch_lightning_and_python(flag, monkeypatch, capsys):
    import platform

    import lightning
    import torch

    from lightning_2d import __version__
    from lightning_2d.tools.cli import main

    monkeypatch.setattr(sys, "argv", ["lightning-2d", flag])
    main()
    assert capsys.readouterr().out.strip() == (
        f"lightning-2d {__version__} (torch {torch.__version__}, lightning {lightning.__version__},"
        f" Python {platform.python_version()})")


# ---- lightning-2d --help, and errors as one message -----------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "no arguments"])
def test_help_lists_every_subcommand_one_line_each(argv, capsys):
    from lightning.pytorch.cli import LightningCLI

    from lightning_2d.tools.cli import COMMANDS, TOOLS, main

    assert set(COMMANDS) == set(LightningCLI.subcommands()) | set(TOOLS)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == (0 if argv else 2)  # as argparse: no command is a usage error
    text = capsys.readouterr().out if argv else capsys.readouterr().err
    lines = text.splitlines()
    for name in ["fit", "validate", "test", "predict", "plan", "benchmark", "prepare-data", "export"]:
        assert sum(line.startswith(f"  {name} ") for line in lines) == 1, name
    assert any(line.lstrip().startswith("-V, --version") for line in lines)
    assert "`lightning-2d COMMAND --help`" in text and "LIGHTNING_2D_TRACEBACK=1" in text


@pytest.fixture
def debug_recipe_run(tmp_path, monkeypatch):
    """``lightning-2d fit --config recipes/debug_cpu.yaml ARGS`` in this process; starting it fails the test."""
    import functools
    from pathlib import Path

    import lightning.pytorch as pl

    from lightning_2d.tools.cli import main

    @functools.wraps(pl.Trainer.fit)  # LightningCLI reads fit's parameters (ckpt_path) from its signature
    def launched(*args, **kwargs):
        raise AssertionError("Trainer.fit was called: the job would have started its processes")

    monkeypatch.setattr(pl.Trainer, "fit", launched)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_2D_TRACEBACK", raising=False)
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "debug_cpu.yaml"

    def run(*args: str) -> None:
        monkeypatch.setattr(sys, "argv", ["lightning-2d"])  # the arguments are given to main
        main(["fit", f"--config={recipe}", *args])

    return run


def test_a_bad_ckpt_path_is_one_message_before_any_process_starts(debug_recipe_run, tmp_path, capsys, monkeypatch):
    from lightning_2d.checkpoint import CheckpointError

    mistyped = tmp_path / "ckpts" / "epoch=0-step=9.ckpt"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(b"PK\x03\x04 cut short")  # the start of a torch.save archive, nothing after
    for path, reason in ((mistyped, "does not exist"), (truncated, "is damaged (not a readable torch archive")):
        with pytest.raises(SystemExit) as exit_:
            debug_recipe_run(f"--ckpt_path={path}")
        assert exit_.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith(f"lightning-2d fit: error: Checkpoint {path} {reason}"), err
        assert "Traceback" not in err and err.count("\n") == 1
    monkeypatch.setenv("LIGHTNING_2D_TRACEBACK", "1")  # the traceback, for a bug report
    with pytest.raises(CheckpointError, match="does not exist"):
        debug_recipe_run(f"--ckpt_path={mistyped}")


def test_a_checkpoint_with_changed_bytes_is_one_message_before_any_process_starts(debug_recipe_run, tmp_path, capsys):
    """The issue's case: a shard with 100 flipped exponent bits in one weight (its size unchanged) used to resume
    and train; now `fit --ckpt_path` refuses it in one line naming the file, the tensor and the step, exit 1."""
    from tests.unit.test_checkpoint_digests import WEIGHT, flip_exponent_bits, save

    checkpoint = save(tmp_path / "ckpts", "epoch=0-step=8.ckpt")
    file = flip_exponent_bits(checkpoint)
    with pytest.raises(SystemExit) as exit_:
        debug_recipe_run(f"--ckpt_path={checkpoint}")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"lightning-2d fit: error: Checkpoint {checkpoint} is damaged: its bytes changed after it was saved at step 8"
        f" ({file.name}: {WEIGHT} reads as"
    ), err
    assert "Traceback" not in err and err.count("\n") == 1


def test_ckpt_paths_checked_before_launch(tmp_path):
    from lightning_2d.checkpoint import CheckpointError, check_ckpt_path

    for name in (None, "last", "best", "hpc", "registry:org/model:v1", "s3://bucket/run/last.ckpt"):
        assert check_ckpt_path(name) is None  # Lightning resolves these itself
    interrupted = tmp_path / "epoch=0-step=6.ckpt"
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"shard")  # a save that never wrote its metadata
    with pytest.raises(CheckpointError, match=r"step=6\.ckpt is incomplete \(an interrupted save\)"):
        check_ckpt_path(str(interrupted))


def test_the_launchers_check_of_ckpt_path_is_handed_to_the_strategy(tmp_path, corpus, monkeypatch):
    """``fit --ckpt_path`` reads a small checkpoint whole before any process starts; rank 0 runs in this process, and
    its strategy is handed what that check read (its loads then skip it, ``test_checkpoint_digests``)."""
    from lightning_2d.tools.cli import Lightning2DCLI
    from tests.unit.test_checkpoint_digests import save

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.setattr(Lightning2DCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not run
    checkpoint = save(tmp_path / "ckpts", "epoch=0-step=8.ckpt")
    cli = cli_main(["fit", *common(tmp_path, corpus), "--trainer.strategy=model_parallel_2d",
                    f"--ckpt_path={checkpoint}"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ModelParallel2DStrategy)
    assert strategy.checkpoint_integrity is cli.checkpoint_integrity
    assert strategy.checkpoint_integrity.checked_whole(checkpoint)


def test_a_tool_s_error_is_one_message_and_the_variable_shows_its_traceback(tmp_path, monkeypatch, capsys):
    from lightning_2d.tools.cli import main

    (tmp_path / "a_null.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    argv = ["prepare-data", f"--data.paths={tmp_path / 'a_null.jsonl'}", f"--data.cache_dir={tmp_path / 'cache'}",
            "--num-workers=1"]
    monkeypatch.setattr(sys, "argv", ["lightning-2d"])  # the arguments are given to main
    monkeypatch.delenv("LIGHTNING_2D_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-2d prepare-data: error: 1 problem(s) in the corpus (nothing was cached):")
    assert "a_null.jsonl:2: field 'text' holds null (null), not a string" in err and "Traceback" not in err
    monkeypatch.setenv("LIGHTNING_2D_TRACEBACK", "1")
    with pytest.raises(DataError, match=r"a_null\.jsonl:2: field 'text' holds null"):
        main(argv)
