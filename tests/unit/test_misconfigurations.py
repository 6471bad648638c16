"""Misconfigurations and bad inputs, one row each: every one is refused early (at construction, or in the
launching process before any rank starts) with a message that names the value and the way out.

Add a case for every new refusal, and quote its message in a row of the troubleshooting table
(``lightning_2d/tools/troubleshooting.py``, shown in docs/troubleshooting.md) that names the case:
tests/unit/test_troubleshooting.py runs the cases a row names and checks the quotes against what they raise.
Cases that need real processes (a NaN on one rank, a damaged checkpoint at 2×2) live in tests/distributed/.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest

from lightning_2d import (
    LlamaLightningModule,
    ModelParallel2DStrategy,
    ParallelConfigError,
    ParallelPlan,
    PreferenceDataModule,
    TextDataModule,
)
from lightning_2d.checkpoint.errors import CheckpointError, ExportError
from lightning_2d.checkpoint.resolution import check_ckpt_path, resolve_checkpoint
from lightning_2d.data import DataError
from lightning_2d.fabric import ModelParallel2DStrategy as FabricStrategy
from lightning_2d.ops.distillation import DistillationConfigError
from lightning_2d.ops.lora import LoRAConfigError
from lightning_2d.ops.preference import PreferenceConfigError


def planted_checkpoint(tmp: Path) -> str:
    """A sharded checkpoint whose meta.pt holds a pickled ``os.system`` (its digest recorded again)."""
    from tests.unit.test_checkpoint_digests import save
    from tests.unit.test_safe_loading import plant_meta

    return str(plant_meta(save(tmp, "saved"), tmp / "planted" / "epoch=0-step=8.ckpt", tmp / "ran"))


def cut_manifest(tmp: Path) -> str:
    """A sharded checkpoint whose digests.json lost its second half."""
    from tests.unit.test_checkpoint_digests import save

    path = save(tmp / "cut", "epoch=0-step=8.ckpt")
    manifest = path / "digests.json"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    return str(path)


def changed_bytes(tmp: Path) -> str:
    """A sharded checkpoint one of whose tensors changed after it was saved (its digest no longer matches)."""
    from tests.unit.test_checkpoint_digests import flip_exponent_bits, save

    path = save(tmp / "changed", "epoch=0-step=8.ckpt")
    flip_exponent_bits(path)
    return str(path)


def edited_manifest(tmp: Path) -> str:
    """A sharded checkpoint whose digests.json was edited (a digest replaced): it no longer matches its own digest."""
    from tests.unit.test_checkpoint_digests import save

    path = save(tmp / "edited", "epoch=0-step=8.ckpt")
    manifest = json.loads((path / "digests.json").read_text())
    next(iter(manifest["files"].values()))[0][-1] = "0" * 16
    (path / "digests.json").write_text(json.dumps(manifest))
    return str(path)


def export_of_a_cut_shard(tmp: Path) -> None:
    """An export of a sharded checkpoint whose shard file lost all but its first 100 bytes."""
    from lightning_2d.hf import export_hf
    from tests.unit.test_checkpoint_digests import save

    path = save(tmp / "cut", "epoch=0-step=8.ckpt")
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    export_hf(path, tmp / "out", model="debug")


def without_document_mask() -> LlamaLightningModule:
    """A module of one's own that says it cannot take per-document positions."""
    return type("Mine", (LlamaLightningModule,), {"supports_document_mask": False})("debug")


def export_of_a_folder(tmp_path: Path) -> None:
    from lightning_2d.hf import export_hf

    (tmp_path / "empty").mkdir()
    export_hf(tmp_path / "empty", tmp_path / "out", model="debug")


def trainer(**strategy) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=4, strategy=ModelParallel2DStrategy(**strategy), logger=False,
                     max_steps=1, enable_progress_bar=False, enable_model_summary=False)


def QLORA() -> LlamaLightningModule:
    """A QLoRA module whose projections split into 4 FSDP shards of whole NF4 scaler groups."""
    return LlamaLightningModule(model_overrides={"dim": 256, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 256},
                                lora={"quantize_base": "nf4"})


def without_expert_entries() -> ParallelPlan:
    """debug-moe's plan with its experts (``num_experts``) but no expert-parallel entries naming them."""
    from dataclasses import replace

    from lightning_2d.models.llama.model import PRESETS
    from lightning_2d.models.llama.plan import llama_plan
    from lightning_2d.parallel import ParallelConfig

    return replace(llama_plan(PRESETS["debug-moe"], ParallelConfig(), module="model"), expert_parallel={})


def fit_before_spawn(module: L.LightningModule, datamodule: L.LightningDataModule | None = None, **strategy) -> None:
    """``trainer.fit`` of a 4-process CPU job: must fail in this process, before any rank is started."""
    trainer(**strategy).fit(module, datamodule=datamodule)


