"""What a checkpoint is made of, by name: the files of a sharded checkpoint folder, the suffixes of checkpoint
files, the mark of our full files, and the step in a checkpoint's name.

A sharded checkpoint is a folder written by PyTorch Distributed Checkpoint (one ``.distcp`` file per rank,
``.metadata`` written by rank 0 once every rank's shard is on disk), our ``rng/rank{r}.pt`` and ``digests.json``
(``digests.MANIFEST_FILE``), and Lightning's ``meta.pt``, written last. A full checkpoint is one ``torch.save`` file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"
DCP_SHARD_SUFFIX = ".distcp"
RNG_FOLDER = "rng"
# Lightning's checkpoint suffix, then torch's usual ones (``fabric.save("step-3.pt")``).
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")
# A step number in the common naming schemes: Lightning's ``epoch=E-step=N`` and ``step=N``, the
# Fabric recipe's ``step-000003``, ``step_N``, ``stepN``. Not preceded by a letter, so ``timestep5``
# or ``mystep5`` carry no step.
STEP_PATTERN = re.compile(r"(?<![a-z])step[=_-]?(\d+)", re.IGNORECASE)
# The key our strategies put in every checkpoint: what tells our full ``.pt`` files from tensor dumps.
FULL_FILE_MARK = b"lightning_2d"


def checkpoint_step(path: Path) -> Optional[int]:
    """The step number in ``path``'s name (that of its target, for a link), or ``None``.

    Args:
        path: A checkpoint file or folder, named ``epoch=0-step=12.ckpt``, ``step-000012``, ``step_12.pt``...
    """
    matches = STEP_PATTERN.findall(Path(path).resolve().name)
    return int(matches[-1]) if matches else None
