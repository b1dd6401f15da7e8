"""v41 custom ops. Importing the package registers every op under `torch.ops.v41`."""
from custom_ops import attention, cache, compressor, engram, index, moe  # noqa: F401
from custom_ops import attn_out, gemm, head, mhc, norm, overlap, rope  # noqa: F401
from custom_ops.registry import defined, op  # noqa: F401
