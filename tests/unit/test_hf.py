"""Hugging Face interop on one process: export → transformers' logits equal ours; import back; the export
streams one output file at a time, reads checkpoints weights-only and never guesses the model."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
import transformers  # test-only dependency (the test extra)

from lightning_2d import LlamaLightningModule, ModelArgs, RopeScaling, Transformer
from lightning_2d.hf import ExportError, export_hf, hf_to_meta, meta_to_hf, model_args_from_hf

ARGS = ModelArgs.from_name("debug", n_layers=2, rope_theta=500000.0)


def hf_reference_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' convert_llama_weights_to_hf.permute, written out independently."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def test_rotary_permutation_round_trips():
    w = torch.randn(8 * 16, 32)
    assert torch.equal(meta_to_hf(w, 8), hf_reference_permute(w, 8))
    assert torch.equal(hf_to_meta(meta_to_hf(w, 8), 8), w)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained-looking model (random but not the init), saved as a full Lightning checkpoint and exported."""
    root = tmp_path_factory.mktemp("hf")
    model = Transformer(ARGS)
    model.init_weights(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # norms no longer exactly one
    checkpoint = root / "full.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "model_args": asdict(ARGS)}, checkpoint)
    export_hf(checkpoint, root / "hf")
    export_hf(checkpoint, root / "hf_sharded", max_shard_bytes=200_000)
    return model, root


def test_transformers_loads_the_export_with_equal_logits(exported):
    model, root = exported
    hf = transformers.LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["intermediate_size"] == ARGS.ffn_hidden_dim and config["num_key_value_heads"] == 4


def test_sharded_export_has_an_index(exported):
    _, root = exported
    index = json.loads((root / "hf_sharded" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((root / "hf_sharded" / f).is_file() for f in files)


@pytest.mark.parametrize("folder", ["hf", "hf_sharded"])
def test_init_from_reads_the_weights_back_exactly(exported, folder):
    model, root = exported
    module = LlamaLightningModule(init_from=str(root / folder))
    assert module.model_args.ffn_hidden_dim == ARGS.ffn_hidden_dim
    module.configure_model()
    for name, weight in model.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], weight), name
    assert model_args_from_hf(root / folder).rope_theta == 500000.0


def test_init_from_refuses_a_different_shape(exported):
    _, root = exported
    with pytest.raises(ValueError, match=r"does not match .*config\.json: n_layers: 4 vs 2"):
        LlamaLightningModule("debug", init_from=str(root / "hf")).configure_model()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        LlamaLightningModule(init_from=str(root))


# ---- streaming export: equal to the previous exporter, one output file in memory at a time -----------
def previous_export(checkpoint, out_dir, dtype=None, max_shard_bytes=5 * 2**30):
    """The exporter before streaming (every tensor collected, then written), as the reference output."""
    from safetensors.torch import save_file

    from lightning_2d.checkpoint.hf import hf_config, hf_name, meta_to_hf, rotary_heads

    if checkpoint.is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = torch.load(checkpoint / "meta.pt", weights_only=False)
        weights = []
        for key, meta in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items():
            if key.startswith("state_dict.model.") and isinstance(meta, TensorStorageMetadata):
                tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "torch.distributed is disabled": on purpose
                    dcp.load({key: tensor}, checkpoint_id=str(checkpoint), no_dist=True)
                weights.append((key[len("state_dict.model."):], tensor))
    else:
        metadata = torch.load(checkpoint, weights_only=False)
        weights = [(k[len("model."):], v) for k, v in metadata["state_dict"].items() if k.startswith("model.")]
    args = ModelArgs(**metadata["model_args"])
    shards, size = [{}], 0
    for name, tensor in weights:
        tensor = tensor.to(dtype or tensor.dtype)
        if (heads := rotary_heads(name, args)) is not None:
            tensor = meta_to_hf(tensor, heads)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name(name)] = tensor.contiguous()
        size += nbytes
    out_dir.mkdir(parents=True)
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out_dir / file, metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out_dir / "config.json").write_text(json.dumps(hf_config(args, tensor.dtype), indent=1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real checkpoint of a 1-process Trainer fit (full file), and the same as the 2D strategy lays out
    a sharded one: the state dict and optimizer state in a DCP folder, the rest in ``meta.pt``."""
    import warnings

    import lightning as L
    import torch.distributed.checkpoint as dcp
    from torch.utils.data import DataLoader

    root = tmp_path_factory.mktemp("trained")
    L.seed_everything(0)
    module = LlamaLightningModule("debug", model_overrides={"n_layers": 2}, warmup_steps=1, max_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    ids = torch.randint(0, 256, (8, 17))
    trainer.fit(module, DataLoader([{"input_ids": s[:-1], "labels": s[1:]} for s in ids], batch_size=4))
    full = root / "full.ckpt"
    trainer.save_checkpoint(full)

    checkpoint = torch.load(full, weights_only=True)  # what a real checkpoint holds loads weights-only
    sharded = root / "sharded.ckpt"
    state = {"state_dict": checkpoint.pop("state_dict"), "optimizer_0": checkpoint.pop("optimizer_states")[0]}
    checkpoint["lightning_2d"] = {"layout": {"world_size": 1, "data_parallel": 1, "tensor_parallel": 1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": on purpose
        dcp.save(state, checkpoint_id=sharded, no_dist=True)
    torch.save(checkpoint, sharded / "meta.pt")
    return {"full": full, "sharded": sharded, "weights": dict(module.model.state_dict()), "root": root}


def test_export_refuses_a_sharded_checkpoint_with_changed_bytes(trained, tmp_path):
    """Each tensor's chunks are checked against the digests saved with them before the export reads them."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    from lightning_2d.checkpoint import CheckpointError
    from lightning_2d.checkpoint.digests import digesting_writer
    from tests.unit.test_checkpoint_digests import flip_exponent_bits

    path = tmp_path / "epoch=0-step=2.ckpt"
    state = {"state_dict": torch.load(trained["full"], weights_only=True)["state_dict"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": on purpose
        dcp.save(state, checkpoint_id=path, storage_writer=digesting_writer(path), no_dist=True)
    shutil.copy(trained["sharded"] / "meta.pt", path / "meta.pt")
    export_hf(path, tmp_path / "intact")  # the copy as saved exports
    name = "state_dict.model.layers.1.attention.wq.weight"
    file = flip_exponent_bits(path, name)
    refused = rf"saved at step 2 \({file.name}: {name} reads as .*Nothing was exported"
    with pytest.raises(CheckpointError, match=refused):
        export_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def same_export(ours, reference):
    """Same files, byte for byte (safetensors headers, tensor data, index, config)."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in reference.iterdir())
    for file in reference.iterdir():
        assert (ours / file.name).read_bytes() == file.read_bytes(), file.name


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize(("dtype", "max_shard_bytes"), [(None, 5 * 2**30), (torch.bfloat16, 60_000)])
def test_streaming_export_equals_the_previous_exporter(trained, tmp_path, kind, dtype, max_shard_bytes):
    export_hf(trained[kind], tmp_path / "ours", dtype=dtype, max_shard_bytes=max_shard_bytes)
    previous_export(trained[kind], tmp_path / "previous", dtype=dtype, max_shard_bytes=max_shard_bytes)
    same_export(tmp_path / "ours", tmp_path / "previous")
    files = {p.name for p in (tmp_path / "ours").glob("*.safetensors")}
    assert len(files) == (1 if dtype is None else 13)
    # And the values are the trained ones, in the Hugging Face layout.
    module = LlamaLightningModule(init_from=str(tmp_path / "ours"))
    module.configure_model()
    for name, weight in trained["weights"].items():
        assert torch.equal(module.model.state_dict()[name], weight.to(dtype or weight.dtype).float()), name


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_export_holds_one_output_file_at_a_time(trained, tmp_path, monkeypatch, kind):
    """Structural check of the peak memory: whenever a file is written, the converted tensors alive
    are exactly that file's (the previous files' are freed, the next file's not read yet)."""
    import weakref

    import safetensors.torch

    import lightning_2d.checkpoint.hf.export as hf  # where export_hf looks up to_hf_tensor

    alive: set[str] = set()
    events: list[tuple[str, Any]] = []
    convert, save = hf.to_hf_tensor, safetensors.torch.save_file

    def tracked_convert(name, tensor, args, dtype):
        out = convert(name, tensor, args, dtype)
        alive.add(name)
        weakref.finalize(out, alive.discard, name)
        events.append(("convert", name))
        return out

    def tracked_save(tensors, path, metadata=None):
        events.append(("save", set(alive), {hf.hf_name(n) for n in alive} == set(tensors)))
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(hf, "to_hf_tensor", tracked_convert)
    monkeypatch.setattr(safetensors.torch, "save_file", tracked_save)
    export_hf(trained[kind], tmp_path / "out", dtype=torch.bfloat16, max_shard_bytes=60_000)

    saves = [e for e in events if e[0] == "save"]
    assert len(saves) == 13 and all(matches for _, _, matches in saves)
    # Each file's tensors are converted after the previous file is written and before its own.
    converted_since_save: set[str] = set()
    for event in events:
        if event[0] == "convert":
            converted_since_save.add(event[1])
        else:
            assert event[1] == converted_since_save
            converted_since_save = set()
    assert not alive  # nothing kept after the export


def test_exporting_again_into_a_folder_leaves_no_files_of_the_earlier_export(trained, tmp_path):
    export_hf(trained["full"], tmp_path / "out", max_shard_bytes=60_000)
    (tmp_path / "out" / "README.md").write_text("kept")
    export_hf(trained["full"], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "config.json", "model.safetensors"]


# ---- model args: never guessed --------------------------------------------------------------------
@pytest.fixture(scope="module")
def without_args(trained):
    """The trained weights in a file that records no model args (a plain state dict checkpoint)."""
    path = trained["root"] / "no_args.ckpt"
    torch.save({"state_dict": torch.load(trained["full"], weights_only=True)["state_dict"]}, path)
    return path


def test_a_checkpoint_without_model_args_needs_model(trained, without_args, tmp_path):
    with pytest.raises(ExportError, match=r"no_args\.ckpt does not record its model args .* refuses to guess\. "
                                          r"Pass .*--model PRESET \(one of debug, llama2-7b.*--model-overrides"):
        export_hf(without_args, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    export_hf(without_args, tmp_path / "out", model="debug", model_overrides={"n_layers": 2})
    previous_export(trained["full"], tmp_path / "previous")
    same_export(tmp_path / "out", tmp_path / "previous")


def test_a_model_that_does_not_fit_the_weights_is_refused_naming_them(trained, without_args, tmp_path):
    with pytest.raises(ExportError, match=r"do not fit --model debug \(18 of 39 tensors\): layers\.2\.attention\.wq"
                                          r"\.weight: missing; .*; and 12 more"):
        export_hf(without_args, tmp_path / "out", model="debug")
    with pytest.raises(ExportError, match=r"tok_embeddings\.weight: stored \[256, 128\], expected \[512, 128\]; "
                                          r"output\.weight: stored \[256, 128\], expected \[512, 128\]\. Pass"):
        export_hf(without_args, tmp_path / "out", model="debug", model_overrides={"n_layers": 2, "vocab_size": 512})
    # A checkpoint that records its args: --model must agree with them.
    with pytest.raises(ExportError, match=r"--model debug .*disagrees with the model args stored in .*full\.ckpt: "
                                          r"n_layers: 4 vs 2 \(given vs stored\)\. Drop --model"):
        export_hf(trained["full"], tmp_path / "out", model="debug")
    with pytest.raises(ExportError, match=r"Unknown model name 'llama9'"):
        export_hf(without_args, tmp_path / "out", model="llama9")
    assert not (tmp_path / "out").exists()


def test_older_checkpoints_record_the_model_in_their_hyper_parameters():
    from lightning_2d.hf import checkpoint_model_args

    debug2 = ModelArgs.from_name("debug", n_layers=2)
    assert checkpoint_model_args({"hyper_parameters": {"model": "debug", "model_overrides": {"n_layers": 2}}}) == debug2
    assert checkpoint_model_args({"hyper_parameters": {"model": asdict(debug2)}}) == debug2
    assert checkpoint_model_args({"hyper_parameters": {"model": debug2}}) == debug2
    assert checkpoint_model_args({"hyper_parameters": {"model": None}}) == ModelArgs.from_name("debug")
    assert checkpoint_model_args({"hyper_parameters": {"model": None, "init_from": "/hf"}}) is None
    assert checkpoint_model_args({"hyper_parameters": {"lr": 1.0}}) is None
    assert checkpoint_model_args({}) is None


# ---- weights-only reads: a pickled object that could run code is refused, not built -----------------
class RunsCode:
    """Unpickling this runs ``exec``: what a malicious checkpoint would hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_a_pickled_object_that_would_run_code_is_refused(trained, tmp_path):
    import pickle
    import shutil

    pickle.loads(pickle.dumps(RunsCode(tmp_path / "proof")))  # the payload does run when unpickled...
    assert (tmp_path / "proof").exists()
    marker = tmp_path / "ran"
    full = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": RunsCode(marker)}}, full)
    with pytest.raises(ExportError, match=r"evil\.ckpt holds a pickled exec, which a weights-only load "
                                          r"refuses to build .* the file was not loaded"):
        export_hf(full, tmp_path / "out")

    sharded = tmp_path / "evil_sharded.ckpt"
    shutil.copytree(trained["sharded"], sharded)
    torch.save({"model_args": {}, "callbacks": {"x": RunsCode(marker)}}, sharded / "meta.pt")
    with pytest.raises(ExportError, match=r"meta\.pt holds a pickled exec.* Or pass --model PRESET"):
        export_hf(sharded, tmp_path / "out")
    # With --model, meta.pt is not needed: the weights are exported, the object still never built.
    with pytest.warns(UserWarning, match=r"meta\.pt holds a pickled exec"):
        export_hf(sharded, tmp_path / "out", model="debug", model_overrides={"n_layers": 2})
    assert (tmp_path / "out" / "model.safetensors").is_file()

    # DCP's .metadata is a plain pickle: it is read with a restricted unpickler.
    with open(sharded / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    with pytest.raises(ExportError, match=r"\.metadata was not loaded: GLOBAL builtins\.exec is not part of DCP's"):
        export_hf(sharded, tmp_path / "out2", model="debug")
    assert not marker.exists()


def test_a_trusted_type_can_be_allowed_by_name(trained, tmp_path):
    from fractions import Fraction

    checkpoint = torch.load(trained["full"], weights_only=True)
    checkpoint["callbacks"] = {"Custom": {"ratio": Fraction(1, 3)}}
    path = tmp_path / "custom.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(ExportError, match=r"pass --allow-global fractions\.Fraction"):
        export_hf(path, tmp_path / "out")
    export_hf(path, tmp_path / "out", allow_globals=["fractions.Fraction"])
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_reports_a_missing_model_without_a_traceback(without_args, tmp_path, capsys):
    from lightning_2d.tools.export import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(without_args), str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-2d export: error: ") and "--model PRESET" in err and "Traceback" not in err
    assert err.count("\n") == 1

    main([str(without_args), str(tmp_path / "out"), "--model", "debug", "--model-overrides", '{"n_layers": 2}',
          "--max-shard-gb", "0.0001"])
    assert "Wrote" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main([str(without_args), str(tmp_path / "out"), "--model", "debug", "--model-overrides", "n_layers=2"])
    assert exit_info.value.code == 2 and "--model-overrides is not JSON" in capsys.readouterr().err
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "notes.ckpt"), str(tmp_path / "out")])
    assert exit_info.value.code == 1 and "notes.ckpt is not a torch.save zip archive" in capsys.readouterr().err


# ---- import: each block is read as a slice, never the whole tensor ------------------------------------
def test_a_block_cutting_heads_reads_only_the_heads_it_touches(exported, monkeypatch):
    import safetensors

    from lightning_2d.hf import HFWeights

    model, root = exported
    weights = HFWeights(root / "hf", ARGS)
    requested = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_slice(self, key):
            stored = self.handle.get_slice(key)

            class Sliced:
                def __getitem__(self, index):
                    requested.append(index)
                    return stored[index]

            return Sliced()

        def get_tensor(self, key):
            raise AssertionError("fill_block_ read a whole tensor")

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    wq = model.state_dict()["layers.1.attention.wq.weight"]  # 8 heads of 16 rows
    block = torch.empty(28, 64)
    weights.fill_block_(block, "layers.1.attention.wq.weight", tuple(wq.shape), (12, 16))
    assert torch.equal(block, wq[12:40, 16:80])
    assert requested == [(slice(0, 48), slice(16, 80))]  # heads 0-2, the block's columns only


def test_a_failed_export_leaves_the_output_folder_as_it_was(trained, tmp_path, monkeypatch):
    """A shard cut short (a copy interrupted): the export fails while reading it and neither creates the
    output folder nor touches an earlier export there."""
    import shutil

    broken = tmp_path / "broken.ckpt"
    shutil.copytree(trained["sharded"], broken)
    shard = next(broken.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10])  # the weights come first, then AdamW
    with pytest.raises(ExportError, match=r"broken\.ckpt is damaged .*\n  - __0_0\.distcp: [\d,]+ bytes, but the metadata places data up to byte"):
        export_hf(broken, tmp_path / "new_out")
    assert not (tmp_path / "new_out").exists()
    export_hf(trained["full"], tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    # A failure while writing (here: a full disk on the third file) leaves the earlier export intact too.
    import safetensors.torch

    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return save(tensors, path, metadata=metadata)

    save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        export_hf(trained["full"], tmp_path / "out", max_shard_bytes=60_000)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.ckpt", "out"]  # no staging folder left


# ---- Llama 3.1's rotary scaling (rope_type "llama3"), both ways -------------------------------------
# Scaled from 32 positions, tested at 96: each band of frequencies is present at head size 16 (wavelengths
# 6.3 kept, 19.9 interpolated, 62.8 and longer divided by the factor).
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=32)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest absolute difference over the largest absolute logit."""
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.fixture(scope="module")
def scaled_hf(tmp_path_factory):
    """A tiny Llama with Llama 3.1's rotary scaling made and saved by transformers, and its fp32 logits."""
    root = tmp_path_factory.mktemp("llama31")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-5, rope_parameters=dict(LLAMA31_ROPE),
        initializer_range=0.1,  # attention far from uniform, so the rotary angles show in the logits
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "hf")
    tokens = torch.randint(0, 128, (2, 96))
    with torch.no_grad():
        logits = model(tokens).logits
    return root / "hf", tokens, logits


def test_a_scaled_model_imports_with_the_logits_of_transformers(scaled_hf):
    directory, tokens, theirs = scaled_hf
    module = LlamaLightningModule(init_from=str(directory))
    assert module.model_args.rope_scaling == LLAMA31_SCALING and module.model_args.rope_theta == 10000.0
    module.configure_model()
    unscaled = Transformer(replace(module.model_args, rope_scaling=None))
    unscaled.load_state_dict(module.model.state_dict())
    with torch.no_grad():
        ours, ignored = module.model(tokens), unscaled(tokens)
    assert relative_error(ours, theirs) <= 1e-5
    assert relative_error(ignored, theirs) > 1e-2  # the same weights without the scaling: far off


def test_the_model_refuses_a_directory_whose_scaling_differs(scaled_hf):
    directory, _, _ = scaled_hf
    with pytest.raises(ValueError, match=r"does not match .*config\.json: rope_scaling: None vs "
                                         r"RopeScaling\(rope_type='llama3', factor=8\.0"):
        LlamaLightningModule(init_from=str(directory), model_overrides={"rope_scaling": None}).configure_model()


def write_config(source, target, **changes):
    """``target/config.json``: ``source``'s with fields changed (``None``: removed)."""
    target.mkdir()
    config = {**json.loads((source / "config.json").read_text()), **changes}
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return target


def transformers_frequencies(directory) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(directory)).inv_freq


def test_an_export_with_a_scaling_given_in_python_writes_it_or_names_the_disagreement(trained, without_args, tmp_path):
    scaling = RopeScaling(original_max_position_embeddings=32)
    export_hf(without_args, tmp_path / "out", model="debug", model_overrides={"n_layers": 2, "rope_scaling": scaling})
    assert model_args_from_hf(tmp_path / "out").rope_scaling == scaling
    with pytest.raises(ExportError, match=r"--model debug with --model-overrides '\{\"n_layers\": 2, \"rope_scaling\": "
                                          r"\{\"rope_type\": \"llama3\", .*disagrees with the model args stored in .*"
                                          r"full\.ckpt: rope_scaling: RopeScaling\(.*\) vs None \(given vs stored\)"):
        export_hf(trained["full"], tmp_path / "refused", model="debug",
                  model_overrides={"n_layers": 2, "rope_scaling": scaling})


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_older_config_files_with_rope_scaling_import_as_transformers_reads_them(scaled_hf, tmp_path, type_key):
    """Files written before transformers 5 (Meta's Llama 3.1 ones among them): ``rope_scaling`` with ``rope_type``
    (or, older, ``type``), the base period at the top level."""
    directory, _, _ = scaled_hf
    legacy = {k: v for k, v in LLAMA31_ROPE.items() if k not in ("rope_type", "rope_theta")}
    legacy[type_key] = "llama3"
    older = write_config(directory, tmp_path / "older", rope_parameters=None, rope_scaling=legacy, rope_theta=10000.0)
    assert model_args_from_hf(older) == model_args_from_hf(directory)
    assert model_args_from_hf(older).rope_scaling == LLAMA31_SCALING
    torch.testing.assert_close(transformers_frequencies(older), transformers_frequencies(directory), rtol=0, atol=0)


def test_the_original_length_defaults_as_in_transformers(scaled_hf, tmp_path):
    from lightning_2d.models.llama.model import rope_frequencies

    directory, _, _ = scaled_hf
    without = {k: v for k, v in LLAMA31_ROPE.items() if k != "original_max_position_embeddings"}
    cases = {  # none given: max_position_embeddings; a top-level one wins over rope_parameters'
        "no_original": ({"rope_parameters": without}, 128),
        "top_level_original": ({"original_max_position_embeddings": 64}, 64),
    }
    for name, (changes, original) in cases.items():
        args = model_args_from_hf(write_config(directory, tmp_path / name, **changes))
        assert args.rope_scaling.original_max_position_embeddings == original, name
        ours = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
        torch.testing.assert_close(ours, transformers_frequencies(tmp_path / name), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_parameters": {**LLAMA31_ROPE, "rope_type": "yarn"}},
     r"uses the rotary scaling rope_type 'yarn', which this model does not implement; supported: 'default' \(no "
     r"scaling\) and 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_type 'linear', which this model does not implement"),
    ({"rope_parameters": {k: v for k, v in LLAMA31_ROPE.items() if k != "high_freq_factor"}},
     r"rope_type 'llama3' needs factor, low_freq_factor and high_freq_factor; missing: high_freq_factor"),
    ({"rope_parameters": {**LLAMA31_ROPE, "factor": 0.5}},
     r"has a rotary scaling this model cannot read: rope_scaling\.factor must be a number of at least 1, got 0\.5"),
])
def test_other_rotary_scalings_are_refused_naming_the_value(scaled_hf, tmp_path, changes, message):
    directory, _, _ = scaled_hf
    with pytest.raises(ValueError, match=message):
        model_args_from_hf(write_config(directory, tmp_path / "refused", **changes))


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention_bias": True}, r"attention_bias is True \(needs False\)"),
    ({"mlp_bias": True}, r"mlp_bias is True \(needs False\)"),
    ({"hidden_act": "gelu"}, r"hidden_act is 'gelu' \(needs 'silu'\)"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor is 0\.5 \(needs 1\.0\)"),
    ({"head_dim": 4}, r"head_dim is 4 \(needs \d+\)"),
])
def test_a_llama_layout_the_native_model_cannot_compute_is_refused_naming_the_field(scaled_hf, tmp_path, changes, message):
    """Fields the native model does not implement would load the weights and compute another function."""
    directory, _, _ = scaled_hf
    with pytest.raises(ValueError, match=r"describes a Llama this model cannot represent: " + message
                       + r".*Hugging Face path instead"):
        model_args_from_hf(write_config(directory, tmp_path / "refused", **changes))


