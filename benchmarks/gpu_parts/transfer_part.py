"""Part 4: KV transfer on one device between two engines in one process (a prefill engine and
a decode engine on the same random-weight 135M-shaped model): over the gRPC path (a real
loopback KVTransfer server, when grpcio imports), over NIXL (when it imports), and through
the pinned staging alone (what the gRPC path does on each side, without the socket; needs
nothing). Bytes/s against the device copy bandwidth; the decoded tokens must equal a
colocated engine's."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpu_parts.engine_models import (
    build_model,
    dtype_of,
    engine_generate,
    free_device_memory,
    greedy,
    make_engine,
    prompts_of,
)
from gpu_parts.report import FAIL, PASS, SKIP, Context, Deadline, Row, last_line

PART = "4 transfer"
Pull = Callable[[Any, Any], None]  # (KVHandle, PullPlan) -> None, blocking
TRANSPORTS = ("grpc", "nixl", "staging")


@contextmanager
def grpc_transport(prefill: Any, decode: Any) -> Iterator[Pull]:
    """A KVTransfer server on the prefill engine's tensor, a pulling client on the decode's."""
    from kvrelay.transfer.grpc_connector import GrpcConnector
    from kvrelay.transfer.kv_secret import KVSecret

    secret = KVSecret.generate()
    server, client = GrpcConnector(secret=secret), GrpcConnector(secret=secret, serve=False)
    try:
        server.register(prefill.kv_tensor, prefill.engine_id, prefill.epoch)
        server.authorize_pulls(prefill.handoff.claim_pull)
        client.register(decode.kv_tensor, decode.engine_id, decode.epoch)
        client.add_peer(server.metadata())
        yield client.pull
    finally:
        client.close()
        server.close()


@contextmanager
def nixl_transport(prefill: Any, decode: Any) -> Iterator[Pull]:
    from kvrelay.transfer.nixl_connector import NixlConnector

    server, client = NixlConnector(), NixlConnector()
    try:
        server.register(prefill.kv_tensor, prefill.engine_id, prefill.epoch)
        client.register(decode.kv_tensor, decode.engine_id, decode.epoch)
        client.add_peer(server.metadata())
        yield client.pull
    finally:
        client.close()
        server.close()


@contextmanager
def staging_transport(prefill: Any, decode: Any) -> Iterator[Pull]:
    """The gRPC path's two halves back to back: the server's chunked device -> host reads of
    each run of blocks, the puller's host -> device writes at the chunk's segments."""
    from kvrelay.transfer.kv_regions import (
        StagingPool,
        block_byte_rows,
        chunk_segments,
        flat_bytes,
    )
    from kvrelay.transfer.runs import merge_runs

    rows, flat = block_byte_rows(prefill.kv_tensor), flat_bytes(decode.kv_tensor)
    chunk = 2 << 20
    readers = StagingPool(prefill.kv_tensor.device, chunk)
    writers = StagingPool(decode.kv_tensor.device, chunk)

    def pull(handle: Any, plan: Any) -> None:
        size, offset = rows.shape[1], 0
        local = plan.local_block_ids
        with readers.lease() as reader, writers.lease() as writer:
            for run in merge_runs(plan.remote_block_ids, range(len(local))):
                region = rows[run.remote_start : run.remote_start + run.length].view(-1)
                for data in reader.read(region):
                    writer.write(flat, chunk_segments(local, size, offset, len(data)), data)
                    offset += len(data)

    yield pull


OPENERS = {"grpc": grpc_transport, "nixl": nixl_transport, "staging": staging_transport}
# The modules each transport imports. The generated gRPC code (kvrelay/v1) checks the installed
# grpcio and protobuf at import: on a machine with ones older than pyproject's floors it raises
# a RuntimeError or protobuf's VersionError, not an ImportError; either way the transport
# cannot run there.
MODULES = {
    "grpc": ("kvrelay.transfer.grpc_connector",),
    "nixl": ("kvrelay.transfer.nixl_connector",),
    "staging": ("kvrelay.transfer.kv_regions",),
}


def import_problem(name: str) -> str | None:
    """Why transport `name` cannot be imported on this machine, or None when it can."""
    for module in MODULES[name]:
        try:
            importlib.import_module(module)
        except Exception as exc:  # absent, or older than the generated code needs
            return last_line(exc)
    return None


def relay(
    prefill: Any, decode: Any, pull: Pull, prompts: list[list[int]], tag: str, max_tokens: int
) -> tuple[list[list[int]], int, float]:
    """Prefill `prompts` on one engine, pull each KV into the other, decode there. Returns
    the outputs, the bytes pulled and the seconds the pulls took."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        prefill.add_request(rid, prompt, greedy(max_tokens))
    handles: dict[str, Any] = {}
    while prefill.has_unfinished_requests():
        handles.update({o.request_id: o.kv_handle for o in prefill.step() if o.kv_handle})
    nbytes, seconds = 0, 0.0
    for rid, prompt in zip(ids, prompts, strict=True):
        plan = decode.add_prefilled_request(rid, prompt, greedy(max_tokens), handles[rid])
        if plan is None:
            raise RuntimeError(f"{rid}: the decode engine refused the handle (see the log)")
        start = time.perf_counter()
        pull(handles[rid], plan)
        seconds += time.perf_counter() - start
        nbytes += len(plan.local_block_ids) * decode.kv_block_bytes
        decode.finish_pull(rid, True)
        prefill.release_kv(rid)
    done: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for output in decode.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[rid] for rid in ids], nbytes, seconds


