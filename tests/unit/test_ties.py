"""Tied embeddings (one weight for the token embedding and the output head) through the parallel steps, on the
planner's fake world (one process standing in for 4 ranks): the tie survives tensor parallelism as one DTensor
sharded over the vocabulary, FSDP2 manages it in the root unit, and a pipeline refuses it. The training parity of a
tied model at 2×2 against one device is in tests/distributed/test_downloaded_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from lightning_2d.models.llama.model import ModelArgs, Transformer
from lightning_2d.models.llama.plan import llama_plan
from lightning_2d.parallel import ParallelConfig, ParallelDims, parallelize_model
from lightning_2d.parallel.ties import holds_shared_outside, retie, shared_parameters

TIED = ModelArgs.from_name("debug", tie_word_embeddings=True)


def meta_model(args: ModelArgs = TIED) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def test_a_tied_model_has_one_weight_under_two_names_and_counts_it_once():
    model = meta_model()
    assert model.output.weight is model.tok_embeddings.weight
    assert shared_parameters(model) == [("tok_embeddings.weight", "output.weight")]
    assert shared_parameters(meta_model(ModelArgs.from_name("debug"))) == []
    assert sum(p.numel() for p in model.parameters()) == TIED.num_params()
    untied = ModelArgs.from_name("debug")
    assert untied.num_params() - TIED.num_params() == TIED.vocab_size * TIED.dim
    # The shared weight is also the head's matmul: it stays in the FLOPs count.
    assert TIED.num_params(exclude_embedding=True) == TIED.num_params()
    assert "output.weight" not in model.param_init_specs()  # one init, the head's scale
    assert model.param_init_specs()["tok_embeddings.weight"].std == TIED.dim**-0.5


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_tie_survives_tensor_parallelism_and_fsdp_as_one_dtensor_in_the_root_unit(sequence_parallel):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from lightning_2d.tools.planner import fake_world

    model = meta_model()
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2,
                            sequence_parallel=sequence_parallel).resolve_dtypes("32-true")
    with fake_world(4):
        mesh = ParallelDims(1, 2, 2).build_mesh("cpu")
        parallelize_model(model, mesh, llama_plan(TIED, config, module=""), config)
        weight = model.tok_embeddings.weight
        assert model.output.weight is weight and isinstance(weight, DTensor)
        # Sharded over the vocabulary by tensor parallelism, then by FSDP over the data ranks.
        assert weight.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
        # (FSDP's shard of a tensor-parallel Shard(0) is a strided shard of dim 0.)
        assert weight.placements[1] == Shard(0) and weight.placements[0].dim == 0, weight.placements
        assert weight.to_local().shape == (TIED.vocab_size // 4, TIED.dim)
        # Not a unit of its own (FSDP2 manages a parameter in one unit): the embedding and the head, with the
        # norm of the output unit, stay in the root; every block is still its own unit.
        assert not isinstance(model.tok_embeddings, FSDPModule) and not isinstance(model.output, FSDPModule)
        assert isinstance(model, FSDPModule)
        assert all(isinstance(block, FSDPModule) for block in model.layers.values())
        assert [p for p in model.parameters() if p is weight] == [weight]  # one parameter for the optimizer


def test_a_pipeline_refuses_a_tied_model_with_the_reason():
    from lightning_2d.tools.planner import fake_world

    config = ParallelConfig(data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=2,
                            pipeline_schedule="1F1B").resolve_dtypes("32-true")
    with fake_world(2):
        mesh = ParallelDims(1, 1, 1, pp=2).build_mesh("cpu")
        with pytest.raises(ValueError, match=r"pipeline parallelism cannot split a model with tied parameters "
                                             r"\(tok_embeddings\.weight = output\.weight\).*pipeline_parallel_size=1"):
            parallelize_model(meta_model(), mesh, llama_plan(TIED, config, module=""), config)


def test_retie_refuses_names_sharded_two_ways():
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_2d.tools.planner import fake_world

    model = meta_model()
    with fake_world(2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
        weight = model.tok_embeddings.weight
        model.tok_embeddings.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        model.output.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        with pytest.raises(ValueError, match=r"tok_embeddings\.weight and output\.weight got different tensor-parallel"
                                             r" layouts \(\[Shard\(dim=0\)\].*vs \[Replicate\(\)\]"):
            retie(model, [("tok_embeddings.weight", "output.weight")])


def test_a_unit_holding_both_uses_of_a_tie_may_be_its_own_unit():
    model = meta_model()
    assert holds_shared_outside(model.tok_embeddings, model) == ["output.weight", "tok_embeddings.weight"]
    assert holds_shared_outside([model.tok_embeddings, model.output], model) == []
    assert holds_shared_outside(model.layers["0"], model) == []
    # The model's ties computed once by a caller that asks for many units give the same answers; none: nothing held.
    ties = shared_parameters(model)
    assert holds_shared_outside(model.tok_embeddings, model, ties) == ["output.weight", "tok_embeddings.weight"]
    assert holds_shared_outside(model.tok_embeddings, model, []) == []


def test_a_tied_hugging_face_decoder_keeps_its_tie_through_the_parallel_steps():
    transformers = pytest.importorskip("transformers")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    from lightning_2d.hf import hf_decoder_plan, load_hf_config
    from lightning_2d.tools.planner import fake_world

    config = load_hf_config({"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "tie_word_embeddings": True})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    parallel = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2).resolve_dtypes("32-true")
    with fake_world(4):
        mesh = ParallelDims(1, 2, 2).build_mesh("cpu")
        parallelize_model(model, mesh, hf_decoder_plan(config, parallel, module=""), parallel)
        weight = model.model.embed_tokens.weight
        assert model.lm_head.weight is weight and weight.placements[1] == Shard(0)
        assert not isinstance(model.model.embed_tokens, FSDPModule) and isinstance(model, FSDPModule)
