"""DeltaTracker: a request's stream of cumulative outputs and single-token rows (the engine's
StepDelta, as the engine loop hands them over) becomes deltas that carry each token once, at
its position, with the request's fields."""

from __future__ import annotations

import pytest

from kvrelay.common.messages import SampleDelta
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.worker.deltas import DeltaTracker

METRICS = {"arrival_time": 1.0, "first_token_time": 2.0, "num_cached_tokens": 4.0}


def _output(tokens: list[int], finish: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, "", tokens, None, None, finish, None)
    return RequestOutput("r", None, [5, 6, 7], [completion], finish is not None, dict(METRICS))


def test_rows_between_outputs_carry_each_token_once_at_its_position() -> None:
    tracker = DeltaTracker()
    first = tracker.delta(_output([10]))
    assert first.samples == [SampleDelta(0, 0, [10], None, None, None)]
    rows = [tracker.token(11), tracker.token(12)]
    assert [d.samples for d in rows] == [
        [SampleDelta(0, 1, [11], None, None, None)],
        [SampleDelta(0, 2, [12], None, None, None)],
    ]
    for delta in rows:
        assert (delta.request_id, delta.finished, delta.kv_handle) == ("r", False, None)
        assert (delta.num_prompt_tokens, delta.num_cached_tokens) == (3, 4)
        assert delta.metrics == METRICS and delta.prompt_logprobs is None
    final = tracker.delta(_output([10, 11, 12, 13], "length"))
    assert final.finished
    assert final.samples == [SampleDelta(0, 3, [13], None, "length", None)]


def test_rows_of_a_resumed_request_follow_its_resumed_tokens() -> None:
    tracker = DeltaTracker(already_sent=2)
    assert tracker.delta(_output([1, 2, 3])).samples[0].token_ids == [3]
    assert tracker.token(4).samples[0].start == 3


def test_a_row_before_any_output_is_refused() -> None:
    with pytest.raises(RuntimeError, match="before any output"):
        DeltaTracker().token(3)
