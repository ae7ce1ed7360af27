"""csrc_cpu/blocked_matmul.cpp: dense matmuls on weights packed in blocks of 32 outputs, against
the fp64 matmul; `pack_blocks`' layout; `pack_blocks_together`'s one allocation; and
`blocked_ops_for`'s choice of the weights the kernel takes."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvrelay_kernels.cpu_blocked import (
    BLOCK,
    blocked_ops_for,
    load_blocked_ops,
    pack_blocks,
    pack_blocks_together,
    packed_numel,
)
from kvrelay_kernels.host_memory import in_one_allocation

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ops_for(name: str) -> ModuleType:
    ops = load_blocked_ops()
    assert ops is not None, "the CPU kernels did not build (is a C++ compiler there?)"
    if not ops.supports(name):
        pytest.skip(f"this build has no blocked kernel for {name} (no AVX-512 / AVX512-BF16)")
    return ops


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + bias.double() if bias is not None else out


def assert_matches(got: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    # fp32 sums in k order (about sqrt(k) roundings of 2^-24 of the sum's terms), then one
    # rounding to the output's dtype.
    rounding = 2**-8 if got.dtype == torch.bfloat16 else 2**-20
    torch.testing.assert_close(got.double(), expected, rtol=rounding, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("name", DTYPES)
# 1-4: two sets of sums; 5-12: one pass; 13, 16, 25, 40: equal passes of at most 12
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 16, 25, 40])
@pytest.mark.parametrize("n", [1, 17, 32, 100])  # a block's tails: under 16, over 16, whole
@pytest.mark.parametrize("k", [2, 6, 64, 578])  # odd step counts leave one step after pairs
def test_the_kernel_matches_the_fp64_matmul(name: str, rows: int, n: int, k: int) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    gen = torch.Generator().manual_seed(rows * 10000 + n * 100 + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    blocks = pack_blocks(w)
    for b in (None, bias):
        got = ops.blocked_matmul(x, blocks, n, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert_matches(got, reference(x, w, b), k)


def test_an_odd_in_features_runs_in_fp32() -> None:
    ops = ops_for("float32")
    x, w = torch.randn(3, 7), torch.randn(5, 7)
    assert_matches(ops.blocked_matmul(x, pack_blocks(w), 5, None), reference(x, w, None), 7)


@pytest.mark.parametrize("name", DTYPES)
def test_no_rows_give_an_empty_result(name: str) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    w = torch.randn(40, 64).to(dtype)
    out = ops.blocked_matmul(torch.empty(0, 64, dtype=dtype), pack_blocks(w), 40, None)
    assert out.shape == (0, 40)


@pytest.mark.parametrize("name", DTYPES)
def test_a_strided_input_is_read_as_its_values(name: str) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    x = torch.randn(64, 3).to(dtype).t()  # [3, 64], not contiguous
    blocks = pack_blocks(torch.randn(10, 64).to(dtype))
    strided = ops.blocked_matmul(x, blocks, 10, None)
    assert torch.equal(strided, ops.blocked_matmul(x.contiguous(), blocks, 10, None))


@pytest.mark.parametrize("name", DTYPES)
def test_bad_arguments_are_refused(name: str) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    x = torch.randn(1, 64).to(dtype)
    blocks = pack_blocks(torch.randn(40, 64).to(dtype))
    with pytest.raises(RuntimeError, match="blocks of 73 outputs"):
        ops.blocked_matmul(x, blocks, 41 + BLOCK, None)  # more outputs than the blocks hold
    with pytest.raises(RuntimeError, match="blocks of"):
        ops.blocked_matmul(torch.randn(1, 66).to(dtype), blocks, 40, None)  # another k
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.blocked_matmul(x, blocks.half(), 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.blocked_matmul(x, blocks, 40, torch.ones(39))
    with pytest.raises(RuntimeError, match="bias"):
        ops.blocked_matmul(x, blocks, 40, torch.ones(40, dtype=torch.float64))


def test_bf16_needs_an_even_in_features() -> None:
    ops = ops_for("bfloat16")
    w = torch.randn(4, 7).bfloat16()
    blocks = torch.zeros(packed_numel(w), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="even k"):
        ops.blocked_matmul(torch.randn(1, 7).bfloat16(), blocks, 4, None)


def test_the_bf16_layout_pairs_two_k_of_32_outputs() -> None:
    w = torch.arange(40 * 4, dtype=torch.float32).reshape(40, 4).bfloat16()
    blocks = pack_blocks(w).reshape(2, 2, BLOCK, 2)  # [blocks][k / 2][32][2]
    assert torch.equal(blocks[0, 1, 5], w[5, 2:4])  # output 5, k 2 and 3
    assert torch.equal(blocks[1, 0, 7], w[39, 0:2])  # the second block's 8th output
    assert torch.count_nonzero(blocks[1, :, 8:]) == 0  # padded outputs are zeros


def test_the_fp32_layout_puts_each_k_of_32_outputs_side_by_side() -> None:
    w = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    blocks = pack_blocks(w).reshape(2, 3, BLOCK)  # [blocks][k][32]
    assert torch.equal(blocks[0, 2, :], w[:BLOCK, 2])
    assert torch.equal(blocks[1, 1, :8], w[BLOCK:, 1])
    assert torch.count_nonzero(blocks[1, :, 8:]) == 0


def test_packing_into_a_given_place_writes_there_and_checks_its_size() -> None:
    w = torch.randn(40, 6)
    place = torch.empty(packed_numel(w))
    assert pack_blocks(w, out=place) is place
    assert torch.equal(place, pack_blocks(w))
    with pytest.raises(ValueError, match="must hold"):
        pack_blocks(w, out=torch.empty(packed_numel(w) - 1))


def test_packed_together_the_weights_share_one_allocation_in_order() -> None:
    ops = ops_for("float32")
    weights = [torch.randn(40, 64), torch.randn(8, 64, dtype=torch.float64), torch.randn(3, 16)]
    together = pack_blocks_together(weights)
    assert together[1] is None  # no fp64 kernel: that weight is left to oneDNN / torch
    first, last = together[0], together[2]
    assert first is not None and last is not None
    assert in_one_allocation([first, last])
    assert first.data_ptr() % 64 == 0 and last.data_ptr() % 64 == 0
    assert last.data_ptr() > first.data_ptr()
    for weight, packed in ((weights[0], first), (weights[2], last)):
        assert torch.equal(packed, pack_blocks(weight))
        x = torch.randn(2, weight.shape[1])
        out = ops.blocked_matmul(x, packed, weight.shape[0], None)
        assert_matches(out, reference(x, weight, None), weight.shape[1])


def test_blocked_ops_for_takes_only_what_the_kernel_runs() -> None:
    ops = load_blocked_ops()
    assert ops is not None
    fp32 = torch.randn(8, 64)
    assert (blocked_ops_for(fp32) is not None) == ops.supports("float32")
    assert (blocked_ops_for(fp32.bfloat16()) is not None) == ops.supports("bfloat16")
    assert blocked_ops_for(fp32.half()) is None  # no fp16 kernel
    assert blocked_ops_for(torch.randn(8, 7).bfloat16()) is None  # bf16 pairs need an even k
    assert blocked_ops_for(torch.randn(8, 64, device="meta")) is None
    assert blocked_ops_for(torch.randn(2, 8, 64)) is None
    assert not ops.supports("float16")
