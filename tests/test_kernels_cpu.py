"""The Triton impls (custom_ops/triton) against the reference impls, on the CPU under the Triton
interpreter: fp32, tiny shapes, fresh random inputs and metadata every run (seed printed on
failure; V41_TEST_SEED pins one), outputs poisoned first so every element must be written.

TRITON_INTERPRET must be set before triton is first imported in a process (triton's own
library functions are decorated at import), and setting it would change triton for every other
test of the session. So unless this process was started with TRITON_INTERPRET=1, the module
only defines one test, which reruns this file in a subprocess with it set, once with the
grid's programs in order and once reversed (tests/program_order.py).
"""
from __future__ import annotations

import pytest

from tests.kernel_cases import INTERPRETED, interpreter_reruns

pytest.importorskip("triton")

if not INTERPRETED:
    test_kernels_under_triton_interpreter = interpreter_reruns(__file__, timeout=600)

else:
    import torch

    from tests import program_order
    program_order.apply()

    import custom_ops  # noqa: F401
    from custom_ops import attention as ref_attn
    from custom_ops import cache as ref_cache
    from custom_ops import compressor as ref_comp
    from custom_ops import index as ref_index
    from custom_ops import registry
    from custom_ops.triton import (triton_compress_pool, triton_index_topk, triton_scatter_rows,
                                   triton_sparse_attn)
    from tests.kernel_cases import (flash_width_case, index_plane, make_step, random_candidates,
                                    random_topk, rel, rne_bf16_casts)
    from v41 import quant

    # ---- sparse_attn -----------------------------------------------------------------------
    def test_sparse_attn_split_choice(monkeypatch):
        """On 132 SMs: one wave of token x split programs (H200: T=64 2 splits 82 us, 3 splits
        102 us), never more splits than key blocks, none once the tokens fill the SMs."""
        from custom_ops.triton import attention, common
        monkeypatch.setattr(common, "num_sms", lambda device: 132)
        cpu = torch.device("cpu")
        assert [attention.split_for(t, 1, 20, cpu) for t in (1, 16, 64, 132, 4096)] == [20, 8, 2, 1, 1]
        assert attention.split_for(64, 1, 20, cpu, split_k=5) == 5
        assert attention.split_for(1, 1, 1, cpu) == 1

    def test_inv_rope_wo_a_split_choice(monkeypatch):
        """Flash's wo_a (8 groups, R = 1024, I = 4096: 64 K steps) on 132 SMs: about four waves
        of programs while the output tiles leave SMs idle (128 tiles at T <= 16: 4 splits; 64
        at T = 64: 8), fewer where the FP32 partials would outweigh half the weight, none once
        the tiles fill the SMs."""
        from custom_ops.triton import attn_out
        monkeypatch.setattr(attn_out, "num_sms", lambda device: 132)
        cpu = torch.device("cpu")
        assert [attn_out.split_for(128, 64, t, 4096, cpu) for t in (1, 6, 16)] == [4, 4, 4]
        assert attn_out.split_for(64, 64, 64, 4096, cpu) == 8
        assert attn_out.split_for(64, 64, 128, 4096, cpu) == 4          # partials: 4096 // (8 * 128)
        assert attn_out.split_for(64, 8, 1, 512, cpu) == 2              # 4 K steps a split at least
        assert attn_out.split_for(132, 64, 1, 4096, cpu) == attn_out.split_for(2048, 64, 4096, 4096, cpu) == 1

    @pytest.mark.parametrize("ratio", [0, 1, 2])
    @pytest.mark.parametrize("split_k,qk_split,block_h", [(1, 1, None), (3, 1, 16), (None, 2, 16)])
    def test_sparse_attn(g, ratio, split_k, qk_split, block_h):
        W, H, d, K, page = 8, 20, 40, 6, 8
        step = make_step(g, n_req=3, max_new=5, max_start=20, W=W, page=page, n_slots=5,
                         pad_tokens=2, pad_reqs=1)
        T = step.T
        q = torch.randn(T, H, d, generator=g)
        kv = torch.randn(T, d, generator=g)
        ring = torch.randn(step.n_ring, d, generator=g)
        sink = torch.randn(H, generator=g)
        scale = d ** -0.5
        if ratio:
            rpp = page // ratio
            pool = torch.randn(step.num_pages * rpp, d, generator=g)
            topk = random_topk(g, step, ratio, K)
        else:
            rpp, pool, topk = 1, None, None
        args = (q, kv, ring, step.win_idx, pool, topk, step.block_table, step.batch_ids,
                max(ratio, 1), rpp, sink, scale)
        ref = torch.empty(T, H, d)
        ref_attn.sparse_attn(*args, ref)
        out = torch.full((T, H, d), float("nan"))
        triton_sparse_attn(*args, out, split_k=split_k, block_n=4, qk_split=qk_split, block_h=block_h)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-5
        assert (out[step.batch_ids < 0] == 0).all()       # padding rows: no valid row -> 0

    def test_sparse_attn_no_window_rows_decode(g):
        """Decode rows whose window is all -1 except themselves and whose top-k is mostly -1."""
        W, H, d, K, page = 8, 16, 32, 8, 8
        step = make_step(g, n_req=4, max_new=1, max_start=3, W=W, page=page, n_slots=4, decode=True,
                         pad_tokens=1)
        T = step.T
        q, kv = torch.randn(T, H, d, generator=g), torch.randn(T, d, generator=g)
        ring, sink = torch.randn(step.n_ring, d, generator=g), torch.randn(H, generator=g)
        pool = torch.randn(step.num_pages * page, d, generator=g)
        topk = random_topk(g, step, 1, K, holes=0.5)
        args = (q, kv, ring, step.win_idx, pool, topk, step.block_table, step.batch_ids, 1, page,
                sink, d ** -0.5)
        ref = torch.empty(T, H, d)
        ref_attn.sparse_attn(*args, ref)
        for sk, qs in ((1, 1), (4, 2)):
            out = torch.full((T, H, d), float("nan"))
            triton_sparse_attn(*args, out, split_k=sk, block_n=4, qk_split=qs)
            assert rel(out, ref) < 1e-5

    def test_sparse_attn_bf16_flash_width(g, monkeypatch):
        """bf16 at Flash list widths (128 window + 512 selected rows, d 512, sink), against the
        reference's online softmax over 64-row blocks. The kernel's blocks are BLOCK_N rows of
        the padded list, merged across key splits, so its probabilities round to bf16 against
        other running maxima: a documented deviation (README, Correctness), bounded here by the
        reference's own distance from float64. With 64-row blocks, one split and no -1 entries
        the blocks coincide and only the dot order is left."""
        rne_bf16_casts(monkeypatch)
        args, _ = flash_width_case(g, torch.bfloat16, T=4, H=16)
        T, H, d = args[0].shape
        ref, exact = torch.empty(T, H, d, dtype=torch.bfloat16), torch.empty(T, H, d, dtype=torch.float64)
        ref_attn.sparse_attn(*args, ref)
        wide = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        ref_attn.sparse_attn(*wide, exact)
        for sk in (1, 4):
            out = torch.full((T, H, d), float("nan"), dtype=torch.bfloat16)
            triton_sparse_attn(*args, out, split_k=sk)
            assert rel(out, ref) < 4e-3, sk
            assert rel(out, exact) < 1.25 * rel(ref, exact), sk
        args, _ = flash_width_case(g, torch.bfloat16, T=2, H=16, holes=False)
        ref, out = torch.empty_like(args[0]), torch.empty_like(args[0])
        ref_attn.sparse_attn(*args, ref)
        triton_sparse_attn(*args, out, split_k=1, block_n=64)
        assert (out != ref).float().mean() < 0.02       # with 32-row blocks: about 15%

    # ---- index_topk ------------------------------------------------------------------------
    @pytest.mark.parametrize("fmt", ["fp8", "fp4"])
    @pytest.mark.parametrize("ratio", [1, 2])
    @pytest.mark.parametrize("mode", ["full", "full_no_candidates", "reindex"])
    def test_index_topk(g, fmt, ratio, mode):
        h, d, K, C, cb, page = 4, 64, 8, 3, 4, 16
        step = make_step(g, n_req=3, max_new=6, max_start=60, W=8, page=page, n_slots=4,
                         pad_tokens=2, pad_reqs=1)
        T, rpp = step.T, page // ratio
        plane, pscale = index_plane(g, step.num_pages * rpp, d, fmt)
        q = quant.index_query_qat(torch.randn(T, h, d, generator=g), fmt)      # as the model hands it over
        w = torch.randn(T, h, generator=g)
        cand = random_candidates(g, step, ratio, C, cb) if mode == "reindex" else None
        produce = mode == "full"
        args = (q, w, plane, pscale, step.block_table, step.batch_ids, step.positions, ratio, rpp,
                fmt, cand, cb)
        ref = torch.empty(T, K, dtype=torch.long)
        ref_c = torch.empty(T, C, dtype=torch.long) if produce else None
        ref_index.index_topk(*args, ref, ref_c)
        # a small score budget: several tiles of rows, several chunks a row; REINDEX also on the
        # chunked selection (row_max=1), whose candidate mapping the ties test does not reach
        kws = [{}, {"score_budget": 50, "block_j": 16, "select_block": 4}, {"static_width": True}]
        for kw in kws + ([{"select_block": 4, "row_max": 1}] if mode == "reindex" else []):
            out = torch.full((T, K), -7, dtype=torch.long)
            out_c = torch.full((T, C), -7, dtype=torch.long) if produce else None
            triton_index_topk(*args, out, out_c, **kw)
            assert torch.equal(out, ref), (kw, out, ref)
            if produce:
                assert torch.equal(out_c, ref_c), (kw, out_c, ref_c)
        # the step's largest position from the host (Batch.max_position) sizes the scores: exact
        # or above every row, the same selection; below it (a wrong bound, shown where no
        # candidate blocks are published) fewer rows are scored
        top = int(step.positions[step.batch_ids >= 0].max())
        for mp in (top, top + 5) + (() if produce else (top // 2,)):
            outs = []
            for fn in (ref_index.index_topk, triton_index_topk):
                out = torch.full((T, K), -7, dtype=torch.long)
                out_c = torch.full((T, C), -7, dtype=torch.long) if produce else None
                fn(*args, out, out_c, torch.tensor([mp]))
                outs.append((out, out_c))
            for out, out_c in outs:
                same = torch.equal(out, ref) and (not produce or torch.equal(out_c, ref_c))
                assert same == (mp >= top or mode == "reindex"), (mp, top)

    def test_index_topk_ties(g):
        """Many exact ties (all-zero keys): smaller row first, like the reference."""
        h, d, K, C, cb, page = 2, 32, 6, 4, 2, 8
        step = make_step(g, n_req=2, max_new=4, max_start=30, W=4, page=page, n_slots=2)
        plane, pscale = index_plane(g, step.num_pages * page, d, "fp4")
        keep = torch.rand(plane.shape[0], generator=g) < 0.3
        plane[~keep] = 0                                    # code 0 = +0.0: score exactly 0
        q = quant.index_query_qat(torch.randn(step.T, h, d, generator=g), "fp4")
        w = torch.randn(step.T, h, generator=g).abs()
        args = (q, w, plane, pscale, step.block_table, step.batch_ids, step.positions, 1, page,
                "fp4", None, cb)
        ref, ref_c = torch.empty(step.T, K, dtype=torch.long), torch.empty(step.T, C, dtype=torch.long)
        ref_index.index_topk(*args, ref, ref_c)
        out, out_c = torch.full_like(ref, -7), torch.full_like(ref_c, -7)
        for row_max in (None, 1):                           # one program a row, and the chunked passes
            out, out_c = torch.full_like(ref, -7), torch.full_like(ref_c, -7)
            triton_index_topk(*args, out, out_c, block_j=8, select_block=2, row_max=row_max)
            assert torch.equal(out, ref) and torch.equal(out_c, ref_c), row_max

    @pytest.mark.parametrize("w", [45, 9, 6])
    @pytest.mark.parametrize("row_max", [None, 1])
    def test_select_into(g, row_max, w):
        """The selection alone against a stable descending sort: ties (smaller column first),
        -inf never taken, +inf first, fewer finite scores than k, rows of nothing finite,
        negative and positive scores across the key's sign bit, several chunks a row; rows of at
        most k columns too (the one-program kernel skips its radix passes there)."""
        from custom_ops.triton.index import select_into
        n, k = 7, 9
        score = torch.randint(-4, 5, (n, w), generator=g).float() * 0.5     # many exact ties
        score[1] = torch.randn(w, generator=g) * 1e-30                      # tiny, both signs
        score[2, 5:] = float("-inf")                                        # 5 finite < k
        score[3] = float("-inf")                                            # nothing finite
        score[4, [3, w - 2]] = float("inf")
        score[5, :] = -0.0
        score[5, ::3] = 0.0                                                 # -0.0 and +0.0 tie in the reference's order
        score[6, :k] = score[6, :k].abs() + 0.5                             # exactly k finite, all positive
        score[6, k:] = float("-inf")
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
        ref = torch.where(score.gather(1, order) > float("-inf"), order, -1)
        ref = torch.where(ref >= 0, ref, w + 1).sort(1).values
        ref = torch.nn.functional.pad(torch.where(ref == w + 1, -1, ref), (0, k - ref.shape[1]), value=-1)
        out = torch.full((n, k), -1, dtype=torch.long)
        select_into(score, out, block=8, row_max=row_max)
        assert torch.equal(out, ref), (out, ref)

    # ---- scatter_rows ----------------------------------------------------------------------
    @pytest.mark.parametrize("kind", ["f32", "bf16", "fp8", "e8m0", "scale1d", "odd_bytes", "gapped"])
    def test_scatter_rows(g, kind):
        N, T = 40, 12
        if kind == "f32":
            dst, rows = torch.randn(N, 24, generator=g), torch.randn(T, 24, generator=g)
        elif kind == "bf16":
            dst = torch.randn(N, 3, 8, generator=g).bfloat16()
            rows = torch.randn(T, 3, 8, generator=g).bfloat16()
        elif kind == "fp8":
            dst = torch.randn(N, 32, generator=g).to(torch.float8_e4m3fn)
            rows = torch.randn(T, 32, generator=g).to(torch.float8_e4m3fn)
        elif kind == "e8m0":
            dst = torch.randint(0, 255, (N, 4), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
            rows = torch.randint(0, 255, (T, 4), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        elif kind == "scale1d":
            dst, rows = torch.randn(N, generator=g), torch.randn(T, generator=g)
        elif kind == "odd_bytes":
            dst = torch.randint(0, 255, (N, 3), generator=g, dtype=torch.uint8)
            rows = torch.randint(0, 255, (T, 3), generator=g, dtype=torch.uint8)
        else:   # a plane viewed with gaps between rows, rows cast from another dtype
            dst = torch.randn(N, 20, generator=g)[:, 2:14]
            rows = torch.randn(T, 12, generator=g).double()
        dest = torch.randperm(N, generator=g)[:T]
        dest[torch.rand(T, generator=g) < 0.3] = -1
        base = dst.clone()
        ref = dst.clone()
        ref_cache.scatter_rows(ref, rows, dest)
        triton_scatter_rows(dst, rows, dest)
        assert torch.equal(dst.view(torch.uint8) if dst.dtype.itemsize == 1 else dst,
                           ref.view(torch.uint8) if ref.dtype.itemsize == 1 else ref)
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[dest[dest >= 0]] = False
        assert torch.equal(dst[untouched].view(torch.uint8), base[untouched].view(torch.uint8))

    # ---- compress_pool ---------------------------------------------------------------------
    def test_compress_pool(g):
        D, slots = 48, 6
        step = make_step(g, n_req=4, max_new=7, max_start=9, W=4, page=8, n_slots=slots,
                         pad_tokens=3)
        pos, bid = step.positions, step.batch_ids
        T = step.T
        slot_of = torch.randperm(slots, generator=g)[:4]
        tail_src = torch.full((T,), -1, dtype=torch.long)
        tail_dst = torch.full((T,), -1, dtype=torch.long)
        t = 0
        for i, (s, n) in enumerate(zip(step.starts, step.n_new)):
            for p in range(s, s + n):
                if p % 2 == 1 and p == s:
                    tail_src[t] = slot_of[i]
                if p == s + n - 1 and p % 2 == 0:
                    tail_dst[t] = slot_of[i]
                t += 1
        v, gt = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g) * 3
        tv, tg = torch.randn(slots, D, generator=g), torch.randn(slots, D, generator=g)
        ref_tv, ref_tg, ref = tv.clone(), tg.clone(), torch.empty(T, D)
        ref_comp.compress_pool(v, gt, pos, bid, tail_src, tail_dst, ref_tv, ref_tg, ref)
        out = torch.full((T, D), float("nan"))
        triton_compress_pool(v, gt, pos, bid, tail_src, tail_dst, tv, tg, out)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-5
        assert torch.equal(tv, ref_tv) and torch.equal(tg, ref_tg)

    # ---- registry --------------------------------------------------------------------------
    def test_registry_selection():
        sel = registry.selected()
        for name in ("sparse_attn", "index_topk", "scatter_rows", "compress_pool"):
            assert sel[f"v41::{name}"] == {"cpu": "reference", "cuda": "triton"}
        # CPU tensors still dispatch to the reference through torch.ops
        dst = torch.zeros(4, 2)
        torch.ops.v41.scatter_rows(dst, torch.ones(2, 2), torch.tensor([1, -1]))
        assert dst[1].eq(1).all() and dst[[0, 2, 3]].eq(0).all()
        registry.select("scatter_rows", "reference")
        assert registry.selected()["v41::scatter_rows"]["cuda"] == "reference"
        registry.select("scatter_rows", "triton")
        assert registry.log_selected()["v41::scatter_rows"]["cuda"] == "triton"
        # a block runs the chosen ops on the reference; the previous choice comes back after
        with registry.using("reference", "cuda", names=("sparse_attn",)):
            sel = registry.selected()
            assert sel["v41::sparse_attn"]["cuda"] == "reference"
            assert sel["v41::index_topk"]["cuda"] == "triton"
        with registry.using("reference", "cuda"):
            assert {s["cuda"] for s in registry.selected().values()} == {"reference"}
        assert registry.selected()["v41::sparse_attn"]["cuda"] == "triton"
