"""Preference data for DPO and its kin: rows → pairs of a prompt and a chosen and a rejected completion
(``formats``, TRL's names) → two sequences trained on their completions, the prompt shared and truncated
(``encode``) → the chat cache, two conversations a pair → windows of whole pairs (``datamodule``:
``PreferenceDataModule``, its batches' contract). Built on ``data/chat``; knows nothing of models or parallelism
beyond the data-parallel rank and size it is given."""

from lightning_2d.data.preference.builtin import stdlib_preference_file, stdlib_preference_rows
from lightning_2d.data.preference.datamodule import (
    NO_SEQUENCE,
    PAIR_OVERFLOW,
    PreferenceDataModule,
    PreferencePackingReport,
    PreferenceWindows,
)
from lightning_2d.data.preference.encode import (
    TRUNCATION_MODES,
    EncodedPair,
    PreferenceEncoder,
    PreferenceEncodingError,
    PreferencePieceEncoder,
)
from lightning_2d.data.preference.formats import (
    PREFERENCE_FIELDS,
    PREFERENCE_FORMATS,
    PreferenceFormatError,
    PreferencePair,
    to_pair,
)

__all__ = [
    "NO_SEQUENCE", "PAIR_OVERFLOW", "PREFERENCE_FIELDS", "PREFERENCE_FORMATS", "TRUNCATION_MODES", "EncodedPair",
    "PreferenceDataModule", "PreferenceEncoder", "PreferenceEncodingError", "PreferenceFormatError",
    "PreferencePackingReport", "PreferencePair", "PreferencePieceEncoder", "PreferenceWindows",
    "stdlib_preference_file", "stdlib_preference_rows", "to_pair",
]
