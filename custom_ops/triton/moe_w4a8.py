"""`v41::moe_experts_w4a8`: the routed experts read as stored, FP4 E2M1 packed two per byte with
an E8M0 scale per 32 along K. `triton_moe_experts_w4a8` dispatches by `expert_path`: moe_gemv.py's
FP4 GEMVs at one token, fp4_mma.py's tensor-core GEMVs on tiles of an expert's pairs while the
(token, slot) pairs are few an expert, moe.py's MMA tiles on FP4 tiles dequantized to bf16 beyond
('tiles'). All use moe.py's tile scheme (tokens sorted by expert, a static tile bound,
a deterministic reduction in ascending expert id). FP64, out not FP32, or widths not a multiple
of 32 run the reference.
"""
from __future__ import annotations

import torch

from custom_ops import gemm as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES
from custom_ops.triton.moe import fits, run_experts

DECODE_PAIRS = 384         # 64 tokens x top-6: up to here the GEMVs, whose FP32 partials grow with the pairs
MMA_TILE_PAIRS = 8         # fp4_mma.py's tiles hold eight of an expert's pairs
SPLIT_TILE_PAIRS_PER_EXPERT = 8     # up to here the 16-row tiles split K in two (`tile_knobs`)
SMALL_TILE_PAIRS_PER_EXPERT = 32    # up to here 16-row tiles


def expert_path(tokens: int, pairs: int) -> str:
    """'gemv' at one token (moe_gemv.py's FP4 GEMVs, a program a pair: its pairs are distinct
    experts); 'mma' up to MMA_TILE_PAIRS tokens (fp4_mma.py: a tile of up to eight of an expert's
    pairs a program, the weights decoded once for them, on tensor cores; a token's top-k are
    distinct experts, so up to eight tokens every expert's pairs fit one tile however the router
    spreads them, and each expert's weights are read once); 'tiles' (moe.py's MMA tiles on FP4
    weight tiles dequantized to bf16, `tile_knobs`) beyond, and past DECODE_PAIRS pairs.
    H100, experts-slice-mma-h100.json (flash-slice's 16 experts, uniform random routing), µs as
    'gemv' / 'mma' / 'tiles' at 1 token: 81.8 / 93.8 / 118.0; 2: 111.4 / 103.8 / 133.8;
    6: 292.1 / 174.0 / 186.9; 16: 751.3 / 226.3 / 237.5. In the native decode step at 16
    requests (the random model's own routing) 'mma' took 21.65 ms of device time against 21.15
    with 'tiles' (native-decode-head-h100.json run j): past eight tokens 'tiles' stays."""
    if tokens == 1:
        return "gemv"
    return "mma" if tokens <= MMA_TILE_PAIRS and pairs <= DECODE_PAIRS else "tiles"


def tile_knobs(pairs: int, experts: int) -> dict:
    """The 'tiles' path's defaults by pairs an expert on average: 16-row tiles up to
    SMALL_TILE_PAIRS_PER_EXPERT (run_experts' own beyond), each GEMM's K split in two up to
    SPLIT_TILE_PAIRS_PER_EXPERT. H100, one run (experts-slice-h100.json), flash-slice's experts:
    3 / 6 / 16 tokens (1.1 / 2.25 / 6 pairs an expert) 169 / 189 / 236 µs split in two against
    237 / 239 / 247 unsplit; 64 tokens (24 an expert) 410 µs in 16-row tiles against 502 in the
    default 32-row ones (16 rows split in two not timed there)."""
    per = pairs / max(experts, 1)
    if per > SMALL_TILE_PAIRS_PER_EXPERT:
        return {}
    return {"block_m": 16, "splits": 2 if per <= SPLIT_TILE_PAIRS_PER_EXPERT else 1}


def triton_moe_experts_w4a8(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out, *, path: str | None = None,
                            **knobs) -> None:
    """`v41::moe_experts_w4a8` (same signature). `path` (default `expert_path`; knobs without a
    path imply 'gemv', the tiles without knobs take `tile_knobs`): 'gemv', moe.py's tile
    grouping with moe_gemv.py's FP4 GEMVs (`run_experts` with scales); 'mma', the same GEMVs on
    tensor cores (fp4_mma.py: mma.sync on each group of 32); 'tiles', moe.py's MMA
    tile kernels with each FP4 weight tile dequantized exactly to x's dtype in registers (no
    per-32 scale promotion after the dots: the scales are in the tile). Every product is exact
    in FP32, so only the order of the FP32 sums differs from the reference. Knobs: run_experts'
    (block_m, block_n_up, block_n_down, block_k, splits, num_warps, num_stages, prefetch)."""
    if x.dtype not in TL_DTYPES or w1.dtype != torch.int8 or w1.stride() != w3.stride() or \
            s1.stride() != s3.stride() or not fits(x, (w1, w3, w2, s1, s3, s2), w1.shape[1], out, knobs):
        return _ref.moe_experts_w4a8(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out)
    pairs, experts = ids.numel(), w1.shape[0]
    if not knobs:
        path = path or expert_path(x.shape[0], pairs)
        knobs = tile_knobs(pairs, experts) if path == "tiles" else {}
    path = path or "gemv"
    if path not in ("gemv", "mma", "tiles"):
        raise ValueError(f"moe_experts_w4a8: path {path!r} is not 'gemv', 'mma' or 'tiles'")
    run_experts(x, ids, weights, w1, w3, w2, tuple(t.view(torch.uint8) for t in (s1, s3, s2)), limit, out,
                tiles=path == "tiles", mma=path == "mma", **knobs)


register_impl("moe_experts_w4a8", "triton", triton_moe_experts_w4a8, device_type="cuda")
