"""What ``PreferenceDataModule`` trains on without a download: pairs about the standard library, made from the
built-in chat corpus (``chat/builtin.py``: questions about the standard library's functions and classes, answered
from their docstrings).

Each pair's prompt is a question ("What does the function ``textwrap.dedent`` do?"), its chosen completion the
docstring's answer and its rejected completion an evasive non-answer naming the same object, one of a few fixed
phrasings: a consistent, dispreferred style a preference loss can learn to rank below the answer. Deterministic,
written once as JSONL (explicit format, strings) under the cache directory. The unpaired examples KTO trains on
(``format="unpaired"``) are the same pairs unpaired as TRL's ``KTOTrainer`` unpairs a paired data set: each chosen
answer a desirable example, each evasive one an undesirable example (``formats.unpaired_rows``).
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_2d.data.chat.builtin import BUILTIN_VERSION, stdlib_conversations, write_atomically
from lightning_2d.data.preference.formats import unpaired_rows

#: The rejected completions' phrasings (``{name}``: the object asked about), taken in turn.
EVASIVE = (
    "I'm not sure what `{name}` does. You could look it up in the documentation.",
    "That depends on many things, so it is hard to say what `{name}` does in general.",
    "Sorry, I can't help with questions about `{name}`.",
    "`{name}` does what its name says. Try it and see.",
)


def stdlib_preference_rows() -> list[dict[str, str]]:
    """The built-in pairs (``{"prompt", "chosen", "rejected"}``), in the chat corpus's order."""
    rows = []
    for conversation in stdlib_conversations():
        question, answer = conversation["messages"][:2]
        name = question["content"].split("`")[1]
        rejected = EVASIVE[len(rows) % len(EVASIVE)].format(name=name)
        rows.append({"prompt": question["content"], "chosen": answer["content"], "rejected": rejected})
    return rows


def stdlib_unpaired_rows() -> list[dict[str, object]]:
    """The built-in pairs as unpaired examples (``{"prompt", "completion", "label"}``): every chosen answer
    (desirable), then every evasive one (undesirable)."""
    return unpaired_rows(stdlib_preference_rows())


def stdlib_preference_file(cache_dir: Path, unpaired: bool = False) -> Path:
    """The built-in pairs (or, ``unpaired``, their unpaired examples) as JSONL under ``cache_dir`` (written once)."""
    folder = Path(cache_dir).expanduser()
    path = folder / f"stdlib-{'unpaired' if unpaired else 'preferences'}-v{BUILTIN_VERSION}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        rows = stdlib_unpaired_rows() if unpaired else stdlib_preference_rows()
        write_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path
