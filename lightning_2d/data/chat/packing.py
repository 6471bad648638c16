"""Conversations into windows of ``seq_len`` positions: best-fit decreasing, or one per window.

A conversation of ``L`` tokens takes ``L - 1`` positions of a window (inputs ``ids[:-1]``, labels ``ids[1:]``);
each is its own document in the window (its positions restart at 0, the model's document mask keeps it from
attending to the others), and what no conversation fills is padding (no loss). ``pack_windows`` returns the
windows as a CSR pair (``offsets``, ``items``): window ``w`` holds conversations ``items[offsets[w]:offsets[w+1]]``,
in that order.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from lightning_2d.data.sources import DataError

OVERFLOW = ("truncate", "drop", "error")


@dataclass(frozen=True)
class Windows:
    """Packed windows.

    Args:
        offsets: ``(W + 1,)`` int64: window ``w``'s conversations are ``items[offsets[w]:offsets[w + 1]]``.
        items: Conversation indices (into the cache).
        lengths: ``(W,)`` positions each window fills (the rest is padding).
    """

    offsets: np.ndarray
    items: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def window(self, w: int) -> np.ndarray:
        return self.items[self.offsets[w] : self.offsets[w + 1]]


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of at most ``capacity``: items longest first, each into the fullest bin it still fits (a new one if
    none). Deterministic (ties: the lower index first, the earlier bin first). ``lengths`` must be ≤ ``capacity``.

    Within 11/9 of the fewest bins plus one (Johnson's bound for first-fit decreasing holds for best fit too).
    ``O(n log n)``: the bins are kept by their free space, one list per distinct free space.
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    bins: list[list[int]] = []
    free_keys: list[int] = []  # sorted distinct free spaces that some bin has
    by_free: dict[int, deque[int]] = {}  # free space -> bins with it, earliest first
    for item in order.tolist():
        size = int(lengths[item])
        at = bisect.bisect_left(free_keys, size)
        if at < len(free_keys):
            free = free_keys[at]
            stack = by_free[free]
            b = stack.popleft()
            if not stack:
                del by_free[free]
                free_keys.pop(at)
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(item)
        left = free - size
        if left > 0:
            if left not in by_free:
                bisect.insort(free_keys, left)
                by_free[left] = deque()
            by_free[left].append(b)
    return bins


def pack_windows(positions: np.ndarray, seq_len: int, pack: bool = True) -> Windows:
    """Windows of the conversations whose ``positions`` (``L - 1`` each, already ≤ ``seq_len``) are given."""
    if positions.size and int(positions.max()) > seq_len:
        raise DataError(f"a conversation takes {int(positions.max())} positions, more than seq_len ({seq_len})")
    if pack:
        bins = best_fit_decreasing(positions, seq_len)
    else:
        bins = [[i] for i in range(len(positions))]
    counts = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    items = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(offsets[-1]))
    filled = np.add.reduceat(positions[items], offsets[:-1]) if len(bins) else np.zeros(0, dtype=np.int64)
    return Windows(offsets, items, filled.astype(np.int64))
