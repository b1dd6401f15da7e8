"""The KV pool sized from GPU memory (`--gpu-memory-utilization`, as vLLM): of the GPU's bytes
the engine may use `total x utilization`; the weights, the profiled activation peak, the CUDA
graph pool and the index scorer's scratch come off, the STATE slots (one per running request)
and checkpoint images next, and the rest becomes PAGEs. A pool that cannot hold one request of
`max_model_len` tokens is refused with the numbers. `plan_pool` is pure; `profile_cuda` measures
the inputs on a CUDA engine.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from runtime.geometry import AdmissionError

GiB = 2 ** 30


@dataclass(frozen=True)
class PoolPlan:
    num_pages: int
    num_slots: int
    budget_bytes: int          # total x utilization
    reserved_bytes: int        # weights + activations + graph pool + scorer scratch
    state_bytes: int           # slots and images
    page_bytes: int            # num_pages x bytes per PAGE
    graph_pool_bytes: int = 0  # the part of reserved_bytes planned for the CUDA graph pool

    def summary(self) -> dict:
        return asdict(self)


def plan_pool(*, total_bytes: int, utilization: float, weight_bytes: int, activation_peak: int,
              graph_pool_bytes: int, scorer_scratch: int, bytes_per_page: int, bytes_per_state: int,
              max_model_len: int, page_tokens: int, num_slots: int, bytes_per_image: int = 0,
              num_images: int = 0) -> PoolPlan:
    """(num_pages, num_slots) for the memory left; AdmissionError naming the numbers when one
    request of `max_model_len` tokens does not fit beside `num_slots` slots."""
    if not 0 < utilization <= 1:
        raise AdmissionError(f"gpu_memory_utilization: {utilization} is not in (0, 1]")
    for name, v in (("total_bytes", total_bytes), ("weight_bytes", weight_bytes),
                    ("activation_peak", activation_peak), ("graph_pool_bytes", graph_pool_bytes),
                    ("scorer_scratch", scorer_scratch), ("bytes_per_page", bytes_per_page),
                    ("bytes_per_state", bytes_per_state), ("num_slots", num_slots)):
        if v < 0 or (name in ("bytes_per_page", "num_slots") and v == 0):
            raise ValueError(f"{name}: {v} is not a valid size")
    budget = int(total_bytes * utilization)
    reserved = weight_bytes + activation_peak + graph_pool_bytes + scorer_scratch
    state = num_slots * bytes_per_state + num_images * bytes_per_image
    pages = max(0, budget - reserved - state) // bytes_per_page
    need = -(-max_model_len // page_tokens)
    if pages < need:
        raise AdmissionError(
            f"gpu_memory_utilization: {utilization} of {total_bytes / GiB:.2f} GiB is {budget / GiB:.2f} GiB; "
            f"weights {weight_bytes / GiB:.2f} GiB, activation peak {activation_peak / GiB:.2f} GiB, graph pool "
            f"{graph_pool_bytes / GiB:.2f} GiB, index scratch {scorer_scratch / GiB:.2f} GiB and {num_slots} STATE "
            f"slots + {num_images} images ({state / GiB:.2f} GiB) leave {pages} PAGEs of {bytes_per_page} bytes; "
            f"one request of max_model_len {max_model_len} needs {need}: raise --gpu-memory-utilization, or lower "
            f"--max-model-len, --max-num-seqs or --max-num-batched-tokens")
    return PoolPlan(pages, num_slots, budget, reserved, state, pages * bytes_per_page, graph_pool_bytes)


def graph_pool_overrun(plan: PoolPlan, captured_bytes: int) -> str | None:
    """A warning when the captured graph pool outgrew its plan (the plan profiles one forward at
    the largest capture size; TR_HYBRID keeps every token piece's outputs for every bucket, which
    that undercounts), else None: the bytes came out of the headroom `1 - utilization` leaves."""
    if captured_bytes <= plan.graph_pool_bytes:
        return None
    return (f"CUDA graph pool: {captured_bytes / GiB:.2f} GiB captured, {plan.graph_pool_bytes / GiB:.2f} GiB "
            f"planned; the {(captured_bytes - plan.graph_pool_bytes) / GiB:.2f} GiB over came out of the "
            f"memory --gpu-memory-utilization leaves free: lower it, or set --num-pages, if the GPU is shared")


def profile_cuda(runner, tokens: int, decode_bs: int) -> dict:
    """On a CUDA runner (a small cache allocated): the GPU's total bytes, the bytes held now
    (weights and that cache), the activation peak of a padding forward of `tokens` rows and
    of `decode_bs` rows (the largest captured decode graph: the shared graph pool holds about
    what its forward allocates)."""
    import torch
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()       # blocks cached from the load (dequantization temporaries) are not weights
    free, total = torch.cuda.mem_get_info(dev)
    peaks = {}
    with torch.inference_mode():
        for name, rows in (("activation_peak", tokens), ("graph_pool_bytes", decode_bs)):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            runner.forward(runner.padding_batch(rows), runner.cache)
            torch.cuda.synchronize(dev)
            peaks[name] = torch.cuda.max_memory_allocated(dev) - base
    cache_bytes = runner.cache.nbytes
    # what other processes hold counts against the budget too, as in vLLM
    held = total - free
    return {"total_bytes": total, "weight_bytes": max(0, held - cache_bytes), **peaks}
