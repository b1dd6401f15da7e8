"""FULL CUDA graphs (`--cudagraph-mode FULL`): the runner's compiled forward captured once per
width (rows), largest first, into one shared memory pool. The graphs read the runner's
persistent step buffers (runtime.batch.StepBuffers) and the KV cache, so a replay is what
`ModelRunner.prepare` already does (host mirrors, one copy per field, padding rows to the
captured width) plus the replay; no Python runs in the forward. The graphs also gather the
step's Engram rows from the published ids (`ModelRunner.graph_forward`): two kernel launches
fewer on the host's path before the replay.

A width's forward is a chain of graphs (`GraphChain`), cut at compiled-piece boundaries
(`CHAIN_CUTS`): launching a graph of ~4,200 kernels took the host 2-3 ms at 16-56 rows on the
H200 while the device waited (benchmarks/decode_timeline.py); a small first graph starts the
device at once, and each later graph launches while the one before it runs.

A step replays when every row it computes is one it samples: decode rows, and DSpark verify
requests (the anchor and each draft, `1 + k` rows, all sampled): then no row takes the decoder
replay plan and every row is a token of the whole model, as the padding rows the graph was
captured on. The widths are the decode batch sizes and, with DSpark, `1 + k` times each
(EngineArgs.graph_sizes). Prefill and other mixed steps run the compiled forward.

tests/test_cuda_graph_cpu.py runs this class on the CPU with a recording stand-in for
torch.cuda's graph API (replay == plain forward at its width, bitwise; tokens as without
graphs; padding inert), tests/test_dspark_compiled.py with DSpark's verify steps;
tests/test_cuda_graph_gpu.py holds the same checks with real graphs.
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


# the compiled pieces (in call order) a new graph of a chain begins at. Piece 0 is the forward's
# head (embedding, mHC expand), then a piece a layer: the first graph holds the head and layer 0,
# and each graph is about three times the one before, so its launch ends before the one before it
# has run. (With the head alone in the first graph, flash-slice's replays idled 0.34-0.41 ms
# between the head and layer 0 at every width, graphs-flash-slice-h200.json's graph_gaps:
# the second graph's launch.)
CHAIN_CUTS = (2, 4, 10, 28)


class GraphChain:
    """One forward captured as consecutive CUDA graphs in one memory pool, replayed in capture
    order (tensors passed from one graph to the next stay referenced through the capture, so no
    later graph reuses their memory before it reads them). Cuts happen on real CUDA only: the
    CPU tests' recording stand-in keeps one graph per forward."""
    active: GraphChain | None = None     # the chain being captured: compiled pieces call `piece_boundary`

    def __init__(self, pool):
        self.pool, self.graphs, self.pieces, self.replays = pool, [], 0, 0

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self.graphs.append(g)

    def end(self) -> None:
        self.graphs[-1].capture_end()
        if self.pool is None:
            self.pool = self.graphs[-1].pool()

    def cut(self) -> None:
        """A compiled piece is about to run: end the graph and begin the next at CHAIN_CUTS."""
        if self.pieces in CHAIN_CUTS and torch.cuda.is_available():
            self.end()
            self.begin()
        self.pieces += 1

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()
        self.replays += 1


def piece_boundary() -> None:
    """Called before every compiled piece (runtime.compile.backend): a cut point of the chain
    being captured, if any."""
    if GraphChain.active is not None:
        GraphChain.active.cut()


_capture_stream = None


def capture_chain(fn, args, pool, dev) -> tuple[GraphChain, torch.Tensor]:
    """(chain, output) of `fn(*args)` captured into `pool` (None: a new one) on a side stream,
    after a warm-up call (autotuning, lazy allocations)."""
    global _capture_stream
    fn(*args)
    torch.cuda.synchronize(dev)
    chain = GraphChain(pool)
    # one side stream for every capture: the pool reuses a freed block only on its own stream
    if _capture_stream is None and torch.cuda.is_available():
        _capture_stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(_capture_stream):
        chain.begin()
        GraphChain.active = chain
        try:
            out = fn(*args)
        finally:
            GraphChain.active = None
            chain.end()
    return chain, out


