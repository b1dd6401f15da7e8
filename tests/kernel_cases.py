"""Random inputs for the kernel tests (tests/test_kernels_cpu.py, tests/test_kernels_gpu.py), the
seed every kernel and fused-op test draws them from, and the relative error they bound:
a ragged step laid out the way runtime/model_runner.py lays it out (flat tokens, padding rows
with batch id -1, zero-length padding requests, window rows from the ring or this batch, block
tables of distinct pages), plus per-op tensors. Imports no triton."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from v41 import quant


SEED = int(os.environ.get("V41_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def seeded_generator(request, device="cpu") -> torch.Generator:
    """The generator of the `g` fixture (tests/conftest.py): V41_TEST_SEED (random when unset)
    plus the test's name, printed and kept in the report so that a failure can be replayed."""
    seed = SEED + sum(map(ord, request.node.name))
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed} (V41_TEST_SEED={SEED})")
    return torch.Generator(device).manual_seed(seed)


def gamma(k: int) -> float:
    """γ_k = k·u/(1-k·u), u = 2^-24: an FP32 summation of k terms in any order is within
    γ_k·Σ|terms| of the exact sum (Higham, Accuracy and Stability, §4.2)."""
    u = 2.0**-24
    return k * u / (1 - k * u)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def require_compiled_kernels() -> None:
    """At the top of a GPU kernel test module: skip it without a CUDA device, under the
    Triton interpreter (it needs compiled kernels), or without triton."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the GPU tests need compiled kernels", allow_module_level=True)
    pytest.importorskip("triton", reason="triton is not installed")


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_reruns(test_file: str, timeout: int, **env):
    """The one test an interpreter module (tests/test_kernels_cpu.py and the like) holds outside
    the interpreter: the module run again by `run_under_interpreter`, its programs in order and
    reversed. Bound to a test_ name in the module, which pytest collects."""
    @pytest.mark.parametrize("order", ["forward", "reversed"])
    def test(order):
        run_under_interpreter(test_file, order, timeout, **env)
    return test


def run_under_interpreter(test_file: str, order: str, timeout: int, **env) -> None:
    """Run a test file again in a subprocess under TRITON_INTERPRET=1, its programs in `order`
    (tests/program_order.py), with `env` added; fails with its output unless it passes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", V41_PROGRAM_ORDER=order, **env)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]


