"""The prefill -> decode hand-off of one engine: leases, KV handles, pull plans, failure policy.
It changes requests only through the scheduler; it never runs the model nor emits outputs.
A handle is made only once the KV writes it names are complete on the device (KVWriteFence)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.common.messages import KVHandle, PullPlan, Role
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager, blocks_needed
from kvrelay.engine.leases import LeaseTable
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

RECOMPUTE = "recompute"  # kv_transfer_failure: recompute an unusable prompt KV here
FAIL = "fail"  # kv_transfer_failure: finish the request aborted instead
HANDLE_ID_BYTES = 24  # 192 random bits: a handle id is a capability, so it must not be guessed


class KVWriteFence:
    """Makes the KV writes queued on the device complete before a handle naming them leaves the
    engine: a gRPC server thread (another stream) or a NIXL READ (another process, over UCX)
    must never read a block the prefill's kernels are still writing.

    On CUDA, `wait` records an event on the device's current stream, where the step that
    sampled the request's first token wrote its prompt's last KV, and waits for it; the step's
    own host sync for its sampled tokens has usually passed it already, so it costs a few
    microseconds. On any other device it does nothing. With no device given, it acts on the
    current CUDA device when this process has initialized CUDA, else does nothing.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)
        self.num_waits = 0  # events waited on (CUDA only)

    def _cuda_device(self) -> torch.device | None:
        if self.device is not None:
            return self.device if self.device.type == "cuda" else None
        if torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def wait(self) -> None:
        """Block until every KV write queued so far on the device's current stream is done."""
        device = self._cuda_device()
        if device is None:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
        self.num_waits += 1


@dataclass(frozen=True)
class _Pull:
    """A decode-side request whose prompt blocks are being pulled."""

    request: Request
    handle: KVHandle
    num_blocks: int  # blocks to pull (prefix-cache hits left out)


