"""What every variant trains, the same way: this rank's synthetic tokens (the same samples whatever the
layout), or under ``--preference`` its synthetic packed pairs (``SyntheticPairs``), the seeded initial weights, and
AdamW with ``LlamaLightningModule``'s hyper-parameters and schedule for the hand-written variants.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_2d.data.preference.datamodule import NO_SEQUENCE
from lightning_2d.integration.module import LlamaLightningModule, fused_adamw, warmup_cosine_schedule
from lightning_2d.models.llama.model import Transformer
from lightning_2d.ops.linear_cross_entropy import IGNORE_INDEX
from lightning_2d.ops.init import SeededInit
from lightning_2d.parallel.materialize import local_block
from lightning_2d.parallel.modules import canonical_name
from lightning_2d.tools.benchmark.settings import BenchmarkSettings


class SyntheticTokens(torch.utils.data.Dataset):
    """This data-parallel rank's batches of random tokens, drawn up front (not in the timed loop).

    Sample ``i`` of the global stream is drawn from a generator seeded by ``(seed, i)``, so a
    sample's tokens do not depend on the layout; data-parallel rank ``r`` takes, of each global
    batch, the ``r``-th slice of ``local_batch_size`` samples.

    Args:
        settings: Shape, steps and seed.
        dp_rank: This rank's index in the data-parallel dimension.
    """

    def __init__(self, settings: BenchmarkSettings, dp_rank: int) -> None:
        local, vocab = settings.local_batch_size, settings.model_args.vocab_size
        rows = []
        for step in range(settings.total_steps):
            for j in range(local):
                index = step * settings.global_batch_size + dp_rank * local + j
                g = torch.Generator().manual_seed(settings.seed * 1_000_003 + index)
                rows.append(torch.randint(0, vocab, (settings.seq_len + 1,), generator=g))
        self.tokens = torch.stack(rows)  # (steps · local_batch, seq_len + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def synthetic_loader(settings: BenchmarkSettings, rank: int) -> torch.utils.data.DataLoader:
    """The loader of global ``rank``: tensor-parallel groups are consecutive ranks, so its data-parallel
    index is ``rank // tp`` (the same in Lightning's mesh and in ``init_device_mesh((dp, tp))``)."""
    dataset = SyntheticTokens(settings, dp_rank=rank // settings.tp)
    return torch.utils.data.DataLoader(dataset, batch_size=settings.local_batch_size, shuffle=False)


#: Positions a pair takes at most in a ``SyntheticPairs`` window: a window of ``seq_len`` holds
#: ``max(1, seq_len // PAIR_POSITIONS)`` pairs, each of its two sequences at most half the pair's share.
PAIR_POSITIONS = 128
#: Token id of a window's padding (its labels are ``-100``).
PAD_ID = 0


def pairs_per_window(seq_len: int) -> int:
    """The pairs each ``SyntheticPairs`` window of ``seq_len`` positions holds."""
    return max(1, seq_len // PAIR_POSITIONS)


def _window_generator(settings: BenchmarkSettings, index: int) -> torch.Generator:
    # Offset from SyntheticTokens' seeds: a window's pairs are not the token stream's sample `index`.
    return torch.Generator().manual_seed(settings.seed * 1_000_003 + index + 500_000_001)


def _draw_lengths(g: torch.Generator, seq_len: int) -> list[tuple[int, int, int]]:
    """Each pair's prompt tokens and its chosen and rejected completions' tokens, drawn first from ``g``: a sequence
    of ``p`` prompt and ``c`` completion tokens takes ``p + c - 1`` positions (inputs and next-token labels), at most
    ``seq_len // pairs // 2``; its completions fill at least half of what the prompt leaves."""
    longest = seq_len // pairs_per_window(seq_len) // 2

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    lengths = []
    for _ in range(pairs_per_window(seq_len)):
        prompt = draw(1, max(1, longest // 2))
        room = longest - prompt + 1  # completion tokens that still fit
        lengths.append((prompt, draw(max(1, room // 2), room), draw(max(1, room // 2), room)))
    return lengths


def pair_window(settings: BenchmarkSettings, index: int) -> dict[str, torch.Tensor]:
    """Window ``index`` of the global stream of synthetic pairs, drawn from a generator seeded by ``(seed, index)``
    (the same whatever the layout), as ``PreferenceDataModule``'s samples are (its module docstring): whole pairs,
    each its chosen sequence then its rejected one (a random prompt shared, random completions), then padding;
    ``input_ids``, ``labels`` (the completions' tokens, ``-100`` elsewhere), ``position_ids`` (restarting at each
    sequence and at the padding), ``sequence_ids`` (pair ``p``'s chosen ``2p``, rejected ``2p + 1``, ``-1`` on
    padding), ``sequence_numbers`` (the stream's numbering: window ``i``'s pair ``p`` is pair ``i · pairs + p``,
    its chosen ``2k``, its rejected ``2k + 1``) and ``pairs`` (0-dim)."""
    g, seq_len, vocab = _window_generator(settings, index), settings.seq_len, settings.model_args.vocab_size
    lengths = _draw_lengths(g, seq_len)
    inputs, labels, positions, ids, numbers = [], [], [], [], []
    for pair, (prompt_len, *completions) in enumerate(lengths):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        for side, completion_len in enumerate(completions):
            tokens = torch.cat([prompt, torch.randint(0, vocab, (completion_len,), generator=g)])
            target = tokens[1:].clone()
            target[: prompt_len - 1] = IGNORE_INDEX  # trained: the completion's tokens only
            inputs.append(tokens[:-1])
            labels.append(target)
            positions.append(torch.arange(len(target)))
            ids.append(torch.full_like(target, 2 * pair + side))
            numbers.append(torch.full_like(target, 2 * (index * len(lengths) + pair) + side))
    pad = seq_len - sum(map(len, inputs))
    inputs.append(torch.full((pad,), PAD_ID, dtype=torch.long))
    labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
    positions.append(torch.arange(pad))
    ids.append(torch.full((pad,), NO_SEQUENCE, dtype=torch.long))
    numbers.append(torch.full((pad,), NO_SEQUENCE, dtype=torch.long))
    return {"input_ids": torch.cat(inputs), "labels": torch.cat(labels), "position_ids": torch.cat(positions),
            "sequence_ids": torch.cat(ids), "sequence_numbers": torch.cat(numbers),
            "pairs": torch.tensor(len(lengths), dtype=torch.long)}


class PairWindows(Dataset):
    """This data-parallel rank's windows of synthetic pairs (``pair_window``), drawn up front, split by rank as
    ``SyntheticTokens``' samples are; with ``reference_logps`` set (``SyntheticPairs.set_reference_log_probs``), each
    sequence's value at its first position, 0 elsewhere (``PreferenceDataModule``'s ``reference_logps``)."""

    def __init__(self, settings: BenchmarkSettings, dp_rank: int) -> None:
        local = settings.local_batch_size
        self.windows = [pair_window(settings, step * settings.global_batch_size + dp_rank * local + j)
                        for step in range(settings.total_steps) for j in range(local)]
        self.reference_logps: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = dict(self.windows[i])
        if self.reference_logps is not None:
            ids, numbers = sample["sequence_ids"], sample["sequence_numbers"]
            first = (ids >= 0) & torch.cat([torch.ones(1, dtype=torch.bool), ids[1:] != ids[:-1]])
            values = torch.zeros(len(ids), dtype=torch.float32)
            values[first] = torch.from_numpy(self.reference_logps[numbers[first].numpy()])
            sample["reference_logps"] = values
        return sample


def _with_step_pairs(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A training batch: the samples stacked, and ``step_pairs`` (this replica's pairs over the optimizer step:
    the benchmark accumulates no batches, so the batch's)."""
    batch = default_collate(samples)
    batch["step_pairs"] = batch["pairs"].sum().to(torch.float32)
    return batch


class SyntheticPairs(L.LightningDataModule):
    """Under ``--preference``: this data-parallel rank's synthetic packed pairs (``PairWindows``), batched as
    ``PreferenceDataModule``'s are (``step_pairs`` on training batches), and ``precompute_reference``'s side of the
    data (``PreferenceTuning._precompute_reference``): ``sequence_count``, ``reference_loaders``,
    ``load_reference_log_probs``, ``save_reference_log_probs``, ``set_reference_log_probs``.

    ``load_reference_log_probs`` gives synthetic values for any reference, so no reference pass runs: the variant
    under ``precompute_reference`` times its steps with the values read from batches and the frozen copy never built
    (the values found before it is: ``release_cached_frozen_models``), not the one-time pass before them. A sequence's value is what a uniform model gives its completion,
    ``-(completion tokens) · ln(vocab)``, not the initial model's own: that variant's first loss is not the others'
    ``ln 2`` (1.03 for ``debug`` at 256 positions), which changes nothing of a step's work.

    Args:
        settings: Shape, steps and seed.
        dp_rank: This rank's index in the data-parallel dimension.
    """

    #: Chosen and rejected are documents of their own (``position_ids``), as in ``PreferenceDataModule``.
    document_mask = True
    preference_units = "pairs"

    def __init__(self, settings: BenchmarkSettings, dp_rank: int) -> None:
        super().__init__()
        self.settings = settings
        self.seq_len, self.batch_size = settings.seq_len, settings.local_batch_size
        self.dataset = PairWindows(settings, dp_rank)
        self._saved: dict[str, np.ndarray] = {}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=_with_step_pairs)

    # ---- precompute_reference's protocol (``PreferenceDataModule``'s methods of the same names) ----
    @property
    def sequence_count(self) -> int:
        """The stream's sequences (two a pair), what ``set_reference_log_probs`` gives a value each."""
        return self.settings.total_steps * self.settings.global_batch_size * 2 * pairs_per_window(self.seq_len)

    def reference_loaders(self) -> list[DataLoader]:
        """This replica's windows once (every replica holds as many): what a reference pass would score."""
        return [DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)]

    def synthetic_reference_log_probs(self) -> np.ndarray:
        """Each sequence's synthetic reference value, ``-(completion tokens) · ln(vocab)`` (``float32``,
        ``(sequence_count,)``): the lengths of every window of the stream drawn again, not its tokens."""
        s = self.settings
        completions = [c for index in range(s.total_steps * s.global_batch_size)
                       for _, *sides in _draw_lengths(_window_generator(s, index), s.seq_len) for c in sides]
        return (-np.asarray(completions, dtype=np.float64) * math.log(s.model_args.vocab_size)).astype(np.float32)

    def load_reference_log_probs(self, key: str) -> np.ndarray:
        """The values saved for ``key`` in this run, else the synthetic ones: never ``None``, so no pass runs."""
        return self._saved[key] if key in self._saved else self.synthetic_reference_log_probs()

    def save_reference_log_probs(self, key: str, values: np.ndarray, identity: dict[str, Any]) -> None:
        """Kept in memory for ``key`` (nothing is written: the data is drawn again every run)."""
        self._saved[key] = np.asarray(values, dtype=np.float32)

    def set_reference_log_probs(self, values: np.ndarray) -> None:
        """Give every window its sequences' reference values (``reference_logps``)."""
        if values.shape != (self.sequence_count,):
            raise ValueError(f"reference log-probabilities of shape {values.shape} for {self.sequence_count}"
                             " sequences")
        self.dataset.reference_logps = np.asarray(values, dtype=np.float32)


def synthetic_data(settings: BenchmarkSettings, rank: int) -> dict[str, Any]:
    """``Trainer.fit``'s data for global ``rank``: ``datamodule=SyntheticPairs`` under ``--preference``
    (``precompute_reference`` talks to ``trainer.datamodule``), else ``train_dataloaders=synthetic_loader``."""
    if settings.preference is not None:
        return {"datamodule": SyntheticPairs(settings, dp_rank=rank // settings.tp)}
    return {"train_dataloaders": synthetic_loader(settings, rank)}


def adamw_defaults() -> dict[str, Any]:
    """``LlamaLightningModule``'s optimizer hyper-parameters (its constructor defaults): one source of truth."""
    parameters = inspect.signature(LlamaLightningModule.__init__).parameters
    names = ("learning_rate", "weight_decay", "betas", "eps", "fused", "warmup_steps", "min_lr_ratio")
    return {name: parameters[name].default for name in names}


def lr_warmup_steps(settings: BenchmarkSettings) -> int:
    return max(1, settings.warmup)


def build_adamw(
    model: torch.nn.Module, device: torch.device, settings: BenchmarkSettings
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule for the hand-written variants, following ``LlamaLightningModule.configure_optimizers``:
    weight decay on matrices only, fused on CUDA and CPU and foreach elsewhere, linear warm-up then cosine."""
    hp = adamw_defaults()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    fused = fused_adamw(hp["fused"], device)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp["learning_rate"],
        betas=tuple(hp["betas"]),
        eps=hp["eps"],
        fused=fused,
        foreach=None if fused else True,
    )
    schedule = warmup_cosine_schedule(lr_warmup_steps(settings), settings.total_steps, hp["min_lr_ratio"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


@torch.no_grad()
def load_seeded_init(model: Transformer, seed: int) -> None:
    """Overwrite each rank's shards with the values ``Transformer.init_weights(seed)`` gives the full
    model, and recompute the rotary table: every variant then starts from the same weights."""
    source = SeededInit(model.param_init_specs(), seed)
    device = torch.device("cpu")
    for name, param in model.named_parameters():
        local, offset = local_block(param)
        source.fill_block_(local, canonical_name(name), tuple(param.shape), offset)
        device = local.device
    model.init_buffers(device)
