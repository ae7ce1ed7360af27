"""What a worker streams to the router: each step's new tokens, not the cumulative output.

The engine's RequestOutput is cumulative (vLLM's shape); sending it every step would cost
O(length^2) bytes per request over Ray. A delta carries only what is new, with the position of
its first token so a receiver can line up streams that overlap (a recompute after a failure).
The engine itself hands a running plain request's next token over alone (Engine.step_delta),
which `DeltaTracker.token` turns into a delta without any cumulative output built.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvrelay.common.messages import EngineRequest, OutputDelta, SampleDelta
from kvrelay.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from kvrelay.worker.engine_loop import EngineLoop


async def request_deltas(loop: EngineLoop, request: EngineRequest) -> AsyncIterator[OutputDelta]:
    """Run `request` on `loop` and yield each step's new tokens, up to the finished delta
    (what a worker's output channel sends). With a `kv_handle`, the prompt's KV is pulled from
    its prefill worker first (recomputed here if the pull fails, or failed, by the engine's
    kv_transfer_failure). With `resume_output_token_ids`, the deltas start after those
    tokens. Leaving early aborts the request."""
    tracker = DeltaTracker(already_sent=len(request.resume_output_token_ids))
    async for output in loop.outputs(request):
        yield tracker.token(output) if isinstance(output, int) else tracker.delta(output)


class DeltaTracker:
    """Turns one request's cumulative outputs into deltas."""

    def __init__(self, already_sent: int = 0) -> None:
        # sample index -> tokens already sent (a resumed n = 1 request: those it came with)
        self._sent: dict[int, int] = {0: already_sent} if already_sent else {}
        self._done: set[int] = set()  # samples whose finish was sent
        self._prompt_sent = False  # prompt_logprobs go once
        self._last: RequestOutput | None = None  # the last cumulative output seen

    def token(self, token_id: int) -> OutputDelta:
        """The delta of one more token of sample 0, after a cumulative output of the same
        request (the engine's StepDelta rows: a running plain request): that output's
        request fields and metrics, this one token."""
        last = self._last
        if last is None:
            raise RuntimeError("a token row came before any output of its request")
        start = self._sent.get(0, 0)
        self._sent[0] = start + 1
        return OutputDelta(
            last.request_id,
            [SampleDelta(0, start, [token_id], None, None, None)],
            False,
            len(last.prompt_token_ids),
            int(last.metrics.get("num_cached_tokens", 0)),
            None,
            dict(last.metrics),
        )

    def delta(self, output: RequestOutput) -> OutputDelta:
        self._last = output
        samples = []
        for sample in output.outputs:
            start = self._sent.get(sample.index, 0)
            new_ids = sample.token_ids[start:]
            if sample.index in self._done or (not new_ids and sample.finish_reason is None):
                continue
            self._sent[sample.index] = len(sample.token_ids)
            if sample.finish_reason is not None:
                self._done.add(sample.index)
            logprobs = sample.logprobs[start:] if sample.logprobs is not None else None
            samples.append(
                SampleDelta(
                    sample.index,
                    start,
                    list(new_ids),
                    logprobs,
                    sample.finish_reason,
                    sample.stop_reason,
                )
            )
        prompt_logprobs = None
        if output.prompt_logprobs is not None and not self._prompt_sent:
            prompt_logprobs, self._prompt_sent = output.prompt_logprobs, True
        return OutputDelta(
            output.request_id,
            samples,
            output.finished,
            len(output.prompt_token_ids),
            int(output.metrics.get("num_cached_tokens", 0)),
            output.kv_handle,
            dict(output.metrics),
            prompt_logprobs,
        )
