"""step_outputs.SteadyRows: a batch that stays the same from step to step is appended in a
few passes in C; every step it takes leaves the requests, the rows and the touched parents
exactly as the per-request way does, and any step that could stop a request, carries
logprobs or meets a finished request is left to that way."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.sampler import SampleLogprobs
from kvrelay.engine.step_outputs import SteadyRows, append_sampled

EOS = 2
STOP = 9
VOCAB = 3000  # tokens drawn from here: EOS and STOP come up now and then, not every step

Owner = dict[str, tuple[ParentRequest, int]]


def _request(index: int, *, max_tokens: int, detokenized: bool = False) -> tuple[Request, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[STOP])
    request = Request(f"r{index}", [5, 6], params, 1000, eos_token_ids=(EOS,))
    request.status = RequestStatus.RUNNING
    detokenizer: Any = object() if detokenized else None  # only its presence matters
    return request, ParentRequest(request.request_id, None, [5, 6], [request], [detokenizer])


class Side:
    """One copy of the batch and what appending to it gave, step after step."""

    def __init__(self, steady: SteadyRows | None) -> None:
        self.steady = steady
        self.requests: list[Request] = []
        self.owner: Owner = {}
        self.history: list[Any] = []
        self.build_outputs = True  # a touched parent's output, as the engine builds it

    def join(self, index: int, max_tokens: int) -> None:
        request, parent = _request(index, max_tokens=max_tokens)
        self.requests.append(request)
        self.owner[request.request_id] = (parent, 0)

    def slow(self, request: Request, token: int, entry: Any) -> ParentRequest:
        request.append_output(token, entry)
        status = request.check_stop()
        if status is not None:
            self.finish(request, status)
        return self.owner[request.request_id][0]

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status

    def step(self, tokens: list[int], logprobs: list[SampleLogprobs | None]) -> None:
        rows: tuple[list[str], list[int]] = ([], [])
        touched, appended = append_sampled(
            list(self.requests), tokens, logprobs, self.owner,
            slow=self.slow, finish=self.finish, rows=rows, steady=self.steady,
        )  # fmt: skip
        for parent in touched.values():
            if self.build_outputs:
                parent.output()  # makes it delta_ready, as in the engine
        self.history.append((rows, list(touched), appended))

    def state(self) -> list[Any]:
        return [(r.output_token_ids, r.status, r.first_token_time is None) for r in self.requests]

    def drop_finished(self) -> None:
        self.requests = [r for r in self.requests if not r.is_finished]


@pytest.mark.parametrize("seed", range(4))
def test_steady_steps_leave_everything_as_the_per_request_way(seed: int) -> None:
    rng = random.Random(seed)
    steady = SteadyRows()
    sides = [Side(steady), Side(None)]
    joined = 0
    stopped = 0
    for step in range(300):
        for side in sides:
            side.drop_finished()  # as the scheduler does: the batch changes when one ends
        if not sides[0].requests or rng.random() < 0.03:  # and when requests join
            for _ in range(rng.randint(1, 4)):
                max_tokens = rng.choice([3, 60, 400])
                for side in sides:
                    side.join(joined, max_tokens)
                joined += 1
        n = len(sides[0].requests)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        logprobs: list[SampleLogprobs | None] = [None] * n
        if rng.random() < 0.03:
            logprobs[rng.randrange(n)] = SampleLogprobs(-0.5, [(3, -0.1)])
        if rng.random() < 0.02:  # aborted between two steps, still in the sampled batch
            victim = rng.randrange(n)
            for side in sides:
                side.requests[victim].status = RequestStatus.FINISHED_ABORTED
        for side in sides:
            side.step(tokens, logprobs)
        assert sides[0].state() == sides[1].state(), f"step {step}"
        assert sides[0].history[-1] == sides[1].history[-1], f"step {step}"
        stopped += sum(r.status is RequestStatus.FINISHED_STOPPED for r in sides[0].requests)
    # The steady way carried most steps (else this compared the per-request way with itself).
    assert steady.steps > 150, steady.steps
    assert stopped and joined > 10, (stopped, joined)


def test_a_request_sampling_its_first_token_joins_the_steady_way_the_step_after() -> None:
    steady = SteadyRows()
    side = Side(steady)
    for index in range(3):
        side.join(index, 100)
    side.step([10, 11, 12], [None] * 3)  # first tokens: parents touched, not rows
    assert steady.steps == 0 and side.history[-1][1] == ["r0", "r1", "r2"]
    side.step([13, 14, 15], [None] * 3)
    assert steady.steps == 1 and side.history[-1] == ((["r0", "r1", "r2"], [13, 14, 15]), [], 3)
    assert [r.output_token_ids for r in side.requests] == [[10, 13], [11, 14], [12, 15]]


@pytest.mark.parametrize("size", [1, 3])
def test_an_empty_step_after_a_steady_one_appends_nothing(size: int) -> None:
    """A step that scheduled nothing (a grammar compiling, say) samples no request: no row,
    whatever batch was remembered (a remembered batch of one once gave its id a row with no
    token, and the worker's loop died on the two lists' lengths)."""
    steady = SteadyRows()
    side = Side(steady)
    for index in range(size):
        side.join(index, 100)
    for token in range(20, 23):
        side.step([token] * size, [None] * size)
    assert steady.steps == 2
    rows: tuple[list[str], list[int]] = ([], [])
    touched, appended = append_sampled(
        [], [], [], side.owner, slow=side.slow, finish=side.finish, rows=rows, steady=steady
    )
    assert rows == ([], []) and touched == {} and appended == 0 and steady.steps == 2


def test_a_batch_with_a_detokenized_request_never_takes_the_steady_way() -> None:
    steady = SteadyRows()
    side = Side(steady)
    side.build_outputs = False  # a detokenizer stand-in cannot build one
    side.join(0, 100)
    request, parent = _request(1, max_tokens=100, detokenized=True)
    side.requests.append(request)
    side.owner[request.request_id] = (parent, 0)
    seen: list[str] = []
    slow = side.slow

    def counting_slow(request: Request, token: int, entry: Any) -> ParentRequest:
        seen.append(request.request_id)
        return slow(request, token, entry)

    side.slow = counting_slow  # type: ignore[method-assign]
    for token in range(20, 25):
        side.step([token, token], [None, None])
    assert steady.steps == 0 and seen == ["r1"] * 5
    assert side.requests[0].output_token_ids == side.requests[1].output_token_ids
