"""No load runs code stored in a checkpoint (#42): a pickled ``os.system`` planted in a checkpoint's ``meta.pt``, its
RNG file or a full file is refused on every load path before it is built, in one line naming the file, what it holds
and that it was not loaded; the file the payload would create never appears.

The paths here run in one process: the CLI's pre-launch check of ``fit``/``validate``/``test``/``predict
--ckpt_path`` (``main`` in-process, nothing launched), the checkpoint IO both strategies load through
(``DistributedCheckpointIO``: resolve, the non-tensor part, the RNG), ``init_from``/``lora_init_from`` folders (never
a pickle), and export (``test_hf.py``). The strategies' loads in a real 4-rank job: ``test_checkpoints.py``
(Trainer) and ``test_fabric.py`` (Fabric)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lightning_2d.checkpoint import digests
from lightning_2d.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from lightning_2d.checkpoint.rng import load_rng
from lightning_2d.checkpoint.safe_load import load_checkpoint_file
from lightning_2d.checkpoint.writer import save_full_file
from tests.unit.test_checkpoint_digests import save, state

REFUSED = r"holds a pickled posix\.system, which a weights-only load refuses to build .*: the file was not loaded"


class SystemCall:
    """Unpickling this runs ``os.system(command)``: the issue's payload (pickled as ``posix.system``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def payload(marker: Path) -> SystemCall:
    return SystemCall(f"touch {marker}")


def redigest(folder: Path, name: str) -> None:
    """Record ``name``'s current bytes in the manifest, as someone rewriting a checkpoint with the format in hand
    would (or as a checkpoint saved before whole-file digests stands): only the weights-only load stands between
    the file and the payload."""
    file = folder / digests.MANIFEST_FILE
    manifest = json.loads(file.read_text())
    manifest.pop("self")
    manifest["whole"][name] = list(digests.file_digest((folder / name).read_bytes()))
    manifest["self"] = digests._manifest_body_digest(manifest)
    file.write_text(json.dumps(manifest, separators=(",", ":")))


def plant_meta(checkpoint: Path, to: Path, marker: Path, redigested: bool = True) -> Path:
    """A copy of sharded ``checkpoint`` whose ``meta.pt`` holds its dict plus the payload."""
    shutil.copytree(checkpoint, to)
    meta = load_checkpoint_file(to / "meta.pt")
    torch.save({**meta, "callbacks": {"Evil": payload(marker)}}, to / "meta.pt")
    if redigested:
        redigest(to, "meta.pt")
    return to


def plant_full(checkpoint: Path, to: Path, marker: Path) -> Path:
    """A copy of full file ``checkpoint`` with the payload among its hyper-parameters (its tensors, and so their
    digests, unchanged)."""
    loaded = load_checkpoint_file(checkpoint)
    to.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**loaded, "hyper_parameters": {**loaded.get("hyper_parameters", {}), "x": payload(marker)}}, to)
    return to


def one_line(message: str) -> str:
    assert "\n" not in message, message
    return message


def test_the_payload_runs_when_unpickled(tmp_path):
    """The planted object is live: a plain unpickling creates the file every other test asserts absent."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(payload(marker)))
    assert marker.exists()


@pytest.fixture
def checkpoints(tmp_path):
    """A sharded checkpoint saved by our writer, a full file, the payload's marker, and planted copies of both."""
    marker = tmp_path / "ran"
    sharded = save(tmp_path, "epoch=0-step=8.ckpt")
    full = tmp_path / "full.ckpt"
    save_full_file({**state(), "global_step": 8, "lightning_2d": {"layout": {"world_size": 1}}}, full)
    return {
        "marker": marker,
        "sharded": sharded,
        "meta": plant_meta(sharded, tmp_path / "meta" / "epoch=0-step=8.ckpt", marker),
        "meta_changed": plant_meta(sharded, tmp_path / "changed" / "epoch=0-step=8.ckpt", marker, redigested=False),
        "full": plant_full(full, tmp_path / "full" / "epoch=0-step=8.ckpt", marker),
    }


def test_the_checkpoint_io_of_both_strategies_refuses_a_payload_in_one_line(checkpoints):
    """``DistributedCheckpointIO`` (the Trainer's and Fabric's loads, one process): resolve, then the non-tensor
    part read weights-only; a ``meta.pt`` changed since its save is refused by its digest before it is unpickled."""
    from lightning_2d.integration.checkpoint_io import DistributedCheckpointIO

    io = DistributedCheckpointIO(0, 1, lambda: None, lambda obj: obj, sharded=True, async_save=False, layout={})
    for key in ("meta", "full"):
        with pytest.raises(UnsafeCheckpointError, match=REFUSED) as err:
            io.load_checkpoint(checkpoints[key])
        assert str(checkpoints[key]) in one_line(str(err.value))
    changed = r"is damaged \(meta\.pt changed after it was saved: it is [\d,]+ bytes long, saved [\d,]+ bytes long\)"
    with pytest.raises(CheckpointError, match=changed):
        io.load_checkpoint(checkpoints["meta_changed"])
    with pytest.raises(CheckpointError, match=r"weights_only=False .* torch\.serialization\.add_safe_globals"):
        io.load_checkpoint(checkpoints["sharded"], weights_only=False)
    assert io.load_checkpoint(checkpoints["sharded"])["global_step"] == 8  # the intact one loads
    assert not checkpoints["marker"].exists()


