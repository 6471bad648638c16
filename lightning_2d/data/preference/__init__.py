"""Preference data for DPO and its kin: rows → pairs of a prompt and a chosen and a rejected completion
(``formats``, TRL's names) → two sequences trained on their completions, the prompt shared and truncated
(``encode``) → the chat cache, two conversations a pair → windows of whole pairs (``datamodule``:
``PreferenceDataModule``, its batches' contract). KTO's unpaired examples (a prompt, a completion, a label) take
the same road, one conversation each, packed with their KL sequences. Built on ``data/chat``; knows nothing of
models or parallelism beyond the data-parallel rank and size it is given."""

from lightning_2d.data.preference.builtin import (
    stdlib_preference_file,
    stdlib_preference_rows,
    stdlib_unpaired_rows,
)
from lightning_2d.data.preference.datamodule import (
    NO_SEQUENCE,
    PAIR_OVERFLOW,
    PREFERENCE_UNITS,
    PreferenceDataModule,
    PreferencePackingReport,
    PreferenceWindows,
    UnpairedPackingReport,
    UnpairedWindows,
)
from lightning_2d.data.preference.encode import (
    TRUNCATION_MODES,
    EncodedExample,
    EncodedPair,
    PreferenceEncoder,
    PreferenceEncodingError,
    PreferencePieceEncoder,
    Truncation,
)
from lightning_2d.data.preference.formats import (
    PREFERENCE_FIELDS,
    PREFERENCE_FORMATS,
    PreferenceFormatError,
    PreferencePair,
    UnpairedExample,
    is_unpaired_row,
    to_example,
    to_pair,
    unpaired_rows,
)

__all__ = [
    "NO_SEQUENCE", "PAIR_OVERFLOW", "PREFERENCE_FIELDS", "PREFERENCE_FORMATS", "PREFERENCE_UNITS", "TRUNCATION_MODES",
    "EncodedExample", "EncodedPair", "PreferenceDataModule", "PreferenceEncoder", "PreferenceEncodingError",
    "PreferenceFormatError", "PreferencePackingReport", "PreferencePair", "PreferencePieceEncoder",
    "PreferenceWindows", "Truncation", "UnpairedExample", "UnpairedPackingReport", "UnpairedWindows",
    "is_unpaired_row", "stdlib_preference_file", "stdlib_preference_rows", "stdlib_unpaired_rows", "to_example",
    "to_pair", "unpaired_rows",
]
