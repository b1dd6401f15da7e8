"""The fused ops the compile passes lower the model to (custom_ops/norm.py, rope.py, attn_out.py,
mhc.py, moe.py, engram.py): their reference impls, the CPU path.

(a) Each reference impl equals the eager model's own composition bitwise, in float64, float32
    and bfloat16, on fresh random inputs (seed printed; V41_TEST_SEED pins one).
(c) torch.library.opcheck passes for every fused op (and the two existing ops given Triton
    impls: moe_experts, engram_gather).
The Triton impls against these references: tests/test_fused_ops_cpu.py.
"""
from __future__ import annotations

import pytest
import torch

import custom_ops
from custom_ops import engram as ref_engram
from tests.fused_op_cases import acc_of, ops, rnd, rope_table
from v41 import layers, quant
from v41.engram.device import Engram
from v41.model import MHC, collapse, expand
from v41.moe import MoE

DTYPES = [torch.float64, torch.float32, torch.bfloat16]

# ---- (a) reference == eager composition, bitwise ------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (5, 3, 64)])
def test_rms_norm_reference(g, dtype, shape):
    x = rnd(g, *shape, dtype=dtype, scale=3.0)
    w = rnd(g, shape[-1], dtype=dtype)
    eps = 1e-6
    out = torch.empty_like(x)
    ops.rms_norm(x, w, eps, out)
    assert torch.equal(out, layers.RMSNorm(w, eps)(x))
    ops.rms_norm_fp8(x, w, eps, out)
    assert torch.equal(out, quant.fp8_qat(layers.RMSNorm(w, eps)(x), 32))
    # what the eager model computes next: the FP8 Linear of the normed input (its GEMM is
    # quant.matmul's, which a plain CPU bf16 `@` matches on some seeds only: AVX2 hosts)
    W = rnd(g, 40, shape[-1], dtype=dtype)
    assert torch.equal(quant.matmul(out, W.T), layers.Linear(W, "fp8")(layers.RMSNorm(w, eps)(x)))

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_reference(g, dtype, yarn):
    rope = rope_table(yarn=yarn)
    T = 9
    pos = torch.randint(0, 512, (T,), generator=g)
    for shape in ((T, 4, 64), (T, 96)):
        x = rnd(g, *shape, dtype=dtype)
        out = torch.empty_like(x)
        for inverse in (False, True):
            ops.rope(x, rope.cos, rope.sin, pos, inverse, out)
            assert torch.equal(out, rope(x, pos, inverse=inverse))
    # the window KV path: kv_norm -> RoPE -> FP8 QAT
    kv = layers.RMSNorm(rnd(g, 96, dtype=dtype), 1e-6)(rnd(g, T, 96, dtype=dtype))
    out = torch.empty_like(kv)
    ops.rope_fp8_qat(kv, rope.cos, rope.sin, pos, False, out)
    assert torch.equal(out, quant.fp8_qat(rope(kv, pos)))

@pytest.mark.parametrize("dtype", DTYPES)
def test_inv_rope_wo_a_reference(g, dtype):
    rope = rope_table()
    T, H, d, G, R = 6, 4, 64, 2, 24
    o = rnd(g, T, H, d, dtype=dtype)
    wo_a = rnd(g, G * R, H * d // G, dtype=dtype, scale=0.1).view(G, R, -1)
    pos = torch.randint(0, 512, (T,), generator=g)
    out = torch.empty(T, G * R, dtype=dtype)
    ops.inv_rope_wo_a(o, rope.cos, rope.sin, pos, wo_a, out)
    # the end of Attention.forward (quant.einsum: bf16 operands summed as the FP32 GEMM)
    z = quant.einsum("tgi,goi->tgo", rope(o, pos, inverse=True).view(T, G, -1), wo_a).flatten(1)
    assert torch.equal(out, z)

@pytest.mark.parametrize("dtype", DTYPES)
def test_mhc_reference(g, dtype):
    T, hc, D = 7, 4, 32
    acc = acc_of(dtype)
    X = rnd(g, T, hc, D, dtype=dtype)
    fn = rnd(g, hc * (hc + 2), hc * D, dtype=acc, scale=0.1)
    base, scale = rnd(g, hc * (hc + 2), dtype=acc), rnd(g, 3, dtype=acc).abs()
    pre, post = torch.empty(T, hc, dtype=acc), torch.empty(T, hc, dtype=acc)
    comb = torch.empty(T, hc, hc, dtype=acc)
    ops.mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, pre, post, comb)
    p, q, c = MHC(fn, base, scale, hc, 20, 1e-6, 1e-20)(X)
    assert torch.equal(pre, p) and torch.equal(post, q) and torch.equal(comb, c)
    out = torch.empty(T, D, dtype=dtype)
    ops.hc_collapse(X, pre, out)
    assert torch.equal(out, collapse(X, pre))
    f = rnd(g, T, D, dtype=dtype)
    Y = torch.empty_like(X)
    ops.hc_expand(f, X, post, comb, Y)
    assert torch.equal(Y, expand(f, X, post, comb))

