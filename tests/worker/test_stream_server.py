"""A worker's output-stream listener (worker/stream_server.py) on real loopback sockets: only a
router that proves the channel's key gets batches, once per key, in time; anything else is
hung up on having been told nothing; a router trusts only a worker that proves the key too;
an opened channel nobody connects to aborts its requests; with Ray's TLS on, the stream is
TLS with the same certificates."""

from __future__ import annotations

import asyncio
import random
import ssl
from pathlib import Path

import msgspec
import pytest

from kvrelay.common.messages import ChannelItem, EngineRequest, KVHandle, OutputDelta, SampleDelta
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.stream_wire import (
    HELLO_BYTES,
    MAX_FRAME_BYTES,
    ChannelAddress,
    StreamAuthError,
    client_tls,
    frame,
    hello,
    read_batch,
    server_tls,
    worker_proof,
)
from kvrelay.router.worker_channels import connect
from kvrelay.worker import output_channels as worker_channel
from kvrelay.worker import stream_server
from tests.pki import have_openssl, make_ca, make_leaf
from tests.worker.scripted_endpoint import ScriptedEndpoint

CHANNEL = "c" * 32
OTHER = "d" * 32
WAIT_S = 10.0


async def _start(worker: ScriptedEndpoint, request_id: str, tokens: int = 10_000) -> None:
    await worker.start(
        CHANNEL, 0, EngineRequest(request_id, [1, 2], SamplingParams(max_tokens=tokens))
    )


