"""CUDA graphs for decode steps (issue 14): one graph per padded batch size, captured once,
replayed by every pure decode step that fits; everything else runs eagerly.

An eager decode step of the 135M model launches ~1,100 kernels; a replay launches one graph
after a handful of copies into its static inputs (graph_padding.py). The split-K partition
count of each graph is fixed at capture for contexts up to max_model_len, and its scratch is
one preallocated workspace shared by every layer and graph (they run one after another on one
stream). Only on CUDA with the CUDA decode kernel: CPU and meta never capture.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvrelay.config import ModelConfig
from kvrelay.engine.graph_padding import (
    StaticDecodeInputs,
    capture_sizes,
    padded_size,
    replays,
)
from kvrelay.models.inputs import AttentionInputs
from kvrelay_kernels import cuda_backend
from kvrelay_kernels.counters import COUNTERS

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode graphs of one model over one KV tensor."""

    def __init__(
        self,
        model: Any,  # runner.CausalLMModel (not imported: runner imports this module)
        kv_cache: torch.Tensor,
        max_num_seqs: int,
        max_blocks: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.static = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks, kv_cache.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._decode_calls: dict[int, int] = {}  # decode-kernel launches inside each graph
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # (size, n) -> output's n rows
        self._workspace = self._allocate_workspace()

    @staticmethod
    def supported(model: Any, kv_cache: torch.Tensor) -> str | None:
        """Why graphs cannot be used for this model and cache (None: they can)."""
        if kv_cache.device.type != "cuda":
            return f"the KV cache is on {kv_cache.device}"
        if getattr(model.backend, "name", None) != "cuda":
            return f"attention backend {model.backend.name!r} (graphs need 'cuda')"
        if not cuda_backend.decode_kernel_runs(kv_cache, model.config.num_attention_heads):
            return "no compiled CUDA decode kernel for this head size, dtype or block size"
        return None

    @staticmethod
    def workspace_bytes(config: ModelConfig, max_num_seqs: int, max_model_len: int) -> int:
        """Bytes of the split-K scratch the graphs share (the largest batch, the most
        partitions): memory the KV sizing must leave free."""
        numel = cuda_backend.split_workspace_numel(
            capture_sizes(max_num_seqs)[-1],
            config.num_attention_heads,
            config.head_dim,
            cuda_backend.max_partitions(max_model_len),
        )
        return numel * 4

    def _allocate_workspace(self) -> torch.Tensor:
        nbytes = self.workspace_bytes(self.model.config, self.sizes[-1], self.max_model_len)
        return torch.empty(nbytes // 4, dtype=torch.float32, device=self.kv_cache.device)

    def _attention(self, size: int) -> AttentionInputs:
        config = self.model.config
        partitions = cuda_backend.graph_partitions(
            self.max_model_len,
            size,
            config.num_key_value_heads,
            config.num_attention_heads // config.num_key_value_heads,
            self.kv_cache.device,
        )
        s = self.static
        plan = s.plan(size, self.max_model_len, partitions, self._workspace)
        return AttentionInputs(
            s.slot_mapping[:size],
            s.block_tables[:size],
            s.seq_lens[:size],
            s.query_start_loc[: size + 1],
            plan,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool). The
        static inputs hold padding only: slot -1, so capturing writes nothing to the cache."""
        with torch.cuda.device(self.kv_cache.device):  # cuda:N: capture on N's streams
            self._capture_all()

    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            attn = self._attention(size)
            args = (self.static.input_ids[:size], self.static.positions[:size])
            self.model(*args, self.kv_cache, attn)  # warm-up: lazy inits happen outside
            torch.cuda.synchronize(self.kv_cache.device)
            before = COUNTERS.cuda_decode_calls
            graph = torch.cuda.CUDAGraph()
            # thread_local: a worker's other threads (KV transfers) may use CUDA meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                hidden = self.model(*args, self.kv_cache, attn)
            # Capture records launches without running them: count them at each replay.
            self._decode_calls[size] = COUNTERS.cuda_decode_calls - before
            COUNTERS.cuda_decode_calls = before
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
            COUNTERS.graph_captures += 1
        torch.cuda.synchronize(self.kv_cache.device)
        logger.info(
            "captured %d CUDA graphs for decode batches %s in %.1f s",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - start,
        )

    def size_for(self, attn: AttentionInputs, num_tokens: int) -> int | None:
        """The captured size this step replays, or None (run it eagerly)."""
        size = replays(attn.plan, num_tokens, self.sizes)
        return size if size in self._graphs else None

    def decode_size(self, num_seqs: int) -> int | None:
        """The captured size a pure decode step of `num_seqs` sequences replays, or None."""
        size = padded_size(num_seqs, self.sizes)
        return size if size in self._graphs else None

    def run(
        self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs
    ) -> torch.Tensor:
        """Replay the graph of `size` on this step's inputs; returns the hidden states of the
        step's own rows (a view of the graph's output, valid until the next replay)."""
        return self.replay(
            size, input_ids, positions, attn.slot_mapping, attn.seq_lens, attn.block_tables
        )

    def replay(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """`run` from the decode inputs themselves (no plan: a pure decode step built from
        the runner's persistent batch); `size` from `decode_size`."""
        self.static.load(size, input_ids, positions, slot_mapping, seq_lens, block_tables)
        graph, hidden = self._graphs[size]
        graph.replay()
        COUNTERS.graph_replays += 1
        COUNTERS.cuda_decode_calls += self._decode_calls[size]
        n = input_ids.shape[0]
        if n == size:
            return hidden  # no slice: a slice is a device op (~5 us of host time)
        rows = self._rows.get((size, n))
        if rows is None:  # one per (size, n): the graph's output tensor never changes
            rows = self._rows[(size, n)] = hidden[:n]
        return rows
