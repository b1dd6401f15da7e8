"""The DSpark draft as CUDA graphs, keyed by request count (the cache-format doc: "DSpark
additionally replays its request-count-keyed draft graph").

The draft (v41.dspark.DSpark: three stages over the draft rings, the Markov head, five rows per
request) is captured once per count in `sizes` on static input rows (anchor token, anchor
position, STATE slot, context floor), into the target graphs' pool. A proposal for B requests
checks their inputs on the host, writes them into a pinned mirror with the rest of the captured
count as inert requests (slot 0, position 0, a context floor past every position: they read no
context row, and the draft writes nothing), copies it over in one non-blocking copy, replays,
and returns the first B rows of the proposed tokens. More requests than the largest count run
the draft eagerly (`SpecStep.propose`).
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from runtime.cuda_graph import capture_graph, capturing

log = logging.getLogger("v41")

# the input rows of the static buffer: anchors, anchor positions, slots, context floors
ANCHORS, POSITIONS, SLOTS, FLOORS = range(4)


class DraftGraphRunner:
    def __init__(self, spec, sizes, pool=None):
        """`spec`: the runner's SpecStep; `sizes`: request counts (each at most max_num_seqs);
        `pool`: the target graphs' memory pool, shared."""
        r = spec.runner
        if r.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {r.device}")
        sizes = tuple(sorted(set(sizes)))
        if not sizes or sizes[0] < 1 or sizes[-1] > r.max_seqs:
            raise ValueError(f"draft graph sizes {sizes} not in [1, {r.max_seqs}]")
        self.spec, self.sizes, self.pool = spec, sizes, pool
        self.host = torch.zeros(4, sizes[-1], dtype=torch.long, pin_memory=torch.cuda.is_available())
        self.dev = torch.zeros(4, sizes[-1], dtype=torch.long, device=spec.taps.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.fn = self.tokens
        self.replays = 0

    def tokens(self, anchors, anchor_pos, slots, floors, rings) -> torch.Tensor:
        """The draft's proposed tokens [B, T]; the inputs were checked on the host."""
        return self.spec.draft(anchors, anchor_pos, slots, floors, rings, check=False).tokens

    def _args(self, b: int) -> tuple:
        return (*self.dev[:, :b], self.spec.draft_rings)

    def _stage(self, cols: np.ndarray | None, b: int) -> None:
        """`cols` [4, B] into the mirror, inert requests up to `b`, one copy to the device."""
        h = self.host.numpy()
        B = 0 if cols is None else cols.shape[1]
        if B:
            h[:, :B] = cols
        h[:, B:b] = 0
        h[FLOORS, B:b] = self.spec.draft.max_pos          # past every position: no context row
        self.dev[:, :b].copy_(self.host[:, :b], non_blocking=True)

    def capture(self) -> dict:
        """Every count, largest first. Returns {sizes, seconds, pool_bytes}."""
        dev = self.dev.device
        with capturing(dev) as report, torch.inference_mode():
            for b in sorted(self.sizes, reverse=True):
                self._stage(None, b)
                g, out = capture_graph(self.fn, self._args(b), self.pool, dev)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b], self.outputs[b] = g, out
        report = {"sizes": list(self.sizes), **report}
        log.info("CUDA graphs (DSpark draft): %d request counts captured in %.1fs (largest %d)",
                 len(self.sizes), report["seconds"], self.sizes[-1])
        return report

    def propose(self, cols: np.ndarray, on_device: tuple | None = None) -> torch.Tensor | None:
        """The proposed tokens [B, T] of B requests (`cols` [4, B]: anchors, anchor positions,
        slots, context floors), or None when B is above the largest captured count.
        `on_device`: (anchors, anchor positions) [B] on the device, copied over cols' first two
        rows after the host's copy (those rows then only bound the checks)."""
        B = cols.shape[1]
        if not B or B > self.sizes[-1]:
            return None
        d = self.spec.draft
        d.check_inputs(cols[ANCHORS], cols[POSITIONS], cols[SLOTS], cols[FLOORS], self.spec.draft_rings.shape[1])
        b = self.sizes[bisect.bisect_left(self.sizes, B)]
        self._stage(cols, b)
        if on_device is not None:
            self.dev[ANCHORS, :B].copy_(on_device[0])
            self.dev[POSITIONS, :B].copy_(on_device[1])
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:B]
