"""A fake EngineWorker (services/kvrelay/worker/actor.py's contract) for router tests.

A plain class, made a Ray actor with `ray.remote(FakeWorker).options(num_cpus=0)`. Its "model"
is a formula of the prompt, the output position and the seed, the same at every fake, so a
recompute gives the tokens a relayed run gives. One token per step (`step_s`). It keeps the
books a real engine keeps (live requests, leases, blocks in use), which a test reads through
`state()`, and scripts the faults of a relay through `configure(**faults)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvrelay.common.messages import (
    DrainState,
    EngineRequest,
    EngineStats,
    KVHandle,
    OutputDelta,
    PeerMetadata,
    Role,
    SampleDelta,
    WorkerInfo,
    WorkerStatus,
)
from kvrelay.common.stream_wire import ChannelAddress
from kvrelay.worker.output_channels import OutputChannels

if TYPE_CHECKING:
    pass

VOCAB = 50000
BLOCK_SIZE = 4
KV_TRANSFER_FAILED = "KV transfer failed"


def model_token(prompt: Sequence[int], position: int, seed: int | None = None) -> int:
    """Output token `position` of `prompt`: what every fake's model generates."""
    return (sum(prompt) * 31 + position * 7 + (seed or 0) * 1009) % VOCAB


def model_tokens(prompt: Sequence[int], count: int, seed: int | None = None) -> list[int]:
    return [model_token(prompt, i, seed) for i in range(count)]


