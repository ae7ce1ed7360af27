"""Structured outputs compiled by llguidance (a maintained grammar engine: JSON schema, regex,
Lark/GBNF grammars over a tokenizer's vocabulary). Shared by the router (a constraint that
cannot compile is refused before it is queued) and the engine (the matchers that mask logits).

llguidance is imported on first use only: a process that never sees a constraint never loads it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message says why."""


def llguidance_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def grammar_text(constraint: StructuredOutputs) -> str:
    """The llguidance grammar of `constraint` (not yet checked against a vocabulary).

    Raises:
        GrammarError: llguidance is missing, or the spec cannot be read.
    """
    return _grammar_text(constraint.cache_key)


@functools.lru_cache(maxsize=256)
def _grammar_text(key: tuple[str, str, bool]) -> str:
    kind, spec, flexible = StructuredKind(key[0]), key[1], key[2]
    try:
        from llguidance import LLMatcher, grammar_from
    except ImportError:
        raise GrammarError(
            "structured outputs need the llguidance package (pip install llguidance)"
        ) from None
    try:
        if kind in (StructuredKind.JSON, StructuredKind.JSON_OBJECT):
            schema: Any = json.loads(spec) if kind is StructuredKind.JSON else {"type": "object"}
            options = {"whitespace_flexible": flexible}
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        if kind is StructuredKind.REGEX:
            return LLMatcher.grammar_from_regex(spec)
        if kind is StructuredKind.CHOICE:
            return grammar_from("choice", spec)
        return grammar_from("grammar", spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


def check_grammar(constraint: StructuredOutputs, tokenizer: Any | None = None) -> None:
    """Compile `constraint` once (against `tokenizer`, an llguidance LLTokenizer, when given).

    Raises:
        GrammarError: it does not compile; the message is llguidance's, first line first.
    """
    from llguidance import LLMatcher

    text = grammar_text(constraint)
    error = LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise GrammarError(error.strip())


def ll_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None
) -> Any:
    """An llguidance LLTokenizer of a Hugging Face tokenizer, `vocab_size` wide (the model's
    logits may be wider than the tokenizer's vocabulary: padding ids are never allowed).
    `eos_token_ids` (default: the tokenizer's EOS) are the tokens that may end a complete
    output: an engine passes its model's, which may name more than the tokenizer does."""
    import llguidance.hf

    eos = list(eos_token_ids) if eos_token_ids else None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
