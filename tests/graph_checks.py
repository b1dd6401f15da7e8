"""The checks tests/test_cuda_graph_gpu.py (real CUDA graphs, H200) and test_cuda_graph_cpu.py
(a recording stand-in for the graph API) both run on an engine whose runner replays graphs."""
from __future__ import annotations

import numpy as np
import torch

from runtime.sequence import SamplingParams
from tests import harness as H
from tests.compile_helpers import restore, snapshot


def decoding(eng, n: int, seed: int = 0, max_tokens: int = 32):
    """`n` requests past their prompts (every one decoding); returns them."""
    seqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for p in H.prompts((5, 17, 40, 9, 33, 64, 3, 20)[:n], seed=seed)]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        eng.step()
    return seqs


def replay_equals_plain_forward(eng, width: int, steps: int = 3) -> None:
    """Each of `steps` steps replays at `width` and gives the logits and cache of the same
    forward run without a graph at that width, from the same cache state (bit for bit)."""
    for _ in range(steps):
        sb = eng.scheduler.schedule()
        assert eng.runner.graphs.width_for(sb) == width
        step_equals_plain_forward(eng, sb)


def step_equals_plain_forward(eng, sb) -> None:
    """The scheduled step `sb` replayed at its width equals the same forward without graphs at
    that width (logits, NaN rows included, and every cache plane); then it is committed."""
    r = eng.runner
    width = r.graphs.width_for(sb)
    assert width is not None
    snap, cursor = snapshot(r.cache), r.cache.cursor.clone()
    graphed = r.run(sb).clone()
    after = snapshot(r.cache)
    restore(r.cache, snap)
    r.cache.cursor.copy_(cursor)
    plain = r.run(sb, **r.graphs.running(width))
    torch.testing.assert_close(graphed, plain, rtol=0, atol=0, equal_nan=True)
    assert all(torch.equal(after[k], v) for k, v in snapshot(r.cache).items())
    final = np.flatnonzero(sb.is_final_chunk)
    eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: int(plain[i].argmax()) for i in final})


def planes_written_by_a_step(eng, n: int = 3, seed: int = 2) -> list[torch.Tensor]:
    """With `n` requests decoding, every cache plane poisoned with NaN, one step: which entries
    it wrote (a replay's padding rows must add none to a plain step's)."""
    decoding(eng, n, seed=seed)
    c = eng.runner.cache
    planes = [c.ring] + [t for o in c.owners.values() for t in (o.main, o.tail_v, o.tail_g) if t is not None]
    for t in planes:
        t.fill_(float("nan"))
    eng.step()
    return [~t.isnan() for t in planes]
