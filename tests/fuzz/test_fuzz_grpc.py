"""Property tests of the gRPC input contract (kvrelay.v1.Generation/Generate) against the
session's `kvrelay serve`: any field value the protobuf types allow, and random or mutated
bytes, gets no UNKNOWN / INTERNAL; INVALID_ARGUMENT names the field at fault; a victim stream
keeps its exact tokens, /health answers within 1 s, the pools end with no block in use."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.v1 import generation_pb2 as pb
from tests.api.metrics import pools_idle, wait_for
from tests.fuzz.corpus import MAX_BODY_BYTES
from tests.fuzz.guard import Guard, grpc_victim
from tests.fuzz.strategies import BIG_STRINGS, FUZZ
from tests.fuzz.wire import call_raw, check_grpc
from tests.servers import ServerProcess

# alone: /health and kill-recovery bounds in wall time (Makefile: RUN_SUITE).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.alone]

UINT32 = (0, 1, 2, 3, 2**31 - 1, 2**31, 2**32 - 1)
FLOAT32 = (0.0, -0.0, 1e-40, 1e-45, 0.5, 1.0, 2.5, -1.0, -2.5, 3.4e38, -3.4e38, math.nan,
           math.inf, -math.inf)  # fmt: skip
# Valid sizes stay tiny (the suite's time); the invalid ones are at and past every bound.
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "n": st.sampled_from((1, 2, 0, 129, 256, 3000, 2**31, 2**32 - 1)),
    "max_tokens": st.sampled_from((1, 2, 4, 0, 9000, 2**31, 2**32 - 1)),
    "min_tokens": st.sampled_from((0, 1, 3, 2**31, 2**32 - 1)),
    "logprobs": st.sampled_from((0, 1, 5, 20, 21, 2**32 - 1)),
    "temperature": st.sampled_from(FLOAT32),
    "top_p": st.sampled_from(FLOAT32),
    "min_p": st.sampled_from(FLOAT32),
    "repetition_penalty": st.sampled_from(FLOAT32),
    "presence_penalty": st.sampled_from(FLOAT32),
    "frequency_penalty": st.sampled_from(FLOAT32),
    "top_k": st.sampled_from((0, -1, 1, 5, -2, 2**31 - 1, -(2**31))),
    "seed": st.sampled_from((0, 1, 2**63 - 1, 2**63, 2**64 - 1)),
    "stop_token_ids": st.lists(st.sampled_from(UINT32), max_size=3),
    "stop": st.lists(st.text(max_size=6), max_size=3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
# The names a field error may start with: the request's fields and the sampling options'.
FIELDS = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} | set(SAMPLING) | {"input"}
# Options whose value can make another one's error (a limit depends on both).
INTERACTS = {"n": {"max_tokens"}, "max_tokens": {"n", "min_tokens", "prompt"},
             "min_tokens": {"max_tokens"}, "seed": {"n"}}  # fmt: skip

texts = st.text(max_size=12)  # protobuf strings cannot carry a lone surrogate
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bogus", "", "SYSTEM"])
chats = st.lists(
    st.builds(pb.ChatMessage, role=roles | texts, content=texts | st.sampled_from(BIG_STRINGS)),
    max_size=3,
).map(lambda ms: {"messages": pb.ChatMessages(messages=ms)})
inputs: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.just({}),
    (texts | st.sampled_from(BIG_STRINGS)).map(lambda p: {"prompt": p}),
    st.lists(st.sampled_from((*UINT32, 49151, 49152)), max_size=4).map(
        lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)}
    ),
    chats,
)


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    names = draw(st.lists(st.sampled_from(sorted(SAMPLING)), unique=True, max_size=6))
    options = {name: draw(SAMPLING[name]) for name in names}
    return pb.GenerateRequest(
        request_id=draw(st.just("") | texts),
        model=draw(st.just("") | texts),
        stream=draw(st.booleans()),
        sampling=pb.SamplingOptions(**options),
        **draw(inputs),
    )


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request's bytes with bytes flipped, cut or inserted, or random bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=80))
    data = bytearray(draw(requests()).SerializeToString() or b"\x1a\x02Hi")
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


def costly(request: pb.GenerateRequest) -> bool:
    """Mutated bytes can ask for real work (thousands of tokens): not sent, the suite must stay
    short. The structured strategies never draw such values."""
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else 16
    return 16 < max_tokens < 9000 or (s.HasField("n") and 3 < s.n <= 128)


@pytest.fixture(scope="module")
def channel(kvrelay_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(kvrelay_server.grpc_target) as chan:
        yield chan


def guarded(server: ServerProcess, traffic: Any) -> None:
    with Guard(lambda: grpc_victim(server.grpc_target), f"{server.http_url}/health") as guard:
        traffic()
    guard.check()
    idle = wait_for(server, pools_idle, timeout_s=30)
    assert pools_idle(idle), idle.samples


def field_of(details: str) -> str:
    """The field an INVALID_ARGUMENT's details start with ("sampling.seed: ..." -> "seed")."""
    match = re.match(r"(?:sampling\.)?(\w+)", details)
    assert match and match.group(1) in FIELDS, f"details do not name a field: {details!r}"
    return match.group(1)


def test_one_bad_option_is_named(kvrelay_server: ServerProcess, channel: grpc.Channel) -> None:
    """A valid prompt with one sampling option set to anything its type allows."""

    @FUZZ
    @given(name=st.sampled_from(sorted(SAMPLING)), data=st.data())
    def run(name: str, data: st.DataObject) -> None:
        options = {"max_tokens": 2, name: data.draw(SAMPLING[name])}
        request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingOptions(**options))
        code, details, _ = call_raw(channel, request.SerializeToString(), timeout_s=60)
        check_grpc(code, details)
        if code == "INVALID_ARGUMENT":
            assert field_of(details) in {name} | INTERACTS.get(name, set()), (name, details)

    guarded(kvrelay_server, run)


def test_any_message_or_bytes_keeps_the_contract(
    kvrelay_server: ServerProcess, channel: grpc.Channel
) -> None:
    """Whole requests with any fields, and random or mutated bytes: a message over the
    server's size limit is RESOURCE_EXHAUSTED (refused unread, whatever it holds), malformed
    protobufs INVALID_ARGUMENT, well-formed ones refused naming a field or served."""

    @FUZZ
    @given(data=requests().map(lambda r: r.SerializeToString()) | mutated())
    def run(data: bytes) -> None:
        try:
            parsed = pb.GenerateRequest.FromString(data)
        except DecodeError:
            parsed = None
        if parsed is not None and costly(parsed):
            return
        code, details, _ = call_raw(channel, data, timeout_s=60)
        check_grpc(code, details)
        if len(data) > MAX_BODY_BYTES:  # the server's default --max-body-bytes
            assert code == "RESOURCE_EXHAUSTED", (code, details)
        elif parsed is None:
            assert code == "INVALID_ARGUMENT", (code, details)
        elif code == "INVALID_ARGUMENT":
            field_of(details)

    guarded(kvrelay_server, run)
