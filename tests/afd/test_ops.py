# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The afd op library (vllm/afd/_C): CPU gather/scatter kernels."""

import pytest
import torch

from vllm.afd.kernels import ops


@pytest.fixture(autouse=True, scope="module")
def library():
    """torch.ops.afd.* exist once the library is loaded; every test here may
    run first (found by --reverse-order: two tests relied on an earlier one
    having called ops.load())."""
    ops.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_scatter_match_torch(dtype, index_dtype):
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(70, 3, 40, generator=g) * 10).to(dtype)
    index = torch.randperm(70, generator=g)[:50].to(index_dtype)
    out = ops.gather_rows(src, index)
    assert torch.equal(out, src.index_select(0, index.long()))

    dst = torch.zeros_like(src)
    ops.scatter_rows(out, index, dst)
    expected = torch.zeros_like(src).index_copy_(0, index.long(), out)
    assert torch.equal(dst, expected)


def test_gather_with_repeats_and_empty():
    src = torch.arange(12.0).reshape(4, 3)
    idx = torch.tensor([3, 3, 0])
    assert torch.equal(ops.gather_rows(src, idx), src[[3, 3, 0]])
    empty = ops.gather_rows(src, torch.empty(0, dtype=torch.long))
    assert empty.shape == (0, 3)


def test_errors_are_clear_and_write_nothing():
    src = torch.ones(4, 8)
    out = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match=r"index\[1\] = 4 is out of range for 4 rows"):
        torch.ops.afd.gather_rows(src, torch.tensor([0, 4]), out)
    assert torch.count_nonzero(out) == 0  # checked before any row moved
    with pytest.raises(RuntimeError, match=r"index\[1\] = 2 repeats"):
        torch.ops.afd.scatter_rows(torch.ones(2, 8), torch.tensor([2, 2]), torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        torch.ops.afd.gather_rows(src, torch.tensor([0, 1]), torch.zeros(2, 8).half())
    with pytest.raises(RuntimeError, match="rows differ in shape"):
        torch.ops.afd.gather_rows(src, torch.tensor([0, 1]), torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="index has 3 entries for 2 rows"):
        torch.ops.afd.gather_rows(src, torch.tensor([0, 1, 2]), out)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.afd.gather_rows(torch.ones(8, 4).t(), torch.tensor([0, 1]), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="index must be int64 or int32"):
        torch.ops.afd.gather_rows(src, torch.tensor([0.0, 1.0]), out)


def test_ops_compile_as_opaque_calls():
    def pack(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(idx.numel(), x.shape[1], dtype=x.dtype)
        torch.ops.afd.gather_rows(x * 2, idx, buf)
        return buf + 1

    x = torch.randn(16, 32)
    idx = torch.tensor([5, 1, 9])
    compiled = torch.compile(pack, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, idx), pack(x, idx))
