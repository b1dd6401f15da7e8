"""Triton impls of the v41 ops, registered for CUDA tensors (`registry.register_impl(...,
"triton", device_type="cuda")`); the torch reference stays the impl of every other device.
Each impl is also a plain function with the op's signature (e.g. `triton_sparse_attn`), which
the CPU tests run on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported).
Importing this package needs triton; callers guard it with `except ImportError`.
"""
from custom_ops.triton.attention import triton_sparse_attn  # noqa: F401
from custom_ops.triton.cache import triton_scatter_rows  # noqa: F401
from custom_ops.triton.compressor import triton_compress_pool  # noqa: F401
from custom_ops.triton.index import triton_index_topk  # noqa: F401
from custom_ops.triton.attn_out import triton_inv_rope_wo_a  # noqa: F401
from custom_ops.triton.fp8_gemm import (triton_fp8_act_quant, triton_fp8_block_gemm,  # noqa: F401
                                        triton_fp8_block_gemm_act_quant, triton_fp8_linear)
from custom_ops.triton.engram import triton_engram_gate, triton_engram_gather  # noqa: F401
from custom_ops.triton.head import triton_f32_linear  # noqa: F401
from custom_ops.triton.mhc import triton_hc_collapse, triton_hc_expand, triton_mhc_mix  # noqa: F401
from custom_ops.triton.moe import triton_moe_experts  # noqa: F401
from custom_ops.triton.moe_route import triton_moe_route  # noqa: F401
from custom_ops.triton.moe_w4a8 import triton_moe_experts_w4a8  # noqa: F401
from custom_ops.triton.norm import (triton_hc_collapse_rms_norm_act_quant, triton_rms_norm,  # noqa: F401
                                    triton_rms_norm_act_quant, triton_rms_norm_fp8)
from custom_ops.triton.overlap import triton_join, triton_moe_experts_fork, triton_moe_experts_w4a8_fork  # noqa: F401
from custom_ops.triton.rope import triton_rms_norm_rope_fp8_qat, triton_rope, triton_rope_fp8_qat  # noqa: F401
