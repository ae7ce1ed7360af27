"""The short ways a served batch of plain requests takes every step, each against the general
way it stands for: the greedy batch sampled without a row per request (sampler.GreedyRows),
the sampled tokens appended with the stop checks skipped where they cannot fire
(step_outputs.py, Request.stop_watch), and the output of one plain sample built inline
(ParentRequest._plain_output)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.isolation import sample_isolating
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.sampler import GreedyRows, SampleLogprobs, Sampler, SamplingRow
from kvrelay.engine.step_outputs import append_sampled

EOS = 2
VOCAB = 12


def _row(params: SamplingParams, outputs: list[int]) -> SamplingRow:
    return SamplingRow(params, [5, 6], outputs, None, (EOS,))


def test_greedy_rows_give_the_argmax_of_listed_rows_without_reading_one() -> None:
    logits = torch.randn(6, 40)
    params = SamplingParams(temperature=0.0)
    listed = [_row(params, [i]) for i in range(6)]
    built: list[int] = []

    def row(i: int) -> SamplingRow:
        built.append(i)
        return listed[i]

    sampler = Sampler(torch.Generator().manual_seed(0))
    lazy = GreedyRows(6, row)
    got = sampler(logits, lazy)
    assert got.token_ids == sampler(logits, listed).token_ids == logits.argmax(-1).tolist()
    assert got.logprobs == [None] * 6 and built == []  # no row was made
    assert torch.equal(sampler.draw_uniforms(lazy), torch.zeros(6))
    tokens, (lp_rows, lp) = sampler.sample_on_device(logits, lazy, torch.zeros(6))
    assert tokens.tolist() == got.token_ids and lp_rows == [] and lp is None
    # Read one by one (a failed step's retry): the rows themselves, slices included.
    assert lazy[4] is listed[4] and lazy[-1] is listed[5] and lazy[1:3] == listed[1:3]
    assert len(lazy) == 6 and list(lazy) == listed
    with pytest.raises(IndexError, match="row 6 of 6"):
        lazy[6]
    requests: Any = [object()] * 6
    assert sample_isolating(sampler, logits, lazy, requests).token_ids == got.token_ids


def test_fp32_logits_go_to_the_argmax_as_they_are() -> None:
    """The greedy argmax reads fp32 logits themselves (a `float()` would be one more device
    op a step) and upcasts any other dtype first; either way the same tokens."""
    sampler = Sampler()
    logits = torch.randn(3, 20)
    rows = GreedyRows(3, lambda i: _row(SamplingParams(temperature=0.0), []))
    tokens, _ = sampler.sample_on_device(logits, rows, torch.zeros(3))
    listed = [_row(SamplingParams(temperature=0.0), []) for _ in range(3)]
    general, _ = sampler.sample_on_device(logits, listed, torch.zeros(3))
    half, _ = sampler.sample_on_device(logits.bfloat16(), rows, torch.zeros(3))
    assert tokens.tolist() == general.tolist() == logits.argmax(-1).tolist()
    assert half.tolist() == logits.bfloat16().float().argmax(-1).tolist()


@pytest.mark.parametrize(
    ("fields", "plain"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "max_tokens": 3, "stop_token_ids": [4], "ignore_eos": True}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
        ({"temperature": 0.0, "presence_penalty": 0.5}, False),
        ({"temperature": 0.0, "logit_bias": {3: 1.0}}, False),
        ({"temperature": 0.0, "logprobs": 0}, False),
        ({"temperature": 0.0, "min_tokens": 1}, False),
    ],
)
def test_plain_greedy_is_greedy_with_nothing_before_the_argmax(
    fields: dict[str, Any], plain: bool
) -> None:
    request = Request("r", [5], SamplingParams(**fields), max_total_tokens=100)
    assert request.plain_greedy is plain


def _pair(rng: random.Random, index: int) -> tuple[Request, Request]:
    """Two identical requests of random stop settings (one for each way)."""
    max_tokens = rng.choice([None, 1, 3, 6])
    fields: dict[str, Any] = {
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "min_tokens": rng.randint(0, max_tokens or 4),
        "stop_token_ids": rng.sample(range(VOCAB), rng.randint(0, 3)),
        "ignore_eos": rng.random() < 0.3,
    }

    def make() -> Request:
        prompt = [7] * rng.randint(1, 3)
        total = rng.choice([6, 100])
        return Request(f"r{index}", prompt, SamplingParams(**fields), total, eos_token_ids=(EOS,))

    state = rng.getstate()
    first = make()
    rng.setstate(state)
    return first, make()


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_append_stops_exactly_where_check_stop_does(seed: int) -> None:
    """Random EOS, stop ids, min_tokens, max_tokens and context limits: the fast way and the
    per-token `check_stop` way leave every request with the same tokens, status and stop
    reason after every step, and touch the same parents."""
    rng = random.Random(seed)
    pairs = [_pair(rng, i) for i in range(12)]
    sides = []
    for side in range(2):
        requests = [pair[side] for pair in pairs]
        parents = {
            r.request_id: ParentRequest(r.request_id, None, r.prompt_token_ids, [r], [None])
            for r in requests
        }
        owner = {rid: (parent, 0) for rid, parent in parents.items()}
        for r in requests:
            r.status = RequestStatus.RUNNING
        sides.append((requests, owner))

    def finish(request: Request, status: RequestStatus) -> None:
        assert status.is_finished
        request.status = status

    for _ in range(8):
        tokens = [rng.choice([EOS, *range(VOCAB)]) for _ in pairs]
        touched = []
        for (requests, owner), fast in zip(sides, (True, False), strict=True):

            def slow(request: Request, token: int, entry: Any, owner: Any = owner) -> Any:
                request.append_output(token, entry)
                status = request.check_stop()
                if status is not None:
                    finish(request, status)
                return owner[request.request_id][0]

            lps: list[SampleLogprobs | None] = [None] * len(requests)
            got, _ = append_sampled(
                requests, tokens, lps, owner, slow=slow, finish=finish, fast=fast
            )
            touched.append(list(got))
        assert touched[0] == touched[1]
        for a, b in zip(sides[0][0], sides[1][0], strict=True):
            assert (a.output_token_ids, a.status, a.stop_reason) == (
                b.output_token_ids, b.status, b.stop_reason,
            )  # fmt: skip
            assert (a.first_token_time is None) == (b.first_token_time is None)
    assert any(r.status == RequestStatus.FINISHED_STOPPED for r in sides[0][0])
    assert any(r.status == RequestStatus.FINISHED_LENGTH for r in sides[0][0])


def test_the_fast_append_leaves_logprobs_and_texts_to_the_full_way() -> None:
    """A request with logprobs, a grammar or a detokenizer, or on a prefill engine: the full
    way, with the logprobs entry it expects; the fast way counts only its own tokens."""
    plain = Request("p", [5], SamplingParams(temperature=0.0), 100)
    logprobs = Request("l", [5], SamplingParams(temperature=0.0, logprobs=1), 100)
    grammar = Request("g", [5], SamplingParams(temperature=0.0), 100, matcher=object())
    texts = Request("t", [5], SamplingParams(temperature=0.0), 100)
    requests = [plain, logprobs, grammar, texts]
    detokenizer: Any = object()  # only its presence matters here
    owner = {
        r.request_id: (
            ParentRequest(r.request_id, None, [5], [r], [detokenizer if r is texts else None]),
            0,
        )
        for r in requests
    }
    seen: list[tuple[str, Any]] = []

    def slow(request: Request, token: int, entry: Any) -> ParentRequest:
        seen.append((request.request_id, entry))
        return owner[request.request_id][0]

    lps = [None, SampleLogprobs(-0.5, [(3, -0.1)]), None, None]
    _, fast = append_sampled(requests, [4] * 4, lps, owner, slow=slow, finish=None)  # type: ignore[arg-type]
    assert fast == 1 and plain.output_token_ids == [4]
    assert seen == [("l", {3: -0.1, 4: -0.5}), ("g", None), ("t", None)]
    seen.clear()
    _, fast = append_sampled(requests, [4] * 4, lps, owner, slow=slow, finish=None, fast=False)  # type: ignore[arg-type]
    assert fast == 0 and [rid for rid, _ in seen] == ["p", "l", "g", "t"]


@pytest.mark.parametrize("status", [RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED])
def test_the_plain_output_equals_the_general_one(status: RequestStatus) -> None:
    child = Request("r", [5, 6], SamplingParams(temperature=0.0), 100)
    parent = ParentRequest("r", "text", [5, 6], [child], [None])
    assert parent._plain
    child.append_output(7, None)
    child.append_output(8, None)
    child.num_cached_tokens = 4
    child.status = status
    child.stop_reason = 8 if status.is_finished else None
    fast = parent.output()
    parent._plain = False
    general = parent.output()
    assert fast == general and fast.finished == status.is_finished
    assert fast.outputs[0].token_ids is not child.output_token_ids  # a copy, not the list
    child.append_output(9, None)
    assert fast.outputs[0].token_ids == [7, 8]


def test_only_one_plain_sample_takes_the_plain_output() -> None:
    params = SamplingParams(temperature=0.0)

    def parent(**fields: Any) -> ParentRequest:
        p = SamplingParams(temperature=0.0, **fields)
        return ParentRequest.fan_out(
            "r", None, [5], p, tokenizer=None, max_total_tokens=9, eos_token_ids=()
        )

    assert parent()._plain and not parent(n=2)._plain
    assert not parent(logprobs=1)._plain and not parent(prompt_logprobs=1)._plain
    child = Request("c", [5], params, 9)
    detokenizer: Any = object()
    assert not ParentRequest("c", None, [5], [child], [detokenizer])._plain


def test_the_runner_asks_a_steady_batch_once_and_its_grammars_every_step(
    make_engine: Any,
) -> None:
    """Whether a batch is all plain greedy (no row per request) is read once per batch
    (Request.plain_greedy never changes), a grammar's matcher every step (it may come)."""
    runner = make_engine().runner
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    batch = [Request(f"g{i}", [5, 6], greedy, max_total_tokens=16) for i in range(3)]
    assert runner._plain_greedy_batch(batch)
    batch[1].__dict__["plain_greedy"] = False  # not read again for the same requests...
    assert runner._plain_greedy_batch(list(batch))
    batch[2].matcher = object()  # type: ignore[assignment]  # ...but a matcher is
    assert not runner._plain_greedy_batch(list(batch))
    batch[2].matcher = None
    sampled = Request("s", [5, 6], SamplingParams(temperature=0.7), max_total_tokens=16)
    assert not runner._plain_greedy_batch([*batch[:2], sampled])  # a new batch: read
    assert runner._plain_greedy_batch([batch[0], batch[2]])
