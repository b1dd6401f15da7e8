"""TR_HYBRID CUDA graphs (`--cudagraph-mode TR_HYBRID`): the runner's compiled forward, split at
the splitting ops (passes/split.py SPLITTING_OPS: sparse attention, index top-k, the ratio-2
compressor, row scatters), replays a token graph per compiled piece with those ops eager between
them (runtime/compile/piece_graphs.py), so prefill, mixed and decode steps all replay.

A step of T tokens runs at the smallest token bucket b >= T (`width_for`): the runner pads it to
b rows (batch id -1, every destination -1: the eager ops read and write nothing for them, the
token pieces compute rows nobody reads) and every piece that sees b rows replays its graph of b.
Steps above the largest bucket run the compiled forward without graphs.

Under decoder bounded replay a step that finishes a prompt runs the late layers on the decoder's
rows only (runtime/replay.py). Those are padded to a bucket too (the smallest one holding them;
padding rows gathered from row 0 with batch id -1 and every destination and window -1, never a
query row of the last layer, so nothing reads them), and their per-row fields live in step
buffers of their own (dec_*), so the late pieces replay: each is captured twice per bucket, on
the runner's buffers (steps without a decoder: decode steps) and on the decoder's
(`padding_decoder`), right after, so replays in a step stay in capture order (piece_graphs.py).

tests/test_token_graphs.py runs this on the CPU with the recording stand-in of torch.cuda's graph
API (tests/test_cuda_graph_cpu.py); tests/test_cuda_graph_gpu.py holds the GPU checks.
"""
from __future__ import annotations

import bisect
import logging

import torch
from tqdm import tqdm

from runtime import replay
from runtime.batch import Batch
from runtime.cuda_graph import capturing

log = logging.getLogger("v41")


def token_buckets(max_tokens: int) -> tuple:
    """1, 2, 4, ..., 512 below the step budget, and the budget when it is at most 512."""
    return tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < max_tokens}
                        | ({max_tokens} if max_tokens <= 512 else set())))


class TokenGraphRunner:
    gathers_engram = False      # the step's Engram rows come from `prepare`: the pieces read them

    def __init__(self, runner, sizes):
        """`sizes`: the token buckets to capture (each at most max_num_batched_tokens)."""
        if runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {runner.device}")
        graphs = getattr(runner.forward, "piece_graphs", None)
        if graphs is None:
            raise ValueError("TR_HYBRID replays the pieces of a forward compiled with splitting ops "
                             "(CompileConfig.splitting_ops)")
        sizes = tuple(sorted(set(sizes)))
        if not sizes or sizes[0] < 1 or sizes[-1] > runner.max_tokens:
            raise ValueError(f"token buckets {sizes} not in [1, {runner.max_tokens}]")
        self.runner, self.sizes, self.pieces = runner, sizes, graphs

    def width_for(self, sb) -> int | None:
        """The bucket a step runs at: the smallest one holding its tokens, else None."""
        T = sb.scheduled_tokens
        if not T or T > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, T)]

    @property
    def replays(self) -> int:
        """Piece graphs replayed so far."""
        return self.pieces.counts()["replays"]

    def running(self, width: int) -> dict:
        """The runner's running width for a step at `width` (its requests stay as scheduled; the
        decoder's rows, under bounded replay, at a bucket as well)."""
        return {"running_tokens": width, "decoder_buckets": self.sizes}

    def capture(self, progress: bool = True) -> dict:
        """Capture every piece at every bucket, largest first, each forward after a warm-up
        forward at its width; under decoder bounded replay each bucket's late pieces once more on
        a padding decoder. Returns {sizes, seconds, pool_bytes, pieces, graphs}."""
        r, dev = self.runner, self.runner.device
        self.pieces.static_storages.update(t.untyped_storage().data_ptr()
                                           for t in (*r.bufs.dev.values(), *r.engram_buf.values()))
        with capturing(dev) as report, torch.inference_mode():
            for b in tqdm(sorted(self.sizes, reverse=True), desc="token graphs", unit="bucket", disable=not progress):
                batch = r.padding_batch(b)
                for decoder in (False, True) if r.decoder_replay else (False,):
                    if decoder:
                        batch.decoder = replay.padding_decoder(r.bufs, batch, b, Batch)
                    r.forward(batch, r.cache)                      # warm-up: autotuning, lazy allocations
                    torch.cuda.synchronize(dev)
                    with self.pieces.replaying(b, capture=True):
                        r.forward(batch, r.cache)
        counts = self.pieces.counts()
        report = {"sizes": list(self.sizes), **report, "pieces": counts["pieces"], "graphs": counts["graphs"]}
        log.info("CUDA graphs (TR_HYBRID): %d token pieces at %d buckets, %d graphs in %.1fs (largest %d), "
                 "graph pool %.1f MiB", counts["pieces"], len(self.sizes), counts["graphs"], report["seconds"],
                 self.sizes[-1], report["pool_bytes"] / 2**20)
        return report

    def replay(self, width: int, batch, cache) -> torch.Tensor:
        """The forward of what `prepare` published at `width`: token pieces replay, the
        splitting ops run on the batch."""
        with self.pieces.replaying(width):
            return self.runner.forward(batch, cache)
