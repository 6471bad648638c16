"""``lightning-2d plan``: check a layout and estimate its per-device memory on a simulated world, without GPUs.

    lightning-2d plan --model llama3-8b --num-nodes 1 --devices 8 --tensor-parallel-size 8
    lightning-2d plan --model llama3-405b --num-nodes 64 --devices 8 --tensor-parallel-size 8 \\
        --activation-checkpointing full --seq-len 8192 --micro-batch-size 1 --precision bf16-mixed --json
    lightning-2d plan --model llama3-405b --num-nodes 64 --devices 8 --tensor-parallel-size 8 \\
        --pipeline-parallel-size 8 --pipeline-microbatches 16 --activation-checkpointing full --seq-len 8192

One process plays rank 0 (under a pipeline, one rank of each pipeline rank) of a world of
``num_nodes × devices`` ranks: a *fake* process group (no communication,
``torch.testing._internal.distributed.fake_pg``) lets the real code run. The layout is resolved and
checked by the real rules (``validate_parallel_dims``, every problem in one ``ParallelConfigError``),
the real mesh is built (``ParallelDims.build_mesh``), the Llama ``Transformer`` is built on the meta
device and parallelized by the real ``parallelize_model`` (pipeline split → TP/SP → activation
checkpointing → compile → FSDP2). Nothing is allocated: the per-device sizes are read from the local
shards of the DTensor parameters.

What the estimate holds, per device (rank 0, whose FSDP shards are the padded size every rank allocates;
under a pipeline, see below):

* **parameters**: the local shards, in their stored dtype (fp32; bf16 under ``bf16-true``).
* **gradients**: the same shapes and dtype (FSDP2 reduce-scatters into the parameter's dtype).
* **optimizer state**: AdamW's ``exp_avg`` and ``exp_avg_sq``, two tensors like each parameter.
* **FSDP all-gather buffers**: the unsharded parameters of the units gathered at once, in
  ``param_dtype``: a unit and the next one (implicit forward prefetch, explicit backward prefetch)
  plus, under the ``default`` reshard policy, the output unit kept gathered from its forward to its
  backward (simulated unit by unit, see ``gathered_peak``).
* **FSDP reduce-scatter buffers**: the largest unit's unsharded gradients (``param_dtype``) and the
  reduce-scatter input (``reduce_dtype``) that FSDP2 keeps until the next unit's reduction.
* **gradient accumulation** (``accumulate_grad_batches > 1`` without ``reduce_every_micro_batch``):
  every unit's unsharded gradients, accumulated in ``reduce_dtype`` between micro-batches.
* **activations**: what autograd saves, tensor by tensor, for the model's forward and backward
  (``ActivationModel``), at its peak.

Everything is counted as live at once, which is conservative: gradients only exist from backward
on (``zero_grad(set_to_none=True)``) and the activation peak falls before most of them exist.
Not included: the CUDA context, NCCL and cuBLAS workspaces and allocator fragmentation, which the
``reserve`` (``--reserve-gib``) stands for.

**Under pipeline parallelism** (``pipeline_parallel_size`` p > 1) the pipeline ranks hold different
stages (the first the embedding, the last the final norm and head; the interleaved schedule several
stages per rank), so every pipeline rank ``k`` is planned, played by global rank ``k·dp·tp``: the real
``parallelize_model`` prunes the model to its stages and shards each stage view as its own FSDP root.
The report's per-device figures are the fullest pipeline rank's (it decides the verdict); ``pipeline``
lists them all. Per pipeline rank:

* **parameters, gradients, optimizer state**: its pruned model's local shards.
* **FSDP buffers**: torch's ``PipelineStage`` runs every micro-batch's backward without resharding
  and without gradient reduction (``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)``) and reduce-scatters once after the last one. From its first
  backward to the end of the step each unit of the rank's stages therefore stays gathered
  (``param_dtype``) and holds its unsharded gradient (``reduce_dtype``): all of them are counted,
  whatever ``reshard_after_forward`` says; the reduce-scatter buffer is the largest unit's, as without
  a pipeline. Under ``reduce_every_micro_batch`` the library hides the stage from that handling
  (each micro-batch's backward reshards and reduce-scatters): the FSDP buffers are then those of no pipeline.
* **activations** (``pipeline_activation_estimate``): a pipeline micro-batch is ``micro_batch_size``
  sequences, ``m = pipeline_microbatches`` of them per step (when not set, ``m = p × stages per rank``
  is assumed and a note says so; at run time it defaults to the per-rank batch size). Each stage is
  the ``ActivationModel`` of its blocks (the fused loss only on the last stage). The rank's forwards
  and backwards are walked in the schedule's order: GPipe keeps all ``m`` micro-batches in flight,
  1F1B ``min(p - k, m)``, Interleaved1F1B its warm-up forwards + 1 stage-chunks (torch's
  ``_get_warmup_ops``). At the peak one micro-batch is at its own peak and every other one in flight
  keeps its saved tensors (on the last stage also the loss's hidden-state gradient and fp32 head-gradient
  accumulator) and, before the last stage, its stage output. Always there: the receive buffers that
  ``PipelineStage`` allocates for every micro-batch, activations on non-first stages and gradients on
  non-last ones.

Approximate under a pipeline: the unit buffers, the gradients and the activation peak are counted at
once, though the gathered units and gradients are complete only after a micro-batch's backward and
the steady state's peak micro-batch count is reached around it; token ids are counted for the
micro-batches in flight, not for the whole batch each rank loads (a few MiB).

The Python API: ``plan_run(...) -> PlanReport`` (``report.as_dict()``, ``format_report(report)``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import re
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional

import torch
from torch import nn

from lightning_2d._compat import fake_store
from lightning_2d.models.llama.model import PRESETS, ModelArgs, Transformer
from lightning_2d.parallel.config import (
    SUPPORTED_PRECISIONS,
    ParallelConfig,
    ParallelConfigError,
)
from lightning_2d.parallel.dims import ParallelDims, validate_parallel_dims

GIB = 2**30
#: H100 / A100 80GB: the nominal size. ``torch.cuda.get_device_properties().total_memory`` reports
#: ~79.1 GiB on an H100 SXM; what the CUDA context takes out of it is part of the reserve.
DEFAULT_DEVICE_MEMORY_GIB = 80.0
#: What the estimate does not see: the CUDA context (~0.5 GiB), NCCL and cuBLAS workspaces and
#: the caching allocator's fragmentation.
DEFAULT_RESERVE_GIB = 2.0
DEFAULT_LOSS_CHUNK_SIZE = 1024  # LlamaLightningModule's and Transformer's default
#: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` (like the parameter; the step counts are scalars).
ADAMW_STATES = 2
#: Activation bytes → peak of ``RMSNorm``'s backward per input element, beyond its saved tensors
#: (measured with a live-tensor tracker on CPU, torch 2.13): its fp32 chain rule through
#: ``rsqrt(mean(x²))`` holds about four fp32 tensors the input's size at once, and in bf16 a
#: low-precision one more.
NORM_BACKWARD_BYTES = {4: 16, 2: 18}


# ---- the activation model ---------------------------------------------------------------------
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
        loss_chunk_size: Tokens per chunk of the fused loss (``None``: all at once).
        has_embedding: Whether the token embedding runs here (its token ids are kept): always without
            a pipeline, on the first stage with one.
        has_head: Whether the final norm, the output head and the fused loss run here: always without a
            pipeline, on the last stage with one. Without them the peak is in the blocks' backward.
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

    @classmethod
    def for_layout(
        cls,
        args: ModelArgs,
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
    ) -> ActivationModel:
        """The model for ``args`` on one rank of a ``tp``-way tensor-parallel group.

        Args:
            args: The model's shape.
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
        """
        return cls(
            tokens=micro_batch_size * seq_len,
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
        )

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

    def block_saved(self, mode: str = "none") -> dict[str, int]:
        """Bytes one block keeps from its forward to its backward, by tensor group.

        Args:
            mode: ``"none"`` (everything autograd saves), ``"full"`` (the checkpoint's input) or
                ``"selective_op"`` (the input and the outputs of the per-op save list).
        """
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
        norm = n // s * (d * (4 + a) + 4)  # fp32 input, normalized value, rsqrt
        return {
            "norms (fp32 input, normalized, rsqrt)": 2 * norm,
            "attention/SwiGLU inputs (whole sequence)": 2 * n * d * a,
            # q, k, v (k and v repeated to the query heads), SDPA output; logsumexp in fp32
            "attention q, k, v, output, logsumexp": 4 * n * self._attention_width * a + n * self.heads * 4,
            "SwiGLU w1, silu, w3, product": 4 * n * self.ffn_hidden * a,
        }

    def recompute_extra(self, mode: str) -> int:
        """Bytes a checkpointed block adds while its backward runs: its recomputed forward, less what it kept.

        Args:
            mode: ``"none"`` (nothing recomputed), ``"full"`` or ``"selective_op"``.
        """
        if mode == "none":
            return 0
        saved = sum(self.block_saved("none").values())
        # In fp32 the first norm's fp32 input is the block input itself, already kept.
        duplicate = self._residual if self.act_bytes == 4 else 0
        if mode == "full":
            return saved - duplicate
        n, a = self.tokens, self.act_bytes
        # Recomputation reuses the cached outputs: w1 out and SDPA out/logsumexp are saved tensors
        # already counted; wq and wv out (rotated, repeated) and under SP wo's reduce-scatter output
        # (added to the residual) are consumed and freed.
        reused = n * (self.heads + self.kv_heads) * self.head_dim * a + n * self.ffn_hidden * a
        reused += n * self._attention_width * a + n * self.heads * 4
        if self.seq_shards > 1:  # wo's reduce-scatter output, consumed by the residual add
            reused += self._residual
        return saved - duplicate - reused

    def backward_transient(self) -> int:
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
        return self._residual + max(swiglu, norm)

    # -- head and loss ---------------------------------------------------------------------------
    def inputs_saved(self) -> int:
        """Bytes of token ids kept: the tokens where the embedding runs (under TP the embedding saves
        its shifted ids as well) and the labels where the loss runs (int64)."""
        n = self.tokens
        tokens = n * 8 * (2 if self.tp > 1 else 1) if self.has_embedding else 0
        return tokens + (n * 8 if self.has_head else 0)

    def loss_saved(self) -> dict[str, int]:
        """Bytes the final norm and the fused loss keep for backward (where they run), and the inputs."""
        n, a, d, s = self.tokens, self.act_bytes, self.dim, self.seq_shards
        if not self.has_head:
            return {"tokens, labels": self.inputs_saved()}
        return {
            "final norm": n // s * (d * (4 + a) + 4),
            "loss: hidden-state gradient": n * d * a,
            "loss: fp32 head-gradient accumulator": self.vocab * d * 4,
            "tokens, labels": self.inputs_saved(),
        }

    def loss_forward_transient(self) -> int:
        """Extra bytes while the fused loss runs its chunks (the forward's peak)."""
        n, a, d, v = self.tokens, self.act_bytes, self.dim, self.vocab
        chunk = n if self.loss_chunk_size is None else min(self.loss_chunk_size, n)
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

        The candidates: the fused loss at the end of forward (every block's saved tensors alive),
        the final norm's backward (both only ``has_head``), and each block's backward (recomputation
        included) while the blocks before it still hold theirs.

        Args:
            activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
            selective_ac_option: ``"op"`` or N (for ``"selective"``).
        """
        modes = self.block_modes(activation_checkpointing, selective_ac_option)
        per_block = [sum(self.block_saved(m).values()) for m in modes]
        blocks = sum(per_block)
        loss = self.loss_saved()
        inputs = loss["tokens, labels"]
        # (phase, blocks' saved, head/loss/inputs, transient) at each candidate moment
        if self.has_head:
            moments = [("forward (fused loss)", blocks, sum(loss.values()), self.loss_forward_transient())]
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
            moments.append((phase, below, inputs, self.recompute_extra(modes[i]) + self.backward_transient()))
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
        return self.block_saved(modes[-1]) if modes else {}


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


# ---- pipeline schedules ---------------------------------------------------------------------------
def schedule_order(schedule: str, pp: int, stages_per_rank: int, microbatches: int, pp_rank: int) -> list[tuple[str, int]]:
    """This rank's forwards (``"F"``) and backwards (``"B"``) in the order torch runs them, each with the
    local stage it runs (``0 .. stages_per_rank - 1``; local stage ``j`` is stage ``pp_rank + j·pp``).

    Follows ``torch.distributed.pipelining.schedules``: ``ScheduleGPipe`` runs every forward, then every
    backward; ``Schedule1F1B`` runs ``min(m, pp - pp_rank)`` warm-up forwards, then alternates one
    backward and one forward; ``ScheduleInterleaved1F1B`` runs ``_get_warmup_ops`` warm-up forwards,
    then alternates one forward and one backward (``_get_1f1b_rank_ops``), its local stage changing
    every ``microbatches_per_round`` operations.

    Args:
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.
        pp: Pipeline ranks.
        stages_per_rank: Stages each rank holds (1 but for the interleaved schedule).
        microbatches: Micro-batches per step ``m``.
        pp_rank: This rank's place in the pipeline.
    """
    m, n = microbatches, stages_per_rank
    if schedule == "GPipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1F1B":
        warmup = min(m, pp - pp_rank)
        order = [("F", 0)] * warmup
        for done in range(m):
            order.append(("B", 0))
            if warmup + done < m:
                order.append(("F", 0))
        return order
    if schedule != "Interleaved1F1B":
        raise ValueError(f"schedule={schedule!r}; use 'GPipe', '1F1B' or 'Interleaved1F1B'")
    rounds = max(1, m // pp)
    per_round = m // rounds
    # _get_warmup_ops: (n - 1) rounds for the last rank, 2 more per hop before it; at most every chunk.
    warmup = min((n - 1) * per_round + 2 * (pp - 1 - pp_rank), m * n)
    chunks = m * n
    order = []
    for op in range(chunks + warmup):  # warm-up forwards, (forward, backward) pairs, cool-down backwards
        if op < chunks:
            order.append(("F", (op // per_round) % n))
        if op >= warmup:
            order.append(("B", n - 1 - ((op - warmup) // per_round) % n))
    return order


def pipeline_activation_estimate(
    base: ActivationModel,
    split: list[int],
    *,
    pp: int,
    pp_rank: int,
    schedule: str,
    microbatches: int,
    activation_checkpointing: str,
    selective_ac_option: Any = "op",
) -> ActivationEstimate:
    """The activation peak of one pipeline rank over a schedule step.

    Each of the rank's stages is an ``ActivationModel`` of its blocks (``base`` with ``n_layers``,
    ``has_embedding`` and ``has_head`` set; ``base`` is one micro-batch of ``micro_batch_size``
    sequences). The rank's operations are walked in torch's order (``schedule_order``); at each one
    the peak is the micro-batch being processed at its own single-micro-batch peak plus, for every
    other micro-batch in flight (forward run, backward not yet), what its stage keeps between the two:
    the blocks' saved tensors, on the last stage the final norm's and the fused loss's (its hidden-state
    gradient and fp32 head-gradient accumulator), on non-last stages the stage output (torch keeps it
    for the backward). Always there: the receive buffers ``PipelineStage`` allocates for every
    micro-batch up front, activations on non-first stages and gradients on non-last ones
    (residual-stream tensors). A non-first stage's first block gets its receive buffer as input:
    what it saves of it is not counted twice.

    Args:
        base: One micro-batch of the whole model on one device (``ActivationModel.for_layout``).
        split: Blocks of every stage, in stage order (``pipeline_split``).
        pp: Pipeline ranks.
        pp_rank: The rank to estimate.
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.
        microbatches: Micro-batches per step.
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        selective_ac_option: ``"op"`` or N.

    Returns:
        The peak; ``saved_by_blocks``, ``head_and_loss`` and ``stage_outputs`` sum over the micro-batches
        in flight, ``transient`` is the processed one's, ``receive_buffers`` the rank's.
    """
    from lightning_2d.parallel.pipeline import stages_of_rank

    num_stages = len(split)
    per_rank = num_stages // pp
    residual = base.residual_bytes
    kept: list[tuple[int, int, int]] = []  # per local stage, one micro-batch between forward and backward
    active: list[tuple[int, int, int, int]] = []  # per local stage, one micro-batch at its own peak
    estimates: list[ActivationEstimate] = []
    receive = 0
    for stage in stages_of_rank(pp_rank, pp, per_rank):
        first, last = stage == 0, stage == num_stages - 1
        model = replace(base, n_layers=split[stage], has_embedding=first, has_head=last)
        est = model.estimate(activation_checkpointing, selective_ac_option)
        shared = 0 if first else model.saved_input(est.block_modes[0])
        output = 0 if last else residual
        # (blocks, final norm/loss/inputs, stage output); at the peak also the transient
        kept.append((est.kept_by_blocks - shared, est.kept_by_head, output))
        active.append((est.saved_by_blocks - shared, est.head_and_loss, output, est.transient))
        estimates.append(est)
        receive += microbatches * residual * ((not first) + (not last))
    counts = [0] * per_rank
    best_total, best_local, best_counts = -1, 0, counts
    for kind, local in schedule_order(schedule, pp, per_rank, microbatches, pp_rank):
        if kind == "F":
            counts[local] += 1
        # The micro-batch being processed at its own peak, every other one in flight as kept.
        total = sum(c * sum(k) for c, k in zip(counts, kept)) - sum(kept[local]) + sum(active[local])
        if total > best_total:
            best_total, best_local, best_counts = total, local, list(counts)
        if kind == "B":
            counts[local] -= 1
    others = list(best_counts)
    others[best_local] -= 1
    parts = [sum(c * k[i] for c, k in zip(others, kept)) + active[best_local][i] for i in range(3)]
    est = estimates[best_local]
    in_flight = sum(best_counts)
    nouns = ("stage-chunk", "stage-chunks") if per_rank > 1 else ("micro-batch", "micro-batches")
    what = nouns[in_flight != 1]
    stage = stages_of_rank(pp_rank, pp, per_rank)[best_local]
    offset = sum(split[:stage])  # the stage's blocks are numbered from 0: name them as in the model
    phase = re.sub(r"block (\d+)", lambda m: f"block {int(m.group(1)) + offset}", est.phase)
    return ActivationEstimate(
        peak=receive + sum(parts) + active[best_local][3],
        phase=f"{schedule}, {in_flight} {what} in flight: stage {stage}, {phase}",
        saved_by_blocks=parts[0],
        head_and_loss=parts[1],
        transient=active[best_local][3],
        block_modes=[m for e in estimates for m in e.block_modes],
        block_saved=estimates[-1].block_saved,
        kept_by_blocks=sum(k[0] for k in kept),
        kept_by_head=sum(k[1] for k in kept),
        receive_buffers=receive,
        stage_outputs=parts[2],
        in_flight=in_flight,
    )


# ---- FSDP units -----------------------------------------------------------------------------------
@dataclass
class FSDPUnit:
    """One ``fully_shard`` group as the planner sees it.

    Args:
        name: Module name(s).
        kind: ``"input"``, ``"block"``, ``"output"`` or ``"root"`` (see ``reshard_after_forward_by_unit``).
        sharded_numel: Elements this rank holds (FSDP-padded local shards).
        gathered_bytes: Bytes of its unsharded parameters on this rank (in the all-gather dtype).
        unsharded_numel: Elements of its unsharded parameters on this rank.
        unshard_in_backward: Whether backward all-gathers it again (an embedding's does not).
    """

    name: str
    kind: str
    sharded_numel: int
    gathered_bytes: int
    unsharded_numel: int
    unshard_in_backward: bool = True


def gathered_peak(units: list[FSDPUnit], reshard: dict[str, bool]) -> int:
    """The most bytes of unsharded parameters alive at once over a forward and a backward.

    While a unit computes, the next one's all-gather is in flight (FSDP2's implicit prefetch in
    forward, its default one-unit prefetch in backward). A unit whose kind does not reshard after
    forward stays gathered until its backward; every unit reshards after its backward.

    Args:
        units: In forward order.
        reshard: ``reshard_after_forward_by_unit(policy)``.
    """
    gathered: set[int] = set()
    peak = 0

    def size(indices: set[int]) -> int:
        return sum(units[i].gathered_bytes for i in indices)

    for i, unit in enumerate(units):
        gathered.add(i)
        prefetch = {i + 1} if i + 1 < len(units) else set()
        peak = max(peak, size(gathered | prefetch))
        if reshard[unit.kind]:
            gathered.discard(i)
    order = [i for i in reversed(range(len(units))) if units[i].unshard_in_backward or i in gathered]
    for k, i in enumerate(order):
        gathered.add(i)
        prefetch = {order[k + 1]} if k + 1 < len(order) and units[order[k + 1]].unshard_in_backward else set()
        peak = max(peak, size(gathered | prefetch))
        gathered.discard(i)
    return peak


# ---- the report -----------------------------------------------------------------------------------
@dataclass
class PlanReport:
    """A layout's resolved sizes and per-device memory estimate (bytes), with the verdict.

    Under pipeline parallelism the pipeline ranks hold different parts of the model: the per-device
    fields are those of the pipeline rank with the largest total (which decides the verdict), and
    ``pipeline`` lists every pipeline rank.

    Args:
        model: Preset name, with the overridden ``ModelArgs`` fields named.
        model_args: ``ModelArgs`` fields.
        total_params: Parameters of the whole model.
        num_nodes: Nodes simulated.
        devices_per_node: Devices (ranks) per node.
        world_size: ``num_nodes × devices_per_node``.
        dims: ``data_parallel_replicate``, ``data_parallel_shard``, ``tensor_parallel`` (and ``data_parallel``;
            ``pipeline_parallel`` when above 1).
        precision: Trainer precision.
        param_dtype: Dtype FSDP gathers parameters in (and activations are computed in).
        reduce_dtype: Dtype of the gradient reduce-scatter.
        seq_len: Tokens per sequence.
        micro_batch_size: Sequences per micro-batch and device.
        accumulate_grad_batches: Micro-batches per optimizer step.
        parallel_config: The ``ParallelConfig`` fields (dtypes as names).
        params_per_device: Parameter elements on this device (padded shards).
        param_bytes: Their bytes.
        grad_bytes: Sharded gradients.
        optimizer_bytes: AdamW states.
        buffer_bytes: Module buffers (the rotary table).
        all_gather_bytes: FSDP's unsharded parameters at their peak.
        reduce_scatter_bytes: FSDP's unsharded gradients and reduce-scatter input at their peak.
        accumulation_bytes: Unsharded gradients kept between micro-batches (deferred reduction).
        activation_bytes: Activation peak.
        activation_phase: Where the activation peak is.
        activation_parts: The peak's parts and the last block's saved tensors.
        total_bytes: The sum of the above (the estimated peak of allocated memory).
        reserve_bytes: Added for what the estimate does not see.
        device_memory_bytes: The device's memory.
        fits: ``total + reserve <= device memory``.
        headroom_bytes: ``device memory - total - reserve`` (negative when it does not fit).
        suggestions: Changes that would make it fit (empty when it fits).
        notes: What was simulated differently from a real run.
        seconds: Wall time of the planning.
        pipeline: One dict per pipeline rank (empty without a pipeline): ``pipeline_rank``,
            ``global_rank`` (the rank planned), ``stages`` (indices), ``blocks`` (per stage),
            ``embedding`` / ``head`` (whether it holds them), ``params_per_device``, ``microbatches``,
            ``in_flight`` (micro-batches or stage-chunks in flight at its activation peak), and the
            ``param``, ``all_gather``, ``accumulation``, ``activation`` and ``total`` bytes.
    """

    model: str
    model_args: dict[str, Any]
    total_params: int
    num_nodes: int
    devices_per_node: int
    world_size: int
    dims: dict[str, int]
    precision: str
    param_dtype: str
    reduce_dtype: str
    seq_len: int
    micro_batch_size: int
    accumulate_grad_batches: int
    parallel_config: dict[str, Any]
    params_per_device: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    accumulation_bytes: int
    activation_bytes: int
    activation_phase: str
    activation_parts: dict[str, Any]
    total_bytes: int
    reserve_bytes: int
    device_memory_bytes: int
    fits: bool
    headroom_bytes: int
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    pipeline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``fits with X GiB headroom`` or ``does not fit: needs Y GiB of Z GiB``."""
        needed = (self.total_bytes + self.reserve_bytes) / GIB
        if self.fits:
            return f"fits with {self.headroom_bytes / GIB:.1f} GiB headroom"
        return f"does not fit: needs {needed:.1f} GiB of {self.device_memory_bytes / GIB:.1f} GiB"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the verdict, and the byte sizes in GiB too (``*_gib``)."""
        out = asdict(self)
        out["verdict"] = self.verdict
        for entry in (out, *out["pipeline"]):
            for name in [k for k in entry if k.endswith("_bytes")]:
                entry[name.removesuffix("_bytes") + "_gib"] = round(entry[name] / GIB, 3)
        return out


# ---- the simulated world --------------------------------------------------------------------------
@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process, as ``rank``; destroyed on exit.

    The fake backend answers every collective without communicating (its results are garbage), so
    meshes, DTensors and ``fully_shard`` can be set up for a world this machine does not have.

    Args:
        world_size: Ranks of the simulated world.
        rank: The rank this process plays (its mesh coordinates: under a pipeline, its stages).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "plan_run simulates its own world with a fake process group, but this process already has a"
            " default process group; call it in a process without one (e.g. before the Trainer starts)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_args(model: str, overrides: Optional[dict[str, Any]], problems: list[str]) -> Optional[ModelArgs]:
    try:
        return ModelArgs.from_name(model, **(overrides or {}))
    except (ValueError, TypeError) as err:
        lines = [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]] or [str(err)]
        problems.extend(f"model: {line}" for line in lines if line)
        return None


def _run_problems(args: Optional[ModelArgs], seq_len: int, micro_batch_size: int, device_memory_gib: float,
                  reserve_gib: float, loss_chunk_size: Optional[int]) -> list[str]:
    problems = []
    if seq_len < 1:
        problems.append(f"seq_len must be a positive number of tokens, got {seq_len}")
    elif args is not None and seq_len > args.max_seq_len:
        problems.append(
            f"seq_len ({seq_len}) exceeds the model's max_seq_len ({args.max_seq_len}); use a shorter sequence or"
            f" raise it with --model-overrides '{{\"max_seq_len\": {seq_len}}}'"
        )
    if micro_batch_size < 1:
        problems.append(f"micro_batch_size must be a positive number of sequences, got {micro_batch_size}")
    if device_memory_gib <= 0:
        problems.append(f"device_memory_gib must be positive, got {device_memory_gib}")
    if reserve_gib < 0:
        problems.append(f"reserve_gib must be >= 0, got {reserve_gib}")
    if loss_chunk_size is not None and loss_chunk_size < 1:
        problems.append(f"loss_chunk_size must be a positive number of tokens or None, got {loss_chunk_size}")
    return problems


def _validate(
    config: ParallelConfig,
    args: Optional[ModelArgs],
    problems: list[str],
    *,
    num_nodes: int,
    devices: int,
    precision: str,
    seq_len: int,
) -> ParallelDims:
    """``validate_parallel_dims`` for the target (CUDA) world, merged with the planner's own problems."""
    from lightning_2d.models.llama.plan import llama_plan

    if num_nodes < 1 or devices < 1:
        problems.append(f"num_nodes ({num_nodes}) and devices ({devices}) must be positive integers")
        raise ParallelConfigError(problems)
    try:
        dims = validate_parallel_dims(
            config,
            world_size=num_nodes * devices,
            devices_per_node=devices,
            plan=llama_plan(args, config) if args is not None else None,
            precision=precision,
            seq_len=seq_len,
            num_nodes=num_nodes,
            device_type="cuda",  # the target's rules (float8, async TP), not this machine's
            device_index=None,  # no GPU to ask for its compute capability
        )
    except ParallelConfigError as err:
        raise ParallelConfigError(problems + err.problems) from None
    if problems:
        raise ParallelConfigError(problems)
    return dims


def _units(model: nn.Module, plan: Any, dims: ParallelDims, gather_dtype: torch.dtype) -> list[FSDPUnit]:
    """The FSDP units ``apply_fully_shard`` made on ``model`` (a ``Transformer`` or a pipeline stage view),
    in forward order, with their sizes on the planned rank (FSDP shard 0: the padded size)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_2d.parallel.fsdp import _only_embeddings
    from lightning_2d.parallel.modules import get_named_submodules, get_submodule_container

    def sizes(modules: list[nn.Module], exclude: set[int]) -> tuple[int, int, int]:
        sharded = unsharded = gathered = 0
        for module in modules:
            for param in module.parameters():
                if id(param) in exclude:
                    continue
                exclude.add(id(param))
                local = param.to_local() if hasattr(param, "to_local") else param
                # Shard 0 has FSDP's padded size (dim 0 rounded up to a multiple of the
                # shard group), which every rank allocates; the gathered tensor is that × the group.
                numel = local.numel()
                full = numel * dims.dp_shard
                sharded += numel
                unsharded += full
                # float8 all-gather: torchao's weight wrappers gather in float8 (one byte)
                itemsize = 1 if "Float8" in type(local).__name__ else gather_dtype.itemsize
                gathered += full * itemsize
        return sharded, unsharded, gathered

    seen: set[int] = set()
    units: list[FSDPUnit] = []
    groups: list[tuple[str, str, list[nn.Module]]] = []
    for name, module in zip(plan.input_units, get_named_submodules(model, plan.input_units, "input_units")):
        groups.append((name, "input", [module]))
    for name, block in get_submodule_container(model, plan.blocks).named_children():
        groups.append((f"{plan.blocks}.{name}", "block", [block]))
    output = get_named_submodules(model, plan.output_unit, "output_unit")
    groups.append(("+".join(plan.output_unit), "output", output))
    groups.append(("(root)", "root", [model]))
    for name, kind, modules in groups:
        if not all(isinstance(m, FSDPModule) for m in modules):
            raise RuntimeError(
                f"{name} is not an FSDP unit after parallelize_model; the planner assumes apply_fully_shard's units"
            )
        sharded, unsharded, gathered = sizes(modules, seen)
        if unsharded:
            in_backward = not (kind == "input" and all(_only_embeddings(m) for m in modules))
            units.append(FSDPUnit(name, kind, sharded, gathered, unsharded, in_backward))
    return units


def _parallelize(model: Transformer, mesh: Any, plan: Any, config: ParallelConfig) -> None:
    """The real ``parallelize_model``; compile and float8 fall back to being validated only if they
    cannot be set up on the meta device."""
    from lightning_2d.parallel.parallelize import parallelize_model

    try:
        parallelize_model(model, mesh, plan, config)
    except Exception as err:  # noqa: BLE001 - only the optional steps get a second chance
        if not (config.compile or config.float8):
            raise
        raise _Retry(str(err)) from err


class _Retry(RuntimeError):
    pass


def plan_run(
    model: str = "llama3-8b",
    *,
    num_nodes: int = 1,
    devices: int = 8,
    config: Optional[ParallelConfig] = None,
    precision: str = "bf16-mixed",
    seq_len: Optional[int] = None,
    micro_batch_size: int = 1,
    accumulate_grad_batches: int = 1,
    model_overrides: Optional[dict[str, Any]] = None,
    loss_chunk_size: Optional[int] = DEFAULT_LOSS_CHUNK_SIZE,
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
) -> PlanReport:
    """Check a layout and estimate its per-device memory for one training step, without GPUs.

    Runs the real validation, mesh and ``parallelize_model`` for rank 0 of a simulated world of
    ``num_nodes × devices`` ranks (a fake process group, torn down before returning, also on error),
    on a meta-device Llama, then adds the activation model (``ActivationModel``). Under pipeline
    parallelism it does so for one rank of every pipeline rank (global rank ``k·dp·tp``), whose stages
    differ, adds the schedule's micro-batches in flight (``pipeline_activation_estimate``) and reports
    the fullest one.

    Args:
        model: A ``ModelArgs`` preset (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``debug``, ...).
        num_nodes: Nodes of the target cluster.
        devices: Devices (processes) per node.
        config: The strategy's options (``ParallelConfig()``: both sizes ``"auto"``).
        precision: Trainer precision: ``32-true``, ``bf16-mixed`` (default) or ``bf16-true``.
        seq_len: Tokens per sequence; ``None``: the model's ``max_seq_len``.
        micro_batch_size: Sequences per device and micro-batch (also per pipeline micro-batch).
        accumulate_grad_batches: Micro-batches per optimizer step (the Trainer's option). Above 1, FSDP
            keeps every unit's unsharded gradients between micro-batches unless
            ``config.reduce_every_micro_batch`` (under a pipeline the schedule reduces after every batch).
        model_overrides: ``ModelArgs`` fields to change (``{"n_layers": 2}``).
        loss_chunk_size: Tokens per chunk of the fused loss (``LlamaLightningModule``'s ``loss_chunk_size``).
        device_memory_gib: Memory of one device in GiB (default 80: H100/A100 80GB; an H200 has 141 GB = 131 GiB).
        reserve_gib: GiB set aside for what the estimate does not see (CUDA context, NCCL, fragmentation).

    Returns:
        The report (``as_dict()`` for JSON, ``format_report`` for the table).

    Raises:
        ParallelConfigError: every problem of the layout (and of the planner's arguments) at once.
    """
    start = time.perf_counter()
    config = config if config is not None else ParallelConfig()
    problems: list[str] = []
    args = _model_args(model, model_overrides, problems)
    seq_len = seq_len if seq_len is not None else (args.max_seq_len if args is not None else 0)
    problems += _run_problems(args, seq_len, micro_batch_size, device_memory_gib, reserve_gib, loss_chunk_size)
    if accumulate_grad_batches < 1:
        problems.append(f"accumulate_grad_batches must be a positive integer, got {accumulate_grad_batches}")
    dims = _validate(config, args, problems, num_nodes=num_nodes, devices=devices, precision=precision, seq_len=seq_len)
    assert args is not None
    resolved = config.resolve_dtypes(precision)
    notes: list[str] = []
    # Pipeline rank k is played by global rank k·dp·tp (its FSDP and TP coordinates 0: the padded shards).
    ranks = [k * dims.dp * dims.tp for k in range(dims.pp)]

    try:
        shards = [_shard(args, dims, resolved, precision, loss_chunk_size, rank) for rank in ranks]
    except _Retry as err:
        notes.append(
            f"compile/float8 could not be set up on the meta device ({err}); validated, but planned without them"
        )
        resolved = replace(resolved, compile=False, float8=False, fsdp_float8_all_gather=False)
        shards = [_shard(args, dims, resolved, precision, loss_chunk_size, rank) for rank in ranks]

    param_dtype = resolved.param_dtype
    activations = ActivationModel.for_layout(
        args, tp=dims.tp, sequence_parallel=resolved.sequence_parallel, seq_len=seq_len,
        micro_batch_size=micro_batch_size, act_dtype=param_dtype, loss_chunk_size=loss_chunk_size,
    )
    microbatches = _pipeline_microbatches(resolved) if dims.pp > 1 else 1
    plans = [
        _plan_rank(shard, k, dims, resolved, precision, activations, accumulate_grad_batches, microbatches)
        for k, shard in enumerate(shards)
    ]
    # The verdict is the fullest device's: under a pipeline, the pipeline rank with the largest total.
    worst = max(plans, key=lambda p: p.total)
    estimate = worst.activations
    if resolved.compile:
        notes.append("activations are estimated for eager blocks; compiled blocks usually save less")
    if resolved.float8:
        notes.append("float8: activations are estimated as in bf16 (torchao keeps the high-precision inputs)")
    if dims.pp > 1:
        notes += _pipeline_notes(resolved, microbatches, accumulate_grad_batches)

    reserve = int(reserve_gib * GIB)
    memory = int(device_memory_gib * GIB)
    headroom = memory - worst.total - reserve
    parts: dict[str, Any] = {
        "saved_by_blocks": estimate.saved_by_blocks,
        "head_loss_and_inputs": estimate.head_and_loss,
        "transient": estimate.transient,
    }
    if dims.pp > 1:
        parts |= {
            "pipeline_receive_buffers": estimate.receive_buffers,
            "stage_outputs": estimate.stage_outputs,
            "in_flight": estimate.in_flight,
        }
    parts |= {"last_block_saved": estimate.block_saved, "block_modes": _count_modes(estimate.block_modes)}
    report = PlanReport(
        model=model if not model_overrides else f"{model} (overridden: {', '.join(sorted(model_overrides))})",
        model_args=asdict(args),
        total_params=args.num_params(),
        num_nodes=num_nodes,
        devices_per_node=devices,
        world_size=dims.world_size,
        dims={**dims.as_dict(), "data_parallel": dims.dp},
        precision=precision,
        param_dtype=_dtype_name(param_dtype),
        reduce_dtype=_dtype_name(resolved.reduce_dtype),
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        accumulate_grad_batches=accumulate_grad_batches,
        parallel_config=_config_dict(resolved, dims),
        params_per_device=worst.shard.numel,
        param_bytes=worst.shard.param_bytes,
        grad_bytes=worst.grad_bytes,
        optimizer_bytes=worst.optimizer_bytes,
        buffer_bytes=worst.shard.buffer_bytes,
        all_gather_bytes=worst.all_gather,
        reduce_scatter_bytes=worst.reduce_scatter,
        accumulation_bytes=worst.accumulation,
        activation_bytes=estimate.peak,
        activation_phase=estimate.phase,
        activation_parts=parts,
        total_bytes=worst.total,
        reserve_bytes=reserve,
        device_memory_bytes=memory,
        fits=headroom >= 0,
        headroom_bytes=headroom,
        notes=notes,
        pipeline=[p.as_dict(microbatches) for p in plans] if dims.pp > 1 else [],
    )
    if not report.fits:
        report.suggestions = _suggestions(
            report, args, dims, resolved, activations, seq_len, micro_batch_size,
            pipeline=(worst.shard.split, worst.pp_rank, microbatches) if dims.pp > 1 else None,
        )
    report.seconds = round(time.perf_counter() - start, 3)
    return report


@dataclass
class _Shards:
    """What one planned rank holds (``_shard``)."""

    units: list[FSDPUnit]  # in forward order, stage after stage
    numel: int  # parameter elements (local shards)
    param_bytes: int
    buffer_bytes: int
    stage_indices: list[int]  # the pipeline stages it runs ([] without a pipeline)
    split: list[int]  # blocks of every stage of the pipeline ([] without a pipeline)


@dataclass
class _RankPlan:
    """One pipeline rank's estimate (the only one without a pipeline)."""

    pp_rank: int
    global_rank: int
    shard: _Shards
    grad_bytes: int
    optimizer_bytes: int
    all_gather: int
    reduce_scatter: int
    accumulation: int
    activations: ActivationEstimate

    @property
    def total(self) -> int:
        return (self.shard.param_bytes + self.grad_bytes + self.optimizer_bytes + self.shard.buffer_bytes
                + self.all_gather + self.reduce_scatter + self.accumulation + self.activations.peak)

    def as_dict(self, microbatches: int) -> dict[str, Any]:
        """The report's per-pipeline-rank entry (JSON-ready)."""
        stages, split = self.shard.stage_indices, self.shard.split
        return {
            "pipeline_rank": self.pp_rank,
            "global_rank": self.global_rank,
            "stages": list(stages),
            "blocks": [split[s] for s in stages],
            "embedding": 0 in stages,
            "head": len(split) - 1 in stages,
            "params_per_device": self.shard.numel,
            "microbatches": microbatches,
            "in_flight": self.activations.in_flight,
            "activation_phase": self.activations.phase,
            "param_bytes": self.shard.param_bytes,
            "all_gather_bytes": self.all_gather,
            "accumulation_bytes": self.accumulation,
            "activation_bytes": self.activations.peak,
            "total_bytes": self.total,
        }


def _pipeline_microbatches(config: ParallelConfig) -> int:
    """The micro-batches per step the estimate assumes: the given count, else one per stage."""
    return config.pipeline_microbatches or config.num_pipeline_stages


def _pipeline_notes(config: ParallelConfig, microbatches: int, accumulate_grad_batches: int) -> list[str]:
    notes = []
    if config.pipeline_microbatches is None:
        notes.append(
            f"pipeline: pipeline_microbatches is not set; assumed {microbatches} (pipeline_parallel_size x stages per"
            " rank) micro-batches of micro_batch_size sequences per step. At run time it defaults to the per-rank"
            " batch size (one sequence per micro-batch); pass --pipeline-microbatches for the count you will use"
        )
    if config.reduce_every_micro_batch:
        notes.append(
            "pipeline: reduce_every_micro_batch: each micro-batch's backward reshards and reduce-scatters (FSDP"
            " buffers as without a pipeline; an all-gather and a reduce-scatter per unit and micro-batch)"
        )
        return notes
    notes.append(
        "pipeline: torch's PipelineStage keeps each FSDP unit of this rank's stages unsharded from its first"
        " backward to the end of the step and accumulates its unsharded gradients (reduce_dtype) over the"
        " micro-batches, reduce-scattered once at the end: both are counted for every unit"
        + (", every batch (accumulate_grad_batches adds nothing)" if accumulate_grad_batches > 1 else "")
        + "; --reduce-every-micro-batch trades that memory for a reduce-scatter per micro-batch"
    )
    return notes


def _plan_rank(
    shard: _Shards,
    pp_rank: int,
    dims: ParallelDims,
    config: ParallelConfig,
    precision: str,
    activations: ActivationModel,
    accumulate_grad_batches: int,
    microbatches: int,
) -> _RankPlan:
    """States, FSDP buffers and activations of one planned rank.

    Args:
        shard: What the rank holds.
        pp_rank: Its pipeline rank (0 without a pipeline).
        dims: The mesh sizes.
        config: The options, dtypes resolved.
        precision: Trainer precision (the stored dtype).
        activations: One micro-batch of the whole model on one device.
        accumulate_grad_batches: Micro-batches per optimizer step.
        microbatches: Pipeline micro-batches per step (1 without a pipeline).
    """
    from lightning_2d.parallel.fsdp import reshard_after_forward_by_unit

    param_dtype, reduce_dtype = config.param_dtype, config.reduce_dtype
    stored = torch.bfloat16 if precision == "bf16-true" else torch.float32
    units = shard.units
    reduce_scatter = max((u.unsharded_numel * (param_dtype.itemsize + reduce_dtype.itemsize) for u in units), default=0)
    if dims.pp > 1:
        if config.reduce_every_micro_batch:
            # Each micro-batch's backward reshards and reduce-scatters (the stage hidden from
            # PipelineStage's FSDP handling, lightning_2d.parallel.pipeline): FSDP's peaks as without a pipeline.
            all_gather = gathered_peak(units, reshard_after_forward_by_unit(config.reshard_after_forward))
            accumulation = 0
        else:
            # PipelineStage runs each micro-batch's backward with set_reshard_after_backward(False) and
            # set_requires_gradient_sync(False) and reduce-scatters once after the last (perform_reduce_grad):
            # from its first backward to the end of the step every unit stays gathered and keeps its
            # unsharded gradient, upcast to reduce_dtype by FSDP2 between backwards.
            all_gather = sum(u.gathered_bytes for u in units)
            accumulation = sum(u.unsharded_numel for u in units) * reduce_dtype.itemsize
        estimate = pipeline_activation_estimate(
            activations, shard.split, pp=dims.pp, pp_rank=pp_rank, schedule=config.pipeline_schedule,
            microbatches=microbatches, activation_checkpointing=config.activation_checkpointing,
            selective_ac_option=config.selective_ac_option,
        )
    else:
        all_gather = gathered_peak(units, reshard_after_forward_by_unit(config.reshard_after_forward))
        accumulation = 0
        if accumulate_grad_batches > 1 and not config.reduce_every_micro_batch:
            # FSDP2 without gradient sync accumulates each unit's unsharded gradient in reduce_dtype.
            accumulation = sum(u.unsharded_numel for u in units) * reduce_dtype.itemsize
        estimate = activations.estimate(config.activation_checkpointing, config.selective_ac_option)
    return _RankPlan(
        pp_rank=pp_rank,
        global_rank=pp_rank * dims.dp * dims.tp,
        shard=shard,
        grad_bytes=shard.numel * stored.itemsize,
        optimizer_bytes=ADAMW_STATES * shard.numel * stored.itemsize,
        all_gather=all_gather,
        reduce_scatter=reduce_scatter,
        accumulation=accumulation,
        activations=estimate,
    )


def _shard(
    args: ModelArgs, dims: ParallelDims, config: ParallelConfig, precision: str, loss_chunk_size: Optional[int],
    rank: int = 0,
) -> _Shards:
    """Build, parallelize and measure the meta model in a fake world, as ``rank``.

    Args:
        args: The model's shape.
        dims: The mesh sizes.
        config: The options, dtypes resolved.
        precision: Trainer precision (``bf16-true`` stores the shards in bf16).
        loss_chunk_size: The fused loss's chunk.
        rank: The global rank to play (under a pipeline: its stages, the model pruned to them).
    """
    from lightning_2d.models.llama.plan import llama_plan

    plan = llama_plan(args, config)
    with fake_world(dims.world_size, rank), warnings.catch_warnings():
        # DeviceMesh warns that slicing a flattened dim is deprecated (fsdp_mesh_of): the library's
        # concern, not the planner user's.
        warnings.simplefilter("ignore", UserWarning)
        # The mesh only needs shapes: "cpu" works with the fake backend on any machine.
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(args, loss_chunk_size=loss_chunk_size)
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # as parallelize_and_materialize: shards stored in bf16
        _parallelize(model, mesh, plan, config)
        pipeline = getattr(model, "_pipeline", None)
        if pipeline is None:
            units, stage_indices, split = _units(model, plan, dims, config.param_dtype), [], []
        else:
            from lightning_2d.parallel.pipeline import stage_plan

            # Each stage view is its own FSDP root with the usual units (embedding on the first, the
            # output unit on the last); the pruned model holds exactly the stages' parameters.
            units = []
            for stage, index in zip(pipeline.stages, pipeline.stage_indices):
                for unit in _units(stage, stage_plan(stage, plan), dims, config.param_dtype):
                    units.append(replace(unit, name=f"stage {index}: {unit.name}"))
            stage_indices, split = list(pipeline.stage_indices), list(model._pipeline_split)
        numel = param_bytes = 0
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            numel += local.numel()
            param_bytes += local.numel() * local.dtype.itemsize
        buffer_bytes = sum(b.numel() * b.dtype.itemsize for b in model.buffers())
        # FSDP's hooks and states hold the model in reference cycles: collect it now rather than in
        # some later, unrelated allocation (the API may be called many times in one process).
        del model, mesh, pipeline
        gc.collect()
    return _Shards(units, numel, param_bytes, buffer_bytes, stage_indices, split)


def _config_dict(config: ParallelConfig, dims: ParallelDims) -> dict[str, Any]:
    out = {}
    for f in fields(ParallelConfig):
        value = getattr(config, f.name)
        out[f.name] = _dtype_name(value) if isinstance(value, torch.dtype) else value
    out["data_parallel_size"], out["tensor_parallel_size"] = dims.dp, dims.tp
    return out


def _count_modes(modes: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for mode in modes:
        counts[mode] = counts.get(mode, 0) + 1
    return counts


# ---- suggestions ----------------------------------------------------------------------------------
def _suggestions(
    report: PlanReport,
    args: ModelArgs,
    dims: ParallelDims,
    config: ParallelConfig,
    activations: ActivationModel,
    seq_len: int,
    micro_batch_size: int,
    pipeline: Optional[tuple[list[int], int, int]] = None,
) -> list[str]:
    """Changes that bring the estimate under the device memory, each with its (approximate) need.

    A variant's states (parameters, gradients, optimizer) scale with ``1 / (world / replicas)`` (the
    model is split over pipeline × FSDP × TP ranks), its FSDP buffers with ``1 / tensor_parallel_size``,
    and its activations are re-estimated by the activation model.

    Under a pipeline (``pipeline``: the split, the reported pipeline rank and the micro-batches) the
    activations are those of the reported rank's stages; the FSDP buffers (the rank's stages gathered
    and their unsharded gradients) also scale with ``1 / pipeline_parallel_size``, and a deeper
    pipeline is tried (the balanced split ``pipeline_split`` makes, its fullest rank's activations).
    """
    memory = report.device_memory_bytes
    states = report.param_bytes + report.grad_bytes + report.optimizer_bytes
    accumulation = report.accumulation_bytes
    fixed = report.buffer_bytes + report.reserve_bytes
    nodes, devices = report.num_nodes, report.devices_per_node
    ac, option = config.activation_checkpointing, config.selective_ac_option
    pp, per_rank = dims.pp, config.stages_per_rank

    def microbatches_for(size: int) -> int:
        return config.pipeline_microbatches or size * per_rank

    @functools.lru_cache(maxsize=None)  # fewest_nodes asks for the same activations over and over
    def activation(ac_mode: str, tp: int, micro: int, pp_size: int) -> int:
        model = ActivationModel.for_layout(
            args, tp=tp, sequence_parallel=config.sequence_parallel, seq_len=seq_len, micro_batch_size=micro,
            act_dtype=config.param_dtype, loss_chunk_size=activations.loss_chunk_size,
        )
        mode_option = option if ac_mode == ac else "op"
        if pipeline is None:
            return model.estimate(ac_mode, mode_option).peak
        split, rank, m = pipeline
        ranks = [rank]
        if pp_size != pp:  # another split: its fullest rank
            split, ranks, m = _balanced_split_of(args, pp_size * per_rank), list(range(pp_size)), microbatches_for(pp_size)
        return max(
            pipeline_activation_estimate(
                model, split, pp=pp_size, pp_rank=k, schedule=config.pipeline_schedule, microbatches=m,
                activation_checkpointing=ac_mode, selective_ac_option=mode_option,
            ).peak
            for k in ranks
        )

    def need(ac_mode: str = ac, tp: int = dims.tp, n_nodes: int = nodes, micro: int = micro_batch_size,
             replicas: int = dims.dp_replicate, pp_size: int = pp) -> float:
        # states ∝ (model / pp) / (dp_shard × tp) = model × replicas / world, whatever the pipeline
        shards_before = nodes * devices // dims.dp_replicate
        shards_after = n_nodes * devices // replicas
        # Under a pipeline the gathered units and their gradients are a whole stage's: 1 / pp. The
        # reduce-scatter buffer is one unit's (a block's) whatever the pipeline.
        staged = report.all_gather_bytes + accumulation
        scaled_buffers = (staged * pp / pp_size + report.reduce_scatter_bytes) * dims.tp / tp
        return states * shards_before / shards_after + scaled_buffers + activation(ac_mode, tp, micro, pp_size) + fixed

    def fits(total: float) -> str:
        return f"needs ~{total / GIB:.1f} GiB" + (" (fits)" if total <= memory else "")

    def layout_ok(n_nodes: int, tp: int, pp_size: int = pp, replicas: int = dims.dp_replicate) -> bool:
        world = n_nodes * devices
        return world % (tp * pp_size) == 0 and (world // (tp * pp_size)) % replicas == 0

    def fewest_nodes(ac_mode: str, tp: int) -> Optional[int]:
        for n in range(nodes + 1, 64 * nodes + 1024):
            if layout_ok(n, tp) and need(ac_mode, tp, n) <= memory:
                return n
        return None

    out: list[str] = []
    if accumulation and pipeline is None:
        out.append(f"--reduce-every-micro-batch (reduce-scatter after each micro-batch): {fits(need() - accumulation)}")
    elif accumulation:  # under a pipeline it also frees the gathered units between micro-batches
        # What stays gathered then: about a unit and the next one (the largest unit's, in param_dtype).
        pd, rd = config.param_dtype.itemsize, config.reduce_dtype.itemsize
        freed = accumulation + report.all_gather_bytes - 2 * report.reduce_scatter_bytes * pd // (pd + rd)
        out.append(f"--reduce-every-micro-batch (reshard and reduce-scatter after each pipeline micro-batch): "
                   f"{fits(need() - freed)}")
    if ac != "full":
        out.append(f"--activation-checkpointing full: {fits(need('full'))}")
    valid_tps = [
        d for d in range(dims.tp + 1, devices + 1)
        if devices % d == 0 and args.n_heads % d == 0 and args.kv_heads % d == 0
        and not (config.sequence_parallel and seq_len % d) and layout_ok(nodes, d)
    ]
    if valid_tps:
        out.append(f"--tensor-parallel-size {valid_tps[0]}: {fits(need(tp=valid_tps[0]))}")
    if pipeline is not None and config.pipeline_layers_per_stage is None:
        # A deeper pipeline: each rank's stages (gathered with their gradients) shrink.
        def schedule_ok(size: int) -> bool:  # the library's rules for the micro-batch count
            try:
                variant = replace(config, pipeline_parallel_size=size)
            except ParallelConfigError:
                return False
            return not variant.microbatch_problems(microbatches_for(size), None)

        deeper = range(pp + 1, args.n_layers // per_rank + 1)
        sizes = [q for q in deeper if layout_ok(nodes, dims.tp, q) and schedule_ok(q)][:8]
        # The smallest that fits, else the one needing least, if it needs less than now: more stages
        # also mean more micro-batches in flight on the first ranks, which may outweigh them.
        needs = {q: need(pp_size=q) for q in sizes}
        fitting = [q for q in sizes if needs[q] <= memory]
        best = fitting[0] if fitting else min(sizes, key=needs.__getitem__, default=None)
        if best is not None and needs[best] < need():
            dp = nodes * devices // (best * dims.tp)
            out.append(f"--pipeline-parallel-size {best} (data parallel {dp}): {fits(needs[best])}")
    if dims.dp_replicate > 1:
        out.append(
            f"--data-parallel-replicate-size 1 (shard over all {dims.dp} data-parallel ranks instead of"
            f" {dims.dp_shard}): {fits(need(replicas=1))}"
        )
    if micro_batch_size > 1:
        out.append(f"--micro-batch-size 1 (accumulate gradients for the same global batch): {fits(need(micro=1))}")
    more = fewest_nodes(ac, dims.tp)
    if more is not None:
        out.append(f"--num-nodes {more} ({more * devices} devices): {fits(need(n_nodes=more))}")
    if not any(line.endswith("(fits)") for line in out):
        # Nothing alone is enough: all three levers together.
        tp = valid_tps[-1] if valid_tps else dims.tp
        flags = ("--activation-checkpointing full " if ac != "full" else "") + (
            f"--tensor-parallel-size {tp} " if tp != dims.tp else "")
        more = fewest_nodes("full", tp)
        if more is not None:
            out.append(f"{flags}--num-nodes {more} ({more * devices} devices): {fits(need('full', tp, more))}")
        else:
            rest = need("full", tp, 10**6) - fixed
            out.append(
                f"{flags.strip() or 'this layout'}: activations and FSDP buffers alone take ~{rest / GIB:.1f} GiB,"
                " which no number of nodes removes: shorten --seq-len or lower --micro-batch-size"
            )
    return out


def _balanced_split_of(args: ModelArgs, stages: int) -> list[int]:
    """``pipeline_split``'s balanced split computed from the shapes, without a model: the same parameter
    counts (``block_costs_of``) given to the same ``balanced_split``."""
    from lightning_2d.parallel.pipeline import balanced_split

    d, kv_dim = args.dim, args.kv_heads * args.head_dim
    block = float(d * (2 * d + 2 * kv_dim) + 3 * d * args.ffn_hidden_dim + 2 * d)
    head = float(args.vocab_size * d + d)  # final norm + output
    return balanced_split([block] * args.n_layers, stages, last_extra=head, first_extra=args.vocab_size * d * 0.1)


# ---- the table ----------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / GIB:9.2f}"


def format_report(report: PlanReport) -> str:
    """The human-readable table of ``lightning-2d plan``."""
    d = report.dims
    c = report.parallel_config
    tp = d["tensor_parallel"]
    sp = " (sequence parallel)" if c["sequence_parallel"] and tp > 1 else ""
    ac = c["activation_checkpointing"]
    if ac == "selective":
        ac += f" ({c['selective_ac_option']})"
    stored = "bf16" if report.precision == "bf16-true" else "fp32"
    pd, rd = report.param_dtype, report.reduce_dtype
    parts = report.activation_parts
    pipeline = report.pipeline
    keeps_fewer = bool(report.parallel_config.get("reduce_every_micro_batch"))  # units reshard per micro-batch
    worst = max(pipeline, key=lambda r: r["total_bytes"]) if pipeline else None
    rows: list[tuple[str, str, str]] = [
        (f"parameters ({stored}, sharded)", f"{report.params_per_device:,}", _gib(report.param_bytes)),
        (f"gradients ({stored}, sharded)", f"{report.params_per_device:,}", _gib(report.grad_bytes)),
        (f"optimizer state (AdamW, 2 x {stored})", f"{ADAMW_STATES * report.params_per_device:,}",
         _gib(report.optimizer_bytes)),
        (f"FSDP all-gather buffers ({pd}{'; a pipeline keeps every unit' if pipeline and not keeps_fewer else ''})", "",
         _gib(report.all_gather_bytes)),
        (f"FSDP reduce-scatter buffers ({pd} + {rd})", "", _gib(report.reduce_scatter_bytes)),
    ]
    if report.accumulation_bytes:
        rows.append((f"unsharded gradients between micro-batches ({rd})", "", _gib(report.accumulation_bytes)))
    # Under a pipeline the peak's description is long: it goes below the table.
    peak = f"{parts['in_flight']} in flight, see below" if pipeline else report.activation_phase
    rows += [
        (f"activations (peak: {peak})", "", _gib(report.activation_bytes)),
        ("  saved by the blocks", "", _gib(parts["saved_by_blocks"])),
        ("  head, loss and inputs", "", _gib(parts["head_loss_and_inputs"])),
        ("  transient at the peak", "", _gib(parts["transient"])),
    ]
    if pipeline:
        rows += [
            ("  stage outputs kept for backward", "", _gib(parts["stage_outputs"])),
            ("  pipeline receive buffers", "", _gib(parts["pipeline_receive_buffers"])),
        ]
    rows.append(("buffers (rotary table)", "", _gib(report.buffer_bytes)))
    width = max(len(r[0]) for r in rows) + 2
    line = "-" * (width + 32)
    out = [
        f"lightning-2d plan: {report.model}, {report.total_params / 1e9:.2f} B parameters,"
        f" on {report.num_nodes} node(s) x {report.devices_per_node} device(s) = {report.world_size} ranks",
        "layout:   " + (f"pipeline_parallel {d['pipeline_parallel']} x " if pipeline else "")
        + f"data_parallel_replicate {d['data_parallel_replicate']} x data_parallel_shard"
        f" {d['data_parallel_shard']} x tensor_parallel {tp}{sp}",
        f"training: {report.precision} (params {stored}, compute {pd}, reduce {rd}), seq_len {report.seq_len},"
        f" micro batch {report.micro_batch_size}"
        + (f" x {report.accumulate_grad_batches} accumulated" if report.accumulate_grad_batches > 1 else "")
        + f", activation checkpointing {ac}, reshard {c['reshard_after_forward']}",
    ]
    if worst is not None:
        stages = sum(len(r["stages"]) for r in pipeline)
        out.append(
            f"pipeline: {c['pipeline_schedule']}, {stages} stages ({len(worst['stages'])} per rank),"
            f" {worst['microbatches']} micro-batches of {report.micro_batch_size} sequence(s) per step"
        )
    where = f" (pipeline rank {worst['pipeline_rank']}, the fullest)" if worst is not None else ""
    out += ["", f"{'per device' + where:<{width}}{'elements':>20}{'GiB':>12}", line]
    out += [f"{label:<{width}}{count:>20}{size:>12}" for label, count, size in rows]
    out += [
        line,
        f"{'estimated peak':<{width}}{'':>20}{_gib(report.total_bytes):>12}",
        f"{'reserve (CUDA context, NCCL, fragmentation)':<{width}}{'':>20}{_gib(report.reserve_bytes):>12}",
        f"{'device memory':<{width}}{'':>20}{_gib(report.device_memory_bytes):>12}",
    ]
    if worst is not None:
        out += ["", f"activation peak: {report.activation_phase}", ""] + _pipeline_table(pipeline, worst)
    out += ["", f"verdict: {report.verdict}"]
    if report.suggestions:
        out.append("try (estimates):")
        out += [f"  {s}" for s in report.suggestions]
    out += [f"note: {n}" for n in report.notes]
    out.append(f"(planned in {report.seconds:.1f} s)")
    return "\n".join(out)


def _pipeline_table(pipeline: list[dict[str, Any]], worst: dict[str, Any]) -> list[str]:
    """One line per pipeline rank: what it holds and its estimate (``*``: the rank detailed above)."""
    header = (f"{'pipeline rank':>13}  {'stages':<10}{'blocks':<12}{'holds':<18}{'params/device':>15}"
              f"{'in flight':>11}{'activations GiB':>17}{'total GiB':>11}")
    lines = [header, "-" * len(header)]
    for r in pipeline:
        holds = "+".join(n for n, held in (("embedding", r["embedding"]), ("head", r["head"])) if held) or "-"
        mark = " *" if r is worst else ""
        lines.append(
            f"{r['pipeline_rank']:>13}  {','.join(map(str, r['stages'])):<10}{','.join(map(str, r['blocks'])):<12}"
            f"{holds:<18}{r['params_per_device']:>15,}{r['in_flight']:>11}{_gib(r['activation_bytes']):>17}"
            f"{_gib(r['total_bytes']):>11}{mark}"
        )
    return lines


# ---- command line -------------------------------------------------------------------------------
def add_parallel_config_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ParallelConfig`` field, as ``lightning-2d benchmark`` generates them (help from the
    field docs; unset flags keep ``ParallelConfig``'s defaults)."""
    from lightning_2d.tools.benchmark import add_strategy_options

    add_strategy_options(parser, defaults={}, description="ModelParallel2DStrategy / ParallelConfig options")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}; write e.g. '{{\"n_layers\": 2}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of ModelArgs fields, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-2d plan`` parser."""
    parser = argparse.ArgumentParser(
        prog="lightning-2d plan",
        description="Check a 2D layout with the real validation and parallelization on a simulated world (one"
        " process, no GPU) and estimate the memory of one training step per device: parameters, gradients,"
        " AdamW state, FSDP buffers and activations, with a verdict against the device memory.",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=list(PRESETS), default="llama3-8b",
                       help="a ModelArgs preset (default: llama3-8b)")
    model.add_argument("--model-overrides", type=_json_object, default=None, metavar="JSON",
                       help="ModelArgs fields to change, as JSON: '{\"n_layers\": 2}'")
    world = parser.add_argument_group("world")
    world.add_argument("--num-nodes", type=int, default=1)
    world.add_argument("--devices", type=int, default=8, help="devices (processes) per node (default: 8)")
    world.add_argument("--device-memory-gib", type=float, default=DEFAULT_DEVICE_MEMORY_GIB,
                       help="memory of one device in GiB (default: 80, an H100/A100 80GB; an H200's 141 GB are"
                       " 131 GiB)")
    world.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                       help="GiB kept for the CUDA context, NCCL and allocator fragmentation (default: 2)")
    run = parser.add_argument_group("training step")
    run.add_argument("--precision", choices=SUPPORTED_PRECISIONS, default="bf16-mixed", help="(default: bf16-mixed)")
    run.add_argument("--seq-len", type=int, default=None,
                     help="tokens per sequence (default: the model's max_seq_len)")
    run.add_argument("--micro-batch-size", type=int, default=1,
                     help="sequences per device and micro-batch (default: 1)")
    run.add_argument("--accumulate-grad-batches", type=int, default=1,
                     help="micro-batches per optimizer step (default: 1); above 1 FSDP keeps unsharded gradients"
                     " between them unless --reduce-every-micro-batch")
    run.add_argument("--loss-chunk-size", type=int, default=DEFAULT_LOSS_CHUNK_SIZE,
                     help="tokens per chunk of the fused loss (default: 1024, LlamaLightningModule's)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_parallel_config_options(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-2d plan`` / ``python -m lightning_2d.tools.planner``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(ParallelConfig) if getattr(args, f.name) is not None}
    try:
        report = plan_run(
            args.model,
            num_nodes=args.num_nodes,
            devices=args.devices,
            config=ParallelConfig(**given),  # its own checks raise ParallelConfigError too
            precision=args.precision,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            accumulate_grad_batches=args.accumulate_grad_batches,
            model_overrides=args.model_overrides,
            loss_chunk_size=args.loss_chunk_size,
            device_memory_gib=args.device_memory_gib,
            reserve_gib=args.reserve_gib,
        )
    except ParallelConfigError as err:
        # The message lists every problem with its fix; a traceback would only bury it.
        print(f"lightning-2d plan: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report), flush=True)


if __name__ == "__main__":
    main()
