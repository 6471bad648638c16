"""Every misconfiguration is reported at once, with values and a fix, before any process group."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_2d import LlamaLightningModule, ModelParallel2DStrategy, ParallelConfig, ParallelConfigError
from lightning_2d.parallel import ParallelPlan, validate_parallel_dims
from lightning_2d.parallel.dims import resolve_parallel_dims


def llama_plan(n_heads=8, n_kv_heads=4) -> ParallelPlan:
    return ParallelPlan(tensor_parallel={"x": object()}, tp_divides={"n_heads": n_heads, "n_kv_heads": n_kv_heads})


def test_world_size_mismatch_lists_valid_pairs():
    with pytest.raises(ParallelConfigError, match=r"\(3 × 2 = 6\) must equal the world size \(4 ") as err:
        validate_parallel_dims(ParallelConfig(3, 2), world_size=4, devices_per_node=4)
    assert "valid (dp, tp) pairs: (1, 4), (2, 2), (4, 1)" in str(err.value)


def test_head_divisibility_names_the_sizes_and_suggests_fits():
    with pytest.raises(ParallelConfigError) as err:
        validate_parallel_dims(
            ParallelConfig(1, 8), world_size=8, devices_per_node=8, plan=llama_plan(n_heads=12, n_kv_heads=4)
        )
    message = str(err.value)
    assert "tensor_parallel_size (8) must divide n_heads (12); try 1, 2 or 4" in message
    assert "tensor_parallel_size (8) must divide n_kv_heads (4); try 1, 2 or 4" in message


def test_sequence_length_checked_only_under_sequence_parallel():
    with pytest.raises(ParallelConfigError, match=r"sequence length \(30\) must be divisible by tensor_parallel_size \(4\)"):
        validate_parallel_dims(ParallelConfig(1, 4), world_size=4, devices_per_node=4, seq_len=30)
    dims = validate_parallel_dims(
        ParallelConfig(1, 4, sequence_parallel=False), world_size=4, devices_per_node=4, seq_len=30
    )
    assert (dims.dp, dims.tp) == (1, 4)


def test_static_options_fail_at_construction_all_at_once():
    with pytest.raises(ParallelConfigError) as err:
        ModelParallel2DStrategy(
            tensor_parallel_size=0,
            activation_checkpointing="fulll",
            reshard_after_forward="sometimes",
            param_dtype="float8",
        )
    message = str(err.value)
    assert "tensor_parallel_size must be a positive integer or 'auto', got 0" in message
    assert "activation_checkpointing='fulll' is not a mode; choose one of 'none', 'full', 'selective'" in message
    assert "reshard_after_forward='sometimes' is not a policy" in message
    assert "param_dtype='float8' is not a dtype" in message


def test_selective_option_must_be_op_or_positive_int():
    with pytest.raises(ParallelConfigError, match=r"selective_ac_option='every' is invalid; use 'op'"):
        ParallelConfig(activation_checkpointing="selective", selective_ac_option="every")
    assert ParallelConfig(activation_checkpointing="selective", selective_ac_option="3").selective_ac_option == 3


def test_unsupported_precision_and_empty_plan():
    with pytest.raises(ParallelConfigError) as err:
        validate_parallel_dims(
            ParallelConfig(2, 2), world_size=4, devices_per_node=4, plan=ParallelPlan(), precision="16-true"
        )
    message = str(err.value)
    assert "precision='16-true' is not supported by the 2D strategy; choose one of 32-true, bf16-mixed, bf16-true" in message
    assert "tensor_parallel_size is 2 but the model's parallel plan has no tensor-parallel entries" in message


@pytest.mark.parametrize(
    ("dp", "tp", "world", "per_node", "expected"),
    [
        ("auto", "auto", 16, 8, (2, 8)),  # TP inside a node, DP across nodes
        ("auto", 2, 8, 8, (4, 2)),
        (2, "auto", 8, 8, (2, 4)),
        (1, 1, 1, 1, (1, 1)),
    ],
)
def test_auto_sizes(dp, tp, world, per_node, expected):
    assert resolve_parallel_dims(ParallelConfig(dp, tp), world, per_node) == expected


def test_trainer_construction_refuses_bad_layout_before_launching():
    with pytest.raises(ParallelConfigError, match=r"\(1 × 3 = 3\) must equal the world size \(4 = 1 node\(s\) × 4 device\(s\)\)"):
        L.Trainer(accelerator="cpu", devices=4, strategy=ModelParallel2DStrategy(tensor_parallel_size=3), logger=False)


def test_registered_by_name():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="model_parallel_2d", logger=False)
    assert isinstance(trainer.strategy, ModelParallel2DStrategy)


class SeqLenData(L.LightningDataModule):
    seq_len = 30

    def train_dataloader(self):
        return DataLoader([{"input_ids": torch.zeros(30, dtype=torch.long), "labels": torch.zeros(30, dtype=torch.long)}])


def test_fit_refuses_model_constraints_before_the_process_group(monkeypatch):
    # Pretend to be rank 0 of 4 processes started by a cluster launcher: Lightning then runs fit in
    # this process, and the strategy must fail before it creates the process group.
    for key, value in {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    module = LlamaLightningModule("debug", model_overrides={"n_kv_heads": 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=ModelParallel2DStrategy(tensor_parallel_size=4), logger=False,
        enable_checkpointing=False, max_steps=1,
    )
    with pytest.raises(ParallelConfigError) as err:
        trainer.fit(module, datamodule=SeqLenData())
    message = str(err.value)
    assert "tensor_parallel_size (4) must divide n_kv_heads (2); try 1 or 2" in message
    assert "sequence length (30) must be divisible by tensor_parallel_size (4)" in message
    assert not dist.is_initialized()


def test_float8_options_are_checked_together_at_construction():
    with pytest.raises(ParallelConfigError) as err:
        ModelParallel2DStrategy(float8="yes", float8_recipe="blockwise", fsdp_float8_all_gather=True)
    message = str(err.value)
    assert "float8='yes' is invalid; use True, False or 'emulate'" in message
    assert "float8_recipe='blockwise' is not a float8 recipe; choose one of 'tensorwise', 'rowwise'" in message
    with pytest.raises(ParallelConfigError, match="fsdp_float8_all_gather=True needs float8_recipe='tensorwise'"):
        ModelParallel2DStrategy(float8=True, float8_recipe="rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ParallelConfigError, match="fsdp_float8_all_gather=True needs float8=True"):
        ModelParallel2DStrategy(fsdp_float8_all_gather=True)


def test_gpu_only_features_fail_on_cpu_before_any_process_starts():
    strategy = ModelParallel2DStrategy(tensor_parallel_size=2, float8=True, async_tensor_parallel=True)
    with pytest.raises(ParallelConfigError) as err:
        L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    message = str(err.value)
    assert "float8=True runs on GPUs with float8 tensor cores (CUDA compute capability >= 8.9" in message
    assert "but the accelerator is 'cpu'" in message
    assert "async_tensor_parallel=True needs compile=True" in message
    assert "async_tensor_parallel=True needs CUDA GPUs with NCCL" in message
    assert not dist.is_initialized()
    # Emulated float8 has no hardware requirement.
    L.Trainer(accelerator="cpu", devices=4,
              strategy=ModelParallel2DStrategy(tensor_parallel_size=2, float8="emulate", sequence_parallel=False))


def test_emulated_float8_with_sequence_parallel_over_gloo_is_refused():
    strategy = ModelParallel2DStrategy(tensor_parallel_size=2, float8="emulate")
    with pytest.raises(ParallelConfigError, match="gloo cannot carry float8 tensors. Set sequence_parallel=False"):
        L.Trainer(accelerator="cpu", devices=4, strategy=strategy)


def test_replicate_size_must_divide_the_data_parallel_size():
    with pytest.raises(ParallelConfigError, match=r"data_parallel_replicate_size \(3\) must divide the data-parallel size \(4\).*use one of 1, 2 or 4"):
        validate_parallel_dims(ParallelConfig(data_parallel_replicate_size=3, tensor_parallel_size=2), world_size=8, devices_per_node=8)
    dims = validate_parallel_dims(ParallelConfig(data_parallel_replicate_size=2, tensor_parallel_size=2), world_size=8, devices_per_node=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2, 4)
    with pytest.raises(ParallelConfigError, match=r"data_parallel_replicate_size must be a positive integer, got 0"):
        ModelParallel2DStrategy(data_parallel_replicate_size=0)
