"""Keyword -> protobuf conversion and response assembly; no server."""

from __future__ import annotations

import pytest

from kvrelay.client import ChatMessage, InvalidArgumentError
from kvrelay.client.convert import (
    SAMPLING_FIELDS,
    ResultAssembler,
    build_request,
    chunk_from_proto,
    sampling_options,
)
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.v1 import generation_pb2 as pb


def test_sampling_fields_are_sampling_params_names() -> None:
    # Every SDK keyword is a SamplingParams field (or the proto-only include_stop_str_in_output),
    # and every wire field of SamplingOptions is reachable from the SDK.
    params = set(SamplingParams.__dataclass_fields__)
    # prompt_logprobs: HTTP only so far (the gRPC reply has no field to carry them).
    assert params - {"skip_special_tokens", "prompt_logprobs"} <= SAMPLING_FIELDS
    assert set(pb.SamplingOptions.DESCRIPTOR.fields_by_name) == SAMPLING_FIELDS


def test_unknown_keywords_raise_type_error_naming_them() -> None:
    with pytest.raises(TypeError, match="max_token, temprature"):
        build_request(
            prompt="x",
            model=None,
            stream=False,
            request_id=None,
            sampling={"temprature": 0.5, "max_token": 3, "top_p": 0.9},
        )


def test_sampling_values_reach_the_wire() -> None:
    opts = sampling_options(
        {
            "n": 2,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 2**64 - 1,
            "max_tokens": 7,
            "stop": "\n",
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "logprobs": 0,
            "presence_penalty": None,
            "logit_bias": {7: -100, 2**32 - 1: 2.5},
        }
    )
    assert opts.n == 2 and opts.HasField("temperature") and opts.temperature == 0.0
    assert opts.top_p == pytest.approx(0.9) and opts.top_k == -1 and opts.seed == 2**64 - 1
    assert (
        opts.max_tokens == 7 and list(opts.stop) == ["\n"] and list(opts.stop_token_ids) == [2, 3]
    )
    assert opts.ignore_eos and opts.HasField("logprobs") and opts.logprobs == 0
    assert dict(opts.logit_bias) == {7: -100.0, 2**32 - 1: 2.5}
    # None and omitted both leave the field unset, so the server's default applies.
    assert not opts.HasField("presence_penalty") and not opts.HasField("min_p")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_tokens", -1),
        ("n", True),
        ("temperature", "hot"),
        ("top_p", float("nan")),
        ("stop_token_ids", [-3]),
        ("seed", 2**64),
        ("ignore_eos", 1),
        ("stop", [1]),
        ("logit_bias", [(1, 2.0)]),
        ("logit_bias", {-1: 2.0}),
        ("logit_bias", {1: "x"}),
    ],
)
def test_values_the_wire_cannot_carry_name_the_field(name: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        sampling_options({name: value})


def test_ranges_are_left_to_the_server() -> None:
    # The server is the one authority on ranges; the client only refuses what it cannot encode.
    opts = sampling_options({"temperature": -1.0, "top_p": 1.5, "max_tokens": 0})
    assert opts.temperature == -1.0 and opts.top_p == 1.5 and opts.HasField("max_tokens")


def test_request_inputs() -> None:
    common = {"model": "m", "stream": True, "request_id": "r1", "sampling": {}}
    text = build_request(prompt="hello", **common)  # type: ignore[arg-type]
    assert text.WhichOneof("input") == "prompt" and text.prompt == "hello"
    assert text.model == "m" and text.stream and text.request_id == "r1"
    ids = build_request(prompt=[1, 2, 3], **common)  # type: ignore[arg-type]
    assert list(ids.prompt_token_ids.ids) == [1, 2, 3]
    chat = build_request(
        messages=[{"role": "system", "content": "be brief"}, ChatMessage("user", "hi")],
        **common,  # type: ignore[arg-type]
    )
    assert [(m.role, m.content) for m in chat.messages.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]"):
        build_request(messages=[{"role": "user"}], **common)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="messages"):
        build_request(messages=[], **common)  # type: ignore[arg-type]


def _response(
    index: int, ids: list[int], text: str, finish: int = 0, usage: bool = False
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id="r",
        choices=[
            pb.Choice(
                index=index,
                token_ids=ids,
                text=text,
                finish_reason=finish,
                stop_reason="\n" if finish == pb.FINISH_REASON_STOP else "",
            )
        ],
        usage=pb.Usage(prompt_tokens=4, completion_tokens=5, total_tokens=9) if usage else None,
    )


def test_chunks_assemble_per_sample() -> None:
    stream = [
        _response(1, [7], "B"),
        _response(0, [1, 2], "ab"),
        _response(0, [3], "c", finish=pb.FINISH_REASON_STOP),
        _response(1, [8], "C", finish=pb.FINISH_REASON_LENGTH, usage=True),
    ]
    chunks = [chunk_from_proto(r) for r in stream]
    assert chunks[0].usage is None and chunks[-1].usage is not None
    assert chunks[2].choices[0].finish_reason == "stop" and chunks[2].choices[0].stop_reason == "\n"
    assembler = ResultAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    result = assembler.result()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in result.choices] == [
        (0, "abc", (1, 2, 3), "stop"),
        (1, "BC", (7, 8), "length"),
    ]
    assert result.text == "abc" and result.usage is not None and result.usage.total_tokens == 9


def test_logprobs_convert() -> None:
    response = pb.GenerateResponse(
        choices=[
            pb.Choice(
                index=0,
                token_ids=[5],
                text="x",
                logprobs=[
                    pb.TokenLogprob(
                        token_id=5,
                        logprob=-0.5,
                        token="x",
                        top_logprobs=[pb.TopLogprob(token_id=5, logprob=-0.5, token="x")],
                    )
                ],
            )
        ]
    )
    [delta] = chunk_from_proto(response).choices
    assert delta.logprobs[0].logprob == -0.5 and delta.logprobs[0].top_logprobs[0].token_id == 5