def blocks_for(prompt: Sequence[int]) -> int:
    return -(-len(prompt) // BLOCK_SIZE)


@dataclass
class Faults:
    """What `configure` scripts (every field by keyword; unknown ones are refused)."""

    prefill_s: float = 0.01  # how long a prefill takes
    step_s: float = 0.01  # one decode step (one token)
    pull_s: float = 0.0  # how long a decode worker's pull takes
    lease_expires: bool = False  # release_kv finds the lease gone: returns False, frees it
    pull_fails: bool = False  # a decode worker's pull fails...
    pull_failure: str = "recompute"  # ...and it recomputes, or ("fail") finishes with "abort"
    start_s: float = 0.0  # how long a `start` call takes to answer (a busy worker's loop)


@dataclass(frozen=True)
class FakeState:
    """A fake's books, as `state()` returns them."""

    engine_id: str
    role: Role
    requests: tuple[str, ...]  # live requests (prefilling, pulling or decoding)
    leases: tuple[str, ...]  # prefilled requests whose blocks wait for a decode worker
    blocks_in_use: int
    calls: tuple[tuple[str, str], ...]  # (method, request id) of every request call, in order
    released: tuple[tuple[str, bool], ...]  # (request id, lease held) per release_kv
    forgotten: tuple[str, ...]  # request ids of the handles forget_kv got
    handles: tuple[str, ...]  # request ids of the KV handles started requests had
    pull_failures: int
    peers: tuple[str, ...]  # prefill engine ids add_peer introduced
    resumed: tuple[tuple[str, tuple[int, ...]], ...]  # (request id, tokens it resumed after)
    bound_to: tuple[str | None, ...]  # per prefill: the decode engine its handle is bound to

    @property
    def whole(self) -> bool:
        return not self.requests and not self.leases and self.blocks_in_use == 0

    def called(self, method: str) -> list[str]:
        """The request ids `method` was called with, in order."""
        return [rid for name, rid in self.calls if name == method]

    def calls_for(self, request_id: str) -> list[str]:
        """The methods called for `request_id`, in order."""
        return [name for name, rid in self.calls if rid == request_id]


@dataclass
class _Live:
    blocks: int
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakeWorker:
    """A prefill, decode or colocated ("both") fake worker; its output channels (`open_channel`
    and `start`) are the real workers' own, over its scripted `_deltas`."""

    def __init__(
        self,
        role: Role | str,
        engine_id: str | None = None,
        num_blocks: int = 1024,
        max_model_len: int = 4096,
        *,
        revision: str = "",
        pod: str = "fake-pod",
        **faults: Any,
    ) -> None:
        self.role = Role(role)
        self.revision, self.pod = revision, pod
        self.state_of_drain = DrainState.SERVING
        self.engine_id = engine_id or f"fake-{self.role}-{uuid.uuid4().hex[:8]}"
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.faults = Faults(**faults)
        self.requests: dict[str, _Live] = {}
        self.leases: dict[str, int] = {}  # request id -> blocks held
        self.calls: list[tuple[str, str]] = []
        self.released: list[tuple[str, bool]] = []
        self.forgotten: list[str] = []
        self.handles: list[str] = []
        self.resumed: list[tuple[str, tuple[int, ...]]] = []
        self.bound_to: list[str | None] = []  # the decode engine each prefill's handle is for
        self.pull_failures = 0
        self.peers: dict[str, int] = {}
        self.channels = OutputChannels(self._deltas)

    # -- test control --

    async def configure(self, **faults: Any) -> None:
        """Change some faults (the others stay)."""
        self.faults = dataclasses.replace(self.faults, **faults)

    async def reset(self, **faults: Any) -> FakeState:
        """Start over with these faults (the others at their defaults) and empty books, for
        the next test; returns the state it ended (a test checks it was whole)."""
        state = await self.state()
        self.faults = Faults(**faults)
        self.state_of_drain = DrainState.SERVING
        self.calls.clear()
        self.released.clear()
        self.forgotten.clear()
        self.handles.clear()
        self.resumed.clear()
        self.bound_to.clear()
        self.pull_failures = 0
        self.peers.clear()
        return state

    async def state(self) -> FakeState:
        return FakeState(
            engine_id=self.engine_id,
            role=self.role,
            requests=tuple(sorted(self.requests)),
            leases=tuple(sorted(self.leases)),
            blocks_in_use=self._blocks_in_use(),
            calls=tuple(self.calls),
            released=tuple(self.released),
            forgotten=tuple(self.forgotten),
            handles=tuple(self.handles),
            resumed=tuple(self.resumed),
            bound_to=tuple(self.bound_to),
            pull_failures=self.pull_failures,
            peers=tuple(sorted(self.peers)),
        )

    # -- requests --

    async def open_channel(self, channel_id: str) -> ChannelAddress:
        return await self.channels.open(channel_id)

    async def start(self, channel_id: str, tag: int, request: EngineRequest) -> None:
        """The real channel's `start`, answering after `start_s` (other calls run meanwhile:
        an abort sent then finds no request)."""
        await asyncio.sleep(self.faults.start_s)
        self.channels.start(channel_id, tag, request)

    async def prefill(
        self, request: EngineRequest, decode_engine_id: str | None = None
    ) -> OutputDelta:
        request_id, params = request.request_id, request.params
        self.calls.append(("prefill", request_id))
        self.bound_to.append(decode_engine_id)
        if self.role is not Role.PREFILL:
            raise RuntimeError(f"a {self.role} worker does not prefill for others")
        prompt = list(request.prompt_token_ids)
        live = self._start(request_id, prompt)
        try:
            if await self._wait(live, self.faults.prefill_s):
                return _delta(request_id, prompt, 0, [], finish_reason="abort")
            first = model_token(prompt, 0, params.seed)
            if params.max_tokens is not None and params.max_tokens <= 1:
                return _delta(request_id, prompt, 0, [first], finish_reason="length")
            self.leases[request_id] = live.blocks  # the blocks pass from the request to a lease
            handle = KVHandle(
                engine_id=self.engine_id,
                epoch=1,
                request_id=request_id,
                block_ids=tuple(range(live.blocks)),
                num_tokens=len(prompt),
                block_hashes=_block_hashes(prompt),
                first_token_id=first,
            )
            return OutputDelta(
                request_id, [SampleDelta(0, 0, [first])], True, len(prompt), kv_handle=handle
            )
        finally:
            self._end(request_id, live)

    async def _deltas(self, request: EngineRequest) -> AsyncIterator[OutputDelta]:
        request_id, params, kv_handle = request.request_id, request.params, request.kv_handle
        resume_output_token_ids = request.resume_output_token_ids
        self.calls.append(("start", request_id))
        if resume_output_token_ids:
            self.resumed.append((request_id, tuple(resume_output_token_ids)))
        if self.role is Role.PREFILL or (kv_handle is not None and self.role is not Role.DECODE):
            raise RuntimeError(f"a {self.role} worker cannot run this request")
        prompt = list(request.prompt_token_ids)
        live = self._start(request_id, prompt)
        try:
            limit = params.max_tokens or self.max_model_len - len(prompt)
            tokens: list[int] = list(resume_output_token_ids)  # a migrated sample goes on
            if kv_handle is not None:
                self.handles.append(kv_handle.request_id)
                if await self._wait(live, self.faults.pull_s):
                    yield _delta(request_id, prompt, 0, [], finish_reason="abort")
                    return
                if self.faults.pull_fails or kv_handle.engine_id not in self.peers:
                    self.pull_failures += 1
                    if self.faults.pull_failure == "fail":
                        reason = f"{KV_TRANSFER_FAILED}: the pull from {kv_handle.engine_id} failed"
                        yield _delta(request_id, prompt, 0, [], "abort", reason)
                        return
                    # Recompute: the stream starts again at position 0 (the prefill's token).
                    if await self._wait(live, self.faults.prefill_s):
                        yield _delta(request_id, prompt, 0, [], finish_reason="abort")
                        return
                    tokens.append(model_token(prompt, 0, params.seed))
                else:
                    tokens.append(kv_handle.first_token_id)  # as the engine appends it
                yield _delta(request_id, prompt, 0, list(tokens), _length(tokens, limit))
            while len(tokens) < limit:
                if await self._wait(live, self.faults.step_s):
                    yield _delta(request_id, prompt, len(tokens), [], finish_reason="abort")
                    return
                tokens.append(model_token(prompt, len(tokens), params.seed))
                yield _delta(
                    request_id, prompt, len(tokens) - 1, tokens[-1:], _length(tokens, limit)
                )
        finally:
            self._end(request_id, live)

    async def release_kv(self, request_id: str) -> bool:
        self.calls.append(("release_kv", request_id))
        held = self.leases.pop(request_id, None) is not None and not self.faults.lease_expires
        self.released.append((request_id, held))
        return held

    async def forget_kv(self, handle: KVHandle) -> int:
        self.calls.append(("forget_kv", handle.request_id))
        self.forgotten.append(handle.request_id)
        return len(handle.block_hashes)

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))
        live = self.requests.pop(request_id, None)
        if live is not None:
            live.aborted.set()
        self.leases.pop(request_id, None)

    # -- what the registry asks --

    async def describe(self) -> WorkerInfo:
        return WorkerInfo(
            role=self.role,
            engine_id=self.engine_id,
            epoch=1,
            block_size=BLOCK_SIZE,
            hash_extra_keys=(),
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            generation=self.revision,
            pod=self.pod,
            name=f"kvrelay-{self.role}-{self.pod}",
        )

    async def drain(self) -> WorkerInfo:
        self.state_of_drain = DrainState.DRAINING
        return await self.describe()

    async def status(self) -> WorkerStatus:
        return WorkerStatus(True, self.state_of_drain)

    async def kv_metadata(self) -> PeerMetadata:
        if self.role is Role.BOTH:
            raise RuntimeError("a colocated worker has no KV connector")
        return PeerMetadata(self.engine_id, 1, "fake", b"")

    async def add_peer(self, meta: PeerMetadata) -> None:
        if self.role is Role.BOTH:
            raise RuntimeError("a colocated worker has no KV connector")
        self.peers[meta.engine_id] = meta.epoch

    async def stats(self) -> EngineStats:
        used = self._blocks_in_use()
        return EngineStats(
            num_running=len(self.requests),
            num_waiting=0,
            num_free_blocks=self.num_blocks - used,
            num_blocks=self.num_blocks,
            kv_usage=used / self.num_blocks,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=0,
            num_leases=len(self.leases),
            kv_pull_fallbacks=self.pull_failures,
        )

    async def cached_block_hashes(self) -> list[bytes]:
        return []

    async def health(self) -> bool:
        return True

    # -- books --

    def _start(self, request_id: str, prompt: list[int]) -> _Live:
        if request_id in self.requests or request_id in self.leases:
            raise ValueError(f"request {request_id} is already running here")
        live = _Live(blocks_for(prompt))
        self.requests[request_id] = live
        return live

    def _end(self, request_id: str, live: _Live) -> None:
        if self.requests.get(request_id) is live:  # not a later request of the same id
            del self.requests[request_id]

    def _blocks_in_use(self) -> int:
        return sum(live.blocks for live in self.requests.values()) + sum(self.leases.values())

    @staticmethod
    async def _wait(live: _Live, seconds: float) -> bool:
        """Sleep `seconds`, or less if the request is aborted: whether it was."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(live.aborted.wait(), seconds)
        return live.aborted.is_set()


def _length(tokens: list[int], limit: int) -> str | None:
    return "length" if len(tokens) >= limit else None


def _delta(
    request_id: str,
    prompt: list[int],
    start: int,
    token_ids: list[int],
    finish_reason: str | None = None,
    stop_reason: str | None = None,
) -> OutputDelta:
    sample = SampleDelta(0, start, token_ids, finish_reason=finish_reason, stop_reason=stop_reason)
    return OutputDelta(request_id, [sample], finish_reason is not None, len(prompt))


def _block_hashes(prompt: list[int]) -> tuple[bytes, ...]:
    full = len(prompt) // BLOCK_SIZE
    return tuple(
        hashlib.sha256(repr(prompt[: (i + 1) * BLOCK_SIZE]).encode()).digest()[:16]
        for i in range(full)
    )


class HangingWorker(FakeWorker):
    """A fake whose registry calls named in `hang_in` (health, describe, status, stats,
    drain) never answer, as an actor stuck in a call or on a lost node: the registry's
    timeouts are all that keep a router going. `hang(...)` changes them later."""

    def __init__(self, role: Role | str, *, hang_in: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(role, **kwargs)
        self.hang_in = set(hang_in)

    async def hang(self, *methods: str) -> None:
        self.hang_in = set(methods)

    async def _maybe_hang(self, method: str) -> None:
        if method in self.hang_in:
            await asyncio.Event().wait()  # forever

    async def health(self) -> bool:
        await self._maybe_hang("health")
        return await super().health()

    async def describe(self) -> WorkerInfo:
        await self._maybe_hang("describe")
        return await super().describe()

    async def status(self) -> WorkerStatus:
        await self._maybe_hang("status")
        return await super().status()

    async def stats(self) -> EngineStats:
        await self._maybe_hang("stats")
        return await super().stats()

    async def drain(self) -> WorkerInfo:
        await self._maybe_hang("drain")
        return await super().drain()
