"""What a prefill engine hands to a decode engine: where the prompt's KV blocks wait.

Plain values only, so a worker can send them over any wire (protobuf, Ray) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVHandle:
    """A prefilled request's KV, held under a lease by the prefill engine `engine_id`.

    `epoch` identifies that engine's life: a restarted engine has a new one, so a handle
    from before the restart is never read with the new engine's descriptors.
    """

    engine_id: str
    epoch: int
    request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks, in token order
    num_tokens: int  # tokens whose K/V the blocks hold: the whole prompt
    block_hashes: tuple[bytes, ...]  # chain hashes of the full blocks (block_hash.py)
    first_token_id: int  # the token the prefill sampled
    # Its logprobs as (token id, logprob) pairs, when the request asked for logprobs.
    first_token_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class PullPlan:
    """Which remote blocks a decode engine must fetch, and into which of its own blocks.

    Blocks the decode engine already had in its prefix cache are left out.
    """

    request_id: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids)
