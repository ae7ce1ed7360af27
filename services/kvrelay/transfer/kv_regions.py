"""Checks and byte views of a block-major KV tensor, shared by the connectors (no transport)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.messages import PullPlan
from kvrelay.transfer.base import TransferError

KV_TENSOR_DIMS = 6  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]


def check_kv_tensor(kv_tensor: torch.Tensor) -> None:
    """Raise ValueError unless `kv_tensor` is a contiguous block-major KV tensor."""
    if kv_tensor.dim() != KV_TENSOR_DIMS:
        raise ValueError(
            f"expected a block-major KV tensor [num_blocks, num_layers, 2, block_size, "
            f"num_kv_heads, head_dim], got shape {tuple(kv_tensor.shape)}"
        )
    if not kv_tensor.is_contiguous():
        raise ValueError("the KV tensor must be contiguous: register the engine's own tensor")
    if kv_tensor.shape[0] == 0:
        raise ValueError("the KV tensor has no blocks")


def block_bytes(kv_tensor: torch.Tensor) -> int:
    """Bytes of one block (all layers, K and V)."""
    return kv_tensor[0].numel() * kv_tensor.element_size()


def block_byte_rows(kv_tensor: torch.Tensor) -> torch.Tensor:
    """`kv_tensor` as `[num_blocks, block_bytes]` uint8, sharing its memory."""
    return kv_tensor.view(-1).view(torch.uint8).view(kv_tensor.shape[0], -1)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> None:
    """Raise TransferError when an id is outside `[0, num_blocks)` (`side`: for the message)."""
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise TransferError(
            f"{side} block ids {bad[:8]} are outside [0, {num_blocks}): the plan does not "
            "match that KV tensor; recompute the prompt instead"
        )


def check_plan(plan: PullPlan, remote_blocks: int, local_blocks: int) -> None:
    """Both sides' ids in range and paired one to one, or TransferError."""
    if len(plan.remote_block_ids) != len(plan.local_block_ids):
        raise TransferError(
            f"pull plan {plan.request_id!r} pairs {len(plan.remote_block_ids)} remote blocks "
            f"with {len(plan.local_block_ids)} local ones; build it with add_prefilled_request"
        )
    check_block_ids(plan.remote_block_ids, remote_blocks, "remote")
    check_block_ids(plan.local_block_ids, local_blocks, "local")