def test_an_rng_file_holding_a_payload_is_refused(tmp_path):
    marker = tmp_path / "ran"
    folder = save(tmp_path, "step-000008")
    torch.save({"torch": torch.get_rng_state(), "x": payload(marker)}, folder / "rng" / "rank0.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"rank0\.pt {REFUSED}"):
        load_rng(folder, 0)
    assert not marker.exists()


def test_a_type_registered_with_torch_is_allowed(tmp_path):
    """A user's own data class in a checkpoint loads once registered with torch, as the refusal says."""
    from fractions import Fraction

    path = tmp_path / "own.ckpt"
    torch.save({"hyper_parameters": {"ratio": Fraction(1, 3)}}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"torch\.serialization\.add_safe_globals\(\[fractions\.Fraction\]\)"):
        load_checkpoint_file(path)
    with torch.serialization.safe_globals([Fraction]):
        assert load_checkpoint_file(path)["hyper_parameters"]["ratio"] == Fraction(1, 3)


@pytest.mark.parametrize("command", ["fit", "validate", "test", "predict"])
def test_the_cli_refuses_a_payload_before_any_process_starts(command, checkpoints, tmp_path, capsys, monkeypatch):
    """``lightning-2d COMMAND --ckpt_path``: one line, exit 1, before the Trainer runs (which would start the
    processes) and before LightningCLI's own ``torch.load`` of a full file for its hyper-parameters."""
    import functools

    import lightning.pytorch as pl

    from lightning_2d.tools.cli import main

    def started(method):
        @functools.wraps(method)  # LightningCLI reads ckpt_path from the method's signature
        def launched(*args, **kwargs):
            raise AssertionError(f"Trainer.{command} was called: the job would have started its processes")
        return launched

    monkeypatch.setattr(pl.Trainer, command, started(getattr(pl.Trainer, command)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_2D_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-2d"])
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "debug_cpu.yaml"
    for key in ("meta", "full"):
        with pytest.raises(SystemExit) as exit_:
            main([command, f"--config={recipe}", f"--ckpt_path={checkpoints[key]}"])
        assert exit_.value.code == 1
        err = one_line(capsys.readouterr().err.rstrip("\n"))
        file = checkpoints[key] / "meta.pt" if key == "meta" else checkpoints[key]
        assert err.startswith(f"lightning-2d {command}: error: {file} holds a pickled posix.system"), err
        assert "the file was not loaded" in err and "Traceback" not in err
    assert not checkpoints["marker"].exists()


def test_init_from_and_lora_init_from_never_read_a_pickle(tmp_path):
    """``init_from`` and ``lora_init_from`` read safetensors and JSON only: a folder whose weights come as a pickled
    ``pytorch_model.bin`` (or ``adapter_model.bin``) is refused, saying why, and nothing in it is built."""
    from lightning_2d import LlamaLightningModule
    from lightning_2d.checkpoint.hf.layout import hf_config
    from lightning_2d.models.llama.model import ModelArgs

    marker = tmp_path / "ran"
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(hf_config(ModelArgs.from_name("debug"), torch.float32)))
    torch.save({"model.embed_tokens.weight": payload(marker)}, base / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin is never read \(a pickle, which could run code"):
        LlamaLightningModule(init_from=str(base))
    import transformers

    config = hf_config(ModelArgs.from_name("debug"), torch.float32)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path / "safe_base")
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    torch.save({"x": payload(marker)}, adapters / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is never read: a pickle"):
        LlamaLightningModule(init_from=str(tmp_path / "safe_base"), lora={"rank": 4, "alpha": 8},
                             lora_init_from=str(adapters))
    assert not marker.exists()


def test_every_load_in_the_package_is_weights_only():
    """Read from the source, so that one load turned back to ``weights_only=False`` fails here even where another
    check happens to run first: ``torch.load`` is called in ``checkpoint/safe_load.py`` only, with
    ``weights_only=True``; every call passing ``weights_only=`` passes ``True``; ``np.load`` (the precomputed reference
    values) passes ``allow_pickle=False``; nothing else unpickles (``pickle.load(s)``) but DCP's metadata reader,
    which builds DCP's types only."""
    import ast

    package = Path(__file__).resolve().parents[2] / "lightning_2d"
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if "pickle.Unpickler" in bases:
                    found.append(f"{where}: unpickler {node.name}")
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name == "torch.load":
                weights_only = keywords.get("weights_only")
                ok = isinstance(weights_only, ast.Constant) and weights_only.value is True
                found.append(f"{where}: torch.load weights_only={'True' if ok else ast.unparse(weights_only) if weights_only else 'unset'}")
            elif "weights_only" in keywords:
                value = keywords["weights_only"]
                if not (isinstance(value, ast.Constant) and value.value is True):
                    found.append(f"{where}:{node.lineno} {name}(weights_only={ast.unparse(value)})")
            elif name in ("np.load", "numpy.load"):  # plain arrays only with allow_pickle=False, spelled out
                allow = keywords.get("allow_pickle")
                if not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append(f"{where}:{node.lineno} {name}(allow_pickle={ast.unparse(allow) if allow else 'unset'})")
            elif name in ("pickle.load", "pickle.loads", "dill.load", "joblib.load"):
                found.append(f"{where}:{node.lineno} {name}")
    assert sorted(found) == [
        "lightning_2d/checkpoint/dcp_metadata.py: unpickler DCPMetadataUnpickler",
        "lightning_2d/checkpoint/safe_load.py: torch.load weights_only=True",
    ], found
