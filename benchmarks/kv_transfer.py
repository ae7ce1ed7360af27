#!/usr/bin/env python
"""KV transfer: NIXL vs gRPC between two Ray actor processes, one run.

Prompts of 256 / 1024 / 4096 tokens in the default model's fp32 KV blocks ([30 layers, K/V,
block 16, 3 KV heads, 64 dims]: 737,280 bytes each). "merged": consecutive block ids on both
sides (one descriptor / byte range per pull); "per-block": every other remote block into
shuffled local ids (one descriptor per block). Handover latency is pull start -> bytes landed,
timed inside the decode actor after a warm-up pull (connection set-up excluded); bandwidth is
bytes over that time; medians of --repeats. The peer: a copy of the same blocks inside the
decode process (torch copy_ per run: a memcpy), measured in the same run.

    .venv/bin/python benchmarks/kv_transfer.py
    .venv/bin/python benchmarks/kv_transfer.py --tokens 256 1024 --repeats 3 --backends grpc
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

BLOCK_SHAPE = (30, 2, 16, 3, 64)  # one block of the default model, block size 16


class Worker:
    """A worker process: a KV tensor of `num_blocks` blocks and one connector."""

    def __init__(
        self, backend: str, engine_id: str, num_blocks: int, seed: int | None, secret: bytes
    ) -> None:
        from kvrelay.engine.leases import LeaseTable
        from kvrelay.transfer.factory import create_connector
        from kvrelay.transfer.kv_secret import KVSecret

        shape = (num_blocks, *BLOCK_SHAPE)
        if seed is None:
            self.kv = torch.zeros(shape)
        else:
            self.kv = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        self.connector = create_connector(backend, secret=KVSecret(secret), timeout_s=60.0)
        self.connector.register(self.kv, engine_id, 1)
        # Pulls are authorized as an engine authorizes them: one lease per pull, as here.
        self.leases = LeaseTable()
        self.connector.authorize_pulls(
            lambda handle_id, requester, blocks: (
                self.leases.claim(handle_id, requester, blocks, time.monotonic()) is None
            )
        )

    def grant(self, remote: list[int]) -> str:
        """A fresh single-use lease on `remote` (what a prefill hands a decode worker)."""
        import secrets

        handle_id = secrets.token_urlsafe(24)
        self.leases.grant(handle_id, time.monotonic() + 60.0, handle_id, remote)
        return handle_id

    def metadata(self) -> Any:
        return self.connector.metadata()

    def add_peer(self, peer: Any) -> None:
        self.connector.add_peer(peer)

    def pull(self, engine_id: str, remote: list[int], local: list[int], handle_id: str) -> float:
        """Seconds from pull start to every byte landed."""
        from kvrelay.common.messages import KVHandle, PullPlan

        handle = KVHandle(engine_id, 1, "bench", tuple(remote), 0, (), 0, handle_id=handle_id)
        plan = PullPlan("bench", tuple(remote), tuple(local))
        start = time.perf_counter()
        self.connector.pull(handle, plan)
        return time.perf_counter() - start

    def local_copy(self, remote: list[int], local: list[int]) -> float:
        """The peer: the same blocks copied within this process, one copy per run."""
        from kvrelay.transfer.runs import merge_runs

        start = time.perf_counter()
        for run in merge_runs(remote, local):
            src = self.kv[run.remote_start : run.remote_start + run.length]
            self.kv[run.local_start : run.local_start + run.length].copy_(src)
        return time.perf_counter() - start

    def checksum(self, ids: list[int]) -> float:
        return float(self.kv[ids].double().sum())


def plans(tokens: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """Block id pairs per pattern; local ids sit in the second half of the tensor."""
    blocks = -(-tokens // BLOCK_SHAPE[2])
    scattered_local = list(range(2 * blocks, 3 * blocks))
    random.Random(seed).shuffle(scattered_local)
    return {
        "merged": (list(range(blocks)), list(range(2 * blocks, 3 * blocks))),
        "per-block": (list(range(0, 2 * blocks, 2)), scattered_local),
    }


def timed_pull(pair: tuple[Any, Any], backend: str, remote: list[int], local: list[int]) -> float:
    """One authorized pull from the prefill actor into the decode actor: its seconds."""
    import ray

    prefill, decode = pair
    handle_id = ray.get(prefill.grant.remote(remote))
    seconds: float = ray.get(decode.pull.remote(f"P-{backend}", remote, local, handle_id))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--backends", nargs="+", default=["nixl", "grpc"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray

    block_bytes = torch.empty(BLOCK_SHAPE).numel() * 4
    num_blocks = 3 * -(-max(args.tokens) // BLOCK_SHAPE[2])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    actor = ray.remote(num_cpus=0)(Worker)
    rows: list[tuple[str, int, str, float, float, float]] = []
    cases = [
        (backend, tokens, pattern)
        for backend in args.backends
        for tokens in args.tokens
        for pattern in ("merged", "per-block")
    ]
    workers: dict[str, tuple[Any, Any]] = {}
    secret = secrets.token_bytes(32)  # the deployment's KV secret: both workers hold it
    for backend in args.backends:
        prefill = actor.remote(backend, f"P-{backend}", num_blocks, args.seed, secret)
        decode = actor.remote(backend, f"D-{backend}", num_blocks, None, secret)
        ray.get(decode.add_peer.remote(ray.get(prefill.metadata.remote())))
        workers[backend] = (prefill, decode)
    for backend, tokens, pattern in tqdm(cases, desc="kv transfer", unit="case"):
        prefill, decode = workers[backend]
        remote, local = plans(tokens, args.seed)[pattern]
        pair = (prefill, decode)
        timed_pull(pair, backend, remote, local)  # warm-up: connect
        if ray.get(decode.checksum.remote(local)) != ray.get(prefill.checksum.remote(remote)):
            raise SystemExit(f"{backend} {pattern}: pulled bytes differ from the source")
        seconds = statistics.median(
            timed_pull(pair, backend, remote, local) for _ in range(args.repeats)
        )
        memcpy = statistics.median(
            ray.get(decode.local_copy.remote(remote, local)) for _ in range(args.repeats)
        )
        nbytes = len(remote) * block_bytes
        rows.append((backend, tokens, pattern, seconds, nbytes / seconds / 1e9, memcpy / seconds))
    ray.shutdown()

    print(f"\nblock: {block_bytes:,} bytes; medians of {args.repeats} pulls after a warm-up\n")
    print("| backend | prompt tokens | blocks | ids | handover ms | GB/s | time / memcpy time |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for backend, tokens, pattern, seconds, gbps, ratio in rows:
        blocks = -(-tokens // BLOCK_SHAPE[2])
        print(
            f"| {backend} | {tokens} | {blocks} | {pattern} | {seconds * 1e3:.2f} | {gbps:.2f} "
            f"| {1 / ratio:.1f} |"
        )


if __name__ == "__main__":
    main()
