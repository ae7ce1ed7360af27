"""Which worker generation a router sends new requests to.

A generation is a hash of everything that changes an engine's behaviour (image, model, engine
args, kvrelay version), set per pod by the operator ($KVRELAY_GENERATION). A prefill and a
decode worker are paired only within one generation: their KV layouts, tokenizers and models
must agree. The router prefers its own generation (its pod's $KVRELAY_GENERATION); it falls
back to another only while its own has no worker to decode on, so an upgrade never leaves a
router with nothing to serve. Without a generation of its own (a laptop), any.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable

from kvrelay.messages import GENERATION_ENV, Role

DECODE_CAPABLE = (Role.DECODE, Role.BOTH)


def own_generation() -> str:
    """This process's generation ("" when unset: any generation will do)."""
    return os.environ.get(GENERATION_ENV, "").strip()


def pick_generation(serving: Iterable[tuple[str, Role]], own: str) -> str | None:
    """The generation new requests go to, given the (generation, role) of every worker that
    takes new requests now; None when no worker can decode.

    `own` first, when a worker of it can decode; else the generation with the most
    decode-capable workers (ties: the greatest name, so that every replica picks the same).
    """
    decoders = Counter(generation for generation, role in serving if role in DECODE_CAPABLE)
    if not decoders:
        return None
    if own in decoders:
        return own
    return max(decoders, key=lambda generation: (decoders[generation], generation))
