"""Shared by the tests/test_compile_*.py modules (the compile pipeline, runtime/compile/ and
passes/): step logits, cache snapshots, a CompiledForward installed on a runner, the mini model
(every layer role of the Flash topology in 8 layers) and the toy cut to its first layers.

Compiled runs use the "post_grad_eager" backend (Inductor's whole graph pipeline: AOT,
decompositions, joint-graph and post-grad passes, ours included, without its C++ code
generation) or, where only Dynamo's graph matters, a counting backend. Dynamo and AOT are most
of a compile's cost on the CPU, so each module compiles its models once (module fixtures) and
tests sharing a compiled model live in one module. Inductor itself runs in the dump test and in
the acceptance module (tests/test_compiled_invariance.py).
"""
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from runtime import compile as C  # noqa: E402
from runtime.engine import EngineArgs, LLMEngine  # noqa: E402
from runtime.sequence import SamplingParams  # noqa: E402
from tests import harness as H  # noqa: E402

MINI_REQS = H.prompts((5, 17, 40), seed=4)


def step_logits(eng, reqs, max_tokens=4, prefix="q"):
    """Every step's logits of all rows (of the sampled rows under decoder bounded replay, which
    computes no others); greedy continuation on the engine's own argmax."""
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, r in enumerate(reqs):
        eng.add_request(r, p, f"{prefix}{i}")
    out = []
    replay = eng.args.decoder_swa_bounded_replay
    while eng.has_unfinished():
        sb = eng.scheduler.schedule()
        final = np.flatnonzero(sb.is_final_chunk)
        lg = eng.runner.run(sb, all_rows=not replay)
        last = final if replay else (np.cumsum(sb.num_new) - 1)[final]
        out.append(lg[torch.as_tensor(last)] if replay else lg)
        eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: int(lg[j].argmax()) for i, j in zip(final, last)})
    return out


def snapshot(cache):
    return {k: v.clone() for k, v in _planes(cache)}


def restore(cache, snap):
    for k, v in _planes(cache):
        v.copy_(snap[k])


def _planes(cache):
    for k, v in vars(cache).items():
        if isinstance(v, torch.Tensor):
            yield k, v
    for o, planes in cache.owners.items():
        for k, v in vars(planes).items():
            if isinstance(v, torch.Tensor):
                yield f"{o}.{k}", v


def compiled(runner, **kw) -> C.CompiledForward:
    """Install a CompiledForward (default: post_grad_eager, passes on) as the runner's forward."""
    pm = kw.pop("pass_manager", None)
    fwd = C.CompiledForward(runner.model, runner.cache, C.CompileConfig(**{"backend": "post_grad_eager", **kw}),
                            pass_manager=pm)
    runner.use_forward(fwd, static_shapes=True)
    return fwd


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """H.mini_cfg() written as a checkpoint directory, with dummy weights."""
    from v41.loader import dummy_weights
    cfg = H.mini_cfg()
    d = tmp_path_factory.mktemp("mini")
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return str(d), cfg, dummy_weights(cfg, progress=False)


def mini_engine(mini, **kw):
    path, _, w = mini
    args = EngineArgs(model=path, dtype="float32", device="cpu",
                      **{"max_num_seqs": 4, "max_num_batched_tokens": 64, **kw})
    return LLMEngine(args, weights=w)


@dataclasses.dataclass
class ToyPrefix:
    runner: Any
    batch: Any
    snap: dict               # the cache before the step
    eager: torch.Tensor      # the eager model's output
    eager_cache: dict        # and the cache after it


def toy_prefix(toy_weights, n_layers, **engine) -> ToyPrefix:
    """The toy with its first `n_layers` layers and the final norm, and one prefill batch (5, 17,
    40 tokens); `engine`: more EngineArgs."""
    eng = H.make_engine(toy_weights, "float32", decoder_swa_bounded_replay=False, **engine)   # no decoder to replay
    runner = eng.runner
    runner.use_forward(runner.model, static_shapes=True)
    runner.model.layers = runner.model.layers[:n_layers]
    for i, p in enumerate(H.prompts((5, 17, 40), seed=0)):
        eng.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True), f"r{i}")
    batch = runner.prepare(eng.scheduler.schedule())
    with torch.inference_mode():
        snap = snapshot(runner.cache)
        eager = runner.model(batch, runner.cache)
        eager_cache = snapshot(runner.cache)
        restore(runner.cache, snap)
    return ToyPrefix(runner, batch, snap, eager, eager_cache)