def transport_rows(
    ctx: Context,
    name: str,
    engines: tuple[Any, Any],
    prompts: list[list[int]],
    expected: list[list[int]],
    max_tokens: int,
) -> list[Row]:
    problem = import_problem(name)
    if problem is not None:
        return [Row(PART, f"{name}: tokens unchanged", SKIP, note=f"n/a: {problem}")]
    try:
        with OPENERS[name](*engines) as pull:
            # Connections and first copies; reversed, so no prefix cache serves the real run.
            relay(*engines, pull, [prompts[0][::-1]], f"{name}-warm", 2)
            got, nbytes, seconds = relay(*engines, pull, prompts, name, max_tokens)
    except ImportError as exc:  # grpcio / NIXL not installed (the bare GPU machine)
        return [Row(PART, f"{name}: tokens unchanged", SKIP, note=f"n/a: {last_line(exc)}")]
    equal = sum(a == b for a, b in zip(got, expected, strict=True))
    copy_gbps = ctx.shared.get("copy_gbps") or 0.0
    gbps = nbytes / seconds / 1e9 if seconds else 0.0
    share = f" = {100 * gbps / copy_gbps:.1f}% of {copy_gbps:.0f} GB/s copy" if copy_gbps else ""
    return [
        Row(
            PART,
            f"{name}: tokens unchanged",
            PASS if equal == len(expected) else FAIL,
            f"{equal}/{len(expected)} equal to colocated",
            "all",
        ),
        Row(
            PART,
            f"{name}: pull bandwidth",
            PASS,
            f"{gbps:.2f} GB/s{share}",
            note=f"{nbytes / 2**20:.0f} MiB in {seconds * 1e3:.0f} ms",
        ),
    ]


def run(ctx: Context, deadline: Deadline) -> list[Row]:
    if "copy_gbps" not in ctx.shared:  # part 2 did not get that far
        from gpu_parts.decode_bench import copy_bandwidth_gbps

        ctx.shared["copy_gbps"] = copy_bandwidth_gbps(
            ctx.device, (1 << 28) if ctx.cuda else 1 << 24
        )
    folder, hf = build_model(ctx, "smollm2-135m")
    vocab = hf.config.vocab_size
    lengths = [20, 33, 50] if ctx.small else [300, 1000, 2048, 4000]
    max_tokens = 6 if ctx.small else 16
    memory = "64MiB" if ctx.small else "4GiB"
    prompt_sets = {
        name: prompts_of(lengths, vocab, seed=40 + i) for i, name in enumerate(TRANSPORTS)
    }
    both = make_engine(
        ctx, folder, eager=False, max_num_seqs=16, kv_cache_memory=memory, max_model_len=4096 + 64
    )
    expected = {name: engine_generate(both, p, max_tokens) for name, p in prompt_sets.items()}
    del both
    free_device_memory()
    kwargs: dict[str, Any] = dict(
        eager=False, max_num_seqs=16, kv_cache_memory=memory, max_model_len=4096 + 64
    )
    engines = (
        make_engine(ctx, folder, role="prefill", **kwargs),
        make_engine(ctx, folder, role="decode", **kwargs),
    )
    rows = [
        Row(
            PART,
            "engines",
            PASS,
            f"{dtype_of(ctx)}, {engines[0].kv_tensor.device}",
            note=f"{engines[0].kv_block_bytes} bytes per KV block",
        )
    ]
    try:
        for name in TRANSPORTS:
            if deadline.expired():
                rows.append(Row(PART, f"{name}: tokens unchanged", SKIP, note="time budget"))
                continue
            try:
                rows += transport_rows(
                    ctx, name, engines, prompt_sets[name], expected[name], max_tokens
                )
            except Exception as exc:  # the next transport still runs
                rows.append(Row(PART, f"{name}: tokens unchanged", FAIL, note=last_line(exc)))
    finally:
        del engines
        free_device_memory()
    return rows
