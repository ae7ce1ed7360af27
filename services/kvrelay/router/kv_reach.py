"""Whether KV really travels, said where operators look (the router's log): at introduction,
can a decode worker reach the KV address a prefill worker advertises? (a loopback address is
reachable from the same pod or host only; across pods every pull would fail and fall back to
recompute); and, at each poll, did a decode worker recompute prompts whose pull failed?"""

from __future__ import annotations

import ipaddress
import logging

from kvrelay.common.messages import EngineStats, PeerMetadata, WorkerInfo

logger = logging.getLogger(__name__)


def advertised_host(meta: PeerMetadata) -> str | None:
    """The host of a gRPC peer's `host:port` address (None for other backends)."""
    if meta.backend != "grpc":
        return None
    try:
        address = meta.payload.decode()
    except UnicodeDecodeError:
        return None
    host = address.rpartition(":")[0]
    return host.strip("[]") or None  # an IPv6 literal is bracketed: [::1]:port


def unreachable_reason(meta: PeerMetadata, prefill: WorkerInfo, decode: WorkerInfo) -> str | None:
    """Why `decode` cannot pull from `prefill` at the address of `meta`; None if it may."""
    host = advertised_host(meta)
    if host is None or prefill.pod == decode.pod:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolved by the puller
        return None
    if not loopback:
        return None
    return (
        f"prefill worker {prefill.engine_id} (pod {prefill.pod}) serves its KV at "
        f"{meta.payload.decode()}, a loopback address that decode worker {decode.engine_id} "
        f"(pod {decode.pod}) cannot reach: every pull will fall back to recompute. Set "
        "KVRELAY_KV_HOST to the pod's IP (the operator sets it from status.podIP)"
    )


def warn_if_unreachable(meta: PeerMetadata, prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """Log a WARNING when `decode` cannot reach `prefill`'s KV; returns whether it can."""
    reason = unreachable_reason(meta, prefill, decode)
    if reason is not None:
        logger.warning("%s", reason)
    return reason is None


def warn_of_fallbacks(worker: WorkerInfo, before: EngineStats | None, now: EngineStats) -> int:
    """Log a WARNING when a worker's KV pulls failed since its last stats (recomputed, or
    failed under kv_transfer_failure="fail"); returns how many. The worker's own log names
    the prefill worker and the address of each."""
    if before is None:
        return 0
    failed = (now.kv_pull_fallbacks + now.kv_transfer_failures) - (
        before.kv_pull_fallbacks + before.kv_transfer_failures
    )
    if failed > 0:
        logger.warning(
            "decode worker %s (pod %s): %d KV pull(s) failed since its last stats (%d "
            "recomputed in all); its log names the prefill worker and address of each: a "
            "wrong KVRELAY_KV_HOST, a network policy, or a mismatched KV secret",
            worker.engine_id,
            worker.pod or "-",
            failed,
            now.kv_pull_fallbacks,
        )
    return max(failed, 0)
