"""FULL CUDA graphs (`--cudagraph-mode FULL`): the runner's compiled forward captured once per
decode batch size, largest first, into one shared memory pool. The graphs read the runner's
persistent step buffers (runtime.batch.StepBuffers) and the KV cache, so a replay is what
`ModelRunner.prepare` already does (host mirrors, one copy per field, padding rows to the
captured width) plus `graph.replay()`; no Python runs in the forward. Prefill and mixed steps
run the compiled forward without graphs.

tests/test_cuda_graph_cpu.py runs this class on the CPU with a recording stand-in for
torch.cuda's graph API (replay == plain forward at its width, bitwise; tokens as without
graphs; padding inert). tests/test_cuda_graph_gpu.py holds the same checks with real graphs.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time

import torch
from tqdm import tqdm

log = logging.getLogger("v41")


@contextlib.contextmanager
def capturing(dev):
    """Around a capture: yields a dict that gets its wall time (`seconds`) and the bytes the
    graph pool grew the allocator by (`pool_bytes`) on exit."""
    report = {}
    t0 = time.perf_counter()
    torch.cuda.synchronize(dev)
    # torch.cuda.graph empties the allocator's cache as it enters; doing it first keeps those
    # released free blocks out of the pool's growth
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(dev)
    yield report
    torch.cuda.synchronize(dev)
    report.update(seconds=round(time.perf_counter() - t0, 2), pool_bytes=torch.cuda.memory_reserved(dev) - before)


class CUDAGraphRunner:
    def __init__(self, runner, sizes):
        """`sizes`: the decode batch sizes to capture (each at most the runner's capacities)."""
        if runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {runner.device}")
        sizes = tuple(sorted(set(sizes)))
        if not sizes or sizes[0] < 1 or sizes[-1] > min(runner.max_seqs, runner.max_tokens):
            raise ValueError(f"capture sizes {sizes} not in [1, {min(runner.max_seqs, runner.max_tokens)}]")
        self.runner, self.sizes = runner, sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def width_for(self, sb) -> int | None:
        """The captured batch size a step replays at: the smallest one holding it when every
        request computes one token and samples it (decode), else None."""
        B = len(sb.seqs)
        if not B or B > self.sizes[-1] or sb.scheduled_tokens != B or sb.resumes or sb.captures:
            return None
        if not all(sb.is_final_chunk):       # a 1-token prompt chunk runs the decoder plan
            return None
        return self.sizes[bisect.bisect_left(self.sizes, B)]

    @staticmethod
    def running(bs: int) -> dict:
        """The runner's running width for a step replayed at `bs`."""
        return {"running_tokens": bs, "running_bs": bs}

    def capture(self, progress: bool = True) -> dict:
        """Capture every size, largest first (later graphs reuse the first one's pool), each after
        a warm-up call at its width. Returns {sizes, seconds, pool_bytes}."""
        r, dev = self.runner, self.runner.device
        with capturing(dev) as report, torch.inference_mode():
            for bs in tqdm(sorted(self.sizes, reverse=True), desc="CUDA graphs", unit="graph", disable=not progress):
                batch = r.padding_batch(bs)
                r.forward(batch, r.cache)                      # warm-up: autotuning, lazy allocations
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = r.forward(batch, r.cache)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[bs], self.outputs[bs] = g, out
        report = {"sizes": list(self.sizes), **report}
        log.info("CUDA graphs: %d decode sizes captured in %.1fs (largest %d), graph pool %.1f MiB",
                 len(self.sizes), report["seconds"], self.sizes[-1], report["pool_bytes"] / 2**20)
        return report

    def replay(self, bs: int, batch=None, cache=None) -> torch.Tensor:
        """Run the graph of width `bs` on what `prepare` published (the graph reads the
        buffers `batch` views); its hidden rows [bs, ...]."""
        self.graphs[bs].replay()
        return self.outputs[bs]


def graph_runner(mode: str, runner, sizes):
    """The runner's graphs for `--cudagraph-mode` (FULL: CUDAGraphRunner over decode batch
    sizes; TR_HYBRID: runtime.token_graphs.TokenGraphRunner over token buckets)."""
    if mode == "TR_HYBRID":
        from runtime.token_graphs import TokenGraphRunner
        return TokenGraphRunner(runner, sizes)
    return CUDAGraphRunner(runner, sizes)
