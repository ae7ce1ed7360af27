"""An attacker on the worker's host, run as its own process by test_kv_security.py: it has the
public code and protocol, a port it found with `ss`, maybe ids it guessed or overheard, and no
platform object. It prints what it got as JSON.

    python -m tests.transfer.attacker grpc '{"address": ..., "attempts": [...]}'
    python -m tests.transfer.attacker nixl '{"agent_name": ..., "ports": [...], ...}'
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any


def grpc_attempts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each attempt: a raw PullBlocks; a `secret` (hex) signs it with that key, else no proof."""
    import grpc

    from kvrelay.transfer.kv_secret import KVSecret
    from kvrelay.v1 import kv_transfer_pb2 as pb
    from kvrelay.v1 import kv_transfer_pb2_grpc as pb_grpc

    stub = pb_grpc.KVTransferStub(grpc.insecure_channel(spec["address"]))
    results = []
    for attempt in spec["attempts"]:
        fields = {k: v for k, v in attempt.items() if k != "secret"}
        request = pb.PullBlocksRequest(**fields)
        if attempt.get("secret"):
            request.proof = KVSecret(bytes.fromhex(attempt["secret"])).pull_proof(
                request.engine_id,
                request.epoch,
                request.handle_id,
                request.requester_engine_id,
                list(request.block_ids),
                request.block_bytes,
            )
        received, code, details = 0, "OK", ""
        try:
            for chunk in stub.PullBlocks(request, timeout=5):
                received += len(chunk.data)
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        results.append({"code": code, "details": details, "bytes": received})
    return results


def nixl_attempts(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh NIXL agent asks for the victim's metadata on every port it found, then tries a
    READ of the victim's memory by name (it knows the name and address: the worst case)."""
    import torch

    from kvrelay.transfer.nixl_api import load_nixl_api

    api = load_nixl_api()
    config = api.nixl_agent_config(enable_listen_thread=True, listen_port=0)
    agent = api.nixl_agent("mallory", config)
    name = spec["agent_name"]
    for port in [api.DEFAULT_COMM_PORT, *spec["ports"]]:
        with contextlib.suppress(Exception):  # a refused connection is an answer too
            agent.fetch_remote_metadata(name, "127.0.0.1", port)
    time.sleep(1.0)
    got_metadata = agent.check_remote_metadata(name)
    dst = torch.zeros(spec["num_bytes"], dtype=torch.uint8)
    agent.register_memory([(dst.data_ptr(), dst.numel(), 0, "")], "DRAM")
    read_error = ""
    try:
        local = agent.get_xfer_descs([(dst.data_ptr(), dst.numel(), 0)], "DRAM")
        remote = agent.get_xfer_descs([(spec["base_address"], dst.numel(), 0)], "DRAM")
        xfer = agent.initialize_xfer("READ", local, remote, name)
        state = agent.transfer(xfer)
        for _ in range(100):
            if state != "PROC":
                break
            time.sleep(0.01)
            state = agent.check_xfer_state(xfer)
        read_error = "" if state == "DONE" else f"state {state}"
    except Exception as exc:
        read_error = repr(exc)
    return {
        "metadata": bool(got_metadata),
        "read_error": read_error,
        "bytes": int(dst.count_nonzero()),
    }


if __name__ == "__main__":
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    answer = grpc_attempts(spec) if mode == "grpc" else nixl_attempts(spec)
    print(json.dumps(answer))