class KVHandoff:
    """Both ends of the hand-off for one engine.

    Prefill role: a request that sampled its first token leaves the batch and its prompt's
    blocks stay held under a lease until `release` (pulled) or `expire_leases`.
    Decode role: `admit_prefilled` allocates a prefilled request's blocks and returns what to
    pull; `finish_pull` lets it run. An unusable KV (mismatched handle, no room, failed pull)
    is recomputed here or fails the request, per `failure_policy`.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        scheduler: Scheduler,
        *,
        role: Role,
        engine_id: str,
        epoch: int,
        kv_block_bytes: int,
        lease_seconds: float,
        failure_policy: str,
        kv_device: torch.device | str | None = None,
        kv_fence: KVWriteFence | None = None,
    ) -> None:
        """`kv_device`: where the KV tensor lives (what the fence waits on); `kv_fence`
        replaces the fence made from it."""
        assert failure_policy in (RECOMPUTE, FAIL), failure_policy  # EngineConfig validates
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.role = role
        self.engine_id = engine_id
        self.epoch = epoch
        self.kv_block_bytes = kv_block_bytes
        self.lease_seconds = lease_seconds
        self.failure_policy = failure_policy
        self._leases = LeaseTable()
        self._pulls: dict[str, _Pull] = {}
        self.kv_fence = kv_fence or KVWriteFence(kv_device)
        self.kv_bytes_pulled = 0
        self.num_pull_fallbacks = 0
        self.num_transfer_failures = 0

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_pulling(self) -> int:
        return len(self._pulls)

    @property
    def num_leases_expired(self) -> int:
        return self._leases.num_expired

    def has_lease(self, request_id: str) -> bool:
        return request_id in self._leases

    def check_params(self, params: SamplingParams, *, prefilled: bool) -> None:
        """Raises ValueError for a request this engine's role cannot take."""
        if prefilled and self.role is Role.PREFILL:
            raise ValueError("a prefill engine does not take prefilled requests")
        if prefilled and params.n != 1:
            raise ValueError("a prefilled request takes n = 1")
        if self.role is Role.PREFILL and params.n != 1:
            raise ValueError("a prefill engine takes n = 1; run n > 1 colocated")

    # -- prefill side --

    def lease_prompt_kv(self, request: Request) -> KVHandle | None:
        """Prefill role: take `request`, which sampled its first token and goes on, out of the
        batch (status FINISHED_REMOTE), lease its prompt's blocks and return their handle.
        Other roles: None, and nothing changes (it keeps decoding here).

        The KV fence is waited on first, so the handle (which the worker publishes for a
        decode engine to read) names only KV that is complete on the device."""
        if self.role is not Role.PREFILL:
            return None
        # Before anything changes: a handle must never name KV still being written, and a
        # device error here leaves the request as it was.
        self.kv_fence.wait()
        rid = request.request_id
        self.scheduler.detach(request)
        request.status = RequestStatus.FINISHED_REMOTE
        num_tokens = request.num_prompt_tokens
        block_size = self.kv_cache.block_size
        table = self.kv_cache.block_table(rid)[: blocks_needed(num_tokens, block_size)]
        logprobs = request.output_logprobs[0].items() if request.output_logprobs else None
        handle_id = secrets.token_urlsafe(HANDLE_ID_BYTES)
        self._leases.grant(rid, time.monotonic() + self.lease_seconds, handle_id, table)
        return KVHandle(
            engine_id=self.engine_id,
            epoch=self.epoch,
            request_id=rid,
            block_ids=tuple(table),
            num_tokens=num_tokens,
            block_hashes=tuple(self.kv_cache.block_hashes(request, num_tokens // block_size)),
            first_token_id=request.output_token_ids[0],
            first_token_logprobs=tuple(logprobs) if logprobs is not None else None,
            handle_id=handle_id,
        )

    def bind_handle(self, handle_id: str, decode_engine_id: str) -> bool:
        """Prefill role: only the engine `decode_engine_id` (the router's pick) may pull
        `handle_id`. False when no lease holds it, or it is bound to another engine.
        Thread-safe."""
        return self._leases.bind(handle_id, decode_engine_id)

    def claim_pull(self, handle_id: str, requester: str, block_ids: Sequence[int]) -> bool:
        """Prefill role: whether the engine `requester`, whose credential the KV server has
        checked, may read `block_ids` under `handle_id` now: a held, unexpired, unspent lease
        bound to it (or not yet bound) that holds those blocks. Spends the handle when it may.
        Why not goes to this worker's log only. Thread-safe (a KV server thread calls it)."""
        refusal = self._leases.claim(handle_id, requester, block_ids, time.monotonic())
        if refusal is not None:
            logger.warning("KV pull by engine %r refused: %s", requester, refusal)
        return refusal is None

    def release(self, request_id: str) -> bool:
        """Free a leased request's blocks. False when no lease was held (already released,
        expired, or never granted)."""
        if not self._leases.release(request_id):
            return False
        self.kv_cache.free(request_id)
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the blocks of every lease past its time; returns their request ids."""
        expired = self._leases.pop_expired(time.monotonic() if now is None else now)
        for request_id in expired:
            logger.warning(
                "request %s: KV lease expired before a decode engine pulled it", request_id
            )
            self.kv_cache.free(request_id)
        return expired

    # -- decode side --

    def admit_prefilled(self, request: Request, handle: KVHandle) -> PullPlan | None:
        """Decode role: allocate the prompt's blocks of `request` (its first token already
        appended; prefix-cache hits reused) and hold it waiting for remote KV.

        Returns:
            The blocks to pull from `handle`'s engine; or None when its KV cannot be used
            (a handle that does not match the prompt, no free blocks): the request is then
            queued to recompute its prompt, or finished aborted, per `failure_policy`.
        """
        rid = request.request_id
        reason = self._mismatch(request, handle)
        cached = [] if reason else self.kv_cache.find_cached_prefix(request)
        if reason is None and not self.kv_cache.allocate_slots(
            rid, handle.num_tokens, cached_blocks=cached
        ):
            reason = "no free KV blocks"
        if reason is not None:
            if self._recompute_allowed(request, reason):
                self.scheduler.add(request)
            return None
        self.scheduler.add_waiting_for_remote_kv(request)
        table = self.kv_cache.block_table(rid)
        skip = len(cached)
        self._pulls[rid] = _Pull(request, handle, len(table) - skip)
        return PullPlan(rid, handle.block_ids[skip:], tuple(table[skip:]))

    def _mismatch(self, request: Request, handle: KVHandle) -> str | None:
        """Why `handle` cannot hold this request's prompt KV, or None when it can."""
        num_tokens = request.num_prompt_tokens
        block_size = self.kv_cache.block_size
        if handle.num_tokens != num_tokens:
            return f"handle holds {handle.num_tokens} tokens, the prompt has {num_tokens}"
        if len(handle.block_ids) != blocks_needed(num_tokens, block_size):
            return f"handle has {len(handle.block_ids)} blocks for {num_tokens} tokens"
        expected = self.kv_cache.block_hashes(request, num_tokens // block_size)
        if tuple(expected) != handle.block_hashes:
            return "block hashes differ (another model, or other tokens)"
        return None

    def finish_pull(self, request_id: str, ok: bool) -> Request | None:
        """Decode role: the pull of `request_id`'s plan is over. On success it joins the
        running batch; on failure it recomputes or is finished aborted, per `failure_policy`.

        Returns:
            The request (look at its status), or None when no pull was pending (aborted).
        """
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return None
        request = pull.request
        if ok:
            self.kv_bytes_pulled += pull.num_blocks * self.kv_block_bytes
            self.scheduler.finish_remote_kv(request, ok=True)
        elif self._recompute_allowed(request, "the KV transfer failed"):
            self.scheduler.finish_remote_kv(request, ok=False)
        return request

    def cancel(self, request_id: str) -> None:
        """The request is being aborted: release its lease, forget its pending pull (the
        scheduler frees its blocks when the engine finishes it)."""
        self.release(request_id)
        self._pulls.pop(request_id, None)

    def _recompute_allowed(self, request: Request, reason: str) -> bool:
        """Apply `failure_policy` to a request whose remote KV cannot be used.

        Returns:
            True for "recompute" (counted, logged; the caller queues it). False for "fail":
            the request is finished aborted with why in its stop_reason, its blocks freed.
        """
        rid = request.request_id
        if self.failure_policy == RECOMPUTE:
            logger.warning("request %s: recomputing its prompt: %s", rid, reason)
            self.num_pull_fallbacks += 1
            return True
        logger.warning("request %s: KV transfer failed, failing it: %s", rid, reason)
        self.num_transfer_failures += 1
        request.stop_reason = (
            f"KV transfer failed: {reason}; retry, or set kv_transfer_failure=recompute"
        )
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return False


def first_token_logprobs(handle: KVHandle, params: SamplingParams) -> dict[int, float] | None:
    """The logprobs entry of a handed-off request's first token (it travels with the handle,
    so a decode engine keeps one entry per output token); None when none were asked for."""
    if params.logprobs is None:
        return None
    return dict(handle.first_token_logprobs or {handle.first_token_id: 0.0})
