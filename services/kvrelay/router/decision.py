"""Where a request runs: prefill then relay then decode, or whole on one worker.

Relaying KV costs a transfer and a second scheduling hop; it pays off only when the prefill is
long enough to disturb the decode batch. So, as Dynamo's conditional disaggregation does, a
request whose prompt tokens *not already cached at the chosen decode worker* number at most
`max_local_prefill_tokens` runs whole on that decode worker. Pools that are missing make
the choice for us: no prefill pool -> decode workers run requests whole; only colocated
workers -> colocated.
"""

from __future__ import annotations

from enum import Enum

from kvrelay.common.messages import Role
from kvrelay.router.request_errors import UnavailableError


class Decision(Enum):
    DISAGGREGATED = "disaggregated"
    DECODE_ONLY = "decode_only"
    COLOCATED = "colocated"


def decide(
    num_prompt_tokens: int,
    cached_at_decode: int,
    roles: set[Role],
    max_local_prefill_tokens: int,
) -> Decision:
    """`roles`: the roles of the healthy workers; `cached_at_decode`: prompt tokens the best
    decode worker probably holds in its prefix cache."""
    if Role.DECODE in roles:
        if Role.PREFILL not in roles:
            return Decision.DECODE_ONLY
        uncached = num_prompt_tokens - cached_at_decode
        if uncached <= max_local_prefill_tokens:
            return Decision.DECODE_ONLY
        return Decision.DISAGGREGATED
    if Role.BOTH in roles:
        return Decision.COLOCATED
    raise UnavailableError(
        "no decode or colocated worker is available to serve the request; retry shortly"
    )
