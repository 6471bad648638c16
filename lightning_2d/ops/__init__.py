"""Pure torch building blocks, below everything else: the fused output projection + cross-entropy and
the seeded, layout-independent parameter initialization. No ``torch.distributed``, no model family."""