def test_a_scaled_model_exports_a_config_transformers_reads_to_the_same_rotary_scaling(scaled_hf, tmp_path):
    directory, tokens, theirs = scaled_hf
    module = LlamaLightningModule(init_from=str(directory))
    module.configure_model()
    checkpoint = tmp_path / "full.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in module.model.state_dict().items()},
                "model_args": asdict(module.model_args)}, checkpoint)
    export_hf(checkpoint, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # Both ways: rope_parameters (transformers 5) and rope_scaling + rope_theta (Meta's 3.1 files, transformers 4).
    assert config["rope_parameters"] == LLAMA31_ROPE
    assert config["rope_scaling"] == {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_theta"}
    assert config["rope_theta"] == 10000.0
    assert model_args_from_hf(tmp_path / "out") == module.model_args
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert {k: exported.config.rope_parameters[k] for k in LLAMA31_ROPE} == LLAMA31_ROPE
    with torch.no_grad():
        assert relative_error(exported(tokens).logits, theirs) <= 1e-5
    # Either half alone reads the same (transformers 5 takes rope_scaling first when both are there).
    for dropped in ("rope_scaling", "rope_parameters"):
        half = tmp_path / f"without_{dropped}"
        half.mkdir()
        (half / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != dropped}))
        loaded = transformers.AutoConfig.from_pretrained(half).rope_parameters
        assert {k: loaded[k] for k in LLAMA31_ROPE} == LLAMA31_ROPE, dropped
        assert model_args_from_hf(half) == module.model_args, dropped