def tokenizer_without_eos(folder: Path) -> str:
    """A Hugging Face ``tokenizer.json`` with no special tokens at all (so no end-of-text token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def tiktoken_without_the_package(folder: Path) -> object:
    """Meta's Llama 3 ``tokenizer.model`` format (``base64-token rank`` lines) while ``tiktoken`` is not installed."""
    import base64
    import sys
    from unittest import mock

    lines = [f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)]
    (folder / "tokenizer.model").write_text("".join(lines))
    with mock.patch.dict(sys.modules, {"tiktoken": None}):
        return TextDataModule(tokenizer=str(folder))


def export_with_a_missing_tokenizer(folder: Path) -> None:
    import torch

    from lightning_2d.hf import export_hf

    torch.save({"state_dict": {"model.w": torch.zeros(1)}}, folder / "model.ckpt")
    export_hf(folder / "model.ckpt", folder / "out", model="debug", tokenizer=folder / "tokenizer.json")


def hf_lora(**lora):
    from lightning_2d.hf import HFCausalLMModule

    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return HFCausalLMModule(base, lora=lora)


def hf_lora_experts():
    from lightning_2d.hf import HFCausalLMModule

    base = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
            "num_experts_per_tok": 2}
    return HFCausalLMModule(base, lora={"rank": 4})


def hf(**config):
    from lightning_2d.hf import HFCausalLMModule

    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return HFCausalLMModule({**base, **config})


def mismatched_weights(folder: Path, shape: tuple[int, ...] | None = None) -> str:
    """A Llama directory whose safetensors lack a tensor its config.json implies (``shape``: hold it in that shape)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    if shape is not None:
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(shape)
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def plan_with_sp_styles() -> ParallelPlan:
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    return ParallelPlan(tensor_parallel={"fc": ColwiseParallel(), "norm": SequenceParallel()})


def llama_directory(folder: Path, **config) -> str:
    """A Hugging Face Llama directory (its ``config.json``: what ``init_from`` reads first) with fields changed."""
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    return str(folder)


def export_of(tmp_path: Path) -> None:
    from lightning_2d.tools.export import main

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    main([str(tmp_path / "notes.txt"), str(tmp_path / "out")])


def tokenizer_folders(tmp: Path) -> tuple[str, str]:
    """Two Llama folders (config, weights, a ``tokenizer.json``) of one vocabulary size whose tokenizers give two
    tokens each other's ids: a student's ``init_from`` and a teacher."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    for name, vocab in (("student", ["a", "b"]), ("teacher", ["b", "a"])):
        transformers.LlamaForCausalLM(config).save_pretrained(tmp / name)
        (tmp / name / "tokenizer.json").write_text(json.dumps(
            {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab)}, "merges": []}}))
    return str(tmp / "student"), str(tmp / "teacher")


def _hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


