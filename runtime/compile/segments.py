"""The forward as segments (the package docstring has the picture): the split points of any
topology, the segment modules Dynamo traces, the forward run through them, and the tensors whose
dim 0 is the token count (the one dynamic dim)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

SEGMENTS = ("_Backbone", "_EarlyLayers", "_LateLayers", "_Layer", "_QueryLayer")


@dataclass(frozen=True)
class SplitPoints:
    """Layers of each part of the forward (any topology): early [0, boundary), the boundary
    layer, late (boundary, last), the last layer."""
    boundary: int
    last: int

    @classmethod
    def of(cls, cfg) -> "SplitPoints":
        topo = cfg.topology
        return cls(topo.boundary, topo.n_backbone - 1)

    @property
    def early(self) -> range:
        return range(0, self.boundary)

    @property
    def late(self) -> range:
        return range(self.boundary + 1, self.last)

    @property
    def single(self) -> tuple:
        """The layers that are one-layer segments (`_Layer<i>`)."""
        return tuple(sorted({self.boundary, self.last}))

    @property
    def query_segment(self) -> str:
        """The name of the last layer's segment on a decoder plan's query rows (`_QueryLayer`)."""
        return f"_QueryLayer{self.last}"


class _Backbone(nn.Module):
    """The whole forward, one graph (bounded replay off)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch, cache):
        return self.model(batch, cache)


class _EarlyLayers(nn.Module):
    """Embedding and the encoder below the boundary layer (0..19 in Flash)."""

    def __init__(self, model, layers: range):
        super().__init__()
        self.model = model
        self.layers = nn.ModuleList(model.layers[i] for i in layers)

    def forward(self, batch, cache, sel):
        X, pre = self.model.embed(batch)
        for block in self.layers:
            X, pre = block(X, pre, batch, cache, sel)
        return X, pre


class _LateLayers(nn.Module):
    """The decoder between the boundary and the last layer (21..38 in Flash)."""

    def __init__(self, model, layers: range):
        super().__init__()
        self.layers = nn.ModuleList(model.layers[i] for i in layers)

    def forward(self, X, pre, batch, cache, sel):
        for block in self.layers:
            X, pre = block(X, pre, batch, cache, sel)
        return X, pre


class _Layer(_LateLayers):
    """The boundary or the last layer as a segment of its own (`_Layer<i>`): the boundary layer
    of every step (with a decoder plan on the decoder's rows, which `enter_decoder` gathers
    between the segments), the last layer of a step without a decoder plan (decode and verify
    steps: every row through every layer; with one, `_QueryLayer`)."""

    def __init__(self, model, layer: int):
        super().__init__(model, range(layer, layer + 1))


class _QueryLayer(_Layer):
    """The last layer of a step with a decoder plan (segment `_QueryLayer<i>`): every decoder
    row's window KV, the rest on the step's query rows alone (`queries`, v41.attention.QueryRows:
    the rows it samples). Its two token counts, the decoder's rows and the query rows, are the
    segment's dynamic dims."""

    def forward(self, X, pre, batch, cache, sel, queries):
        for block in self.layers:
            X, pre = block(X, pre, batch, cache, sel, queries)
        return X, pre


def split_forward(model, batch, cache, early: Callable, late: Callable | None, points: SplitPoints,
                  layer: Callable | None = None, query_layer: Callable | None = None):
    """The forward as segments: `early`/`late` are the (compiled or eager) segment callables;
    `layer(i, X, pre, batch, cache, sel)` runs the boundary or last layer `i` on every row it
    receives, `query_layer(i, X, pre, batch, cache, sel, queries)` the last layer of a step with a
    decoder plan on its query rows (None: eagerly). The boundary layer, on the decoder's rows, is
    then a layer like the late ones. A step with no query row (none samples) runs the last layer
    eagerly: its window KV is all that layer computes then."""
    sel: dict = {}
    X, pre = early(batch, cache, sel)
    queries = None
    if batch.decoder is not None:     # bounded replay: the decoder runs on its rows alone
        X, pre, batch, sel, queries = model.enter_decoder(X, pre, batch, cache, sel)
        if not X.shape[0]:
            return model.final(X, pre)

    def block(i, X, pre, q):
        if q is None:
            if layer is not None:
                return layer(i, X, pre, batch, cache, sel)
        elif query_layer is not None and q.rows.shape[0]:
            return query_layer(i, X, pre, batch, cache, sel, q)
        return model.layers[i](X, pre, batch, cache, sel, q)

    X, pre = block(points.boundary, X, pre, queries if points.last == points.boundary else None)
    if late is not None:
        X, pre = late(X, pre, batch, cache, sel)
    if points.last != points.boundary:
        X, pre = block(points.last, X, pre, queries)
    return model.final(X, pre)


# ---- dynamic dims --------------------------------------------------------------------------

def token_tensors(batch, *extra) -> list:
    """Every tensor whose dim 0 is the token count: the batch's per-token fields, the Engram
    rows, and `extra` (X, pre, sel values)."""
    out = [batch.input_ids, batch.positions, batch.batch_ids, batch.win_idx, batch.ring_dest,
           batch.tail_src, batch.tail_dst]
    out += list(batch.owner_dest.values()) + list(batch.engram_rows.values())
    if getattr(batch, "image_dest", None) is not None:
        out.append(batch.image_dest)
    for e in extra:
        if isinstance(e, dict):
            out += [v for v in e.values() if isinstance(v, torch.Tensor)]
        elif isinstance(e, torch.Tensor):
            out.append(e)
    return out


def call_context(warm: bool):
    """Around a compiled segment's call: once warm, a recompile is an error; before, the trace
    treats the dynamic dims size-obliviously (a 1-token step needs no 0/1 specialization)."""
    return (torch.compiler.set_stance("fail_on_recompile") if warm
            else torch.fx.experimental._config.patch(backed_size_oblivious=True))


def mark_tokens(batch, *extra) -> None:
    for t in token_tensors(batch, *extra):
        torch._dynamo.maybe_mark_dynamic(t, 0)


def mark_queries(queries) -> None:
    """The query rows' count: dim 0 of every per-query field (QueryRows)."""
    for t in (queries.rows, queries.positions, queries.batch_ids, queries.win_idx):
        torch._dynamo.maybe_mark_dynamic(t, 0)

