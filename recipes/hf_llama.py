"""Train a Hugging Face ``transformers`` Llama-family model with the 2D strategy: no plan, no hooks.

    python recipes/hf_llama.py                      # 4 CPU processes, (dp, tp) = (2, 2), a tiny Llama
    python recipes/hf_llama.py --init-from DIR --accelerator gpu --devices 8 --tensor-parallel-size 8 \\
        --tokenizer DIR/tokenizer.json --data my_corpus/ --seq-len 4096

``HFCausalLMModule`` builds ``LlamaForCausalLM`` (or ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``) from its config on the meta device; the strategy applies the built-in plan (sequence parallelism
when ``sequence_parallel=True``), then each rank allocates only its shards: initialized from the
seed (the same weights at every layout and on one device) or read block by block from
``--init-from`` (a directory with ``config.json`` and safetensors, e.g. a downloaded checkpoint).
"""

from __future__ import annotations

import argparse
import email
from pathlib import Path

import lightning as L

from lightning_2d import ModelParallel2DStrategy, TextDataModule
from lightning_2d.hf import HFCausalLMModule

#: A small Llama for CPU: grouped-query attention (8 query heads over 4 key/value heads), byte vocabulary.
TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    parser.add_argument("--init-from", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--data", nargs="+", help="text files or folders (default: the email package's .py files)")
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=40)
    args = parser.parse_args()

    L.seed_everything(0)
    module = HFCausalLMModule(
        config=None if args.init_from else TINY_LLAMA,
        init_from=args.init_from,
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=args.max_steps,
    )
    paths = args.data or sorted(str(p) for p in Path(email.__file__).parent.rglob("*.py") if p.stat().st_size)
    data = TextDataModule(paths=paths, tokenizer=args.tokenizer, seq_len=args.seq_len, batch_size=8)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallel2DStrategy(
            tensor_parallel_size=args.tensor_parallel_size, sequence_parallel=args.sequence_parallel
        ),
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        q = module.model.model.layers[0].self_attn.q_proj.weight
        print(f"{type(module.model).__name__}: q_proj {list(q.device_mesh.mesh_dim_names)} {q.placements}")
        print(f"final loss: {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
