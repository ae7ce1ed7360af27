"""What the scheduler hands the runner each step: the chunks to compute (`ScheduledChunk`,
one per scheduled request) and the step's plan around them (`SchedulerOutput`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple

from kvrelay.engine.request import Request


class ScheduledChunk(NamedTuple):
    """Tokens `start:start + num_tokens` of `request` (prompt + output), to compute this step.
    (A NamedTuple: one is made per running request per step, and a frozen dataclass costs
    three times as much to build.)"""

    request: Request
    start: int
    num_tokens: int
    # True when the chunk reaches the request's last token, so a new token is sampled.
    samples: bool
    # Sibling samples that sample their first token from this chunk's logits, then join
    # `running` sharing the request's blocks (only on a sampling chunk).
    forks: tuple[Request, ...] = ()

    @classmethod
    def of(
        cls, request: Request, num_tokens: int, forks: tuple[Request, ...] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        samples = start + num_tokens == request.num_tokens + request.num_pending
        return cls(request, start, num_tokens, samples, forks if samples else ())

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


# A ScheduledChunk from its five fields, made in C (no Python `__new__` call): the plain
# decodes' chunks of a step are built in one `map`.
NEW_CHUNK: Callable[[tuple[Any, ...]], ScheduledChunk] = partial(tuple.__new__, ScheduledChunk)


@dataclass
class SchedulerOutput:
    """What one step runs."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) to perform before the forward pass.
    copies: list[tuple[int, int]] = field(default_factory=list)
    # Every chunk one token that samples, none with forks: a pure decode step, which the
    # runner builds from its persistent block table (runner.execute_decodes).
    decodes_only: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


REQUEST_OF = itemgetter(0)  # a ScheduledChunk's request
