"""Load a model folder's tokenizer with transformers, from local files only (never the Hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(folder: str | Path) -> bool:
    """Whether the model folder carries tokenizer files."""
    return any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(folder: str | Path) -> Any:
    """The folder's `transformers` tokenizer (a `PreTrainedTokenizerBase`), chat template included.

    Raises:
        FileNotFoundError: the folder has no tokenizer files.
    """
    folder = Path(folder)
    if not has_tokenizer(folder):
        raise FileNotFoundError(
            f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {folder}; a model "
            "folder needs them (run `kvrelay model pull-default` for the default model)"
        )
    # Imported here: transformers takes seconds to import and only tokenizing code needs it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
