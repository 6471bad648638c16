"""The activation model: what autograd keeps for one micro-batch of the Llama ``Transformer`` (or of a
Hugging Face Llama-family decoder, ``Architecture``) on one device.

``ActivationModel`` counts, tensor by tensor, what the real forward saves for backward (and allocates while
it runs) per block, for the head and the loss, under each activation-checkpointing mode, and finds the
peak over a forward and a backward (``ActivationModel.estimate`` → ``ActivationEstimate``). Checked against
autograd's saved tensors and measured CPU peaks in ``tests/unit/test_planner.py``; a pipeline stage's estimate
(``schedules.pipeline_activation_estimate``) is built from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from lightning_2d.ops.linear_cross_entropy import chunk_tokens

#: LlamaLightningModule's and Transformer's default: the chunk sized by memory (``auto_chunk_tokens``).
DEFAULT_LOSS_CHUNK_SIZE: Optional[int] = None
#: FlexAttention's block size (``torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE``, torch 2.13): the
#: block mask holds its tables per 128 query rows × 128 keys.
FLEX_BLOCK_SIZE = 128
#: Activation bytes → peak of ``RMSNorm``'s backward per input element, beyond its saved tensors
#: (measured with a live-tensor tracker on CPU, torch 2.13): its fp32 chain rule through
#: ``rsqrt(mean(x²))`` holds about four fp32 tensors the input's size at once, and in bf16 a
#: low-precision one more.
NORM_BACKWARD_BYTES = {4: 16, 2: 18}


class ModelShape(Protocol):
    """The shape fields the activation model reads: ``ModelArgs``' names (also ``planner.models.HFDecoderArgs``')."""

    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_hidden_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class Architecture:
    """How a model family computes what ``ActivationModel`` counts; the defaults are our Llama ``Transformer``'s.

    A Hugging Face Llama-family decoder (``hf_architecture``) has the same blocks — two RMSNorms computed in
    fp32, the q/k/v/o projections, rotary embedding, SDPA, SwiGLU — so the per-block formula is the same but for
    the points below (each checked against autograd's saved tensors and the live tensors of a step on CPU, in
    ``tests/unit/test_planner.py``).

    Args:
        fused_loss: The head computes the loss chunk by chunk (``VocabProjection``). ``False``: the head
            returns the logits of the whole sequence (``(N, V)``, or ``(N, V / tp)`` under ``loss_parallel``) in
            the activation dtype and ``F.cross_entropy`` keeps its log-softmax (as ``HFCausalLMModule``); its
            backward holds that, the incoming gradient and its own output at once.
        repeat_kv: SDPA gets keys and values repeated to the query heads. ``False``: at their own heads
            (``transformers``' SDPA passes ``enable_gqa=True`` when there is no mask, i.e. causal attention
            without padding or sliding window).
        head_norms: An RMSNorm of each query and key head (Qwen3's ``q_norm``/``k_norm``): each keeps the
            projection's output in fp32, its normalized value and ``rsqrt`` (``n·(H + H_kv)·Dh·(4 + a)`` and
            ``4·n·(H + H_kv)`` bytes per block).
        rotary_per_forward: The rotary ``cos``/``sin`` rows are computed in each forward (``(1, T, Dh)`` each, in
            the activation dtype) and saved by every layer: counted once with the inputs. ``False``: rows of a
            resident table.
        first_block_slices: Under sequence parallelism the first block takes its slice of the whole sequence
            itself (``SequenceShardInput``): checkpointed, it keeps the whole input (``a·N·D``), not the slice.
        keeps_embeddings: The forward holds the embedding's output (``a·N·D``, whole) until it returns
            (``inputs_embeds``): a forward without a graph has it beside every block's working set.
        experts_tensor_parallel: A mixture of experts' routed and shared experts are split by their hidden features
            over the tensor-parallel ranks (our ``MoETensorParallel``). ``False``: each sparse block runs whole on
            every tensor-parallel rank (transformers' blocks under the built-in plan).
    """

    fused_loss: bool = True
    repeat_kv: bool = True
    head_norms: bool = False
    rotary_per_forward: bool = False
    first_block_slices: bool = False
    keeps_embeddings: bool = False
    experts_tensor_parallel: bool = True


#: Our Llama ``Transformer``.
NATIVE = Architecture()


def hf_architecture(model_type: str) -> Architecture:
    """A Hugging Face Llama-family decoder's (``model_type`` in ``HF_DECODER_TYPES``) under SDPA attention."""
    return Architecture(fused_loss=False, repeat_kv=False, head_norms=model_type in ("qwen3", "qwen3_moe"),
                        rotary_per_forward=True,
                        first_block_slices=True, keeps_embeddings=True, experts_tensor_parallel=False)


@dataclass(frozen=True)
class ExpertActivations:
    """What a mixture-of-experts block computes on one rank, for ``ActivationModel``.

    Args:
        num_experts: Routed experts ``E`` of the layer (router scores are ``N × E``).
        top_k: Experts per token ``k``.
        hidden: Each expert's hidden size on this rank ``F_e`` (``/ tp`` when tensor parallelism splits the experts).
        shared_hidden: The shared experts' hidden size on this rank (``/ tp``), 0 without.
        routed_tokens: Assignments this rank's experts compute per token of the micro-batch: ``k`` without expert
            parallelism; under it the worst case, every token of the ``EP`` ranks sending ``min(k, E / EP)``
            assignments to this rank's experts (``EP · min(k, E / EP)``; dropless: nothing caps it).
        expert_parallel: Whether the tokens are exchanged (the experts' input is then a regrouped copy).
        layers: Which of the model's blocks are mixtures of experts (by index); a pipeline stage's blocks (fewer
            than these) are all counted as such (the larger block: the estimate stays an upper bound).
        slices: The sequence slices the layer's tokens come in: ``tp`` when each tensor-parallel rank routes its own
            slice (``experts_over_tensor_parallel``: the router and the dispatch on ``N / tp`` tokens; the shared
            experts still on the whole sequence), else 1 (the whole sequence on every tensor-parallel rank).
    """

    num_experts: int
    top_k: int
    hidden: int
    shared_hidden: int
    routed_tokens: int
    expert_parallel: bool
    layers: tuple[bool, ...]
    slices: int = 1


@dataclass(frozen=True)
class ActivationModel:
    """What autograd keeps for one micro-batch of the Llama ``Transformer`` on one device.

    Every term is a tensor the real forward saves for backward (or allocates while it runs),
    counted once per storage, in the shapes one tensor-parallel rank sees. Derived from
    ``lightning_2d.models.llama.model`` op by op and checked against ``torch.autograd.graph.saved_tensors_hooks``
    and a live-tensor tracker on CPU (``tests/unit/test_planner.py``). It is also the building block of a
    pipeline stage's estimate (``pipeline_activation_estimate``): ``n_layers`` the stage's blocks,
    ``has_embedding`` / ``has_head`` whether it holds the embedding / the final norm, head and loss.
    Per block, with ``N`` tokens,
    ``s`` the sequence shards (``tp`` under sequence parallelism, else 1), ``a`` the activation
    bytes (``param_dtype``), local sizes ``D`` (dim), ``F`` (SwiGLU hidden / tp), ``H`` (query heads
    / tp), ``Dh`` (head dim):

    * each RMSNorm: its input in fp32 (``x.float()``, ``4·N/s·D``), the normalized value before the
      weight (``a·N/s·D``) and ``rsqrt`` (``4·N/s``);
    * the attention and SwiGLU inputs, all-gathered to the whole sequence under SP and saved by the
      projections (``2 × a·N·D``);
    * attention: rotated q, k and v repeated to the query heads (grouped-query attention), the SDPA
      output (``4 × a·N·H·Dh``) and its log-sum-exp (``4·N·H``); the rotary products save only
      the (resident) rotary table;
    * SwiGLU: ``w1`` out, ``silu`` out, ``w3`` out and their product (``4 × a·N·F``).

    Under context parallelism (``cp`` ranks per sequence) ``N`` is this rank's slice of the sequence; each block
    keeps its queries and attention output (``2 × a·N·H·Dh``) but the gathered keys and values of the whole
    sequence at the key/value heads (``2 × a·cp·N·H_kv·Dh``: not repeated, SDPA's ``enable_gqa``); the positions
    and their rotary rows are kept once per forward.

    With packed documents (``document_mask``) or context parallelism the micro-batch builds one attention mask that
    every layer uses, counted once with the inputs (``attention_mask_bytes``): CUDA's FlexAttention block mask.

    A Hugging Face decoder (``architecture``, see ``Architecture``) differs in three places: SDPA keeps the keys
    and values at their own heads (``a·N·(2·H + 2·H_kv)·Dh``), a Qwen3 block also keeps its per-head norms, and
    the head returns the logits, whose cross-entropy keeps its log-softmax (``a·N·V``, see the head below).

    Activation checkpointing keeps instead: ``full``: the block input (``a·N/s·D``); ``selective``
    per op: the block input and the outputs of torchtitan's save list (every other ``mm`` — ``wq``,
    ``wv``, ``w1``, ``w2`` —, SDPA, and the reduce-scatters under SP); ``selective`` N: every N-th
    block full. In backward a checkpointed block recomputes its forward (everything above, minus
    what is already kept).

    The head computes the fused loss in forward, a chunk of ``loss_chunk_size`` tokens at a time
    (``lightning_2d.ops.linear_cross_entropy``): it keeps the hidden states' gradient (``a·N·D``) and
    an fp32 accumulator of the head's gradient (``4·V·D``, ``V`` = vocabulary / tp) for backward,
    and allocates per chunk fp32 logits, their low-precision copy and, in bf16, the chunk's
    weight-gradient product. Logits of the whole sequence never exist.

    Without the fused loss (a Hugging Face decoder) the head keeps its input (``a·N·D``, the whole sequence)
    and the loss the log-softmax of the logits (``a·N·V'``, ``V'`` the vocabulary, or ``V / tp`` under
    ``loss_parallel``); the forward's peak has the logits too, and the loss's backward the incoming gradient
    and, unless ``loss_parallel`` (whose backward works in place), the log-softmax's gradient: up to
    ``3 · a·N·V'`` for the loss alone.

    Preference tuning against a reference model (``reference_forward``) runs one more forward per micro-batch, without
    a graph (``torch.no_grad``), after the trained model's forward and before its backward: nothing of it is kept, so
    it adds only its own peak (``reference_forward_transient``: its largest block's working set, or its head's) while
    every block's and the head's saved tensors are alive.

    Distillation (``teacher_dim``) runs the teacher inside the student's head call (``integration.distillation``):
    its whole forward without a graph (``teacher_forward``: its own largest block's working set, from its own
    ``ActivationModel``), then the fused divergence's chunks (``distillation_transient``), while every block's
    saved tensors are alive.

    Args:
        tokens: Tokens per micro-batch (``micro_batch_size × seq_len``).
        seq_shards: Sequence shards of the residual stream: ``tp`` under sequence parallelism, else 1.
        tp: Tensor-parallel size.
        dim: Model width ``D``.
        n_layers: Transformer blocks.
        heads: Query heads per tensor-parallel rank.
        kv_heads: Key/value heads per tensor-parallel rank.
        head_dim: ``Dh``.
        ffn_hidden: SwiGLU hidden size per tensor-parallel rank.
        vocab: Vocabulary rows per tensor-parallel rank.
        act_bytes: Bytes per activation element (the ``param_dtype`` FSDP computes in).
        loss_chunk_size: Tokens per chunk of the fused loss (``None``: sized by memory, ``auto_chunk_tokens``).
        has_embedding: Whether the token embedding runs here (its token ids are kept): always without
            a pipeline, on the first stage with one.
        has_head: Whether the final norm, the output head and the fused loss run here: always without a
            pipeline, on the last stage with one. Without them the peak is in the blocks' backward.
        architecture: How the model computes it (``NATIVE``: our ``Transformer``; ``hf_architecture``).
        document_mask: Packed documents kept apart (``TextDataModule(document_mask=True)``): the micro-batch builds a
            block mask of its documents. Context parallelism builds one in any case.
        loss_parallel: Without the fused loss: the logits stay vocabulary-sharded for the loss (the
            strategy's ``loss_parallel``); else they are gathered whole on every tensor-parallel rank.
        frozen_base: LoRA: the base's weights get no gradient (see ``for_layout``).
        experts: A mixture of experts' blocks (``ExpertActivations``), else ``None``.
        reference_forward: A preference loss's reference pass: each micro-batch also runs the reference model (a
            frozen copy, or the trained model with its adapters off) forward without a graph, between the trained
            model's forward and its backward.
        teacher_dim: Distillation: the teacher's width (its final hidden states, whole, feed its head); 0 without one.
        teacher_forward: The teacher's forward without a graph, its peak in bytes (its blocks' largest working set,
            ``reference_forward_transient`` of its own model on this layout).
        distillation_buffers: The fused divergence's ``chunk × vocab`` fp32 buffers held at once (3; ``jsd``: 4).
        distillation_chunk: Tokens per chunk of the fused divergence (``DistillationConfig.chunk_size``).
    """

    tokens: int
    seq_shards: int
    tp: int
    dim: int
    n_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    act_bytes: int
    loss_chunk_size: Optional[int] = DEFAULT_LOSS_CHUNK_SIZE
    has_embedding: bool = True
    has_head: bool = True
    cp: int = 1
    seq_len: int = 0
    architecture: Architecture = NATIVE
    loss_parallel: bool = False
    document_mask: bool = False
    frozen_base: bool = False
    experts: Optional[ExpertActivations] = None
    reference_forward: bool = False
    teacher_dim: int = 0
    teacher_forward: int = 0
    distillation_buffers: int = 3
    distillation_chunk: int = 512

    @property
    def _norm_row(self) -> int:
        """Bytes an RMSNorm keeps per row: its fp32 input and ``rsqrt``, and the normalized value for its weight's
        gradient (none when the weight is frozen: LoRA)."""
        return self.dim * (4 + (0 if self.frozen_base else self.act_bytes)) + 4

    @classmethod
    def for_layout(
        cls,
        args: ModelShape,
        *,
        tp: int,
        sequence_parallel: bool,
        seq_len: int,
        micro_batch_size: int,
        act_dtype: torch.dtype,
        loss_chunk_size: Optional[int] = DEFAULT_LOSS_CHUNK_SIZE,
        n_layers: Optional[int] = None,
        has_embedding: bool = True,
        has_head: bool = True,
        cp: int = 1,
        loss_parallel: bool = False,
        document_mask: bool = False,
        frozen_base: bool = False,
        expert_parallel: int = 1,
        reference_forward: bool = False,
        experts_over_tensor: bool = False,
    ) -> ActivationModel:
        """The model for ``args`` on one rank of a ``tp``-way tensor-parallel group.

        Args:
            args: The model's shape: ``ModelArgs`` (our ``Transformer``: ``NATIVE``), or a shape with an
                ``architecture`` (``planner.models.HFDecoderArgs``).
            tp: Tensor-parallel size (must divide the head counts, the SwiGLU width and the vocabulary
                as validated; uneven splits are rounded up).
            sequence_parallel: Whether the residual stream is sharded along the sequence (only with ``tp > 1``).
            seq_len: Tokens per sequence.
            micro_batch_size: Sequences per micro-batch and device.
            act_dtype: The dtype activations are computed in (``param_dtype``).
            loss_chunk_size: Tokens per chunk of the fused loss.
            n_layers: Blocks on this device (a pipeline stage's); ``None``: all of the model's.
            has_embedding: Whether the token embedding runs here (a pipeline's first stage).
            has_head: Whether the final norm, head and loss run here (a pipeline's last stage).
            cp: Context-parallel size: each rank holds ``seq_len / cp`` tokens of every sequence, and each
                attention layer keeps the keys and values of the whole sequence (gathered, at the key/value
                heads: ``lightning_2d.parallel.context``).
            loss_parallel: The strategy's ``loss_parallel`` (matters only without the fused loss).
            document_mask: Whether the batches carry packed documents' positions (a block mask per micro-batch).
            frozen_base: LoRA: the norms' and the head's weights get no gradient, so the norms keep no normalized
                value and the fused loss no head-gradient accumulator (the adapted projections keep their inputs, as
                for their weights' gradients: the adapters' ``A`` needs them).
            expert_parallel: ``expert_parallel_size``: a mixture of experts' tokens are exchanged between that many
                ranks (worst-case routing, ``ExpertActivations``), its experts whole on each tensor-parallel rank.
            reference_forward: A preference loss's reference pass (one more forward without a graph per
                micro-batch, ``reference_forward_transient``).
            experts_over_tensor: ``experts_over_tensor_parallel``: each tensor-parallel rank routes its own sequence
                slice to expert-parallel groups that take in the tensor-parallel ranks (``ExpertActivations.slices``).
        """
        moe = getattr(args, "moe", None)
        experts = None
        architecture = getattr(args, "architecture", NATIVE)
        if moe is not None and getattr(args, "moe_layers", ()):
            # Experts split by features only without expert parallelism, and only where the plan splits them.
            whole = not architecture.experts_tensor_parallel
            slices = tp if experts_over_tensor and expert_parallel > 1 and sequence_parallel and tp > 1 else 1
            split = tp if expert_parallel == 1 and not whole else 1
            per_rank = min(moe.top_k, moe.num_experts // expert_parallel)
            experts = ExpertActivations(
                num_experts=moe.num_experts, top_k=moe.top_k, hidden=math.ceil(moe.hidden_dim / split),
                shared_hidden=math.ceil(moe.shared_dim / (1 if whole else tp)),
                expert_parallel=expert_parallel > 1,
                routed_tokens=moe.top_k if expert_parallel == 1 else expert_parallel * per_rank,
                layers=tuple(args.is_moe_layer(i) for i in range(args.n_layers)), slices=slices,
            )
        return cls(
            document_mask=document_mask,
            frozen_base=frozen_base,
            architecture=architecture,
            loss_parallel=loss_parallel and tp > 1,
            cp=cp,
            seq_len=seq_len,
            tokens=micro_batch_size * seq_len // cp,
            seq_shards=tp if sequence_parallel and tp > 1 else 1,
            tp=tp,
            dim=args.dim,
            n_layers=args.n_layers if n_layers is None else n_layers,
            heads=math.ceil(args.n_heads / tp),
            kv_heads=math.ceil(args.kv_heads / tp),
            head_dim=args.head_dim,
            ffn_hidden=math.ceil(args.ffn_hidden_dim / tp),
            vocab=math.ceil(args.vocab_size / tp),
            act_bytes=act_dtype.itemsize,
            loss_chunk_size=loss_chunk_size,
            has_embedding=has_embedding,
            has_head=has_head,
            experts=experts,
            reference_forward=reference_forward,
        )

    def is_moe_block(self, i: int) -> bool:
        """Whether this device's block ``i`` is a mixture of experts (``ExpertActivations.layers``)."""
        if self.experts is None:
            return False
        layers = self.experts.layers
        return layers[i] if len(layers) == self.n_layers else any(layers)

    def _experts_saved(self) -> dict[str, int]:
        """A mixture-of-experts layer's saved tensors, in place of the SwiGLU's (``ops.moe.MoE``, forward order)."""
        e, a, d = self.experts, self.act_bytes, self.dim
        assert e is not None
        n = self.tokens // e.slices  # the tokens this rank routes: its sequence slice when it routes its own
        routed = n * e.routed_tokens  # the assignments this rank's experts compute
        saved = {
            # softmax's fp32 output, top-k/sort/dispatch indices (int64), the routing weights and their sum (fp32)
            "router scores and routing indices": 4 * n * e.num_experts + 3 * 8 * n * e.top_k + 2 * 4 * n * e.top_k,
            # the tokens sorted by expert, and the experts' outputs back in (token, slot) order for the weighting
            "dispatched tokens, combine input": 2 * a * n * e.top_k * d,
            "experts gate, up, silu, product": 4 * a * routed * e.hidden,
        }
        if e.expert_parallel:  # the received tokens regrouped by local expert: the grouped products' input
            saved["exchanged tokens (worst-case routing)"] = a * routed * d
        if e.shared_hidden:  # on every token of the sequence (gathered for them when each rank routes its slice)
            saved["shared experts w1, silu, w3, product"] = 4 * self.tokens * e.shared_hidden * a
        return saved

    # -- per block -------------------------------------------------------------------------------
    @property
    def _residual(self) -> int:
        """One residual-stream tensor ``(N/s, D)``: a block input, the gradient flowing between blocks."""
        return self.tokens // self.seq_shards * self.dim * self.act_bytes

    @property
    def residual_bytes(self) -> int:
        """Bytes of one residual-stream tensor ``(N/s, D)``: also what pipeline stages send each other."""
        return self._residual

    def saved_input(self, mode: str) -> int:
        """Bytes of a block's saved tensors that are its input tensor itself (not a copy of it).

        A pipeline stage's first block gets the receive buffer as its input: what the block saves
        of it is that buffer, which the planner counts once, as a buffer.

        Args:
            mode: The block's mode (``block_modes``).
        """
        if mode in ("full", "selective_op"):
            return self._residual  # the checkpoint keeps its input
        # Without checkpointing only the first norm's ``x.float()`` saves the input, and only in fp32
        # (where it is ``x`` itself); in bf16 it is an fp32 copy.
        return self._residual if self.act_bytes == 4 else 0

    @property
    def _attention_width(self) -> int:
        return self.heads * self.head_dim

    def block_saved(self, mode: str = "none", moe: bool = False) -> dict[str, int]:
        """Bytes one block keeps from its forward to its backward, by tensor group.

        Args:
            mode: ``"none"`` (everything autograd saves), ``"full"`` (the checkpoint's input) or
                ``"selective_op"`` (the input and the outputs of the per-op save list).
            moe: The block's feed-forward is a mixture of experts (``_experts_saved`` instead of the SwiGLU's).
        """
        saved = self._block_saved(mode)
        if moe and mode == "none":
            saved = {k: v for k, v in saved.items() if not k.startswith("SwiGLU")}
            saved.update(self._experts_saved())
        elif moe and mode == "selective_op":  # no mm of the experts is on the save list (grouped products)
            saved.pop("w1 output", None)
        return saved

    def _block_saved(self, mode: str) -> dict[str, int]:
        n, a, d, s = self.tokens, self.act_bytes, self.dim, self.seq_shards
        if mode == "full":
            return {"block input": self._residual}
        if mode == "selective_op":
            saved = {
                "block input": self._residual,
                "wq, wv outputs": n * (self.heads + self.kv_heads) * self.head_dim * a,
                "w1 output": n * self.ffn_hidden * a,
                # Under TP w2's output is the partial sum of the whole sequence, before its reduce-scatter.
                "w2 output": n * d * a,
                "attention output + logsumexp": n * self._attention_width * a + n * self.heads * 4,
            }
            if s > 1:  # the reduce-scatters' outputs (wo, w2) are on the save list too
                saved["reduce-scatter outputs"] = 2 * self._residual
            return saved
        if mode != "none":
            raise ValueError(f"mode={mode!r}; use 'none', 'full' or 'selective_op'")
        norm = n // s * self._norm_row  # fp32 input, normalized value (unless frozen), rsqrt
        if self.cp > 1:  # local queries and output; the context group's keys and values, not repeated (GQA)
            attention = 2 * n * self._attention_width * a + 2 * n * self.cp * self.kv_heads * self.head_dim * a
            return {
                "norms (fp32 input, normalized, rsqrt)": 2 * norm,
                "attention/SwiGLU inputs (whole sequence)": 2 * n * d * a,
                "attention q, output, gathered k, v, logsumexp": attention + n * self.heads * 4,
                "SwiGLU w1, silu, w3, product": 4 * n * self.ffn_hidden * a,
            }
        if self.architecture.repeat_kv:  # q, k, v (k and v repeated to the query heads), SDPA output
            qkvo = 4 * n * self._attention_width * a
        else:  # k and v at their own heads (SDPA's enable_gqa)
            qkvo = 2 * n * (self.heads + self.kv_heads) * self.head_dim * a
        saved = {
            "norms (fp32 input, normalized, rsqrt)": 2 * norm,
            "attention/SwiGLU inputs (whole sequence)": 2 * n * d * a,
            "attention q, k, v, output, logsumexp": qkvo + n * self.heads * 4,  # logsumexp in fp32
            "SwiGLU w1, silu, w3, product": 4 * n * self.ffn_hidden * a,
        }
        if self.architecture.head_norms:  # each of the rank's q and k heads over the whole sequence
            rows = n * (self.heads + self.kv_heads)
            saved["q/k head norms (fp32 input, normalized, rsqrt)"] = rows * (self.head_dim * (4 + a) + 4)
        return saved

    def recompute_extra(self, mode: str, moe: bool = False) -> int:
        """Bytes a checkpointed block adds while its backward runs: its recomputed forward, less what it kept.

        Args:
            mode: ``"none"`` (nothing recomputed), ``"full"`` or ``"selective_op"``.
            moe: The block is a mixture of experts.
        """
        if mode == "none":
            return 0
        saved = sum(self.block_saved("none", moe).values())
        # In fp32 the first norm's fp32 input is the block input itself, already kept.
        duplicate = self._residual if self.act_bytes == 4 else 0
        if mode == "full":
            return saved - duplicate
        n, a = self.tokens, self.act_bytes
        # Recomputation reuses the cached outputs: w1 out and SDPA out/logsumexp are saved tensors
        # already counted; wq and wv out (rotated, repeated) and under SP wo's reduce-scatter output
        # (added to the residual) are consumed and freed.
        reused = n * (self.heads + self.kv_heads) * self.head_dim * a + (0 if moe else n * self.ffn_hidden * a)
        reused += n * self._attention_width * a + n * self.heads * 4
        if self.seq_shards > 1:  # wo's reduce-scatter output, consumed by the residual add
            reused += self._residual
        return saved - duplicate - reused

    def backward_transient(self, moe: bool = False) -> int:
        """Bytes a block's backward adds at its peak to what the block saved (net of what it freed).

        Two candidate moments, both with the residual gradient ``g`` (``a·N/s·D``) waiting:

        * SwiGLU: after ``w2``'s backward its saved input is freed and the gradients of ``silu`` out
          and ``w3`` out are allocated next to its gradient (``2 × a·N·F`` net); under SP, ``w2``'s
          backward first all-gathers the incoming gradient to the whole sequence (``a·N·D`` next to
          ``a·N·F``).
        * ``ffn_norm``: SwiGLU's saved tensors and its input are freed, and RMSNorm's backward (fp32
          math) peaks at ``NORM_BACKWARD_BYTES`` per input element. It dominates without sequence
          parallelism at large ``tp`` (the norm sees the whole sequence, SwiGLU a ``1/tp`` slice).
        """
        n, a, d = self.tokens, self.act_bytes, self.dim
        swiglu = 2 * n * self.ffn_hidden * a
        if self.seq_shards > 1:
            swiglu = max(swiglu, n * d * a + n * self.ffn_hidden * a)
        rows = n // self.seq_shards
        norm = rows * d * NORM_BACKWARD_BYTES[a] - 4 * n * self.ffn_hidden * a - n * d * a
        if moe and self.experts is not None:
            # The experts' backward: the gradients of their silu and up outputs, then of their input tokens and of
            # the dispatched tokens (all the rank's assignments) before they are summed back per token.
            e = self.experts
            routed = n // e.slices  # this rank's tokens: its sequence slice when it routes its own
            swiglu = 2 * a * routed * e.routed_tokens * e.hidden + 2 * a * routed * e.top_k * d
            norm = rows * d * NORM_BACKWARD_BYTES[a] - sum(self._experts_saved().values()) - n * d * a
        return self._residual + max(swiglu, norm)

    # -- head and loss ---------------------------------------------------------------------------
    def inputs_saved(self) -> int:
        """Bytes of token ids kept: the tokens where the embedding runs (under TP the embedding saves
        its shifted ids as well) and the labels where the loss runs (int64)."""
        n = self.tokens
        tokens = n * 8 * (2 if self.tp > 1 else 1) if self.has_embedding else 0
        # Context parallelism: the positions (int64) and their rows of the fp32 rotary table, each one tensor shared
        # by the layers.
        context = n * 8 + n * self.head_dim * 4 if self.cp > 1 else 0
        # A Hugging Face decoder's cos and sin rows, (1, T, Dh) each, computed once per forward for every layer.
        rotary = 2 * self.seq_len * self.head_dim * self.act_bytes if self.architecture.rotary_per_forward else 0
        return tokens + (n * 8 if self.has_head else 0) + context + rotary + self.attention_mask_bytes()

    def attention_mask_bytes(self) -> int:
        """Bytes of the one attention mask a micro-batch builds for all its layers (``Transformer.forward``, a
        pipeline stage per micro-batch): CUDA's FlexAttention ``BlockMask`` (one head dimension shared by the heads),
        per sequence the int32 count and indices of the partial and of the full key blocks of each 128-row query
        block (``(B, 1, Q/128)`` and ``(B, 1, Q/128, K/128)`` each) and their transposes for the backward, plus the
        document ids its mask function reads (int64). ``Q`` is this rank's queries, ``K`` the whole sequence under
        context parallelism. 0 without documents and context parallelism (causal attention builds no mask).

        The dense mask of the CPU path (``(B, 1, Q, K)``: bool, or additive in the activation dtype under context
        parallelism) is not counted: the planner plans GPUs."""
        if (self.cp == 1 and not self.document_mask) or not self.seq_len:
            return 0
        queries = self.seq_len // self.cp
        batch = self.tokens // queries
        q_blocks, kv_blocks = -(-queries // FLEX_BLOCK_SIZE), -(-self.seq_len // FLEX_BLOCK_SIZE)
        tables = 4 * (4 * batch * q_blocks * kv_blocks + 2 * batch * (q_blocks + kv_blocks))
        if self.cp == 1:
            return tables + 8 * batch * self.seq_len  # each token's document
        # The global index of this rank's queries and of the gathered keys, and the document of each (B, Q), (B, K).
        return tables + 8 * (queries + self.seq_len) * (1 + batch)

    def loss_saved(self) -> dict[str, int]:
        """Bytes the final norm and the fused loss keep for backward (where they run), and the inputs."""
        n, a, d, s = self.tokens, self.act_bytes, self.dim, self.seq_shards
        if not self.has_head:
            return {"tokens, labels": self.inputs_saved()}
        if not self.architecture.fused_loss:
            return {
                "final norm": n // s * self._norm_row,
                "head input (whole sequence)": n * d * a,
                "loss: log-softmax of the logits": n * self._loss_vocab * a,
                "tokens, labels": self.inputs_saved(),
            }
        return {
            "final norm": n // s * self._norm_row,
            "loss: hidden-state gradient": n * d * a,
            "loss: fp32 head-gradient accumulator": 0 if self.frozen_base else self.vocab * d * 4,
            "tokens, labels": self.inputs_saved(),
        }

    @property
    def _loss_vocab(self) -> int:
        """Vocabulary columns of the logits the unfused loss sees: this rank's under ``loss_parallel``, else all."""
        return self.vocab if self.loss_parallel or self.tp == 1 else self.vocab * self.tp

    def loss_backward_transient(self) -> int:
        """Without the fused loss: extra bytes while the loss's backward runs, next to its saved log-softmax —
        the incoming gradient and (a plain tensor's ``log_softmax`` backward) the outgoing one."""
        return (1 if self.loss_parallel else 2) * self.tokens * self._loss_vocab * self.act_bytes

    def loss_forward_transient(self) -> int:
        """Extra bytes while the loss runs (the forward's peak): the fused loss's chunks, or the logits."""
        n, a, d, v = self.tokens, self.act_bytes, self.dim, self.vocab
        if not self.architecture.fused_loss:
            # The logits next to their log-softmax (under TP without loss_parallel, gathered whole; this rank's
            # slice is freed by then).
            return n * self._loss_vocab * a
        chunk = chunk_tokens(self.loss_chunk_size, n, v)  # the fused loss's own rule, None sized by memory
        several = n > chunk
        hidden = n * d * a  # the head's input: the final norm output, all-gathered under SP
        if self.seq_shards > 1:
            hidden += self._residual  # the sharded norm output is still referenced by the caller
        if a == 4:
            # fp32: logits (updated in place into their gradient); the next chunk's logits are
            # computed before the previous ones are released.
            chunks = 4 * chunk * v * (2 if several else 1)
        else:
            # fp32 logits + their bf16 gradient + the (V, D) product added into the accumulator;
            # at the next chunk, its bf16 and fp32 logits next to the previous chunk's pair.
            chunks = max(6 * chunk * v + a * v * d, 12 * chunk * v if several else 0)
        return hidden + chunks

    # -- a forward without a graph (a preference loss's reference pass) ---------------------------------
    def reference_forward_transient(self) -> int:
        """Bytes one forward without a graph (``torch.no_grad``: the preference reference's pass) holds at its peak,
        on top of what the trained model's forward keeps: nothing is saved and each tensor is freed after its last
        use, so it is the largest of its blocks' working sets and its head's (``no_grad_block``, ``no_grad_head``).
        Measured against the live tensors of such a forward on CPU in ``tests/unit/test_planner.py``."""
        blocks = max((self.no_grad_block(self.is_moe_block(i)) for i in range(self.n_layers)), default=0)
        return max(blocks, self.no_grad_head() if self.has_head else 0)

    def no_grad_block(self, moe: bool = False) -> int:
        """One block's peak without a graph. Its input ``x`` (``a·N/s·D``) is alive throughout, the residual ``h`` from
        the attention on; each half holds its norm's output (and under sequence parallelism its all-gather to the whole
        sequence, ``a·N·D``, while gathering next to the collective's own buffer). The largest moment of

        * the attention: q, k, v (``a·N·(H + 2·H_kv)·Dh``) with, while q then k is rotated, the rotary's temporaries
          (our Llama: fp32 ``8·N·h·Dh`` and in low precision the fp32 copy ``4·N·h·Dh``; a Hugging Face decoder's
          ``rotate_half``: ``3·a·N·h·Dh``), or at the core the keys and values repeated to the query heads
          (``2·a·N·H·Dh``; under context parallelism the group's, ``2·a·cp·N·H_kv·Dh``), the output and its
          log-sum-exp, or the output projection's partial sum (``a·N·D``) being reduced (``reduction_bytes``);
        * SwiGLU: ``silu(w1 x)``, ``w3 x`` and their product (``3·a·N·F``), or the product next to ``w2``'s output
          being reduced; a mixture of experts' layer counted as what its training forward saves (an upper bound:
          each tensor is freed sooner here);
        * the second norm in low precision: its fp32 input and normalized value, their cast and its output.
        """
        n, a, d, rows = self.tokens, self.act_bytes, self.dim, self.tokens // self.seq_shards
        x = a * rows * d  # a residual-stream tensor
        whole = n * d * a
        gathered = whole if self.seq_shards > 1 else 0  # a norm's output all-gathered for the projections
        heads, kv, dh = self.heads, self.kv_heads, self.head_dim

        def rotary(h: int) -> int:
            if self.architecture.rotary_per_forward:  # rotate_half: q·cos, rotate_half(q), its product with sin
                return 3 * a * n * h * dh
            return 8 * n * h * dh + (4 * n * h * dh if a < 4 else 0)  # fp32 half products, their stack; q's copy

        if self.cp > 1:  # the context group's keys and values, gathered at their own heads
            keys_values = 2 * a * self.cp * n * kv * dh
        else:
            keys_values = 2 * a * n * heads * dh if self.architecture.repeat_kv and heads > kv else 0
        output = a * n * heads * dh
        attention = 2 * x + gathered + max(
            gathered,  # the all-gather's buffer next to the gathered copy
            a * n * (heads + 2 * kv) * dh + max(
                rotary(heads), output + rotary(kv), keys_values + output + 4 * n * heads,
                output + self.reduction_bytes(),
            ),
        )
        if moe and self.experts is not None:
            feed_forward = sum(self._experts_saved().values())
        else:
            feed_forward = max(3 * a * n * self.ffn_hidden, a * n * self.ffn_hidden + self.reduction_bytes())
        mlp = 3 * x + gathered + max(gathered, feed_forward)
        norm = 2 * x + 4 * rows * d + a * rows * d + (4 * rows * d + a * rows * d if a < 4 else 0)
        # Held by the model's forward for every block: a Hugging Face decoder's embedding output and rotary rows.
        held = (whole if self.architecture.keeps_embeddings else 0) + (
            2 * self.seq_len * dh * a if self.architecture.rotary_per_forward else 0)
        return held + max(attention, mlp, norm)

    def reduction_bytes(self) -> int:
        """Bytes of an output projection's (``wo``, ``w2``) result while it is reduced over the tensor-parallel ranks:
        its partial sum of the whole sequence (``a·N·D``), and under sequence parallelism the reduce-scatter's
        rearranged input and its output (``a·N·D + a·N/s·D``), else under tensor parallelism the all-reduce's output
        (``a·N·D``)."""
        whole = self.tokens * self.dim * self.act_bytes
        if self.seq_shards > 1:
            return 2 * whole + self._residual
        return 2 * whole if self.tp > 1 else whole

    def no_grad_head(self) -> int:
        """The head's peak without a graph, each token's log-probability of its label.

        The fused head (``linear_log_probs``): the final norm's output (whole under sequence parallelism, next to its
        sharded original), a chunk's fp32 logits (in low precision next to their ``a``-byte product) beside the
        previous chunk's exponentials, and the log-probabilities and log-normalizers (``8·N``). Without it (the
        model returns the logits, as ``HFCausalLMModule.token_log_probs`` reads them): the logits of the whole
        sequence (``a·N·V'``), their fp32 copy in low precision and their log-softmax (``4·N·V'`` each), the hidden
        states freed by then; or, when tensor parallelism gathers the logits (no ``loss_parallel``), the gather's
        buffer and result (``2·a·N·V'``) next to this rank's slice and the hidden states."""
        n, a, d, v = self.tokens, self.act_bytes, self.dim, self.vocab
        hidden = n * d * a + (self._residual if self.seq_shards > 1 else 0)
        if not self.architecture.fused_loss:
            vocab = self._loss_vocab
            loss = a * n * vocab + (4 * n * vocab if a < 4 else 0) + 4 * n * vocab
            gather = hidden + a * n * v + 2 * a * n * vocab if vocab != v else 0
            return max(loss, gather)
        chunk = chunk_tokens(self.loss_chunk_size, n, v)  # the fused loss's own rule, None sized by memory
        several = n > chunk
        logits = 4 * chunk * v + (a * chunk * v if a < 4 else 0)
        return hidden + logits + (4 * chunk * v if several else 0) + 8 * n

    # -- distillation: the teacher inside the student's head ----------------------------------------
    def distillation_transient(self) -> int:
        """Bytes the fused divergence (``ops.distillation.linear_distillation``) holds beside the trained forward's
        saved tensors: the student's final norm output (whole under sequence parallelism, next to its shard), the
        teacher's final hidden states (``a·N·D_t``), the student's hidden-state gradient (``a·N·D``) and, unless the
        head is frozen (LoRA), its fp32 weight-gradient accumulator (``4·V'·D``), and a chunk's
        ``distillation_buffers`` fp32 ``chunk × V'`` buffers with, in low precision, both heads' ``a``-byte products."""
        n, a, d, v = self.tokens, self.act_bytes, self.dim, self.vocab
        hidden = n * d * a + (self._residual if self.seq_shards > 1 else 0)
        chunk = min(self.distillation_chunk, n)
        buffers = self.distillation_buffers * 4 * chunk * v + (2 * a * chunk * v if a < 4 else 0)
        gradients = n * d * a + (0 if self.frozen_base else 4 * v * d)
        return hidden + n * self.teacher_dim * a + gradients + buffers

    # -- the peak ---------------------------------------------------------------------------------
    def block_modes(self, activation_checkpointing: str, selective_ac_option: Any = "op") -> list[str]:
        """Each block's mode under the configured activation checkpointing."""
        if activation_checkpointing == "none":
            return ["none"] * self.n_layers
        if activation_checkpointing == "full":
            return ["full"] * self.n_layers
        if str(selective_ac_option) == "op":
            return ["selective_op"] * self.n_layers
        every = int(selective_ac_option)
        return ["full" if (i + 1) % every == 0 else "none" for i in range(self.n_layers)]

    def estimate(self, activation_checkpointing: str = "none", selective_ac_option: Any = "op") -> ActivationEstimate:
        """The peak of activation memory over one micro-batch's forward and backward.

        The candidates: the fused loss at the end of forward (every block's saved tensors alive) — without
        the fused loss, the loss's forward and its backward —, a preference loss's reference forward after it
        (``reference_forward``), the final norm's backward (all only ``has_head``), and each block's backward
        (recomputation included) while the blocks before it still hold theirs.

        Args:
            activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
            selective_ac_option: ``"op"`` or N (for ``"selective"``).
        """
        modes = self.block_modes(activation_checkpointing, selective_ac_option)
        per_block = [sum(self.block_saved(m, self.is_moe_block(i)).values()) for i, m in enumerate(modes)]
        if self.architecture.first_block_slices and self.has_embedding and modes and modes[0] != "none":
            # The checkpoint runs the slicing pre-hook inside: it keeps the whole sequence, not the slice.
            per_block[0] += self.tokens * self.dim * self.act_bytes - self._residual
        blocks = sum(per_block)
        loss = self.loss_saved()
        inputs = loss["tokens, labels"]
        # (phase, blocks' saved, head/loss/inputs, transient) at each candidate moment
        if self.has_head and not self.architecture.fused_loss:
            moments = [
                ("forward (logits, loss)", blocks, sum(loss.values()), self.loss_forward_transient()),
                ("backward of the loss", blocks, sum(loss.values()), self.loss_backward_transient()),
            ]
        elif self.has_head:
            moments = [("forward (fused loss)", blocks, sum(loss.values()), self.loss_forward_transient())]
        if self.has_head and self.reference_forward:
            # The reference's forward runs after the trained one's, whose saved tensors are all alive.
            moments.append(("reference forward (no graph)", blocks, sum(loss.values()),
                            self.reference_forward_transient()))
        if self.has_head and self.teacher_dim:
            # Inside the student's head call: the teacher's trunk without a graph (the student's norm output held),
            # then the fused divergence's chunks.
            hidden = self.tokens * self.dim * self.act_bytes
            moments.append(("teacher forward (no graph, in the head)", blocks, sum(loss.values()),
                            hidden + self.teacher_forward))
            moments.append(("distillation loss (fused heads)", blocks, sum(loss.values()),
                            self.distillation_transient()))
        if self.has_head:
            # The final norm's backward: the loss's buffers have become the head's gradient (FSDP's) and
            # the incoming gradient; RMSNorm's backward temporaries on top.
            rows = self.tokens // self.seq_shards
            norm = rows * self.dim * NORM_BACKWARD_BYTES[self.act_bytes]
            moments.append(("backward of the final norm", blocks, loss["final norm"] + inputs, norm))
        else:  # a pipeline stage without the head: its output goes to the next stage
            moments = [("end of forward", blocks, inputs, 0)]
        below = blocks
        for i in reversed(range(self.n_layers)):  # backward order; blocks after i have freed theirs
            phase = f"backward of block {i}" + (" (recomputed)" if modes[i] != "none" else "")
            moe = self.is_moe_block(i)
            moments.append((phase, below, inputs, self.recompute_extra(modes[i], moe) + self.backward_transient(moe)))
            below -= per_block[i]
        phase, saved, head, transient = max(moments, key=lambda m: m[1] + m[2] + m[3])
        return ActivationEstimate(
            peak=saved + head + transient,
            phase=phase,
            saved_by_blocks=saved,
            head_and_loss=head,
            transient=transient,
            block_modes=modes,
            block_saved=self._last_block_saved(modes),
            kept_by_blocks=blocks,
            kept_by_head=sum(loss.values()),
        )

    def _last_block_saved(self, modes: list[str]) -> dict[str, int]:
        return self.block_saved(modes[-1], self.is_moe_block(len(modes) - 1)) if modes else {}


@dataclass
class ActivationEstimate:
    """The activation peak and its parts (bytes).

    Args:
        peak: Bytes at the peak.
        phase: Where the peak is.
        saved_by_blocks: Bytes the blocks hold at the peak.
        head_and_loss: Bytes the final norm, the loss and the inputs hold at the peak.
        transient: Bytes alive only around the peak (loss chunks, a recomputed block, backward gradients).
        block_modes: Each block's checkpointing mode.
        block_saved: What the last block keeps, by tensor group.
        kept_by_blocks: What the blocks keep from the end of one micro-batch's forward to its
            backward (a pipeline holds that for each micro-batch in flight).
        kept_by_head: What the final norm, the loss and the inputs keep over the same span.
        receive_buffers: Pipeline: the stages' receive buffers (activations and gradients, one per
            micro-batch each); 0 without a pipeline.
        stage_outputs: Pipeline: the outputs of non-last stages kept for their backward, at the peak.
        in_flight: Micro-batches (stage-chunks under an interleaved schedule) whose forward ran and
            whose backward had not finished, at the peak; 1 without a pipeline.
    """

    peak: int
    phase: str
    saved_by_blocks: int
    head_and_loss: int
    transient: int
    block_modes: list[str]
    block_saved: dict[str, int]
    kept_by_blocks: int = 0
    kept_by_head: int = 0
    receive_buffers: int = 0
    stage_outputs: int = 0
    in_flight: int = 1
