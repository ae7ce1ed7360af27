"""The engine's grammar compiler: a request's StructuredOutputs -> an llguidance matcher.

Compiling runs on a small thread pool, never on the engine thread (llguidance drops the GIL
while it builds a grammar, so steps go on meanwhile). The vocabulary llguidance masks over (an
LLTokenizer) is built on the first constraint only: a worker's engine has no tokenizer (the
router detokenizes), so it loads the model folder's then; an engine that never sees a
constraint never loads llguidance. Compiled grammars are kept as prototype matchers, by the
constraint's `cache_key`, in a bounded LRU; every sample runs on a `deep_copy` of one.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvrelay.common.grammar import GrammarError, grammar_text, ll_tokenizer
from kvrelay.common.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# Distinct constraints kept compiled. A JSON-schema matcher is small (kilobytes to a few MiB
# for big schemas) and compiles in about a millisecond, so a bound this size only saves
# recompiling the schemas that a service's clients keep sending.
MAX_CACHED_GRAMMARS = 128
# Threads compiling at once: enough that one slow grammar does not hold up the next request's,
# few enough to leave the cores to the engine's forward passes.
COMPILE_THREADS = 2


class GrammarCompiler:
    """Compiles constraints to llguidance matchers over one model's vocabulary.

    `compile` is called from the engine thread only; the work it submits runs on the pool.
    """

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: Any | None = None,
        *,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        """`tokenizer`: the engine's Hugging Face tokenizer when it has one; else the one in
        `model_path` is loaded when the first constraint arrives."""
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._hf_tokenizer = tokenizer
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer: Any | None = None
        self.num_compiled = 0  # compiles started (cache misses)

    def compile(self, constraint: StructuredOutputs) -> Future[Any]:
        """The prototype matcher of `constraint`, compiled or being compiled: its result is an
        `llguidance.LLMatcher` never advanced (copy it per sample), or its exception a
        GrammarError saying why the constraint cannot be enforced."""
        key = constraint.cache_key
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        future = self._pool.submit(self._compile, constraint)
        self.num_compiled += 1
        self._cache[key] = future  # failures too: the same spec fails the same way again
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: StructuredOutputs) -> Any:
        """On a pool thread: the constraint's matcher.

        Raises:
            GrammarError: no tokenizer, or llguidance refuses the spec (its reason).
        """
        from llguidance import LLMatcher

        tokenizer = self.ll_tokenizer()
        matcher = LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(first_line(matcher.get_error(), "the grammar could not be compiled"))
        return matcher

    def ll_tokenizer(self) -> Any:
        """The llguidance vocabulary, built once (~0.4 s for a 49k vocabulary); thread-safe.

        Raises:
            GrammarError: the model folder has no usable tokenizer.
        """
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self) -> Any:
        hf = self._hf_tokenizer
        if hf is None:
            from kvrelay.models.tokenizer import load_tokenizer

            try:
                hf = load_tokenizer(self.model_path)
            except (OSError, ValueError) as exc:
                raise GrammarError(
                    f"the model has no tokenizer to enforce it with: {exc}"
                ) from None
        try:
            # The model's EOS ids, not only the tokenizer's: either ends a complete output.
            return ll_tokenizer(hf, self.vocab_size, eos_token_ids=self.eos_token_ids or None)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"llguidance cannot read this model's tokenizer: {exc}") from None

    def shutdown(self) -> None:
        """Stop the pool's threads (a compile in progress finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def first_line(error: str, otherwise: str) -> str:
    """llguidance's messages run over several lines (the grammar quoted): the first that
    says something, else `otherwise`."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[0] if lines else otherwise
