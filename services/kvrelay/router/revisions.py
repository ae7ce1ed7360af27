"""Which deployment revision of the workers a router sends new requests to.

A revision is a hash of everything that changes an engine's behaviour (image, model, engine
args, kvrelay version), set per pod by the operator ($KVRELAY_GENERATION: the variable keeps
its name, the operator and the workers read it). A prefill and a decode worker are paired only
within one revision: their KV layouts, tokenizers and models must agree. The router prefers its
own revision (its pod's $KVRELAY_GENERATION); it falls back to another only while its own has
no worker to decode on, so an upgrade never leaves a router with nothing to serve. Without a
revision of its own (a laptop), any.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvrelay.common.env import GENERATION
from kvrelay.common.messages import Role

DECODE_CAPABLE = (Role.DECODE, Role.BOTH)


def own_revision() -> str:
    """This process's revision ("" when unset: any revision will do)."""
    return GENERATION.get().strip()


def pick_revision(serving: Iterable[tuple[str, Role]], own: str) -> str | None:
    """The revision new requests go to, given the (revision, role) of every worker that takes
    new requests now; None when no worker can decode.

    `own` first, when a worker of it can decode; else the revision with the most
    decode-capable workers (ties: the greatest name, so that every replica picks the same).
    """
    decoders = Counter(revision for revision, role in serving if role in DECODE_CAPABLE)
    if not decoders:
        return None
    if own in decoders:
        return own
    return max(decoders, key=lambda revision: (decoders[revision], revision))
