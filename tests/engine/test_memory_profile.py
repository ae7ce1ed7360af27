"""`--gpu-memory-utilization`: the KV sizing arithmetic, the profiling step (run on the CPU
here: the same forward pass a GPU profiles), and the flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.kv_cache.layout import allocate_kv_cache
from kvrelay.engine.memory_profile import (
    MemoryProfile,
    kv_blocks_for_budget,
    kv_cache_budget,
    profile_batch,
    profile_blocks_needed,
    run_profile_step,
)
from kvrelay.models.loader import load_model
from kvrelay_kernels import select_backend

GIB = 2**30


def test_budget_is_utilization_of_total_minus_what_is_used() -> None:
    profile = MemoryProfile(total=80 * GIB, used_before=10 * GIB, peak_increase=2 * GIB)
    assert kv_cache_budget(profile, 0.9) == int(72 * GIB) - 12 * GIB
    assert kv_cache_budget(profile, 1.0) == 68 * GIB
    assert kv_cache_budget(profile, 1.0, reserved=GIB) == 67 * GIB  # the graphs' scratch
    # Another process already holds most of the GPU: nothing is left, never a negative size.
    crowded = MemoryProfile(total=80 * GIB, used_before=75 * GIB, peak_increase=GIB)
    assert kv_cache_budget(crowded, 0.9) == 0


def test_blocks_for_budget_and_the_error_that_says_what_to_do() -> None:
    block_bytes = 30 * 2 * 16 * 3 * 64 * 2  # the 135M model's bf16 block of 16 tokens
    assert kv_blocks_for_budget(900 * block_bytes + 5, block_bytes, 16, 2048, 0.9) == 900
    assert kv_blocks_for_budget(128 * block_bytes, block_bytes, 16, 2048, 0.9) == 128
    with pytest.raises(ValueError) as info:
        kv_blocks_for_budget(127 * block_bytes, block_bytes, 16, 2048, 0.5)
    message = str(info.value)
    assert "lower --max-model-len or raise --gpu-memory-utilization" in message
    assert "127 blocks" in message and "needs 128" in message and "0.5" in message


def test_profile_batch_fills_the_token_budget_with_whole_prefills() -> None:
    lens, tables = profile_batch(num_tokens=1000, max_model_len=384, block_size=16)
    assert lens == [384, 384, 232] and sum(lens) == 1000
    assert [len(t) for t in tables] == [24, 24, 15]
    flat = [b for t in tables for b in t]
    assert flat == list(range(len(flat)))  # distinct blocks, none shared
    assert profile_blocks_needed(1000, 384, 16) == 63
    assert profile_batch(5, 2048, 4) == ([5], [[0, 1]])


def test_profile_step_runs_the_biggest_step_on_the_cpu(tiny_llama_dir: Path) -> None:
    """The same pass a GPU profiles: a valid batch (slots inside the scratch cache), every
    token's K/V written, logits for max_num_seqs rows."""
    model, config = load_model(tiny_llama_dir, select_backend("torch"))
    tokens, max_len, block_size = 70, 32, 4
    cache = allocate_kv_cache(
        config, profile_blocks_needed(tokens, max_len, block_size), block_size, torch.float32
    )
    run_profile_step(model, cache, tokens, max_len, num_logit_rows=16)
    written = cache.abs().sum(dim=(1, 2, 4, 5)) != 0  # [blocks, block_size] token filled?
    assert int(written.sum()) == tokens


def test_flags_and_when_the_gpu_sizes_the_cache(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "--gpu-memory-utilization" in text and "--enforce-eager" in text
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert (args.gpu_memory_utilization, args.enforce_eager, args.kv_cache_memory) == (
        0.9,
        False,
        None,
    )
    assert args.sizes_kv_by_utilization("cuda") and args.sizes_kv_by_utilization("cuda:1")
    assert not args.sizes_kv_by_utilization("cpu")
    config = args.create_engine_config(tiny_llama_dir)
    if config.device == "cpu":
        assert config.cache.kv_cache_memory == 512 * 2**20  # today's CPU default
    assert config.enforce_eager is False
    given = EngineArgs.from_cli_args(
        parser.parse_args(["--kv-cache-memory", "1GiB", "--enforce-eager"])
    )
    assert not given.sizes_kv_by_utilization("cuda") and given.enforce_eager
    assert given.create_engine_config(tiny_llama_dir).enforce_eager is True
    assert not EngineArgs(num_blocks=10).sizes_kv_by_utilization("cuda")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=1.5).create_engine_config(tiny_llama_dir)
