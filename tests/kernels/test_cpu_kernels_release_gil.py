"""kvrelay's CPU kernels run without the GIL, as torch's own ops do: while the engine thread is
inside one, a worker's other Python threads (Ray's output reporting, the KV transfer server's
handlers, the actor's event loop) run.

How it is seen: a watcher thread is released just before a long kernel call and then needs
only the GIL to record whether the call is still running. The switch interval is raised so far
that the caller is never made to drop the GIL between its bytecodes: the watcher gets it while
the kernel runs only if the kernel let go of it, and otherwise after the call, when the caller
blocks in join()."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from kvrelay.models.gguf_blocks import GgufBlocks
from kvrelay.models.quantized import int8_panels
from kvrelay_kernels.cpu_backend import load_extension
from kvrelay_kernels.cpu_blocked import load_blocked_ops, pack_blocks
from kvrelay_kernels.cpu_fused import load_fused_ops
from kvrelay_kernels.cpu_prefill import load_extension as load_prefill_extension
from kvrelay_kernels.cpu_quantized import load_block_quant_ops, load_int8_dot_ops


def ran_while_in_kernel(call: Callable[[], object]) -> bool:
    """Whether another Python thread ran while `call` (one long kernel call) was running."""
    running = [False]
    seen: list[bool] = []
    gate = threading.Lock()
    gate.acquire()

    def watcher() -> None:
        with gate:  # blocked without the GIL until the caller opens the gate
            pass
        seen.append(running[0])  # needs the GIL: runs once the caller lets go of it

    thread = threading.Thread(target=watcher)
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        running[0] = True
        gate.release()
        # The result is kept until the flag is down: freeing a large tensor lets go of the
        # GIL (torch does so), which would let the watcher in after the call.
        result = call()
        running[0] = False
        del result
    finally:
        sys.setswitchinterval(interval)
    thread.join()
    return seen == [True]


def test_the_watcher_sees_a_call_that_keeps_the_gil() -> None:
    """The check itself: a pure-Python busy loop (never lets go of the GIL) reads False."""

    def busy() -> int:
        total = 0
        for i in range(3_000_000):
            total += i
        return total

    assert not ran_while_in_kernel(busy)


def _q8_0(out: int, inp: int) -> GgufBlocks:
    """A random Q8_0 weight (codes and scales; their values do not matter here)."""
    codes = torch.randint(-127, 128, (out, inp), dtype=torch.int8)
    return GgufBlocks(codes, torch.rand(out, inp // 32) * 0.01, None)


def _loaded(module: ModuleType | None) -> ModuleType:
    assert module is not None, "a CPU kernel did not build (is a C++ compiler there?)"
    return module


def test_fused_layer_ops_release_the_gil() -> None:
    ops = _loaded(load_fused_ops())
    x, weight = torch.randn(8192, 4096), torch.ones(4096)
    assert ran_while_in_kernel(lambda: ops.rms_norm(x, weight, 1e-5))


def test_decode_attention_releases_the_gil() -> None:
    ops = _loaded(load_extension())
    seqs, context, block_size, kv_heads, heads, dim = 32, 1024, 16, 2, 32, 64
    blocks = seqs * context // block_size
    cache = torch.randn(blocks, 1, 2, block_size, kv_heads, dim)
    tables = torch.arange(blocks, dtype=torch.int64).view(seqs, -1)
    lens = torch.full((seqs,), context, dtype=torch.int64)
    q = torch.randn(seqs, heads, dim)

    def attend() -> object:
        return ops.paged_decode_attention(q, cache, 0, tables, lens, 0.125)

    assert ran_while_in_kernel(attend)


def test_prefill_attention_releases_the_gil() -> None:
    ops = _loaded(load_prefill_extension())
    rows, block_size, kv_heads, heads, dim = 1024, 16, 2, 8, 64
    cache = torch.randn(rows // block_size, 1, 2, block_size, kv_heads, dim)
    tables = torch.arange(rows // block_size, dtype=torch.int64).view(1, -1)
    q, out = torch.randn(rows, heads, dim), torch.empty(rows, heads, dim)
    chunks = torch.tensor([[0, rows, rows]])

    def attend() -> object:
        ops.paged_prefill_attention(q, cache, 0, chunks, tables, 0.125, 0, 0.0, out)
        return out

    assert ran_while_in_kernel(attend)


def test_block_quant_matmul_releases_the_gil() -> None:
    ops = _loaded(load_block_quant_ops())
    weight, x = _q8_0(2048, 2048), torch.randn(256, 2048)

    def matmul() -> object:
        return ops.q8_0_matmul(x, weight.codes, weight.d, None)

    assert ran_while_in_kernel(matmul)


def test_int8_matmul_releases_the_gil() -> None:
    ops = _loaded(load_int8_dot_ops())
    panels, x = int8_panels(_q8_0(2048, 2048)), torch.randn(1024, 2048)

    def matmul() -> object:
        return ops.q8_0_int8_matmul(x, panels.codes, panels.d, None)

    assert ran_while_in_kernel(matmul)


def test_blocked_matmul_releases_the_gil() -> None:
    ops = _loaded(load_blocked_ops())
    if not ops.supports("float32"):
        pytest.skip("this CPU has no AVX-512: the blocked kernel is not built for fp32")
    weight, x = torch.randn(16384, 2048), torch.randn(4, 2048)
    blocks = pack_blocks(weight)

    def matmul() -> object:
        return ops.blocked_matmul(x, blocks, 16384, None)

    assert ran_while_in_kernel(matmul)
