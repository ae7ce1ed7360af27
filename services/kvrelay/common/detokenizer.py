"""Incremental detokenization and stop-string matching for one sequence.

Text is emitted only once it is stable: a token that ends inside a multi-byte character (the
decoder shows U+FFFD) waits for the tokens that complete it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


# Prompt tokens decoded before the first output token, so that token gets the spacing it has
# after the prompt (decoders drop a leading space at the start of a text).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, and finds stop strings in it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token.

        Returns:
            (the new stable text, the stop string matched or None). When a stop string
            matches, `text` is cut before it and the caller must finish the sequence.
        """
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(delta)

    def _append(self, delta: str) -> tuple[str, str | None]:
        start = len(self.text)
        self.text += delta
        if not self._stop:
            return delta, None
        search_from = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            pos = self.text.find(stop, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return delta, None
        self.text = self.text[: best[0]]
        return self.text[start:] if best[0] > start else "", best[1]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
