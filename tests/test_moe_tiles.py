"""The expert tile scheme (custom_ops/triton/moe_tiles.py) under the Triton interpreter: the
grouping kernel (a program per 128 pairs, one for the tile table) gives the torch path's order
and tile table exactly, and the
reduction sums each token's slots in ascending expert id, padding slots skipped.

As in test_kernels_cpu.py, unless this process runs with TRITON_INTERPRET=1 the module reruns
itself in a subprocess with it set, programs in order and reversed.
"""
from __future__ import annotations

import os

import pytest

from tests.kernel_cases import run_under_interpreter

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") != "1":
    @pytest.mark.parametrize("order", ["forward", "reversed"])
    def test_moe_tiles_under_triton_interpreter(order):
        run_under_interpreter(__file__, order, timeout=600)

else:
    import torch

    from tests import program_order
    program_order.apply()

    from custom_ops.triton import moe_tiles

    def routing(seed: int, T: int, k: int, E: int) -> torch.Tensor:
        """ids [T, k]: k distinct experts a token, a fifth of the slots padding, token 0 all padding."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
        ids[torch.rand(T, k, generator=g) < 0.2] = -1
        ids[0] = -1
        return ids

    @pytest.mark.parametrize("T,k,E,block_m", [(1, 6, 384, 16), (5, 3, 7, 16), (64, 6, 384, 16),
                                               (40, 2, 6, 32), (3, 2, 300, 64), (170, 6, 16, 16)])
    def test_fused_grouping_equals_the_torch_ops(T, k, E, block_m):
        """The kernel's (order, meta) are the stable sort's and the searchsorted tile table's,
        bit for bit, dead tiles included (also past FUSED_PAIRS, where the op uses the torch ops)."""
        ids = routing(T * E + k, T, k, E)
        fused = moe_tiles.expert_tiles(ids, E, block_m, fused=True)
        ops = moe_tiles.expert_tiles(ids, E, block_m, fused=False)
        assert fused[2] == ops[2] == -(-ids.numel() // block_m) + min(E, ids.numel())
        assert torch.equal(fused[0], ops[0]) and torch.equal(fused[1], ops[1])
        if T == 1:
            assert torch.equal(fused[0], torch.sort(torch.where(ids[0] < 0, E, ids[0]), stable=True).indices.int())

    @pytest.mark.parametrize("T,k", [(1, 6), (9, 3), (4, 8)])
    def test_reduce_pairs_sums_in_expert_order(T, k):
        """out[t] = Σ y over t's valid slots taken in ascending expert id, in FP32 from 0: equal to
        that loop in torch, bitwise; padding slots' rows (NaN here) are never read."""
        E, D = 11, 40
        ids = routing(T + k, T, k, E)
        y = torch.randn(T * k, D, generator=torch.Generator().manual_seed(T)) * 1e3
        y[(ids.reshape(-1) < 0)] = float("nan")
        out = torch.full((T, D), float("nan"))
        moe_tiles.reduce_pairs(y, ids, E, out)
        want = torch.zeros(T, D)
        for t in range(T):
            for slot in sorted((s for s in range(k) if ids[t, s] >= 0), key=lambda s: (int(ids[t, s]), s)):
                want[t] += y[t * k + slot]
        assert torch.equal(out, want)
