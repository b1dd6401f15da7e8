"""The step's tensors. `Batch` is the forward's view of one step; `StepBuffers` owns every tensor
a step sends to the device: a persistent device buffer per field (fixed addresses, which a
captured CUDA graph reads), a host mirror of each (pinned on CUDA; on the CPU the device buffer
is host memory and serves as its own mirror) that the runner fills with numpy, and one
non-blocking host-to-device copy per field and step (none on the CPU). Nothing
here reads the device.

A pinned mirror may be rewritten only after the copy that read it has run. A step that samples
ends with the sampler's device-to-host copy, which follows the step's copies on the stream, so
the next step finds them done; after a step that samples nothing `host` waits on the event
recorded behind the last copies (`begin`; an event query first, so finished copies cost no
wait).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A padding row's value in each per-token field: it reads and writes nothing (DESIGN §5
# "Padding is inert"); block-table rows past the step's requests are 0 and only padding rows
# (batch id -1) point there.
PAD = {"input_ids": 0, "positions": 0, "batch_ids": -1, "win_idx": -1, "ring_dest": -1, "tail_src": -1,
       "tail_dst": -1, "dest1": -1, "dest2": -1, "image_dest": -1}


@dataclass
class Batch:
    """The forward's view of one step: tensors of `running_tokens` rows / `running_bs` requests."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch_ids: torch.Tensor        # request of each row, -1 for padding
    block_table: torch.Tensor      # [running_bs, max_pages]
    win_idx: torch.Tensor          # [T, W] window rows: ring row, ring rows + batch row, or -1
    ring_dest: torch.Tensor        # [T] ring row each row is kept in after the step, or -1
    owner_dest: dict               # ratio -> [T] owner plane row of the group a row completes
    tail_src: torch.Tensor         # [T] tail slot a row's group starts in, or -1
    tail_dst: torch.Tensor         # [T] tail slot that keeps the row for the next step, or -1
    engram_rows: dict              # layer -> [T, width] gathered table rows
    image_dest: torch.Tensor | None = None  # [T] checkpoint-image ring row, or -1 (copy mode)
    decoder: object = None         # runtime.replay.DecoderRows, or None: every row runs every layer
    max_position: torch.Tensor | None = None   # [1] on the host: the largest position of a row (None: unknown)


def window_rows(out: np.ndarray, pos, start, slot, floor, W: int, S: int) -> np.ndarray:
    """`Batch.win_idx` of a forward's rows into `out` [T, W], a request's rows consecutive: for row
    t at position p, positions p-W+1 .. p oldest first, each a ring row (slot*W + q % W) below the
    request's first row of the forward (`start`), the forward's own row from there (S*W + t - (p - q),
    S the ring's slots), -1 below `floor`. A row W-1 or more past both reads its forward's rows
    only, S*W + t-W+1+j: one broadcast add; the general rule runs on the rest (at most W-1 a
    request, and those near a floor)."""
    T = len(pos)
    np.add(np.arange(S * W - (W - 1), S * W - (W - 1) + T)[:, None], np.arange(W), out=out)
    low = np.flatnonzero(pos - (W - 1) < np.maximum(start, floor))
    if low.size:
        p = pos[low, None]
        q = p - (W - 1) + np.arange(W)
        row = np.where(q >= start[low, None], S * W + low[:, None] - (p - q), slot[low, None] * W + q % W)
        out[low] = np.where(q >= floor[low, None], row, -1)
    return out


def step_fields(T: int, B: int, W: int, max_pages: int, engram_ids: dict, page: int) -> dict:
    """Shape of every int64 field a step publishes. Per token: the Batch fields (dest1/dest2 are
    owner_dest[1]/[2]); per request: the block table, each request's last row, the requests
    that sample and the rows they sample (a DSpark verify request samples all its rows), the cursor each slot commits after the step, the cursor a
    replay resume sets; the checkpoint images a step captures and their cursors; the decoder's
    rows, windows and query rows (bounded replay); the Engram hash ids of each Engram layer
    (`engram_ids`: layer -> ids per token)."""
    C = T // page + B            # image captures: the PAGE boundaries T rows of B requests cross
    f = {k: (T,) for k in PAD if k != "win_idx"}
    f.update(win_idx=(T, W), block_table=(B, max_pages), sample_rows=(B,), final_rows=(B,), final_last=(T,),
             commit_slots=(B,),
             commit_cursor=(B, 4), resume_slots=(B,), resume_cursor=(B, 4), image_ids=(C,),
             image_cursor=(C, 4), dec_rows=(T,), dec_win=(T, W), dec_queries=(T,))
    f.update({f"engram_ids.{l}": (T, k) for l, k in engram_ids.items()})
    return f


class StepBuffers:
    """Device buffers and their host mirrors, one int64 pair per field (`step_fields`)."""

    def __init__(self, shapes: dict, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dev = {k: torch.zeros(s, dtype=torch.long, device=self.device) for k, s in shapes.items()}
        # on the CPU the device buffer is host memory already: it is its own mirror
        self._host = ({k: torch.zeros(s, dtype=torch.long, pin_memory=True) for k, s in shapes.items()}
                      if self.cuda else self.dev)
        self._np = {k: t.numpy() for k, t in self._host.items()}
        self._copied = torch.cuda.Event() if self.cuda else None     # recorded behind each publish's copies
        self._views = {}               # (field, rows) -> the device buffer's first rows

    @property
    def host(self) -> dict:
        """The host mirrors as written for the current step (numpy)."""
        return self._np

    def begin(self) -> dict:
        """The host mirrors as numpy arrays, safe to write for one step: waits for the copies of
        the step before if they have not run (see the module docstring). Each field is written
        at most once per step."""
        if self.cuda and not self._copied.query():     # (never recorded: done)
            self._copied.synchronize()
        return self._np

    def publish(self, rows: dict) -> dict:
        """Copy the first `rows[k]` rows of each named mirror to its device buffer (non-blocking);
        returns the device views of those rows."""
        out, views = {}, self._views
        for k, n in rows.items():
            d = views.get((k, n))
            if d is None:       # slicing costs a microsecond or two: each (field, rows) once
                d = views[k, n] = self.dev[k][:n]
            if n and self.cuda:
                d.copy_(self._host[k][:n], non_blocking=True)
            out[k] = d
        if self.cuda:
            self._copied.record()
        return out

    def put(self, name: str, a: np.ndarray) -> torch.Tensor:
        """`a` (its first dim at most the field's) on the device, through the mirror."""
        n = len(a)
        self._np[name][:n] = a
        return self.publish({name: n})[name]