def test_a_tied_llama_exports_one_tensor_transformers_ties_and_imports_back(tmp_path):
    """Llama 3.2-style tied embeddings: the export writes the shared weight once with tie_word_embeddings=true,
    transformers' logits equal ours, and init_from reads it back into one tied parameter."""
    from safetensors import safe_open

    args = replace(ARGS, tie_word_embeddings=True)
    model = Transformer(args)
    model.init_weights(3)
    assert model.output.weight is model.tok_embeddings.weight
    checkpoint = tmp_path / "tied.ckpt"
    state = model.state_dict()  # both names, as a DCP checkpoint of the trained model has them
    assert state["output.weight"].data_ptr() == state["tok_embeddings.weight"].data_ptr()
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "model_args": asdict(args)}, checkpoint)
    export_hf(checkpoint, tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, args.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
    from lightning_2d.checkpoint.hf.layout import same_shapes

    assert model_args_from_hf(tmp_path / "hf").tie_word_embeddings and same_shapes(model_args_from_hf(tmp_path / "hf"), args) == []
    module = LlamaLightningModule(init_from=str(tmp_path / "hf"))
    module.configure_model()
    assert module.model.output.weight is module.model.tok_embeddings.weight
    assert torch.equal(module.model.tok_embeddings.weight, model.tok_embeddings.weight)
    # An untied model refuses the tied directory, naming the field.
    from lightning_2d.hf import HFWeights

    with pytest.raises(ValueError, match="tie_word_embeddings: False vs True"):
        HFWeights(tmp_path / "hf", ARGS)


@pytest.mark.parametrize("native", [True, False], ids=["native", "hugging-face"])
def test_a_checkpoint_whose_tensors_do_not_match_its_config_is_refused_at_construction(tmp_path, native):
    """A tensor missing or of another shape than config.json says: refused when the module is built (before any
    process starts), naming each tensor, the stored and the expected shapes."""
    from safetensors.torch import load_file, save_file

    from lightning_2d.hf import HFCausalLMModule

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ok")
    make = (lambda d: LlamaLightningModule(init_from=str(d))) if native else (lambda d: HFCausalLMModule(init_from=str(d)))
    make(tmp_path / "ok")  # the files as written: accepted
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:8]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not hold the model's weights \(2 problem\(s\)\):"
                                         r"(.|\n)*model\.layers\.0\.self_attn\.k_proj\.weight: stored \(8, 32\), the"
                                         r" model's is \(16, 32\)(.|\n)*model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        make(tmp_path / "bad")
