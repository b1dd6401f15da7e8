"""The native weight path (issue 16): `prepare_weights` keeps FP8/FP4 weights as stored where the
op registry runs native GEMMs (CUDA with the Triton impls), and `Linear` / `MoE` then call the
native ops. On a CPU the registry says no, so nothing changes; forcing the native layout on a CPU
runs the native ops' reference impls, which must give what the dequantized path gives."""
from __future__ import annotations

import pytest
import torch

import custom_ops  # noqa: F401
from custom_ops import gemm
from tests import harness as H
from v41 import quant
from v41.layers import Linear, stack_rows
from v41.model import prepare_weights, weight_bytes
from v41.moe import MoE


def test_cpu_keeps_the_dequantized_path(toy_cfg, toy_weights):
    assert not gemm.native_weights("cpu", torch.bfloat16)
    w = prepare_weights(toy_cfg, toy_weights, torch.bfloat16, "cpu")
    layer = w["layers.0"]
    assert not any(isinstance(v, quant.BlockScaled) for v in layer.values())
    want = quant.dequant_fp8_block(toy_weights["layers.0.attn.wq_a.weight"],
                                   toy_weights["layers.0.attn.wq_a.scale"], torch.bfloat16)
    assert torch.equal(layer["attn.wq_a"], want)
    assert set(weight_bytes(w)) <= {"bfloat16", "float32"}


def test_native_layout_and_memory_report(toy_cfg, toy_weights, caplog):
    caplog.set_level("INFO", logger="v41.model")
    nat = prepare_weights(toy_cfg, toy_weights, torch.bfloat16, "cpu", native=True)
    deq = prepare_weights(toy_cfg, toy_weights, torch.bfloat16, "cpu", native=False)
    layer = nat["layers.0"]
    assert layer["attn.wq_a"].fmt == "fp8" and layer["ffn.shared_experts.w2"].fmt == "fp8"
    w1 = layer["ffn.experts.w1"]
    assert w1.fmt == "fp4" and w1.shape == deq["layers.0"]["ffn.experts.w1"].shape
    assert torch.equal(w1.dequant(torch.bfloat16), deq["layers.0"]["ffn.experts.w1"])
    assert not isinstance(layer["attn.wo_a"], quant.BlockScaled)      # BF16 after loading (§5.4)
    nb, db = weight_bytes(nat), weight_bytes(deq)
    assert nb["fp8"] and nb["fp4"] and nb["e8m0"]
    assert sum(nb.values()) < sum(db.values())
    assert any("fp4" in r.getMessage() and "MiB" in r.getMessage() for r in caplog.records)


