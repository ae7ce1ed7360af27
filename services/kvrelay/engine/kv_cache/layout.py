"""The worker's KV tensor: one block-major allocation (docs/architecture.md section 3).

`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`: one block is one contiguous
region across all layers, so moving n blocks to another worker is at most n copies.
"""

from __future__ import annotations

import torch

from kvrelay.config import ModelConfig
from kvrelay_kernels.host_memory import huge_page_empty


def kv_block_shape(model: ModelConfig, block_size: int) -> tuple[int, ...]:
    """Shape of one block: `[num_layers, 2, block_size, num_kv_heads, head_dim]`."""
    return (model.num_hidden_layers, 2, block_size, model.num_key_value_heads, model.head_dim)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    count = 1
    for size in kv_block_shape(model, block_size):
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    model: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A zeroed KV tensor of `num_blocks` blocks on `device`; on the CPU on 2 MiB pages where
    Linux has them (a decode step's attention reads a few KiB of each of its blocks, all
    over the cache: a TLB miss per block on 4 KiB pages)."""
    shape = (num_blocks, *kv_block_shape(model, block_size))
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = num_blocks * kv_block_bytes(model, block_size, dtype)
    return huge_page_empty(nbytes).view(dtype).view(shape).zero_()