#: (case, what runs, the exception, a regular expression its message must match)
CASES: list[tuple[str, Callable[[Path], object], type[BaseException], str]] = [
    ("tensor_parallel_size 0", lambda _: ModelParallel2DStrategy(tensor_parallel_size=0),
     ParallelConfigError, r"tensor_parallel_size must be a positive integer or 'auto', got 0"),
    ("replicate size 0", lambda _: ModelParallel2DStrategy(data_parallel_replicate_size=0),
     ParallelConfigError, r"data_parallel_replicate_size must be a positive integer, got 0"),
    ("unknown AC mode", lambda _: ModelParallel2DStrategy(activation_checkpointing="sometimes"),
     ParallelConfigError, r"activation_checkpointing='sometimes' is not a mode; choose one of 'none', 'full', 'selective'"),
    ("bad selective option", lambda _: ModelParallel2DStrategy(activation_checkpointing="selective", selective_ac_option="x"),
     ParallelConfigError, r"selective_ac_option='x' is invalid; use 'op'"),
    ("unknown reshard policy", lambda _: ModelParallel2DStrategy(reshard_after_forward="maybe"),
     ParallelConfigError, r"reshard_after_forward='maybe' is not a policy"),
    ("a string for a flag", lambda _: ModelParallel2DStrategy(sequence_parallel="no"),
     ParallelConfigError, r"sequence_parallel must be True or False, got 'no' \(str\)"),
    ("float16 parameters", lambda _: ModelParallel2DStrategy(param_dtype="float16"),
     ParallelConfigError, r"param_dtype='float16' is not supported: float16 needs a gradient scaler.*use 'bfloat16'"),
    ("a dtype typo", lambda _: ModelParallel2DStrategy(reduce_dtype="bfloat"),
     ParallelConfigError, r"reduce_dtype='bfloat' is not a dtype; use one of float32, fp32, bfloat16, bf16"),
    ("float8 typo", lambda _: ModelParallel2DStrategy(float8="yes"),
     ParallelConfigError, r"float8='yes' is invalid; use True, False or 'emulate'"),
    ("float8 all-gather without float8", lambda _: ModelParallel2DStrategy(fsdp_float8_all_gather=True),
     ParallelConfigError, r"fsdp_float8_all_gather=True needs float8=True"),
    ("unknown non_finite policy", lambda _: ModelParallel2DStrategy(non_finite="ignore"),
     ParallelConfigError, r"non_finite='ignore' is not a policy; choose 'raise'"),
    ("a number as timeout", lambda _: ModelParallel2DStrategy(timeout=30),
     ParallelConfigError, r"timeout=30 must be a datetime\.timedelta .*not int: a plain number has no unit"),
    ("a number as watchdog_timeout", lambda _: ModelParallel2DStrategy(watchdog_timeout=60),
     ParallelConfigError, r"watchdog_timeout=60 must be a datetime\.timedelta .*or None \(no watchdog\), not int"),
    ("a watchdog bound too short", lambda _: ModelParallel2DStrategy(watchdog_timeout=timedelta(seconds=1)),
     ParallelConfigError, r"watchdog_timeout=.* is under 5 s: .*use at least timedelta\(seconds=10\), or None"),
    ("a negative timeout", lambda _: ModelParallel2DStrategy(timeout=timedelta(seconds=-1)),
     ParallelConfigError, r"must be positive"),
    ("a misspelled backend", lambda _: ModelParallel2DStrategy(process_group_backend="ncll"),
     ParallelConfigError, r"process_group_backend='ncll' is not a torch\.distributed backend; use one of 'nccl', 'gloo'"),
    ("world size mismatch", lambda _: trainer(data_parallel_size=3, tensor_parallel_size=2),
     ParallelConfigError, r"data_parallel_size × tensor_parallel_size \(3 × 2 = 6\) must equal the world size \(4"),
    ("float16 precision", lambda _: L.Trainer(accelerator="cpu", devices=4, strategy=ModelParallel2DStrategy(), precision="16-true"),
     ParallelConfigError, r"precision='16-true' is not supported"),
    ("heads not divisible, before spawn",
     lambda _: fit_before_spawn(LlamaLightningModule("debug", model_overrides={"n_kv_heads": 2}), tensor_parallel_size=4),
     ParallelConfigError, r"tensor_parallel_size \(4\) must divide n_kv_heads \(2\); try 1 or 2"),
    ("sequence length not divisible, before spawn",
     lambda _: fit_before_spawn(LlamaLightningModule("debug"), TextDataModule(seq_len=30, batch_size=2), tensor_parallel_size=4),
     ParallelConfigError, r"sequence length \(30\) must be divisible by tensor_parallel_size \(4\)"),
    ("SP styles with sequence_parallel=False",
     lambda _: fit_before_spawn(LlamaLightningModule("debug"), tensor_parallel_size=2, sequence_parallel=False,
                                plan=plan_with_sp_styles()),
     ParallelConfigError, r"sequence_parallel=False, but the plan's tensor_parallel holds sequence-parallel styles \(norm\)"),
    ("unknown pipeline schedule", lambda _: ModelParallel2DStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b"),
     ParallelConfigError, r"pipeline_schedule='1f1b' is not a schedule; choose one of '1F1B', 'GPipe', 'Interleaved1F1B'"),
    ("interleaved schedule with one stage per rank",
     lambda _: ModelParallel2DStrategy(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=1),
     ParallelConfigError, r"interleaves several stages per rank, but pipeline_stages_per_rank=1; use 2 or more"),
    ("DualPipeV with fewer micro-batches than stages",
     lambda _: ModelParallel2DStrategy(pipeline_parallel_size=2, pipeline_schedule="DualPipeV", pipeline_microbatches=2),
     ParallelConfigError, r"'DualPipeV' needs at least as many micro-batches as stages \(4: 2 × pipeline_parallel_size 2\)"),
    ("a zero-bubble schedule with compiled blocks",
     lambda _: ModelParallel2DStrategy(pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble", compile=True),
     ParallelConfigError, r"'ZBVZeroBubble' splits each backward .* use compile=False"),
    ("fewer micro-batches than stages for 1F1B",
     lambda _: ModelParallel2DStrategy(pipeline_parallel_size=4, pipeline_microbatches=2),
     ParallelConfigError, r"pipeline_schedule='1F1B' needs at least pipeline_parallel_size \(4\) micro-batches, got 2.*'GPipe'"),
    ("a block count per stage missing",
     lambda _: ModelParallel2DStrategy(pipeline_parallel_size=2, pipeline_layers_per_stage=[4]),
     ParallelConfigError, r"pipeline_layers_per_stage has 1 entries but the pipeline has 2 stages"),
    ("pipeline size not dividing the world", lambda _: trainer(pipeline_parallel_size=3),
     ParallelConfigError, r"pipeline_parallel_size \(3\) must divide the world size \(4 = 1 node\(s\) × 4 device\(s\)\)"),
    ("three sizes not multiplying to the world",
     lambda _: trainer(pipeline_parallel_size=2, data_parallel_size=2, tensor_parallel_size=2),
     ParallelConfigError, r"pipeline_parallel_size × data_parallel_size × tensor_parallel_size \(2 × 2 × 2 = 8\).*\(1, 2\), \(2, 1\)"),
    ("more stages than blocks, before spawn",
     lambda _: fit_before_spawn(LlamaLightningModule("debug", model_overrides={"n_layers": 2}), pipeline_parallel_size=4,
                                pipeline_microbatches=4),
     ParallelConfigError, r"the model has 2 transformer blocks, fewer than the 4 pipeline stages"),
    ("block counts not adding up, before spawn",
     lambda _: fit_before_spawn(LlamaLightningModule("debug"), pipeline_parallel_size=2, pipeline_layers_per_stage=[3, 3]),
     ParallelConfigError, r"pipeline_layers_per_stage \[3, 3\] adds up to 6 blocks but the model has 4"),
    ("init_from a directory whose tensors do not match its config.json",
     lambda tmp: LlamaLightningModule(init_from=mismatched_weights(tmp)),
     ValueError, r"does not hold the model's weights \(1 problem\(s\)\):\n  - model\.layers\.0\.mlp\.up_proj\.weight: missing"),
    ("init_from a directory holding a tensor of another shape",
     lambda tmp: LlamaLightningModule(init_from=mismatched_weights(tmp, shape=(32, 32))),
     ValueError, r"model\.layers\.0\.mlp\.up_proj\.weight: stored \(32, 32\), the model's is \(64, 32\)"),
    ("init_from a Llama with attention biases",
     lambda tmp: LlamaLightningModule(init_from=llama_directory(tmp, attention_bias=True)),
     ValueError, r"config\.json describes a Llama this model cannot represent: attention_bias is True \(needs False\)"
     r".*HFCausalLMModule"),
    ("a tied model under a pipeline",
     lambda _: fit_before_spawn(LlamaLightningModule("debug", model_overrides={"tie_word_embeddings": True}),
                                pipeline_parallel_size=2),
     ParallelConfigError, r"pipeline parallelism cannot split a model with tied parameters \(tok_embeddings\.weight ="
                          r" output\.weight\).*Use pipeline_parallel_size=1"),
    ("micro-batches not dividing the batch, before spawn",
     lambda _: fit_before_spawn(LlamaLightningModule("debug"), TextDataModule(seq_len=32, batch_size=6),
                                pipeline_parallel_size=2, pipeline_microbatches=4),
     ParallelConfigError, r"pipeline_microbatches \(4\) must divide the per-rank batch size \(6\); use one of 1, 2, 3, 6"),
    ("context parallel size 0", lambda _: trainer(context_parallel_size=0),
     ParallelConfigError, r"context_parallel_size must be a positive integer, got 0"),
    ("context parallel size not dividing the world", lambda _: trainer(context_parallel_size=3),
     ParallelConfigError, r"context_parallel_size \(3\) must divide the world size \(4; 1 node\(s\) × 4 device\(s\)\);"
     r" use one of 1, 2 or 4"),
    ("sequence length not a multiple of 2 × context × tensor, before spawn",
     lambda _: fit_before_spawn(LlamaLightningModule("debug"), TextDataModule(seq_len=36, batch_size=2),
                                context_parallel_size=2, tensor_parallel_size=2),
     ParallelConfigError, r"sequence length \(36\) must be a multiple of 2 × context_parallel_size \(2\) ×"
     r" tensor_parallel_size \(2, sequence parallelism\) = 8.*e\.g\. 32"),
    ("loss chunk 0", lambda _: LlamaLightningModule("debug", loss_chunk_size=0),
     ValueError, r"loss_chunk_size must be a positive number of tokens, got 0"),
    ("unknown preset", lambda _: LlamaLightningModule("llama9-1t"),
     ValueError, r"llama9-1t"),
    ("a rotary scaling override out of range",
     lambda _: LlamaLightningModule("debug", model_overrides={"rope_scaling": {"rope_type": "llama3", "factor": 0.5}}),
     ValueError, r"rope_scaling\.factor must be a number of at least 1, got 0\.5"),
    ("a rotary scaling override of another type",
     lambda _: LlamaLightningModule("debug", model_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
     ValueError, r"rope_scaling\.rope_type 'yarn' is not supported; supported: 'llama3'"),
    ("init_from a Llama with another rotary scaling",
     lambda tmp: LlamaLightningModule(init_from=llama_directory(tmp, rope_parameters={
         "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
     ValueError, r"uses the rotary scaling rope_type 'yarn', which this model does not implement; supported: 'default'"
     r" \(no scaling\) and 'llama3'"),
    ("data seq_len 0", lambda _: TextDataModule(seq_len=0),
     DataError, r"seq_len must be a positive integer, got 0"),
    ("validation fraction 1.5", lambda _: TextDataModule(val_fraction=1.5),
     DataError, r"val_fraction must be in \[0, 1\), got 1\.5"),
    ("a large corpus without a token cache",
     lambda tmp: (tmp / "corpus.txt").write_text("some text " * 200) and TextDataModule(
         paths=[str(tmp / "corpus.txt")], cache_dir=str(tmp / "cache"), max_unprepared_mb=0.001).check_prepared(),
     DataError, r"The corpus \(1 files, 0\.0 MB\) has no token cache in .* and is larger than max_unprepared_mb"
                r" \(0\.001 MB\).*\n    lightning-2d prepare-data "),
    ("document masking with a tokenizer without an end-of-text token",
     lambda tmp: TextDataModule(tokenizer=tokenizer_without_eos(tmp), document_mask=True),
     DataError, r"document_mask=True needs an end-of-text token .*has none; name it with eos_token=\.\.\."),
    ("document masking for a module that cannot take it, before spawn",
     lambda _: fit_before_spawn(without_document_mask(), TextDataModule(seq_len=32, batch_size=2, document_mask=True,
                                                                        eos_token="\n"), tensor_parallel_size=2),
     ParallelConfigError, r"TextDataModule\(document_mask=True\) gives each packed document its own positions, but"
                          r" Mine cannot take them \(its supports_document_mask is False\)"),
    ("a beginning-of-text token asked of a tokenizer without one", lambda _: TextDataModule(add_bos=True),
     DataError, r"add_bos=True needs a beginning-of-text token, but the tokenizer 'byte' has none .*set add_bos=False"),
    ("a tokenizer folder without a tokenizer", lambda tmp: TextDataModule(tokenizer=str(tmp)),
     FileNotFoundError, r"Tokenizer folder '.*' has none of tokenizer\.json, tokenizer\.model; give a model folder"),
    ("Meta's tiktoken tokenizer.model without tiktoken", tiktoken_without_the_package,
     ImportError, r"is a tiktoken BPE file .*pip install 'lightning-2d\[tiktoken\]' \(or give the model's Hugging Face"
     r" tokenizer\.json instead\)"),
    ("export with a tokenizer that does not exist", export_with_a_missing_tokenizer,
     ExportError, r"--tokenizer .*tokenizer\.json: no such file or folder; give a tokenizer file or a model folder"),
    ("explicit checkpoint that does not exist", lambda tmp: resolve_checkpoint(tmp / "epoch=0-step=9.ckpt", print),
     CheckpointError, r"epoch=0-step=9\.ckpt does not exist\. Not resuming from another checkpoint"),
    ("checkpoint holding a pickled callable", lambda tmp: check_ckpt_path(planted_checkpoint(tmp)),
     CheckpointError, r"meta\.pt holds a pickled posix\.system, which a weights-only load refuses to build .*the file"
                      r" was not loaded.*looks like a function, which no checkpoint needs to hold"),
    ("checkpoint whose digests.json is cut short", lambda tmp: check_ckpt_path(cut_manifest(tmp)),
     CheckpointError, r"is damaged \(digests\.json is unreadable \(JSONDecodeError: .*\): cut short or overwritten, so it"
                      r" cannot vouch for the checkpoint's files\)\. Not resuming from another checkpoint"),
    ("checkpoint whose bytes changed", lambda tmp: check_ckpt_path(changed_bytes(tmp)),
     CheckpointError, r"is damaged: its bytes changed after it was saved at step 8 \(__0_0\.distcp: .* reads as .*,"
                      r" saved as .*\)\. Not resuming from another checkpoint"),
    ("checkpoint whose digests.json was edited", lambda tmp: check_ckpt_path(edited_manifest(tmp)),
     CheckpointError, r"is damaged \(digests\.json is damaged: its content does not match its own digest"),
    ("export of a file that is not a checkpoint", export_of,
     SystemExit, r"1"),
    ("export of a checkpoint whose shard was cut short", export_of_a_cut_shard,
     ExportError, r"is damaged \(cut short or incomplete after saving\):\n  - __0_0\.distcp: 100 bytes, but the"
                  r" metadata places data up to byte"),
    ("export of a folder that is not a checkpoint", export_of_a_folder,
     FileNotFoundError, r"empty is not a complete checkpoint \(a folder with \.metadata and meta\.pt, or a file\)"),
    ("SimpleFSDP asked to keep weights gathered under activation checkpointing",
     lambda _: ModelParallel2DStrategy(fsdp_backend="simple_fsdp", reshard_after_forward="never",
                                       activation_checkpointing="full"),
     ParallelConfigError, r"fsdp_backend='simple_fsdp' with reshard_after_forward='never' and"
                          r" activation_checkpointing='full': the recomputation of a checkpointed block gathers"),
    ("SimpleFSDP asked to reshard without activation checkpointing",
     lambda _: ModelParallel2DStrategy(fsdp_backend="simple_fsdp", reshard_after_forward="always"),
     ParallelConfigError, r"SimpleFSDP has no hook to free a gathered weight after forward .*Set"
                          r" activation_checkpointing='full'"),
    ("SimpleFSDP with FSDP2's float8 all-gather",
     lambda _: ModelParallel2DStrategy(fsdp_backend="simple_fsdp", float8=True, fsdp_float8_all_gather=True),
     ParallelConfigError, r"the float8 all-gather is FSDP2's .* use fsdp_float8_all_gather=False, or"
                          r" fsdp_backend='fully_shard'"),
]
if _hf_available():
    CASES += [
        ("a teacher whose tokenizer maps other tokens", lambda tmp: (lambda folders: LlamaLightningModule(
            init_from=folders[0], teacher=folders[1], distillation={}))(tokenizer_folders(tmp)),
         DistillationConfigError, r"the teacher's tokenizer \(.*teacher/tokenizer.json\) maps other tokens to ids than"
                                  r" the student's \(.*student/tokenizer.json\).*with the student's tokenizer"),
        ("HF decoder under pipeline parallelism, before spawn",
         lambda _: fit_before_spawn(hf(), pipeline_parallel_size=2),
         ParallelConfigError, r"pipeline_parallel_size=2 splits a model into stages by its blocks.*Hugging Face decoder"),
        ("HF decoder under context parallelism, before spawn",
         lambda _: fit_before_spawn(hf(), TextDataModule(seq_len=32, batch_size=2), context_parallel_size=2),
         ParallelConfigError, r"context_parallel_size=2 splits every sequence over 2 ranks.*Hugging Face decoder"),
        ("HF model outside the family", lambda _: hf(model_type="gpt2"),
         ValueError, r"model_type 'gpt2' is not one of the Llama-family decoders"),
        ("LoRA rank 0", lambda _: LlamaLightningModule(lora={"rank": 0}),
         LoRAConfigError, r"rank must be a positive integer, got 0"),
        ("LoRA setting misspelled", lambda _: LlamaLightningModule(lora={"r": 8}),
         LoRAConfigError, r"Unknown LoRA setting\(s\) \['r'\]; the settings are \['alpha', 'dropout', 'quantize_base', 'rank'"),
        ("LoRA target misspelled", lambda _: LlamaLightningModule(lora={"targets": ["q_porj"]}),
         LoRAConfigError, r"lora.targets \['q_porj'\] match no linear layer of Transformer; its linear layers are"
                          r" called \['output', 'w1'.*Hugging Face names accepted: \['down_proj'"),
        ("LoRA target misspelled, HF", lambda _: hf_lora(targets=["wq", "qkv"]),
         LoRAConfigError, r"lora.targets \['qkv'\] match no linear layer of LlamaForCausalLM.*'q_proj'"),
        ("LoRA on the output head", lambda _: LlamaLightningModule(lora={"targets": ["output"]}),
         LoRAConfigError, r"LoRA adapts plain nn.Linear layers; this target is a VocabProjection"),
        ("LoRA with float8", lambda _: fit_before_spawn(LlamaLightningModule(lora={}), TextDataModule(seq_len=32,
                                                        batch_size=2), tensor_parallel_size=2, float8="emulate",
                                                        sequence_parallel=False),
         ParallelConfigError, r"float8='emulate' with LoRA adapters \(LlamaLightningModule\(lora=...\)\).*Use"
                              r" float8=False with lora"),
        ("QLoRA quantization misspelled", lambda _: LlamaLightningModule(lora={"quantize_base": "nf8"}),
         LoRAConfigError, r"quantize_base must be one of \['nf4'\] or None, got 'nf8'"),
        ("QLoRA under tensor parallelism", lambda _: fit_before_spawn(QLORA(), TextDataModule(seq_len=32, batch_size=2),
                                                                      tensor_parallel_size=2),
         ParallelConfigError, r"lora.quantize_base='nf4' \(QLoRA\) with tensor_parallel_size=2: NF4 weights are"
                              r" quantized in blocks of the whole weight.*Use tensor_parallel_size=1"),
        ("QLoRA under HSDP", lambda _: fit_before_spawn(QLORA(), TextDataModule(seq_len=32, batch_size=2),
                                                        data_parallel_size=4, tensor_parallel_size=1,
                                                        data_parallel_replicate_size=2),
         ParallelConfigError, r"QLoRA\) with data_parallel_replicate_size=2: torchao's NF4 all-gather runs over a 1-D"),
        ("QLoRA with SimpleFSDP", lambda _: fit_before_spawn(QLORA(), TextDataModule(seq_len=32, batch_size=2),
                                                             tensor_parallel_size=1, fsdp_backend="simple_fsdp"),
         ParallelConfigError, r"QLoRA\) with fsdp_backend='simple_fsdp'.*Use fsdp_backend='fully_shard'"),
        ("QLoRA with compile", lambda _: fit_before_spawn(QLORA(), TextDataModule(seq_len=32, batch_size=2),
                                                          tensor_parallel_size=1, compile=True),
         ParallelConfigError, r"QLoRA\) with compile=True: a compiled block fails on the NF4 weights FSDP2 gathers.*"
                              r"Use compile=False with quantize_base='nf4'"),
        ("expert parallelism on a dense model", lambda _: fit_before_spawn(
            LlamaLightningModule(), TextDataModule(seq_len=32, batch_size=2), data_parallel_size=4,
            tensor_parallel_size=1, expert_parallel_size=2),
         ParallelConfigError, r"expert_parallel_size=2 but the model has no mixture-of-experts layers.*use"
                              r" expert_parallel_size=1"),
        ("expert parallelism with a plan naming no experts to split", lambda _: fit_before_spawn(
            LlamaLightningModule("debug-moe"), TextDataModule(seq_len=32, batch_size=2), data_parallel_size=4,
            tensor_parallel_size=1, expert_parallel_size=2, plan=without_expert_entries()),
         ParallelConfigError, r"expert_parallel_size=2 but the plan names no experts to split \(ParallelPlan"
                              r"\.expert_parallel is empty\).*or use expert_parallel_size=1"),
        ("experts not divisible by expert_parallel_size", lambda _: fit_before_spawn(
            LlamaLightningModule("debug-moe", model_overrides={"moe": {"num_experts": 6, "top_k": 2, "hidden_dim": 64}}),
            TextDataModule(seq_len=32, batch_size=2), data_parallel_size=4, tensor_parallel_size=1,
            expert_parallel_size=4),
         ParallelConfigError, r"expert_parallel_size \(4\) must divide the model's 6 experts.*use one of 1, 2, 3"
                              r" or 6"),
        ("expert_parallel_size not dividing the data-shard ranks", lambda _: trainer(
            data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=4),
         ParallelConfigError, r"expert_parallel_size \(4\) must divide the data-shard × context ranks \(2 ="
                              r" data_parallel_size 2.*use one of 1 or 2"),
        ("expert_parallel_size that would fit over the tensor-parallel ranks", lambda _: trainer(
            data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=4),
         ParallelConfigError, r"use one of 1 or 2, or experts_over_tensor_parallel=True \(the groups then take in"
                              r" the tensor_parallel_size 2 ranks"),
        ("experts over the tensor-parallel ranks not k x tp", lambda _: trainer(
            data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=8, experts_over_tensor_parallel=True),
         ParallelConfigError, r"expert_parallel_size \(8\) with experts_over_tensor_parallel=True must be k ×"
                              r" tensor_parallel_size \(2\) with k dividing the data-shard × context ranks.*use one of"
                              r" 2 or 4"),
        ("experts over the tensor-parallel ranks without sequence parallelism", lambda _: trainer(
            data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=4, experts_over_tensor_parallel=True,
            sequence_parallel=False),
         ParallelConfigError, r"experts_over_tensor_parallel=True with sequence_parallel=False: each tensor-parallel"
                              r" rank routes its own slice"),
        ("experts over the tensor-parallel ranks without expert parallelism", lambda _: trainer(
            data_parallel_size=2, tensor_parallel_size=2, experts_over_tensor_parallel=True),
         ParallelConfigError, r"experts_over_tensor_parallel=True with expert_parallel_size=1 and"
                              r" tensor_parallel_size=2: .*both must be above 1"),
        ("Hugging Face mixture of experts asking for transformers' per-rank auxiliary loss", lambda _: hf(
            model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
         ValueError, r"output_router_logits=True\); transformers would compute it over each rank's tokens.*"
                     r"config_overrides: \{output_router_logits: false\}"),
        ("expert parallelism on the Hugging Face path", lambda _: fit_before_spawn(
            hf(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2), TextDataModule(seq_len=32,
            batch_size=2), data_parallel_size=4, tensor_parallel_size=1, expert_parallel_size=2),
         ParallelConfigError, r"expert_parallel_size=2 with HFCausalLMModule.*LlamaLightningModule\(init_from="),
        ("SimpleFSDP with compiled full activation checkpointing in torch 2.13", lambda _: ModelParallel2DStrategy(
            fsdp_backend="simple_fsdp", compile=True, activation_checkpointing="full"),
         ParallelConfigError, r"fsdp_backend='simple_fsdp' with compile=True and activation_checkpointing='full' fails"
                              r" in torch 2\.13.*use activation_checkpointing='selective'"),
        ("LoRA on transformers' own experts", lambda _: hf_lora_experts(),
         LoRAConfigError, r"LoRA on transformers' own mixture of experts \(HFCausalLMModule, or a transformers model"
                          r" given to Fabric\) is not supported: its fused experts .*Train"
                          r" LlamaLightningModule\(init_from=<the same folder>, lora=...\)"),
        ("QLoRA on the routed experts", lambda _: LlamaLightningModule(
            "debug-moe", lora={"rank": 4, "quantize_base": "nf4"}),
         LoRAConfigError, r"QLoRA\) on the routed experts: their weights are stacked 3-D tensors .*Use"
                              r" quantize_base=None, or lora.targets without the routed experts"),
        ("mixture-of-experts setting misspelled", lambda _: LlamaLightningModule(
            "debug-moe", model_overrides={"moe": {"num_experts": 8, "top_k": 2, "hidden_dim": 64,
                                                  "load_balancing": "aux"}}),
         ValueError, r"load_balancing must be 'aux_loss', 'bias' or 'none', got 'aux'"),
        ("a preference reference of switched-off adapters without adapters", lambda _: LlamaLightningModule(
            "debug", preference={"loss_type": "sigmoid", "reference": "adapters_off"}),
         PreferenceConfigError, r"preference reference='adapters_off' needs adapters to switch off, but"
                                r" LlamaLightningModule trains the whole model \(no lora=\)\. Use reference='copy'"),
        ("a preference reference copy beside adapters", lambda _: LlamaLightningModule(
            "debug", preference={"loss_type": "sigmoid", "reference": "copy"}, lora={"rank": 4}),
         PreferenceConfigError, r"preference reference='copy' with lora=: under LoRA the reference is the base.*Use"
                                r" reference='adapters_off'"),
        ("KTO on pairs", lambda tmp: fit_before_spawn(
            LlamaLightningModule("debug", preference={"loss_type": "kto"}, lora={"rank": 4}),
            PreferenceDataModule(seq_len=64, batch_size=1, cache_dir=str(tmp)), data_parallel_size=2,
            tensor_parallel_size=2),
         PreferenceConfigError, r"preference loss_type='kto' scores unpaired examples \(prompt, completion, label\),"
                                r" but the PreferenceDataModule's rows are pairs.*unpaired_rows"),
        ("a pairwise preference loss on unpaired examples", lambda tmp: fit_before_spawn(
            LlamaLightningModule("debug", preference={"loss_type": "sigmoid"}, lora={"rank": 4}),
            PreferenceDataModule(format="unpaired", seq_len=64, batch_size=1, cache_dir=str(tmp)),
            data_parallel_size=2, tensor_parallel_size=2),
         PreferenceConfigError, r"preference loss_type='sigmoid' compares a chosen and a rejected completion of one"
                                r" prompt, but the PreferenceDataModule's rows are unpaired examples.*use"
                                r" loss_type='kto'"),
        ("a teacher without distillation settings", lambda _: LlamaLightningModule("debug", teacher="debug"),
         DistillationConfigError, r"LlamaLightningModule has a teacher \(preset 'debug'\) but no distillation=:.*"
                                  r"or leave teacher out"),
        ("distillation settings without a teacher", lambda _: LlamaLightningModule(
            "debug", distillation={"loss": "forward_kl"}),
         DistillationConfigError, r"LlamaLightningModule\(distillation=\.\.\.\) needs teacher=: the model distilled"
                                  r" from"),
        ("a teacher of another vocabulary", lambda _: LlamaLightningModule(
            "debug", teacher={"model": "debug", "model_overrides": {"vocab_size": 320}}, distillation={}),
         DistillationConfigError, r"the teacher \(preset 'debug' with \{'vocab_size': 320\}\) has a vocabulary of 320"
                                  r" tokens, the student 256.*needs the same vocabulary"),
        ("a teacher that is neither a folder nor a preset", lambda _: LlamaLightningModule(
            "debug", teacher="llama-9b", distillation={}),
         DistillationConfigError, r"teacher='llama-9b' is neither a model folder \(no directory there\) nor a preset"
                                  r" \(debug, "),
        ("a distillation weight out of range", lambda _: LlamaLightningModule(
            "debug", teacher="debug", distillation={"alpha": 0}),
         DistillationConfigError, r"distillation alpha must be in \(0, 1\] .*got 0"),
        ("distillation settings that select no divergence", lambda _: LlamaLightningModule(
            "debug", teacher="debug", distillation={"loss": "forward_kl", "beta": 0.5}),
         DistillationConfigError, r"distillation beta=0.5 weighs jsd's mixture, but loss='forward_kl'.*leave beta out,"
                                  r" or use loss='jsd'"),
        ("distillation and a preference loss in one step", lambda _: LlamaLightningModule(
            "debug", teacher="debug", distillation={}, preference={"loss_type": "sigmoid"}),
         DistillationConfigError, r"distillation= with preference=\{'loss_type': 'sigmoid', \.\.\.\}: one step trains"
                                  r" one objective.*drop one of them"),
        ("distillation under pipeline parallelism", lambda _: fit_before_spawn(
            LlamaLightningModule("debug", teacher="debug", distillation={}), data_parallel_size=2,
            tensor_parallel_size=1, pipeline_parallel_size=2),
         DistillationConfigError, r"distillation with pipeline_parallel_size=2 is not supported yet: the student's last"
                                  r" stage would need.*Use pipeline_parallel_size=1"),
        ("a teacher whose heads tensor parallelism does not divide", lambda _: fit_before_spawn(
            LlamaLightningModule("debug", teacher={"model": "debug", "model_overrides": {"n_kv_heads": 2}},
                                 distillation={}), data_parallel_size=1, tensor_parallel_size=4),
         DistillationConfigError, r"tensor_parallel_size \(4\) must divide the teacher's n_kv_heads \(2\): the teacher is"
                                  r" sharded by its own plan on the student's meshes; try 1, 2"),
        ("a frozen model given to fabric.setup under pipeline parallelism", lambda _: L.Fabric(
            accelerator="cpu", devices=4, strategy=FabricStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                                  pipeline_parallel_size=2),
        ).strategy.validate(frozen=True, owner="Transformer"),  # what fabric.setup(reference) checks first
         ParallelConfigError, r"Transformer is a frozen model held beside the trained one \(every parameter"
                              r" requires_grad=False\), but pipeline_parallel_size=2 would split it.*under Fabric only"
                              r" the trained model's pipeline is stepped.*Use pipeline_parallel_size=1.*or the Trainer"
                              r" with a module that declares it"),
    ]


def test_the_table_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_misconfiguration_is_refused_clearly(case, tmp_path, capsys):
    _, run, error, pattern = case
    with pytest.raises(error) as caught:
        run(tmp_path)
    assert re.search(pattern, str(caught.value)), str(caught.value)
    if error is SystemExit:  # a CLI: one line on stderr, no traceback, nothing left behind
        err = capsys.readouterr().err
        assert "is not a torch.save zip archive" in err and "Traceback" not in err
        assert not (tmp_path / "out").exists()
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any process group