def test_native_refuses_fp4_scales_its_kernels_do_not_apply_exactly(toy_cfg, toy_weights):
    """An FP4 expert scale code above gemm.FP4_MAX_SCALE_CODE is refused at load by the scale
    tensor's name when the weights stay native; at the largest allowed code, and dequantized, it loads."""
    name = "layers.1.ffn.experts.2.w3.scale"
    for code, native, refused in ((129, True, True), (255, True, True), (128, True, False), (129, False, False)):
        codes = toy_weights[name].view(torch.uint8).clone()
        codes[0, 0] = code
        weights = {**toy_weights, name: codes.view(torch.float8_e8m0fnu)}
        if refused:
            with pytest.raises(ValueError, match=rf"layers\.1\.ffn\.experts\.2\.w3\.scale: FP4 scale code {code}"):
                prepare_weights(toy_cfg, weights, torch.bfloat16, "cpu", native=native)
        else:
            prepare_weights(toy_cfg, weights, torch.bfloat16, "cpu", native=native)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_linear_matches_dequantized(dtype):
    g = torch.Generator().manual_seed(3)
    q, s = quant.quant_fp8_block(torch.randn(72, 96, generator=g) * 0.05)
    x = torch.randn(2, 5, 96, generator=g).to(dtype)
    deq = Linear(quant.dequant_fp8_block(q, s, dtype), "fp8")(x)
    nat = Linear(quant.BlockScaled(q, s), "fp8")(x)
    assert nat.shape == deq.shape == (2, 5, 72) and nat.dtype == dtype
    exact = quant.fp8_qat(x.double()) @ quant.dequant_fp8_block(q, s, torch.float64).T
    S = quant.fp8_qat(x.double()).abs() @ quant.dequant_fp8_block(q, s, torch.float64).abs().T
    bound = 96 * 2.0**-24 * S + (2.0**-8 * exact.abs() if dtype == torch.bfloat16 else 0)
    assert ((nat.double() - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="kind 'fp8'"):
        Linear(quant.BlockScaled(q, s), "bf16")


def test_stacked_rows_give_each_projection(dtype=torch.float32):
    """stack_rows: one Linear over two weights' rows gives each one's output in its columns,
    native or dequantized; native rows that would split a 32-row scale block are refused."""
    g = torch.Generator().manual_seed(4)
    (q1, s1), (q3, s3) = (quant.quant_fp8_block(torch.randn(64, 96, generator=g) * 0.05) for _ in range(2))
    x = torch.randn(5, 96, generator=g)
    nat = Linear(stack_rows(quant.BlockScaled(q1, s1), quant.BlockScaled(q3, s3)), "fp8")(x)
    deq = Linear(stack_rows(*(quant.dequant_fp8_block(q, s, dtype) for q, s in ((q1, s1), (q3, s3)))), "fp8")(x)
    for out in (nat, deq):
        assert torch.equal(out[:, :64], Linear(quant.BlockScaled(q1, s1), "fp8")(x))
        assert torch.equal(out[:, 64:], Linear(quant.BlockScaled(q3, s3), "fp8")(x))
    with pytest.raises(ValueError, match="32-row scale blocks"):
        stack_rows(quant.BlockScaled(q1[:48], s1[:2]), quant.BlockScaled(q3, s3))


def test_native_moe_matches_dequantized(toy_cfg, toy_weights):
    nat = prepare_weights(toy_cfg, toy_weights, torch.float32, "cpu", native=True)["layers.3"]
    deq = prepare_weights(toy_cfg, toy_weights, torch.float32, "cpu", native=False)["layers.3"]
    sub = lambda w: {k[4:]: v for k, v in w.items() if k.startswith("ffn.")}  # noqa: E731
    args = (toy_cfg.num_experts_per_tok, toy_cfg.routed_scaling_factor, toy_cfg.swiglu_limit)
    m_nat, m_deq = MoE(sub(nat), *args), MoE(sub(deq), *args)
    assert m_nat.native and not m_deq.native
    x = torch.randn(11, toy_cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    assert torch.equal(m_nat(x), m_deq(x))     # the reference of the W4A8 op is the dequantized op


def test_native_engine_on_cpu_matches(toy_weights):
    """The toy engine with --weight-format native (the native ops' reference impls on the CPU)
    generates what the dequantized engine generates, greedy, float32; dequant is the default."""
    reqs = H.prompts((9, 23), seed=2)
    want = H.run_in_order(toy_weights, reqs, max_tokens=4, dtype="float32")
    assert not H.make_engine(toy_weights, "float32").runner.model.layers[3].ffn.native
    block = H.make_engine(toy_weights, "float32", weight_format="native").runner.model.layers[3]
    assert block.attn.wq_a_kv.scale is not None and block.ffn.native     # the native ops do run
    assert H.run_in_order(toy_weights, reqs, max_tokens=4, dtype="float32", weight_format="native") == want


@pytest.mark.parametrize("bad,match", [(dict(weight_format="fp4"), "weight_format: 'fp4'"),
                                       (dict(weight_format="native", dtype="float64"), "float64")])
def test_weight_format_is_checked_before_loading(bad, match):
    from runtime.engine import EngineArgs
    from runtime.geometry import AdmissionError
    with pytest.raises(AdmissionError, match=match):
        EngineArgs(**{"model": "toy", **bad}).admit()


@pytest.fixture(scope="module")
def toy_weights_fp8_wo_a(toy_cfg):
    from v41.loader import dummy_weights
    return dummy_weights(toy_cfg, progress=False, wo_a="fp8")


def test_loader_keeps_wo_a_fp8_when_asked(toy_cfg, toy_weights, toy_weights_fp8_wo_a):
    from v41.loader import dummy_weights
    w = toy_weights_fp8_wo_a
    name = "layers.3.attn.wo_a.weight"
    assert w[name].dtype == torch.float8_e4m3fn and "layers.3.attn.wo_a.scale" in w.tensors
    assert torch.equal(quant.dequant_fp8_block(w[name], w["layers.3.attn.wo_a.scale"], torch.bfloat16),
                       toy_weights[name])                         # §5.4's BF16 copy, exactly
    with pytest.raises(ValueError, match="wo_a 'fp4'"):
        dummy_weights(toy_cfg, progress=False, wo_a="fp4")


def test_native_wo_a_is_an_a8_gemm_per_group(toy_cfg, toy_weights, toy_weights_fp8_wo_a):
    """Native wo_a: per group, the inverse-RoPE'd output quantized per 32 (A8) times the FP8
    weight (W8A8), where the dequantized path multiplies BF16 without an act quant (§5.4), all
    groups in one grouped `fp8_block_gemm`. The dequantized model with an FP8 wo_a equals the
    §5.4 one; the native one computes the A8 form."""
    from v41.layers import fp8_linear
    from v41.model import Transformer
    nat = Transformer(toy_cfg, toy_weights_fp8_wo_a, torch.float32, "cpu", native=True).layers[3].attn
    deq = Transformer(toy_cfg, toy_weights_fp8_wo_a, torch.float32, "cpu", native=False).layers[3].attn
    ref = Transformer(toy_cfg, toy_weights, torch.float32, "cpu", native=False).layers[3].attn
    assert nat.wo_a is None and nat.wo_a_q.dtype == torch.float8_e4m3fn
    assert torch.equal(deq.wo_a, ref.wo_a)
    G, R, I = toy_cfg.o_groups, toy_cfg.o_lora_rank, toy_cfg.o_group_in
    assert nat.wo_a_q.shape == (G * R, I)
    o = torch.randn(7, G, I, generator=torch.Generator().manual_seed(4))
    got = fp8_linear(o.flatten(1), nat.wo_a_q, nat.wo_a_scale, groups=G)
    want = torch.einsum("tgi,goi->tgo", quant.fp8_qat(o.reshape(7, -1)).view(7, G, I), ref.wo_a).flatten(1)
    assert got.shape == (7, G * R)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_native_engine_loads_wo_a_fp8(toy_weights):
    """--weight-format native loads wo_a FP8 (weights=None: the engine's own load) and serves."""
    from runtime.engine import EngineArgs, LLMEngine
    from runtime.sequence import SamplingParams
    eng = LLMEngine(EngineArgs(model="toy", dtype="float32", max_num_seqs=2, max_model_len=128,
                               weight_format="native"))
    attn = eng.runner.model.layers[3].attn
    assert attn.wo_a is None and attn.wo_a_scale is not None
    seq = eng.add_request(H.prompts((20,), seed=5)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(seq.completion_token_ids) == 4


@pytest.mark.parametrize("fmt,dtype", [("native", torch.float8_e4m3fn), ("dequant", torch.bfloat16)])
def test_engine_args_load_weights_as_the_engine_runs_them(fmt, dtype):
    """EngineArgs.load_weights (the engine's load, and benchmarks' shared load across engines):
    wo_a stays FP8 with its scales under native weights, else BF16 without them."""
    from runtime.engine import EngineArgs
    args = EngineArgs(model="toy", dtype="float32", weight_format=fmt)
    cfg, _ = args.admit()
    w = args.load_weights(cfg)
    assert w["layers.3.attn.wo_a.weight"].dtype == dtype
    assert ("layers.3.attn.wo_a.scale" in w.tensors) == (fmt == "native")


def test_native_engine_compiles(tmp_path):
    """The compiled native forward (Inductor's graph pipeline and our passes, post_grad_eager)
    decomposes the functionalized native GEMM ops, whose E8M0 scales it sees as uint8 codes,
    and generates the eager native engine's tokens (float32 mini model, greedy)."""
    import json

    from runtime.sequence import SamplingParams
    from tests.test_dspark_compiled import compile_engine, mini_engine, until_done
    from v41.loader import dummy_weights
    cfg = H.mini_cfg()
    weights = dummy_weights(cfg, progress=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    reqs, params = H.prompts((5, 17, 40), seed=4), SamplingParams(max_tokens=6, ignore_eos=True)
    want = until_done(mini_engine(str(tmp_path), weights, dtype="float32", weight_format="native"), reqs, params)
    eng = mini_engine(str(tmp_path), weights, dtype="float32", weight_format="native")
    assert eng.runner.model.native
    with pytest.MonkeyPatch.context() as mp:
        compile_engine(eng, "NONE", mp, tmp_path / "compile")
    assert until_done(eng, reqs, params) == want
