"""How often each fast path ran: counters a GPU check prints to prove the CUDA decode kernel,
the Triton prefill kernel and CUDA graphs were really used (not silently a fallback).

One process-wide `COUNTERS`; kernels count once per launch from Python (a captured CUDA
graph counts its kernels at capture, its replays in `graph_replays`). Plain int increments:
nothing here touches a device or takes a lock (a lost increment under threads is harmless).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class KernelCounters:
    """Launch and step counts since the process started (or the last `reset`)."""

    cuda_decode_calls: int = 0  # CUDA decode-attention launches (one per layer per step)
    triton_prefill_calls: int = 0  # Triton varlen launches for prefill rows (idem)
    # Triton launches for decode rows, where the decode dispatch chose it (decode_dispatch.py;
    # a graph's count at its capture, not at its replays)
    triton_decode_calls: int = 0
    graph_replays: int = 0  # engine steps run by replaying a captured CUDA graph
    graph_captures: int = 0  # CUDA graphs captured (one per padded batch size)
    eager_steps: int = 0  # engine forward passes run eagerly (prefill, mixed, no graph)
    jit_compiles: int = 0  # Triton kernel variants compiled in this process (jit_watch.py)
    # ... of which after the engine said it was ready: each one stalls a serving step (the
    # warm-up must reach every variant the engine can launch); 0 is the only right value.
    jit_compiles_after_ready: int = 0

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


COUNTERS = KernelCounters()
