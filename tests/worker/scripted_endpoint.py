"""A worker's output channels (worker/output_channels.py) over a scripted delta stream,
in-process: the output-channel and output-stream tests' worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvrelay.common.messages import EngineRequest, OutputDelta, SampleDelta
from kvrelay.common.stream_wire import ChannelAddress
from kvrelay.worker.output_channels import OutputChannels


class ScriptedEndpoint:
    """Request r yields, one delta per `step_s` (a turn of the loop at 0), token
    sum(prompt) + i at output position i, from its resumed position up to max_tokens. It
    records the requests started, in order, and those still running (an abort ends one)."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.started: list[str] = []
        self.running: set[str] = set()
        self.channels = OutputChannels(self._deltas)

    async def open_channel(self, channel_id: str) -> ChannelAddress:
        return await self.channels.open(channel_id)

    async def start(self, channel_id: str, tag: int, request: EngineRequest) -> None:
        self.channels.start(channel_id, tag, request)

    async def _deltas(self, request: EngineRequest) -> AsyncIterator[OutputDelta]:
        request_id, params = request.request_id, request.params
        prompt_token_ids = request.prompt_token_ids
        resume_output_token_ids = request.resume_output_token_ids
        self.started.append(request_id)
        self.running.add(request_id)
        try:
            for i in range(len(resume_output_token_ids), params.max_tokens or 0):
                await asyncio.sleep(self.step_s)
                last = i + 1 == params.max_tokens
                token = sum(prompt_token_ids) + i
                sample = SampleDelta(0, i, [token], finish_reason="length" if last else None)
                yield OutputDelta(request_id, [sample], last, len(prompt_token_ids))
        finally:
            self.running.discard(request_id)
