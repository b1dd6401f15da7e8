"""SWA bounded replay as the runtime guide states it (seeds, "Decoder SWA bounded replay" and
"Encoder SWA bounded replay"), as a `window_start` hook for Oracle.forward.

Decoder: with W the window and L the prompt length, the tail is the prompt's last W rows,
s = max(0, L - W); in every decoder layer (the boundary layer on) a row at position p >= s reads
[max(s, p - W + 1), p]. Rows after the prompt (decode) keep their window, which starts above s
anyway. Encoder: a prefix hit replayed from `encoder_start` reads no window row below it in the
encoder's layers.
"""
from __future__ import annotations

from tests.reference.oracle import replay_window


def bounded_replay(cfg, prompt_len: int, encoder_start: int | None = None):
    boundary = cfg.topology.boundary
    decoder = replay_window(max(0, prompt_len - cfg.sliding_window), boundary)
    encoder = replay_window(encoder_start, 0) if encoder_start is not None else None

    def hook(layer, positions):
        if layer >= boundary:
            return decoder(layer, positions)
        return encoder(layer, positions) if encoder is not None else None
    return hook
