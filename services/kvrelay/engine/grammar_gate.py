"""Requests held aside while their grammar compiles, and the matchers of their samples.

A request with structured outputs is registered at once (its id taken, its outputs returned
like any other's) but kept out of the scheduler until its grammar is compiled (grammar.py):
a sample never runs without its matcher, and the scheduler never learns grammars exist. Then
each sample gets a copy of the compiled matcher, fed the tokens the sample already holds
(a resumed sequence's, a decode engine's handed-off first token), and is queued; or, when the
grammar cannot be compiled or refuses those tokens, the request alone fails. A decode
engine's request waits for its KV pull meanwhile, so the pull and the compile overlap; a pull
that ends first is applied once the grammar is ready.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvrelay.config import EngineConfig
from kvrelay.engine.grammar import GrammarCompiler, first_line
from kvrelay.engine.handoff import KVHandoff
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduler import Scheduler

# What a client is told first when its constraint cannot be enforced (the field it sent).
FIELD = "structured_outputs"


@dataclass
class HeldRequest:
    parent: ParentRequest
    compiled: concurrent.futures.Future[Any]  # the prototype matcher (grammar.py)
    queued: bool  # True: its samples enter the scheduler once ready; False: a pulling one
    pull_ok: bool | None = None  # a pull that ended while it compiled, applied when ready


class GrammarGate:
    """The requests of one engine whose grammar is compiling, by request id."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._held: dict[str, HeldRequest] = {}

    @classmethod
    def of_engine(cls, config: EngineConfig, tokenizer: Any | None) -> GrammarGate:
        """The gate of an engine of `config` (its tokenizer, when it has one)."""
        model = config.model_config
        compiler = GrammarCompiler(config.model, model.vocab_size, model.eos_token_ids, tokenizer)
        return cls(compiler)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, parent: ParentRequest, *, queued: bool) -> None:
        """Keep `parent` aside until its grammar compiles. `queued`: its samples are in no
        queue yet (False: a decode engine's request, waiting for its KV pull)."""
        constraint = parent.children[0].sampling_params.structured_outputs
        assert constraint is not None
        future = self.compiler.compile(constraint)
        self._held[parent.request_id] = HeldRequest(parent, future, queued)

    def defer_pull(self, request_id: str, ok: bool) -> bool:
        """A held request's pull ended: kept to apply when its grammar is ready (True), or
        False when the request is not held (apply it now)."""
        held = self._held.get(request_id)
        if held is None:
            return False
        held.pull_ok = ok
        return True

    def discard(self, request_id: str) -> None:
        """Forget a held request (aborted); its compile runs on, cached for the next."""
        self._held.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for any held grammar to finish compiling (for an
        engine with nothing else to do, instead of spinning)."""
        futures = [held.compiled for held in self._held.values()]
        concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def release(
        self,
        scheduler: Scheduler,
        handoff: KVHandoff,
        queue: Callable[[list[Request]], None],
        finish_pull: Callable[[str, bool], None],
    ) -> list[ParentRequest]:
        """Let every request whose grammar is compiled go on: matchers on its samples, then
        `queue`d (new ones) or its deferred pull applied through `finish_pull`.

        Returns:
            The requests that finished here: failed (`error` set, every sample aborted, its
            blocks freed) or complete already (every sample's grammar stopped).
        """
        finished = []
        for held in self._take_ready():
            parent = held.parent
            error = _start_matchers(parent, held.compiled)
            if error is not None:
                parent.error = error
            for child in parent.children:
                if child.is_finished:
                    continue
                if error is not None:
                    scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                elif child.matcher.is_stopped():  # the tokens it holds complete the grammar
                    scheduler.finish(child, RequestStatus.FINISHED_STOPPED)
            live = [child for child in parent.children if not child.is_finished]
            if not live:
                handoff.cancel(parent.request_id)  # a pull in flight is forgotten
                finished.append(parent)
            elif held.queued:
                queue(live)
            elif held.pull_ok is not None:
                finish_pull(live[0].request_id, held.pull_ok)
        return finished

    def _take_ready(self) -> Iterator[HeldRequest]:
        for request_id, held in list(self._held.items()):
            if held.compiled.done():
                del self._held[request_id]
                yield held


def _start_matchers(parent: ParentRequest, compiled: concurrent.futures.Future[Any]) -> str | None:
    """Give every unfinished sample its own matcher, fed the tokens it holds; the client's
    error message when the grammar did not compile or refuses one of those tokens."""
    try:
        prototype = compiled.result()
    except Exception as exc:  # GrammarError: llguidance's reason; anything else: a bug's
        return f"{FIELD}: cannot be enforced: {exc}"
    for child in parent.children:
        if child.is_finished:
            continue
        matcher = prototype.deep_copy()
        for token_id in child.output_token_ids:
            if not matcher.consume_token(token_id):
                return f"{FIELD}: output token {token_id} breaks the grammar: {_why(matcher)}"
        child.matcher = matcher
    return None


def advance_matcher(matcher: Any, token_id: int) -> RequestStatus | str | None:
    """Feed a constrained sample's new token to its matcher: FINISHED_STOPPED when that
    completes the grammar (it can take nothing more: the output ends there, as at EOS), an
    error message for the client when the grammar refuses the token, else None."""
    if not matcher.consume_token(token_id):
        return f"{FIELD}: the sampled token {token_id} breaks the grammar: {_why(matcher)}"
    return RequestStatus.FINISHED_STOPPED if matcher.is_stopped() else None


def _why(matcher: Any) -> str:
    error = matcher.get_error() if matcher.is_error() else ""
    return first_line(error, "no continuation of the output so far matches it")
