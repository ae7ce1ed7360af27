"""Engine.step_delta: a running plain request's next token handed over as a row, everything
else as Engine.step's cumulative output, and the two ways in lockstep give the same tokens,
the same final outputs, and never a token past a stop."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.outputs import RequestOutput, StepDelta
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request
from kvrelay.engine.step_outputs import append_sampled
from tests.engine.conftest import EngineFactory, assert_pool_whole
from tests.engine.test_disaggregation import copy_blocks, prefill

PROMPTS = {f"r{i}": [3 + (7 * i + j) % 120 for j in range(5 + 3 * i)] for i in range(6)}


def _params(rid: str) -> SamplingParams:
    """A mix: plain greedy, a stop token, n = 2, logprobs, seeded sampling, a short one."""
    index = int(rid[1:])
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[40, 41, 42, 43, 44]),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ][index]


def _comparable(output: RequestOutput) -> dict[str, Any]:
    """An output without its timestamps (two engines' clocks differ)."""
    fields = dataclasses.asdict(output)
    fields["metrics"] = {k: v for k, v in output.metrics.items() if not k.endswith("_time")}
    return fields


def _add_all(engine: Engine) -> None:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, _params(rid))


def test_step_delta_hands_over_what_step_does_as_news(make_engine: EngineFactory) -> None:
    """Two engines, one stepped by `step` and one by `step_delta`: each step the same
    requests hear news; a row's token is exactly what `step`'s cumulative output added; a
    request's first output and its final one are full outputs, equal on both sides."""
    whole, delta = make_engine(), make_engine()
    _add_all(whole)
    _add_all(delta)
    tokens: dict[str, list[int]] = {}  # what the delta side's caller has for sample 0
    rows_seen, finals = 0, 0
    while whole.has_unfinished_requests():
        outputs = {o.request_id: o for o in whole.step()}
        news = delta.step_delta()
        assert isinstance(news, StepDelta)
        full = {o.request_id: o for o in news.outputs}
        assert len(full) == len(news.outputs)
        assert set(news.request_ids).isdisjoint(full)
        assert set(outputs) == set(full) | set(news.request_ids)
        for rid, token in zip(news.request_ids, news.token_ids, strict=True):
            assert rid in tokens, "a row before its request's first output"
            tokens[rid].append(token)
            assert not outputs[rid].finished
            assert outputs[rid].outputs[0].token_ids == tokens[rid]
            assert _params(rid).n == 1 and _params(rid).logprobs is None
            rows_seen += 1
        for rid, output in full.items():
            assert _comparable(output) == _comparable(outputs[rid])
            tokens[rid] = list(output.outputs[0].token_ids)
            finals += output.finished
    assert not delta.has_unfinished_requests()
    assert rows_seen > 10 and finals == len(PROMPTS)
    for engine in (whole, delta):
        assert_pool_whole(engine)


def test_a_stop_token_ends_the_rows_with_the_final_output(make_engine: EngineFactory) -> None:
    """The stop token comes in the finished output, never as a row, and nothing follows it."""
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("probe", PROMPTS["r1"], params)
    reference = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            reference = output.outputs[0].token_ids
    stop_at = 6  # stop on the 7th token (min_tokens keeps an earlier repeat of it going)
    stop = SamplingParams(
        temperature=0.0, max_tokens=40, stop_token_ids=[reference[stop_at]], min_tokens=stop_at
    )
    engine.add_request("stop", PROMPTS["r1"], stop)
    heard: list[tuple[str, Any]] = []
    while engine.has_unfinished_requests():
        news = engine.step_delta()
        heard += [("row", t) for t in news.token_ids] + [("out", o) for o in news.outputs]
    kinds = [kind for kind, _ in heard]
    assert kinds[0] == "out" and kinds[-1] == "out" and set(kinds[1:-1]) == {"row"}
    final = heard[-1][1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].token_ids == reference[: stop_at + 1]
    assert final.outputs[0].stop_reason == reference[stop_at]
    assert [t for kind, t in heard[1:-1]] == reference[1:stop_at]