def _moe(g, dtype, E, D, I, top_k, dup=False):
    acc = acc_of(dtype)
    gate = rnd(g, E, D, dtype=acc, scale=0.2)
    bias = rnd(g, E, dtype=acc, scale=0.1)
    if dup:   # exact ties: pairs of identical router rows with identical biases
        gate = (torch.randint(-8, 9, (E // 2, D), generator=g) / 64).to(acc).repeat_interleave(2, 0)
        bias = (torch.randint(-2, 3, (E // 2,), generator=g) / 4).to(acc).repeat_interleave(2, 0)
    w = {"gate": gate, "gate.bias": bias,
         "experts.w1": rnd(g, E, I, D, dtype=dtype, scale=0.2),
         "experts.w3": rnd(g, E, I, D, dtype=dtype, scale=0.2),
         "experts.w2": rnd(g, E, D, I, dtype=dtype, scale=0.2),
         "shared_experts.w1": rnd(g, I, D, dtype=dtype), "shared_experts.w3": rnd(g, I, D, dtype=dtype),
         "shared_experts.w2": rnd(g, D, I, dtype=dtype)}
    return MoE(w, top_k, 1.5, 10.0)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dup", [False, True])
def test_moe_route_reference(g, dtype, dup):
    T, E, D, k = 11, 8, 32, 3
    moe = _moe(g, dtype, E, D, 32, k, dup)
    x = rnd(g, T, D, dtype=dtype)
    if dup:
        x = (torch.randint(-8, 9, (T, D), generator=g) / 8).to(dtype)
    ids = torch.empty(T, k, dtype=torch.long)
    w = torch.empty(T, k, dtype=acc_of(dtype))
    ops.moe_route(x, moe.gate, moe.bias, k, 1.5, ids, w)
    ri, rw = moe.route(x)
    assert torch.equal(ids, ri) and torch.equal(w, rw)
    # the compiled graph hands the expert op the ids in the eager strides: a slice of the sort's
    # [T, E] indices would cost a copy kernel a layer after the moe_route pass
    assert ri.is_contiguous()

@pytest.mark.parametrize("dtype", DTYPES)
def test_engram_gate_reference(g, dtype):
    T, hc, D, width = 5, 4, 32, 96
    w = {"engram.wkv": rnd(g, (hc + 1) * D, width, dtype=dtype, scale=0.2),
         "engram.q_weight": rnd(g, hc, D, dtype=dtype), "engram.k_weight": rnd(g, hc, D, dtype=dtype)}
    eng = Engram(w, hc, 1e-6)
    X, rows = rnd(g, T, hc, D, dtype=dtype), rnd(g, T, width, dtype=dtype)
    X[0] = 0                                   # dot = +0: the gate's copysign branch
    out = torch.empty_like(X)
    ops.engram_gate(X, eng.wkv(rows), eng.wqk, 1e-6, out)
    assert torch.equal(out, eng(X, rows))

# ---- (c) opcheck --------------------------------------------------------------------------
def _opcheck_cases(g):
    rope = rope_table()
    T, hc, D = 4, 4, 32
    x = rnd(g, T, 64)
    pos = torch.randint(0, 512, (T,), generator=g)
    X = rnd(g, T, hc, D)
    fn, base, scale = rnd(g, 24, hc * D, scale=0.1), rnd(g, 24), rnd(g, 3).abs()
    E, I, k = 4, 32, 2
    ids = torch.tensor([[0, 2], [1, -1], [3, 0], [2, 1]])
    # raw bytes (the op reads the FP8 / E8M0 planes as uint8; opcheck's schema check cannot
    # compare float8 tensors)
    table = torch.randint(0, 126, (10, 64), generator=g, dtype=torch.uint8)
    tscale = torch.randint(120, 130, (10, 2), generator=g, dtype=torch.uint8)
    return {
        "rms_norm": (x, rnd(g, 64), 1e-6, torch.empty(T, 64)),
        "rms_norm_fp8": (x, rnd(g, 64), 1e-6, torch.empty(T, 64)),
        "rms_norm_act_quant": (x, rnd(g, 64), 1e-6, torch.empty(T, 64), torch.empty(T, 64, dtype=torch.float8_e4m3fn),
                               torch.empty(T, 2)),
        "hc_collapse_rms_norm_act_quant": (rnd(g, T, hc, 64), torch.rand(T, hc, generator=g), rnd(g, 64), 1e-6,
                                           torch.empty(T, 64), torch.empty(T, 64, dtype=torch.float8_e4m3fn),
                                           torch.empty(T, 2)),
        "rope": (rnd(g, T, 2, 64), rope.cos, rope.sin, pos, True, torch.empty(T, 2, 64)),
        "rope_fp8_qat": (x, rope.cos, rope.sin, pos, False, torch.empty(T, 64)),
        "rms_norm_rope_fp8_qat": (x, rnd(g, 64), 1e-6, rope.cos, rope.sin, pos, False, torch.empty(T, 64)),
        "inv_rope_wo_a": (rnd(g, T, 2, 64), rope.cos, rope.sin, pos, rnd(g, 2, 16, 64),
                          torch.empty(T, 32)),
        "mhc_mix": (X, fn, base, scale, 20, 1e-6, 1e-20, torch.empty(T, hc), torch.empty(T, hc),
                    torch.empty(T, hc, hc)),
        "hc_collapse": (X, torch.rand(T, hc, generator=g), torch.empty(T, D)),
        "hc_expand": (rnd(g, T, D), X, torch.rand(T, hc, generator=g),
                      torch.rand(T, hc, hc, generator=g), torch.empty(T, hc, D)),
        "moe_route": (rnd(g, T, D), rnd(g, E, D), rnd(g, E), k, 1.5,
                      torch.empty(T, k, dtype=torch.long), torch.empty(T, k)),
        "moe_experts": (rnd(g, T, D), ids, torch.rand(T, k, generator=g), rnd(g, E, I, D),
                        rnd(g, E, I, D), rnd(g, E, D, I), 10.0, torch.empty(T, D)),
        "engram_gate": (X, rnd(g, T, (hc + 1) * D), rnd(g, hc, D), 1e-6, torch.empty(T, hc, D)),
        "engram_gather": (table, tscale, torch.randint(0, 10, (T, 3), generator=g),
                          torch.empty(T, 3 * 64)),
        "f32_linear": (rnd(g, T, D), rnd(g, 40, D), torch.empty(T, 40)),
    }

OPCHECK_OPS = ["rms_norm", "rms_norm_fp8", "rms_norm_act_quant", "hc_collapse_rms_norm_act_quant", "rope",
               "rope_fp8_qat", "rms_norm_rope_fp8_qat", "inv_rope_wo_a", "mhc_mix", "hc_collapse", "hc_expand",
               "moe_route", "moe_experts", "engram_gate", "engram_gather", "f32_linear"]

# opcheck's schema check compares a float8 output arithmetically, which the CPU cannot
FLOAT8_OUTPUTS = {"rms_norm_act_quant", "hc_collapse_rms_norm_act_quant"}


@pytest.mark.parametrize("name", OPCHECK_OPS)
def test_opcheck(g, name):
    from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS
    args = _opcheck_cases(g)[name]
    utils = [u for u in DEFAULT_TEST_UTILS if u != "test_schema" or name not in FLOAT8_OUTPUTS]
    torch.library.opcheck(getattr(ops, name).default, args, test_utils=utils)

def test_fused_ops_defined():
    defined = custom_ops.defined()
    for name in OPCHECK_OPS:
        assert f"v41::{name}" in defined


def test_engram_gather_forgets_a_freed_table():
    """The reference gather decodes a small table once and keys it by address and version. A
    second table of the same shape (another checkpoint of the preset, in one process) can land
    at a freed table's address with version 0: its gather must read its own rows. The cache
    entry goes with its table (deterministic check), and gathers right after a free, tried until
    the allocator reuses the address or 200 times, equal the rows decoded directly."""
    import gc
    ids = torch.arange(20).view(10, 2)

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 127, (630, 32), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        s = torch.randint(120, 130, (630, 1), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return t, s

    def gathered(t, s):
        out = torch.empty(10, 64)
        torch.ops.v41.engram_gather(t, s, ids, out)
        return out

    def direct(t, s):
        rows = t.float()[ids.reshape(-1)].unflatten(-1, (-1, 32)) * s.float()[ids.reshape(-1)][..., None]
        return rows.flatten(-2).reshape(10, 64)

    t, s = make(1)
    gathered(t, s)
    ptr = t.data_ptr()
    assert any(k[0] == ptr for k in ref_engram._decoded)
    del t, s
    gc.collect()
    assert not any(k[0] == ptr for k in ref_engram._decoded)
    for trial in range(200):
        t1, s1 = make(2 * trial)
        gathered(t1, s1)
        ptr = t1.data_ptr()
        del t1, s1
        t2, s2 = make(2 * trial + 1)
        assert torch.equal(gathered(t2, s2), direct(t2, s2))
        if t2.data_ptr() == ptr:
            break
