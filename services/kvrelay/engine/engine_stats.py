"""The engine's counters gathered into one `EngineStats` (what a worker reports and its
metrics read). It only reads: it never changes a counter or the state it reads."""

from __future__ import annotations

from kvrelay.common.messages import EngineStats
from kvrelay.engine.handoff import KVHandoff
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.scheduler import Scheduler


def engine_stats(
    scheduler: Scheduler,
    kv_cache: KVCacheManager,
    handoff: KVHandoff,
    *,
    prompt_tokens: int,
    generation_tokens: int,
) -> EngineStats:
    """The counters of one engine's parts, and its token counts, as of now."""
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_blocks=kv_cache.num_free_blocks,
        num_blocks=kv_cache.pool.num_blocks,
        kv_usage=kv_cache.usage,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens=prompt_tokens,
        generation_tokens=generation_tokens,
        prefix_cache_queries=kv_cache.stats.queries,
        prefix_cache_hits=kv_cache.stats.hits,
        prefix_cache_evictions=kv_cache.pool.num_evictions,
        num_cached_blocks=kv_cache.pool.num_cached_blocks,
        num_leases=handoff.num_leases,
        num_pulling=handoff.num_pulling,
        kv_leases_expired=handoff.num_leases_expired,
        kv_pull_fallbacks=handoff.num_pull_fallbacks,
        kv_transfer_failures=handoff.num_transfer_failures,
        kv_bytes_pulled=handoff.kv_bytes_pulled,
    )