def test_step_and_step_delta_mix_on_one_engine(make_engine: EngineFactory) -> None:
    """A caller may switch: rows follow an output handed over by either way."""
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", PROMPTS["r2"], params)
    [first] = engine.step()  # the prefill and its first token
    tokens = list(first.outputs[0].token_ids)
    news = engine.step_delta()
    assert news.request_ids == ["a"] and news.outputs == []
    tokens += news.token_ids
    [cumulative] = engine.step()
    assert cumulative.outputs[0].token_ids[:-1] == tokens
    tokens = list(cumulative.outputs[0].token_ids)
    while engine.has_unfinished_requests():
        news = engine.step_delta()
        tokens += news.token_ids
        for output in news.outputs:
            *before, last = output.outputs[0].token_ids
            assert output.finished and before == tokens
            tokens.append(last)
    assert len(tokens) == 8  # the 8th came in the final output


def test_a_prefilled_request_gets_a_full_output_before_any_row(
    make_engine: EngineFactory,
) -> None:
    """Decode role: the handed-off first token is appended at the add, with no output; the
    first decode step must hand over the cumulative output (both tokens), not a row."""
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    handle = prefill(pre, {"p": PROMPTS["r3"]}, params)["p"]
    plan = dec.add_prefilled_request("p", PROMPTS["r3"], params, handle)
    assert plan is not None
    copy_blocks(pre, dec, plan)
    dec.finish_pull("p", ok=True)
    assert pre.release_kv("p")
    news = dec.step_delta()
    assert news.request_ids == []
    [output] = news.outputs
    assert output.outputs[0].token_ids[0] == handle.first_token_id
    assert len(output.outputs[0].token_ids) == 2
    rows = 0
    while dec.has_unfinished_requests():
        news = dec.step_delta()
        rows += len(news.request_ids)
    assert rows == 2  # tokens 3 and 4; the 5th came in the final output
    for engine in (pre, dec):
        assert_pool_whole(engine)


def _plain(rid: str, *, ready: bool, max_tokens: int = 50) -> tuple[Request, ParentRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    child = Request(rid, [5], params, 100)
    parent = ParentRequest(rid, None, [5], [child], [None])
    if ready:
        parent.output()  # handed over once: rows may follow
    return child, parent


@pytest.mark.parametrize("fast", [True, False])
def test_append_sampled_rows_only_ready_unfinished_plain_requests(fast: bool) -> None:
    """A row: a `delta_ready` parent whose token did not finish it, on the fast way only (a
    prefill engine's slow way touches every parent)."""
    ready, ready_parent = _plain("ready", ready=True)
    fresh, fresh_parent = _plain("fresh", ready=False)
    ending, ending_parent = _plain("ending", ready=True, max_tokens=1)
    owner = {p.request_id: (p, 0) for p in (ready_parent, fresh_parent, ending_parent)}
    finished: list[str] = []

    def slow(request: Request, token_id: int, logprobs: Any) -> ParentRequest:
        request.append_output(token_id, logprobs)
        return owner[request.request_id][0]

    def finish(request: Request, status: Any) -> None:
        request.status = status
        finished.append(request.request_id)

    rows: tuple[list[str], list[int]] = ([], [])
    requests = [ready, fresh, ending]
    touched, appended = append_sampled(
        requests, [7, 8, 9], [None] * 3, owner, slow=slow, finish=finish, fast=fast, rows=rows
    )
    if fast:
        assert rows == (["ready"], [7]) and list(touched) == ["fresh", "ending"]
        assert appended == 3 and finished == ["ending"]
    else:
        assert rows == ([], []) and list(touched) == ["ready", "fresh", "ending"]
    assert [r.output_token_ids for r in requests] == [[7], [8], [9]]
    assert not fresh_parent.delta_ready and ready_parent.delta_ready
