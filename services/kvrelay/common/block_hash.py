"""Content hashes of full KV blocks: the prefix-cache key, stable across processes and hosts.

Part of the contract with the router (prefix-cache affinity): change the encoding only together
with `HASH_VERSION`. Never uses Python's `hash`, which is randomized per process.

Encoding. The hash of block i of a sequence is SHA-256 over the concatenation of

    parent      32 bytes: the hash of block i - 1, or `ROOT_HASH` for block 0
    num_tokens  uint32, little-endian
    tokens      num_tokens x int64, little-endian: the block's token ids in order
    num_keys    uint32, little-endian
    keys        per extra key: uint32 little-endian byte length, then its UTF-8 bytes

and the hash is the full 32-byte digest. `ROOT_HASH` = SHA-256(b"kvrelay-prefix-cache-v1").
Extra keys make blocks of different models (or, later, adapters) distinct; the engine passes
the model as named in `EngineConfig.model`.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

HASH_VERSION = 1
ROOT_HASH: BlockHash = hashlib.sha256(b"kvrelay-prefix-cache-v1").digest()


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """The hash of one full block whose predecessor's hash is `parent` (see the encoding)."""
    assert len(parent) == 32, "a parent hash is a 32-byte SHA-256 digest"
    keys = extra_keys if isinstance(extra_keys, tuple) else tuple(extra_keys)
    tokens = _tokens_format(len(token_ids)).pack(len(token_ids), *token_ids)
    # One buffer, one digest call: a decode step hashes every block it fills.
    return hashlib.sha256(parent + tokens + _keys_suffix(keys)).digest()


@functools.lru_cache(maxsize=64)
def _tokens_format(num_tokens: int) -> struct.Struct:
    """num_tokens (uint32) then the token ids (int64 each), little-endian."""
    return struct.Struct(f"<I{num_tokens}q")


@functools.lru_cache(maxsize=64)
def _keys_suffix(extra_keys: tuple[str, ...]) -> bytes:
    """num_keys (uint32), then each key's byte length (uint32) and UTF-8 bytes."""
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts += [struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


def extend_block_hashes(
    hashes: list[BlockHash],
    new_token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
) -> None:
    """Append to `hashes` (the chain of a sequence's first blocks) the hashes of the full
    blocks of `new_token_ids`, the sequence's tokens that follow the blocks `hashes` covers
    (a trailing partial block gets none). Only the new tokens are passed: a decode that
    fills a block hashes 16 tokens, not the whole sequence again."""
    for first in range(0, len(new_token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        block = new_token_ids[first : first + block_size]
        hashes.append(hash_block_tokens(parent, block, extra_keys))


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str] = ()
) -> list[BlockHash]:
    """The hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, extra_keys)
    return hashes
