"""Structured-output constraints compiled before a request is queued: one that the grammar
engine cannot compile against this model's vocabulary is a 400 naming the field that sent it,
with llguidance's reason, never a failure on a worker.

The llguidance tokenizer is built once, lazily (about a second), on the prompt encoder's thread
(the Hugging Face tokenizer is not safe to use from two threads); compiling runs on a worker
thread (asyncio.to_thread), so neither stalls the event loop. Verdicts are cached by
constraint, so a schema sent again costs a dictionary lookup.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from kvrelay.common.grammar import GrammarError, check_grammar, ll_tokenizer, llguidance_available
from kvrelay.common.structured_outputs import StructuredOutputs
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.types import GenerateRequest

logger = logging.getLogger(__name__)

MAX_CACHED_VERDICTS = 1024
_UNSET = object()

# Runs a blocking call where the tokenizer may be used (the prompt encoder's thread).
OnTokenizerThread = Callable[..., Awaitable[Any]]


class ConstraintChecker:
    def __init__(self, tokenizer: Any, on_tokenizer_thread: OnTokenizerThread) -> None:
        self._tokenizer = tokenizer
        self._on_tokenizer_thread = on_tokenizer_thread
        self._ll_tokenizer: Any = _UNSET
        self._building: asyncio.Lock | None = None
        self._verdicts: OrderedDict[tuple[str, str, bool], str | None] = OrderedDict()

    async def check(self, request: GenerateRequest) -> None:
        """InvalidRequestError (the constraint's field) if the constraint cannot compile."""
        constraint = request.params.structured_outputs
        if constraint is None:
            return
        param = request.param("structured_outputs")
        if not llguidance_available():
            raise InvalidRequestError(
                f"{param}: structured outputs need the llguidance package, which this server "
                "does not have (pip install llguidance)",
                param,
            )
        key = constraint.cache_key
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        else:
            tokenizer = await self._llg_tokenizer()
            error = await asyncio.to_thread(_compile_error, constraint, tokenizer)
            self._verdicts[key] = error
            if len(self._verdicts) > MAX_CACHED_VERDICTS:
                self._verdicts.popitem(last=False)
        if error is not None:
            raise InvalidRequestError(f"{param} cannot be compiled: {error}", param)

    async def _llg_tokenizer(self) -> Any:
        """The llguidance tokenizer of the model's (None without a fast HF tokenizer: the
        constraint is then compiled without a vocabulary)."""
        if self._ll_tokenizer is not _UNSET:
            return self._ll_tokenizer
        if self._building is None:
            self._building = asyncio.Lock()
        async with self._building:
            if self._ll_tokenizer is _UNSET:
                self._ll_tokenizer = await self._build()
        return self._ll_tokenizer

    async def _build(self) -> Any:
        if self._tokenizer is None:
            return None
        try:
            size = len(self._tokenizer)
            return await self._on_tokenizer_thread(ll_tokenizer, self._tokenizer, size)
        except (ValueError, TypeError, AttributeError) as exc:
            logger.warning("constraints are compiled without the vocabulary: %s", exc)
            return None


def _compile_error(constraint: StructuredOutputs, tokenizer: Any) -> str | None:
    try:
        check_grammar(constraint, tokenizer)
    except GrammarError as exc:
        return str(exc)
    return None