@dataclass
class Step:
    positions: torch.Tensor     # [T]
    batch_ids: torch.Tensor     # [T], -1 padding
    block_table: torch.Tensor   # [B, max_pages]
    win_idx: torch.Tensor       # [T, W]: ring row (< n_ring), n_ring + batch row, or -1
    n_ring: int                 # slots * W
    num_pages: int
    page: int
    starts: list
    n_new: list
    T: int                      # rows including padding

    def vis(self, ratio: int) -> torch.Tensor:
        return torch.where(self.batch_ids >= 0, (self.positions + 1) // ratio, 0)


def make_step(g: torch.Generator, *, n_req: int, max_new: int, max_start: int, W: int, page: int,
              n_slots: int, pad_tokens: int = 0, pad_reqs: int = 0, decode: bool = False,
              new_tokens: list | None = None, device="cpu") -> Step:
    """Requests with a random cached prefix (start) and 1..max_new new tokens (1 for decode,
    or exactly `new_tokens`)."""
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    starts = [ri(0, max_start) for _ in range(n_req)]
    n_new = list(new_tokens) if new_tokens else [1 if decode else ri(1, max_new) for _ in range(n_req)]
    slots = torch.randperm(n_slots, generator=g)[:n_req].tolist()
    need = [-(-(s + n) // page) for s, n in zip(starts, n_new)]
    max_pages = max(need) + 1
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    B = n_req + pad_reqs
    bt = torch.zeros(B, max_pages, dtype=torch.long)
    k = 0
    for i, n in enumerate(need):
        bt[i, :n] = torch.tensor(perm[k:k + n])
        k += n
    pos, bid, win = [], [], []
    t = 0
    for i, (s, n) in enumerate(zip(starts, n_new)):
        for p in range(s, s + n):
            q = torch.arange(p - (W - 1), p + 1)
            in_batch = q >= s
            row = torch.where(in_batch, n_slots * W + t - (p - q), slots[i] * W + q % W)
            win.append(torch.where(q >= 0, row, -1))
            pos.append(p)
            bid.append(i)
            t += 1
    for _ in range(pad_tokens):
        pos.append(0)
        bid.append(-1)
        win.append(torch.full((W,), -1))
    T = len(pos)
    return Step(torch.tensor(pos, device=device), torch.tensor(bid, device=device), bt.to(device),
                torch.stack(win).to(device), n_slots * W, num_pages, page, starts, n_new, T)


def random_topk(g, step: Step, ratio: int, K: int, holes: float = 0.1) -> torch.Tensor:
    """[T, K] distinct visible owner rows, ascending, -1 padded, with some -1 holes inside."""
    out = torch.full((step.T, K), -1, dtype=torch.long)
    vis = step.vis(ratio).cpu()
    for t in range(step.T):
        v = int(vis[t])
        if v == 0:
            continue
        n = min(K, v)
        rows = torch.randperm(v, generator=g)[:n].sort().values
        out[t, :n] = rows
    hole = (torch.rand(out.shape, generator=g) < holes)
    out[hole] = -1
    return out.to(step.positions.device)


def random_candidates(g, step: Step, ratio: int, C: int, block: int) -> torch.Tensor:
    """[T, C] distinct visible candidate blocks, ascending, -1 padded (a producer's output)."""
    out = torch.full((step.T, C), -1, dtype=torch.long)
    vis = step.vis(ratio).cpu()
    for t in range(step.T):
        nb = -(-int(vis[t]) // block)
        if nb == 0:
            continue
        n = min(C, nb)
        out[t, :n] = torch.randperm(nb, generator=g)[:n].sort().values
    return out.to(step.positions.device)


def encode_index(k: torch.Tensor, fmt: str):
    """Index-plane storage of keys k [rows, d] (runtime/cache.py OwnerPlanes.encode_index)."""
    if fmt == "fp8":
        q, s = quant.fp8_row_quant(k)
        return q.to(torch.float8_e4m3fn), s[..., 0].to(torch.float32)
    q, s = quant.fp4_act_quant(k, 32)
    codes = quant.pack_fp4(quant.e2m1_encode(q)).view(torch.uint8)
    return codes, quant.e8m0_encode(s.float()).view(torch.uint8)


def device_generator(g: torch.Generator, device) -> torch.Generator:
    """A generator on `device` seeded from the CPU generator g (g itself on the CPU)."""
    if torch.device(device).type == "cpu":
        return g
    return torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))


def index_plane(g, rows: int, d: int, fmt: str, device="cpu", ties: bool = True):
    """A random index plane; with `ties`, some all-zero keys and some duplicated keys so exact
    score ties occur and the tie rule is exercised."""
    k = torch.randn(rows, d, generator=device_generator(g, device), device=device)
    if ties and rows >= 8:
        z = torch.randperm(rows, generator=g)[: rows // 8]
        k[z] = 0
        a = torch.randperm(rows, generator=g)[: rows // 8]
        b = torch.randperm(rows, generator=g)[: rows // 8]
        k[a] = k[b]
    return encode_index(k, fmt)


def flash_width_case(g, dtype, T: int = 6, H: int = 8, d: int = 512, W: int = 128, K: int = 512,
                     holes: bool = True):
    """Inputs of `v41::sparse_attn` at Flash list widths (window W from a ring, K selected rows
    of one page), plus the same lists as the oracle takes them: valid indices packed in order
    into cat(ring, pool), -1 after."""
    n_pool = 2 * K
    ring, pool = torch.randn(2 * W, d, generator=g), torch.randn(n_pool, d, generator=g)
    win = torch.arange(W).repeat(T, 1) + torch.randint(0, W, (T, 1), generator=g)
    topk = torch.sort(torch.stack([torch.randperm(n_pool, generator=g)[:K] for _ in range(T)]), 1).values
    if holes:  # a short window (its -1s first) and a short selection (its -1s last)
        nw, nk = torch.randint(1, W + 1, (T,), generator=g), torch.randint(0, K + 1, (T,), generator=g)
        nw[0], nk[0] = W, K
        win = torch.where(torch.arange(W) >= W - nw[:, None], win, -1)
        topk = torch.where(torch.arange(K) < nk[:, None], topk, -1)
    q, sink = torch.randn(T, H, d, generator=g), torch.randn(H, generator=g)
    q, ring, pool = q.to(dtype), ring.to(dtype), pool.to(dtype)
    args = (q, torch.zeros(T, d, dtype=dtype), ring, win, pool, topk, torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(T, dtype=torch.long), 1, n_pool, sink, d ** -0.5)
    lists = [torch.cat([w[w >= 0], k[k >= 0] + ring.shape[0]]) for w, k in zip(win, topk)]
    L = max(len(x) for x in lists)
    idx = torch.stack([torch.cat([x, x.new_full((L - len(x),), -1)]) for x in lists])
    return args, (q, torch.cat([ring, pool]), idx, sink, d ** -0.5)


def rne_bf16_casts(monkeypatch):
    """The Triton interpreter casts FP32 to BF16 by truncation; a GPU (cvt.rn) rounds to nearest
    even. Patch the interpreter to cast as the GPU does, so a bf16 comparison measures the
    kernel, not the interpreter."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp
    cast = interp.InterpreterBuilder.cast_impl

    def rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            b = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            return interp.TensorHandle(((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16),
                                       dst_type.scalar)
        return cast(self, src, dst_type)
    monkeypatch.setattr(interp.InterpreterBuilder, "cast_impl", rne)


# ---- native GEMMs (custom_ops/gemm.py) ----------------------------------------------------------

def pow2_blocks(g, shape, lo: int, hi: int, block: tuple) -> torch.Tensor:
    """2^b per block of `block` elements of the last two dims, b uniform in [lo, hi]."""
    n, k = shape[-2:]
    nb, kb = -(-n // block[0]), -(-k // block[1])
    b = torch.randint(lo, hi + 1, tuple(shape[:-2]) + (nb, kb), generator=g).double()
    return torch.exp2(b).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :k]


def fp8_gemm_case(g, M: int, N: int, K: int, exact: bool = False, device="cpu"):
    """Inputs of `v41::fp8_block_gemm`: (xq, xs, w, ws) from a quantized activation [M, K] and a
    block-quantized weight [N, K]. With `exact`, integer activations in [-15, 15] and weights
    that are integers in [-15, 15] times 2^b per 32x32 block (b in [-2, 1]): both survive the
    quantizers unchanged, every partial sum of K <= 1024 products is a multiple of 1/4 below
    2^19 (and a 32-term block of codes sums below 2^13 of its unit), so every FP32 summation
    order gives the same, exact, result."""
    if exact:
        x = torch.randint(-15, 16, (M, K), generator=g).float()
        w = (torch.randint(-15, 16, (N, K), generator=g) * pow2_blocks(g, (N, K), -2, 1, (32, 32))).float()
    else:
        x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g).float())
        w = torch.randn(N, K, generator=g) * pow2_blocks(g, (N, K), -6, -2, (32, 32)).float()
    q, s = quant.fp8_act_quant(x, 32)
    wq, ws = quant.quant_fp8_block(w)
    return (q.to(torch.float8_e4m3fn).to(device), s.float().to(device), wq.to(device), ws.to(device))


def fp8_grouped_case(g, M: int, G: int, R: int, K: int, exact: bool = False, device="cpu"):
    """Inputs of a grouped `v41::fp8_block_gemm` (wo_a's form): (xq, xs) of x [M, G·K] and
    (w, ws) of w [G·R, K], as `fp8_gemm_case` makes them."""
    xq, xs, w, ws = fp8_gemm_case(g, M, G * R, G * K, exact, device)
    return xq, xs, w[:, :K].contiguous(), ws[:, : K // 32].contiguous()


def fp4_experts(g, E: int, n: int, k: int, exact: bool = False):
    """FP4 expert weights (packed [E, n, k/2], scale [E, n, k/32]); with `exact`, E2M1 values
    times 2^b per 1x32 group, b in [-1, 1], which quant_fp4_expert keeps unchanged."""
    if exact:
        codes = torch.randint(0, 16, (E, n, k), generator=g, dtype=torch.uint8)
        w = quant.e2m1_decode(codes, torch.float32) * pow2_blocks(g, (E, n, k), -1, 1, (1, 32)).float()
    else:
        w = torch.randn(E, n, k, generator=g) * 0.2
    return quant.quant_fp4_expert(w)


def w4a8_case(g, T: int, E: int, D: int, I: int, k: int, exact: bool = False, dtype=torch.float32,
              pad_token: bool = True):
    """Inputs of `v41::moe_experts_w4a8` but `limit`: ragged expert groups (random top-k ids),
    some padding slots, expert E-1 without tokens and (`pad_token`) token 0 all padding."""
    x = torch.randint(-15, 16, (T, D), generator=g).float() if exact else torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    drop = torch.rand(T, k, generator=g) < 0.15
    drop[drop.all(1), 0] = False       # only token 0 (`pad_token`) is all padding
    ids[drop] = -1
    if pad_token:
        ids[0] = -1
    weights = torch.rand(T, k, generator=g)
    (w1, s1), (w3, s3), (w2, s2) = (fp4_experts(g, E, a, b, exact) for a, b in ((I, D), (I, D), (D, I)))
    return x.to(dtype), ids, weights, w1, s1, w3, s3, w2, s2
