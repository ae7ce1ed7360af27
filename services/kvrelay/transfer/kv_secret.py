"""The KV transfer's credential: a per-deployment secret that only the platform's workers hold,
and the per-pull proof derived from it. No transport here; the connectors use it.

A puller never sends the secret: it sends HMAC(secret, what it asks for), which names the
server's engine life, the KV handle, the puller's engine id and the blocks, so a proof is
good for one pull of one handle by one engine and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.common.env import KV_SECRET, KV_SECRET_FILE

KV_SECRET_ENV = KV_SECRET.name  # the secret itself (e.g. from a Kubernetes Secret)
KV_SECRET_FILE_ENV = KV_SECRET_FILE.name  # a file holding it (a mounted Secret volume)
MIN_SECRET_BYTES = 32  # 256 bits: as strong as the HMAC-SHA256 built on it

# The one answer an unauthorized caller gets, whatever was wrong (no credential, a wrong one,
# an unknown, expired, replayed or someone else's handle): anything more specific tells an
# attacker which guess was closer. The worker's log says what was wrong.
NOT_AUTHORIZED = "not authorized"

_PROOF_DOMAIN = b"kvrelay/kv-pull/v1"  # a proof of this scheme is never valid for another

# (handle id, requesting engine id, block ids) -> whether that pull may go ahead. The
# prefill engine's lease table answers it (engine/handoff.py: KVHandoff.claim_pull).
ClaimPull = Callable[[str, str, Sequence[int]], bool]


class KVSecretError(ValueError):
    """No usable KV secret was configured."""


@dataclass(frozen=True)
class KVSecret:
    """The deployment's KV transfer secret. Its repr hides the key, so a log line or a Ray
    error that prints an actor's arguments never shows it."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < MIN_SECRET_BYTES:
            raise KVSecretError(
                f"the KV secret must be at least {MIN_SECRET_BYTES} bytes "
                "(e.g. `openssl rand -hex 32`)"
            )

    @classmethod
    def generate(cls) -> KVSecret:
        """A fresh random secret (what `kvrelay serve` uses when none is configured)."""
        return cls(secrets.token_bytes(MIN_SECRET_BYTES))

    @classmethod
    def from_file(cls, path: str | Path) -> KVSecret:
        """The secret in `path` (a trailing newline, as `kubectl create secret` or an editor
        leave one, is not part of it).

        Raises:
            KVSecretError: the file cannot be read or holds too short a secret.
        """
        try:
            key = Path(path).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise KVSecretError(f"cannot read the KV secret file {path}: {exc}") from exc
        return cls(key)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVSecret | None:
        """$KVRELAY_KV_SECRET, else the file named by $KVRELAY_KV_SECRET_FILE, else None."""
        env = os.environ if environ is None else environ
        text = KV_SECRET.get(env)
        if text:
            return cls(text.encode())
        path = KV_SECRET_FILE.get(env)
        return cls.from_file(path) if path else None

    def pull_proof(
        self,
        server_engine_id: str,
        epoch: int,
        handle_id: str,
        requester_engine_id: str,
        block_ids: Sequence[int],
        block_bytes: int,
    ) -> bytes:
        """HMAC-SHA256 over everything a pull asks for, in one unambiguous encoding."""
        mac = hmac.new(self.key, _PROOF_DOMAIN, hashlib.sha256)
        for text in (server_engine_id, handle_id, requester_engine_id):
            raw = text.encode()
            mac.update(struct.pack(">I", len(raw)) + raw)
        mac.update(struct.pack(">QQI", epoch, block_bytes, len(block_ids)))
        mac.update(struct.pack(f">{len(block_ids)}I", *block_ids))
        return mac.digest()

    def verify(self, proof: bytes, expected: bytes) -> bool:
        """Constant-time comparison, so timing tells a guesser nothing."""
        return hmac.compare_digest(proof, expected)


def resolve_kv_secret(explicit: KVSecret | None = None) -> KVSecret:
    """`explicit`, else the environment's secret.

    Raises:
        KVSecretError: none is configured (a worker that moves KV must not run without one).
    """
    secret = explicit if explicit is not None else KVSecret.from_env()
    if secret is None:
        raise KVSecretError(
            f"no KV transfer secret: set ${KV_SECRET_ENV} or ${KV_SECRET_FILE_ENV} on every "
            "worker (the same value for the whole deployment); `kvrelay serve` makes one"
        )
    return secret