async def _raw(address: ChannelAddress, data: bytes) -> bytes:
    """Send `data` to the worker's port as it is; everything it answers before hanging up."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


async def _settle(condition: object, *, tries: int = 200) -> None:
    for _ in range(tries):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)


async def test_a_proven_router_gets_its_batches_and_hanging_up_aborts_the_requests() -> None:
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    await _start(worker, "r")
    reader, writer = await connect(address)
    batch = await asyncio.wait_for(read_batch(reader), WAIT_S)
    assert batch and batch[0].delta is not None and batch[0].delta.request_id == "r"
    writer.close()
    await _settle(lambda: not worker.running)
    assert not worker.running and not worker.channels.ids
    worker.channels.close()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda good: good[:-1] + bytes([good[-1] ^ 1]),  # a wrong proof
        lambda good: OTHER.encode() + good[32:],  # another channel's id, this one's proof
        lambda good: b"\0" * HELLO_BYTES,
        lambda good: good[:10],  # too short, then silence (the handshake times out)
    ],
    ids=["wrong-proof", "wrong-channel", "zeros", "short"],
)
async def test_a_router_that_proves_nothing_is_told_nothing(
    tamper: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_server, "HANDSHAKE_TIMEOUT_S", 0.3)
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    await _start(worker, "secret")
    assert callable(tamper)
    assert await _raw(address, tamper(hello(address))) == b""
    # The worker still serves the router that holds the key.
    reader, writer = await connect(address)
    assert await asyncio.wait_for(read_batch(reader), WAIT_S)
    writer.close()
    worker.channels.close()


async def test_a_key_serves_one_connection() -> None:
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    await _start(worker, "r")
    reader, writer = await connect(address)
    assert await asyncio.wait_for(read_batch(reader), WAIT_S)
    assert await _raw(address, hello(address)) == b""  # a replay of the same hello
    writer.close()
    worker.channels.close()


async def test_random_bytes_get_no_answer_and_break_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stream_server, "HANDSHAKE_TIMEOUT_S", 0.2)
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    rng = random.Random(15)
    sizes = [0, 1, HELLO_BYTES - 1, HELLO_BYTES, HELLO_BYTES + 1, 4096, 100_000]
    answers = await asyncio.gather(
        *(_raw(address, rng.randbytes(size)) for size in sizes for _ in range(3))
    )
    assert set(answers) == {b""}
    await _start(worker, "after")
    reader, writer = await connect(address)
    assert await asyncio.wait_for(read_batch(reader), WAIT_S)
    writer.close()
    worker.channels.close()


async def test_a_channel_nobody_connects_to_aborts_its_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The key would outlive the channel: closing the channel must revoke it, whichever of
    # the two timers fires first (a router proving it in between got a channel nothing feeds).
    monkeypatch.setattr(stream_server, "KEY_TTL_S", 30.0)
    monkeypatch.setattr(worker_channel, "KEY_TTL_S", 0.2)
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    await _start(worker, "orphan")
    await _settle(lambda: "orphan" in worker.running)
    await _settle(lambda: not worker.running)
    assert not worker.running and not worker.channels.ids
    assert await _raw(address, hello(address)) == b""  # the key was revoked with it
    worker.channels.close()


async def test_a_router_trusts_only_a_worker_that_proves_the_key() -> None:
    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(HELLO_BYTES)
        writer.write(worker_proof(b"k" * 32) + frame([]))  # a proof of another key
        await writer.drain()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(StreamAuthError):
        await connect(ChannelAddress("127.0.0.1", port, CHANNEL, b"x" * 32))
    server.close()


async def test_closing_the_worker_ends_every_stream() -> None:
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    await _start(worker, "r")
    reader, writer = await connect(address)
    assert await asyncio.wait_for(read_batch(reader), WAIT_S)
    worker.channels.close()
    while await asyncio.wait_for(read_batch(reader), WAIT_S) is not None:
        pass  # batches sent before the close, then a clean end
    writer.close()
    await _settle(lambda: not worker.running)
    assert not worker.running


def test_the_address_repr_hides_the_key() -> None:
    key = bytes(range(32))
    assert repr(key) not in repr(ChannelAddress("h", 1, CHANNEL, key))


async def test_frames_over_the_limit_or_cut_short_are_errors() -> None:
    def reader_of(data: bytes) -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return reader

    whole = frame([])
    assert await read_batch(reader_of(whole)) == []
    assert await read_batch(reader_of(b"")) is None  # a clean end
    with pytest.raises(ConnectionError, match="mid-frame"):
        await read_batch(reader_of(whole[:-1]))
    with pytest.raises(ConnectionError, match="mid-frame"):
        await read_batch(reader_of(whole[:2]))
    with pytest.raises(ConnectionError, match="over the limit"):
        await read_batch(reader_of((MAX_FRAME_BYTES + 1).to_bytes(4, "big")))


def _framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def test_every_field_of_a_batch_crosses_exactly() -> None:
    handle = KVHandle("e1", 3, "r", (4, 5), 40, (b"\x00h1", b"h2"), 7, ((7, -0.5),), "lease")
    items = [
        ChannelItem(
            0,
            OutputDelta(
                "r",
                [SampleDelta(0, 5, [11, 12], [{11: -0.1, 9: -2.0}] * 2, "stop", 42)],
                True,
                9,
                2,
                handle,
                {"arrival_time": 1.5},
            ),
        ),
        ChannelItem(1, OutputDelta("s", [SampleDelta(1, 0, [], None, "length", "</s>")], True, 3)),
        ChannelItem(2, None, "failed", "out of blocks"),
    ]
    reader = asyncio.StreamReader()
    reader.feed_data(frame(items))
    reader.feed_eof()
    assert await read_batch(reader) == items


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x04\x95",  # a pickle's opening bytes: not msgpack
        msgspec.msgpack.encode([{"tag": "zero"}]),  # msgpack, a wrong type
        msgspec.msgpack.encode({"tag": 0}),  # msgpack, not a list
        msgspec.msgpack.encode([{"delta": None}]),  # a field missing
    ],
    ids=["pickle", "wrong-type", "not-a-list", "missing-field"],
)
async def test_a_frame_that_is_no_batch_is_an_error(payload: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(_framed(payload))
    reader.feed_eof()
    with pytest.raises(ConnectionError, match="no batch"):
        await read_batch(reader)


@pytest.fixture(scope="module")
def ray_tls_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Ray's TLS settings over a throwaway CA and one node certificate for 127.0.0.1."""
    if not have_openssl():
        pytest.skip("the openssl CLI makes the test certificates")
    folder: Path = tmp_path_factory.mktemp("ray-tls")
    make_ca(folder, "ca")
    make_leaf(folder, "node", "ca", "serverAuth,clientAuth", san="IP:127.0.0.1")
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(folder / "node.pem"),
        "RAY_TLS_SERVER_KEY": str(folder / "node.key"),
        "RAY_TLS_CA_CERT": str(folder / "ca.pem"),
    }


async def test_with_rays_tls_on_the_stream_is_tls(
    ray_tls_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ray_tls_env.items():
        monkeypatch.setenv(name, value)
    assert server_tls() is not None and client_tls() is not None
    worker = ScriptedEndpoint(step_s=0.001)
    address = await worker.open_channel(CHANNEL)
    await _start(worker, "private")
    # In plaintext the hello is no TLS handshake: the worker answers nothing readable.
    assert worker_proof(address.key) not in await _raw(address, hello(address))
    reader, writer = await connect(address)  # over TLS, with the node certificate
    batch = await asyncio.wait_for(read_batch(reader), WAIT_S)
    assert batch and batch[0].delta is not None
    assert isinstance(writer.get_extra_info("ssl_object"), ssl.SSLObject)
    writer.close()
    worker.channels.close()


def test_rays_tls_without_its_files_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="RAY_TLS_CA_CERT"):
        server_tls({"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "c", "RAY_TLS_SERVER_KEY": "k"})
    assert server_tls({"RAY_USE_TLS": "0"}) is None
