"""The wire of a worker's output stream (worker/stream_server.py serves it,
router/worker_channels.py reads it): a TCP connection per router and worker that carries the
router's batches of deltas straight from the worker's event loop, instead of one Ray object
per batch.

Why not Ray: a streamed Ray object is a store entry, a report to the caller and wake-ups on
several of Ray's threads in both processes, ~1 ms of CPU per batch on top of the payload; at
one stream that is one batch per token, taken from the engine's cores. A length-prefixed frame
on a socket costs tens of microseconds.

Who may connect: the router asks the worker over Ray (the authenticated control plane) to open
a channel, and gets its address and a fresh single-use key. Both ends prove they hold the key
without sending it (an HMAC over a fixed label per side), the router first; a connection that
fails to prove it in time is closed having been told nothing. Only a proven worker's frames are
ever decoded, and they are msgpack decoded into the message types alone (msgspec, typed:
never pickle, which runs what it is sent). With Ray's TLS on ($RAY_USE_TLS and its certificate
files), the stream runs TLS with the same certificates, so it is exactly as private on the
wire as Ray's own traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import ssl
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from kvrelay.common.messages import ChannelItem

KEY_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
CHANNEL_ID_BYTES = 32  # a uuid4's hex
HELLO_BYTES = CHANNEL_ID_BYTES + PROOF_BYTES
HANDSHAKE_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 256 << 20  # far above any batch (16 streams of deltas are a few KiB)

_HEADER = struct.Struct("!I")
_ROUTER_LABEL = b"kvrelay/output-stream/v1 router"
_WORKER_LABEL = b"kvrelay/output-stream/v1 worker"

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[ChannelItem])

RAY_USE_TLS_ENV = "RAY_USE_TLS"
RAY_TLS_CERT_ENV = "RAY_TLS_SERVER_CERT"
RAY_TLS_KEY_ENV = "RAY_TLS_SERVER_KEY"
RAY_TLS_CA_ENV = "RAY_TLS_CA_CERT"


class StreamAuthError(ConnectionError):
    """The other end did not prove it holds the channel's key."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a router connects for one channel, and the key both ends prove they hold. Its
    repr hides the key (it travels in a Ray reply, which errors may print)."""

    host: str
    port: int
    channel_id: str
    key: bytes = field(repr=False)


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def router_proof(key: bytes) -> bytes:
    return hmac.digest(key, _ROUTER_LABEL, "sha256")


def worker_proof(key: bytes) -> bytes:
    return hmac.digest(key, _WORKER_LABEL, "sha256")


def hello(address: ChannelAddress) -> bytes:
    """The router's first bytes on a connection: the channel and its proof."""
    channel_id = address.channel_id.encode("ascii")
    if len(channel_id) != CHANNEL_ID_BYTES:
        raise ValueError(f"a channel id is {CHANNEL_ID_BYTES} hex characters")
    return channel_id + router_proof(address.key)


def parse_hello(data: bytes) -> tuple[str, bytes]:
    """(channel id, proof) of a router's hello (exactly HELLO_BYTES)."""
    channel_id = data[:CHANNEL_ID_BYTES].decode("ascii", errors="replace")
    return channel_id, data[CHANNEL_ID_BYTES:]


def proves(key: bytes, proof: bytes, *, worker: bool) -> bool:
    expected = worker_proof(key) if worker else router_proof(key)
    return hmac.compare_digest(expected, proof)


def frame(items: Sequence[ChannelItem]) -> bytes:
    """One batch as one frame: its length, then the items as msgpack."""
    payload = _ENCODER.encode(list(items))
    return _HEADER.pack(len(payload)) + payload


async def read_batch(reader: asyncio.StreamReader) -> list[ChannelItem] | None:
    """The next batch from a proven worker; None at a clean end of the stream.

    Raises:
        ConnectionError: the stream broke mid-frame, a frame is over MAX_FRAME_BYTES, or it
            holds anything but a list of ChannelItems.
    """
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectionError("the output stream broke mid-frame") from exc
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"an output frame of {size} bytes is over the limit")
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionError("the output stream broke mid-frame") from exc
    try:
        items: list[ChannelItem] = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError too: wrong shapes or types
        raise ConnectionError(f"an output frame is no batch of channel items: {exc}") from exc
    return items


def server_tls(environ: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """The worker's TLS context when Ray's TLS is on (client certificates required)."""
    files = _ray_tls_files(environ)
    if files is None:
        return None
    cert, key, ca = files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    context.load_cert_chain(cert, key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls(environ: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """The router's TLS context when Ray's TLS is on. Like Ray's own channels it checks that
    the deployment's CA signed the worker's certificate, not its name (pods are dialled by
    IP); the key's proof says which worker it is."""
    files = _ray_tls_files(environ)
    if files is None:
        return None
    cert, key, ca = files
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.check_hostname = False
    context.load_cert_chain(cert, key)
    return context


def _ray_tls_files(environ: Mapping[str, str] | None) -> tuple[str, str, str] | None:
    env = os.environ if environ is None else environ
    if env.get(RAY_USE_TLS_ENV, "").strip().lower() not in ("1", "true"):
        return None
    names = (RAY_TLS_CERT_ENV, RAY_TLS_KEY_ENV, RAY_TLS_CA_ENV)
    missing = [name for name in names if not env.get(name, "").strip()]
    if missing:
        raise ValueError(f"${RAY_USE_TLS_ENV} is on but {', '.join(missing)} not set")
    cert, key, ca = (env[name].strip() for name in names)
    return cert, key, ca
