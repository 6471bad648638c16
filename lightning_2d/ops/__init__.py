"""Pure torch building blocks, below everything else: the fused output projection + cross-entropy, the
distillation divergences fused with a student's and a teacher's heads, the seeded, layout-independent parameter
initialization and the attention core with its masks (FlexAttention compiled once per process on CUDA). No
``torch.distributed``, no model family."""