def capture_graph(fn, args, pool, dev) -> tuple:
    """(graph, output) of `fn(*args)` captured into `pool` (None: a new one, `graph.pool()`),
    after a warm-up call (autotuning, lazy allocations)."""
    fn(*args)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn(*args)
    return g, out


class CUDAGraphRunner:
    def __init__(self, runner, sizes):
        """`sizes`: the widths (rows) to capture, each at most the runner's token capacity."""
        if runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {runner.device}")
        sizes = tuple(sorted(set(sizes)))
        if not sizes or sizes[0] < 1 or sizes[-1] > runner.max_tokens:
            raise ValueError(f"capture sizes {sizes} not in [1, {runner.max_tokens}]")
        self.runner, self.sizes = runner, sizes
        self.graphs: dict[int, GraphChain] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def width_for(self, sb) -> int | None:
        """The captured width a step replays at: the smallest one holding its rows when every
        request's rows are the ones it samples (a decode row; a verify request's anchor and
        drafts) and none resumes or captures an image, else None."""
        T = sb.scheduled_tokens
        if not T or T > self.sizes[-1] or sb.resumes or sb.captures:
            return None
        # a prompt chunk (final or not) computes rows it does not sample: the decoder plan
        if not all(sb.is_final_chunk) or any(n != 1 + len(d) for n, d in zip(sb.num_new, sb.drafts)):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, T)]

    @property
    def replays(self) -> int:
        """Forwards replayed so far, every width's."""
        return sum(chain.replays for chain in self.graphs.values())

    @property
    def gathers_engram(self) -> bool:
        """Its graphs gather the step's Engram rows (ModelRunner.graph_forward), unless mapped
        tables gather them on the host."""
        return self.runner.engram_stager is None

    @staticmethod
    def running(width: int) -> dict:
        """The runner's running width for a step replayed at `width` (its requests as scheduled:
        under static shapes every block-table row is read)."""
        return {"running_tokens": width}

    def capture(self, progress: bool = True) -> dict:
        """Capture every size, largest first (later graphs reuse the first one's pool), each after
        a warm-up call at its width. Returns {sizes, seconds, pool_bytes}."""
        r, dev = self.runner, self.runner.device
        with capturing(dev) as report, torch.inference_mode():
            for width in tqdm(sorted(self.sizes, reverse=True), desc="CUDA graphs", unit="graph", disable=not progress):
                chain, out = capture_chain(r.graph_forward, (r.padding_batch(width), r.cache), self.pool, dev)
                self.pool = chain.pool
                self.graphs[width], self.outputs[width] = chain, out
        report = {"sizes": list(self.sizes), **report,
                  "graphs_per_width": {w: len(c.graphs) for w, c in self.graphs.items()}}
        log.info("CUDA graphs: %d widths captured in %.1fs (largest %d rows, %d graphs each), graph pool %.1f MiB",
                 len(self.sizes), report["seconds"], self.sizes[-1], len(self.graphs[self.sizes[-1]].graphs),
                 report["pool_bytes"] / 2**20)
        return report

    def replay(self, width: int, batch=None, cache=None) -> torch.Tensor:
        """Run the graph of `width` on what `prepare` published (the graph reads the buffers
        `batch` views); its hidden rows [width, ...]."""
        if batch is not None and batch.decoder is not None:
            raise RuntimeError("a FULL graph replayed for a step with a decoder plan: width_for admits "
                               "only steps whose every row samples")
        self.graphs[width].replay()
        return self.outputs[width]


def graph_runner(mode: str, runner, sizes):
    """The runner's graphs for `--cudagraph-mode` (FULL: CUDAGraphRunner over widths of steps
    whose every row samples; TR_HYBRID: runtime.token_graphs.TokenGraphRunner over token buckets)."""
    if mode == "TR_HYBRID":
        from runtime.token_graphs import TokenGraphRunner
        return TokenGraphRunner(runner, sizes)
    return CUDAGraphRunner(runner, sizes)
