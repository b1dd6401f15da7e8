"""The checks tests/test_cuda_graph_gpu.py (real CUDA graphs, H200) and test_cuda_graph_cpu.py
(a recording stand-in for the graph API) both run on an engine whose runner replays graphs."""
from __future__ import annotations

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
    """Each of `steps` decode steps replays at `width` and gives the logits and cache of the same
    forward run without a graph at that width, from the same cache state (bit for bit)."""
    r = eng.runner
    for _ in range(steps):
        sb = eng.scheduler.schedule()
        assert r.graphs.width_for(sb) == width
        snap, cursor = snapshot(r.cache), r.cache.cursor.clone()
        graphed = r.run(sb).clone()
        after = snapshot(r.cache)
        restore(r.cache, snap)
        r.cache.cursor.copy_(cursor)
        plain = r.run(sb, running_tokens=width, running_bs=width)
        assert torch.equal(graphed, plain)
        assert all(torch.equal(after[k], v) for k, v in snapshot(r.cache).items())
        eng.scheduler.postprocess(sb, {s.seq_id: int(t) for s, t in zip(sb.seqs, plain.argmax(-1).tolist())})


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
