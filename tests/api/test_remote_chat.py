"""`kvrelay chat --url`: a chat turn streamed from the running server."""

from __future__ import annotations

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.remote_chat import RemoteChat
from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_remote_chat_streams_the_reply(kvrelay_server: ServerProcess) -> None:
    history = [{"role": "user", "content": "What is the capital of France?"}]
    chat = RemoteChat(kvrelay_server.http_url, SamplingParams(temperature=0, max_tokens=12))
    pieces = list(chat.stream(history))
    assert len(pieces) > 1 and "Paris" in "".join(pieces)


def test_remote_chat_says_what_went_wrong(kvrelay_server: ServerProcess) -> None:
    history = [{"role": "user", "content": "Hi"}]
    bad = RemoteChat(kvrelay_server.http_url, SamplingParams(max_tokens=9000))
    with pytest.raises(ValueError, match=r"refused the request \(400\).*max_tokens"):
        list(bad.stream(history))
    with pytest.raises(ValueError, match="is it running"):
        list(RemoteChat("http://127.0.0.1:9", SamplingParams()).stream(history))
