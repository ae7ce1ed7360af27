"""The staging a GPU pull goes through (kv_regions): where each received chunk's bytes land,
reusable host buffers (allocated once, not per chunk or per pull), chunked reads, and a real
gRPC pull forced through the staging path on the CPU, byte for byte."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Iterator

import pytest
import torch

from kvrelay.transfer.grpc_connector import GrpcConnector
from kvrelay.transfer.kv_regions import (
    PinnedStaging,
    Segment,
    StagingPool,
    chunk_segments,
    flat_bytes,
)
from tests.transfer.peers import make_kv
from tests.transfer.plans import PLANS, SECRET, Leases, after_pull, plan_for

CPU = torch.device("cpu")


def naive_place(
    flat: torch.Tensor, block_ids: list[int], block_bytes: int, offset: int, data: bytes
) -> None:
    """Byte by byte: the meaning chunk_segments must have."""
    for i, byte in enumerate(data):
        index, within = divmod(offset + i, block_bytes)
        flat[block_ids[index] * block_bytes + within] = byte


def test_consecutive_blocks_are_one_segment() -> None:
    # Blocks 4, 5, 6 of 10 bytes: 25 bytes from offset 3 are one run, bytes 43..67.
    assert chunk_segments([4, 5, 6], 10, 3, 25) == [Segment(43, 0, 25)]


def test_a_gap_in_block_ids_starts_a_new_segment() -> None:
    # Blocks 4 then 9: bytes 5..9 of block 4, then 0..7 of block 9.
    assert chunk_segments([4, 9], 10, 5, 13) == [Segment(45, 0, 5), Segment(90, 5, 8)]
    # Descending ids never merge (block 3 precedes block 4 in memory, not after it).
    assert chunk_segments([4, 3], 10, 0, 20) == [Segment(40, 0, 10), Segment(30, 10, 10)]


def test_an_empty_chunk_has_no_segment() -> None:
    assert chunk_segments([1], 10, 0, 0) == []


@pytest.mark.parametrize("seed", range(20))
def test_segments_place_bytes_where_the_naive_rule_does(seed: int) -> None:
    rng = random.Random(seed)
    block_bytes = rng.choice([1, 7, 16, 64])
    num_blocks = 12
    ids = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
    if rng.random() < 0.5:
        ids.sort()  # mostly runs, as a decode engine's fresh blocks often are
    total = len(ids) * block_bytes
    offset = rng.randrange(total)
    data = bytes(rng.randrange(256) for _ in range(rng.randint(1, total - offset)))
    expected = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8)
    naive_place(expected, ids, block_bytes, offset, data)
    got = torch.zeros_like(expected)
    segments = chunk_segments(ids, block_bytes, offset, len(data))
    PinnedStaging(CPU, chunk_bytes=8).write(got, segments, data)
    assert torch.equal(got, expected)
    assert sum(s.nbytes for s in segments) == len(data)
    assert all(a.dst + a.nbytes != b.dst for a, b in itertools.pairwise(segments))


def test_write_reuses_its_buffers_across_chunks() -> None:
    staging = PinnedStaging(CPU, chunk_bytes=64, depth=2)
    flat = torch.zeros(64 * 50, dtype=torch.uint8)
    for i in range(50):
        staging.write(flat, [Segment(i * 64, 0, 64)], bytes([i]) * 64)
    assert staging.num_allocations == 2  # one per slot, then reused
    assert torch.equal(flat.view(50, 64)[:, 0], torch.arange(50, dtype=torch.uint8))
    staging.write(flat, [Segment(0, 0, 100)], b"\x07" * 100)  # a peer's larger chunk
    staging.write(flat, [Segment(0, 0, 100)], b"\x07" * 100)
    assert staging.num_allocations == 4  # each slot grown once
    staging.write(flat, [Segment(0, 0, 100)], b"\x07" * 100)
    assert staging.num_allocations == 4


@pytest.mark.parametrize(("size", "chunk", "depth"), [(0, 8, 2), (5, 8, 2), (64, 8, 2),
                                                       (65, 8, 3), (100, 100, 1)])  # fmt: skip
def test_read_returns_the_region_in_chunks(size: int, chunk: int, depth: int) -> None:
    region = torch.randint(0, 256, (size,), dtype=torch.uint8)
    staging = PinnedStaging(CPU, chunk_bytes=chunk, depth=depth)
    parts = list(staging.read(region))
    assert b"".join(parts) == region.numpy().tobytes()
    assert all(len(p) == chunk for p in parts[:-1])
    assert staging.num_allocations == min(depth, len(parts))
    for _ in range(3):  # read again: the slots go round, never past `depth` buffers
        assert list(staging.read(region)) == parts
    assert staging.num_allocations <= depth


def test_staging_refuses_nonsense_sizes() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        PinnedStaging(CPU, chunk_bytes=0)
    with pytest.raises(ValueError, match="depth"):
        PinnedStaging(CPU, chunk_bytes=8, depth=0)


def test_the_pool_reuses_stagings_and_gives_concurrent_pulls_their_own() -> None:
    pool = StagingPool(CPU, chunk_bytes=16)
    for _ in range(5):
        with pool.lease() as staging:
            first = staging
    assert pool.num_created == 1
    inside = threading.Barrier(2)
    seen: list[PinnedStaging] = []

    def pull() -> None:
        with pool.lease() as staging:
            seen.append(staging)
            inside.wait(timeout=10)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.num_created == 2 and seen[0] is not seen[1] and first in seen


def test_a_failed_pull_still_returns_its_staging() -> None:
    pool = StagingPool(CPU, chunk_bytes=16)
    with pytest.raises(RuntimeError, match="boom"), pool.lease():
        raise RuntimeError("boom")
    with pool.lease():
        pass
    assert pool.num_created == 1


@pytest.fixture
def staged_pair() -> Iterator[tuple[GrpcConnector, torch.Tensor, torch.Tensor, Leases]]:
    """A real gRPC pair whose puller takes the GPU path (staging) with its CPU tensor; the
    server sends 700-byte chunks, so a 512-byte block spans two of them."""
    server = GrpcConnector(chunk_bytes=700, secret=SECRET)
    client = GrpcConnector(serve=False, timeout_s=5.0, secret=SECRET, chunk_bytes=256)
    src, dst, leases = make_kv(0), make_kv(None), Leases()
    server.register(src, "P", 1)
    server.authorize_pulls(leases.claim)
    client.register(dst, "D", 1)
    client._staging = StagingPool(CPU, 256)  # what register sets up for a CUDA tensor
    client.add_peer(server.metadata())
    yield client, src, dst, leases
    client.close()
    server.close()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_staged_grpc_pull_is_exact(
    name: str, staged_pair: tuple[GrpcConnector, torch.Tensor, torch.Tensor, Leases]
) -> None:
    client, src, dst, leases = staged_pair
    remote, local = PLANS[name]
    before = dst.clone()
    client.pull(leases.handle("P", 1, remote, "D"), plan_for(remote, local))
    assert torch.equal(dst, after_pull(before, src, remote, local))
    staging = client._staging
    assert staging is not None and staging.num_created <= 1
    client.pull(leases.handle("P", 1, remote, "D"), plan_for(remote, local))
    assert staging.num_created <= 1  # the next pull reuses the same buffers


def test_flat_bytes_shares_the_tensor_memory() -> None:
    kv = make_kv(1)
    flat = flat_bytes(kv)
    assert flat.numel() == kv.numel() * kv.element_size()
    flat[:4] = 0
    assert kv.view(-1)[0].item() == 0.0


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_grpc_pull_served_through_staging_is_exact(name: str) -> None:
    """The serving side's GPU path (pinned buffers, one device -> host copy per chunk) on a CPU
    tensor: a 700-byte chunking of 512-byte blocks, byte for byte, buffers reused."""
    server = GrpcConnector(chunk_bytes=700, secret=SECRET)
    client = GrpcConnector(serve=False, timeout_s=5.0, secret=SECRET)
    src, dst, leases = make_kv(0), make_kv(None), Leases()
    try:
        server.register(src, "P", 1)
        server.authorize_pulls(leases.claim)
        servicer = server._servicer
        assert servicer is not None and servicer._staging is None  # a host tensor: no staging
        servicer._staging = StagingPool(CPU, 700)  # what a CUDA tensor gets
        client.register(dst, "D", 1)
        client.add_peer(server.metadata())
        remote, local = PLANS[name]
        for _ in range(2):
            before = dst.clone()
            client.pull(leases.handle("P", 1, remote, "D"), plan_for(remote, local))
            assert torch.equal(dst, after_pull(before, src, remote, local))
        assert servicer._staging.num_created == 1  # the second pull reused the first's buffers
    finally:
        client.close()
        server.close()
