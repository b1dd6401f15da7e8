"""Schedule-invariance harness (the seeds' validate_runtime scenarios, no oracle): a fixed set of
requests runs once uninterrupted, then under a perturbing scenario; greedy tokens must be equal
and every page and slot free afterwards; also the prefix-caching prompts (forks, cross
prefixes) and perturbations (missing or corrupt images) that the prefix-cache suites run."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams, Status

# spanning < W, = W, > PAGE and several PAGEs of the toy (W = 16, PAGE = 32)
PROMPT_LENS = (5, 16, 17, 33, 9, 64, 100, 150)


def prompts(n_lens=PROMPT_LENS, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_lens]


@dataclass
class Scenario:
    """Engine settings plus a hook that perturbs the run between steps."""
    name: str
    engine: dict = field(default_factory=dict)
    arrival_steps: list | None = None       # step at which request i arrives (None: all at 0)
    hook: object = None                      # hook(engine, live: dict[idx, Sequence], step, rng)
    seed: int = 0
    requests: object = prompts               # the prompts it runs: requests() -> list of token lists


def make_engine(weights, dtype="float64", **kw) -> LLMEngine:
    # prefix caching is a scenario of its own (under replay a hit is approximate by design)
    args = EngineArgs(model="toy", dtype=dtype, **{"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 512,
                                                                  "enable_prefix_caching": False, **kw})
    return LLMEngine(args, weights=weights)


def run(weights, reqs: list[list[int]], max_tokens: int = 8, scenario: Scenario | None = None,
        dtype: str = "float64") -> dict[int, list[int] | None]:
    """Greedy tokens per request index; None for a request the scenario cancelled."""
    sc = scenario or Scenario("uninterrupted")
    eng = make_engine(weights, dtype, **sc.engine)
    rng = random.Random(sc.seed)
    arrive = sc.arrival_steps or [0] * len(reqs)
    pending = sorted(range(len(reqs)), key=lambda i: (arrive[i], i))
    live, step, cancelled = {}, 0, set()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    while pending or eng.has_unfinished():
        while pending and arrive[pending[0]] <= step:
            i = pending.pop(0)
            live[i] = eng.add_request(reqs[i], params, request_id=f"r{i}")
        if sc.hook is not None:
            for i in sc.hook(eng, live, step, rng) or ():
                cancelled.add(i)
        eng.step()
        step += 1
        assert step < 10_000, "no progress"
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return {i: (None if i in cancelled else s.completion_token_ids) for i, s in live.items()}


# ---- perturbations ------------------------------------------------------------------------

def preempt_randomly(p: float = 0.15, phase: str = "any"):
    """Preempt running requests mid prefill and/or mid decode (they recompute from 0)."""
    def hook(eng, live, step, rng):
        for seq in list(eng.scheduler.running):
            prefill = seq.num_computed < seq.num_prompt_tokens
            if phase == "prefill" and not prefill or phase == "decode" and prefill:
                continue
            if seq.num_computed > 0 and rng.random() < p:
                eng.scheduler.preempt(seq)
    return hook


def cancel_randomly(p: float = 0.1):
    """Cancel requests in every phase: waiting, mid prefill chunk, before their first token,
    mid decode. Returns the cancelled request indices."""
    def hook(eng, live, step, rng):
        out = []
        for i, seq in live.items():
            if seq.status is not Status.FINISHED and rng.random() < p:
                assert eng.abort(seq.request_id)
                out.append(i)
        return out
    return hook


# the perturbing scenarios several suites run on the prompts above (graphs, tensor parallel, sync-free)
CHUNKS = Scenario("chunks", engine={"max_prefill_chunk": 7})
PREEMPT = Scenario("preempt", engine={"max_prefill_chunk": 9}, hook=preempt_randomly(0.2), seed=1)
CANCEL = Scenario("cancel", engine={"max_num_seqs": 3}, hook=cancel_randomly(0.08), seed=2)


# ---- prefix caching ---------------------------------------------------------------------------

PAGE = 32


def forks(root_len: int = 150, seed: int = 7, suffix: int = 9) -> list[list[int]]:
    """A root prompt, then forks sharing its first 1-4 PAGEs, diverging on a PAGE boundary and
    off it (5 tokens in), each with its own suffix; then two page-aligned prompts (the root's
    first 2 PAGEs exactly, and a fork 3 PAGEs + 5 tokens in, completed to 4 PAGEs), whose hit
    must stop one PAGE short of their end. The root runs first, alone."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 1000, (n,), generator=g).tolist()  # noqa: E731
    root = rand(root_len)
    out = [root]
    for k in (1, 2, 3, 4):
        for off in (0, 5):
            out.append(root[: k * PAGE + off] + rand(suffix))
    out += [root[: 2 * PAGE], root[: 3 * PAGE + 5] + rand(PAGE - 5)]
    return out


def cross_prefixes(seed: int = 11, suffix: int = 9) -> list[list[int]]:
    """A = X+Y, B = Z+Y, C = Z+Y (one PAGE each, own suffixes): B and C share the PAGE Y with A
    but not the PAGE before it, so only a hash chained through the earlier PAGEs keeps C from
    taking A's copy of Y (computed after X)."""
    g = torch.Generator().manual_seed(seed)
    x, y, z = (torch.randint(3, 1000, (PAGE,), generator=g).tolist() for _ in range(3))
    return [p + torch.randint(3, 1000, (suffix,), generator=g).tolist() for p in (x + y, z + y, z + y)]


def run_in_order(weights, reqs: list[list[int]], max_tokens: int = 8, **engine) -> list[list[int]]:
    """Greedy tokens of each request run alone to completion, one after the other, in one
    engine (so each finds the cache the earlier ones left)."""
    eng = make_engine(weights, **engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = []
    for p in reqs:
        seq = eng.add_request(p, params)
        while eng.has_unfinished():
            eng.step()
        out.append(seq.completion_token_ids)
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return out


def fork_arrivals(n: int, after: int = 8) -> list[int]:
    """The root at step 0, every fork once the root has been prefilled."""
    return [0] + [after] * (n - 1)


# the fork prompts arriving once the root is prefilled, with prefix caching: hits of 1-4 PAGEs
FORKS = Scenario("forks", engine={"max_prefill_chunk": 48, "enable_prefix_caching": True},
                 arrival_steps=fork_arrivals(len(forks())), requests=forks)


def evict_images(keep_first: int = 1):
    """Drop every checkpoint image but the first `keep_first` of each cached prefix: hits must
    then resume from an earlier boundary (replay from a missing image)."""
    def hook(eng, live, step, rng):
        bm = eng.bm
        for page in sorted(bm.image_of)[keep_first:]:
            bm.drop_image(page)
    return hook


def corrupt_images(kind: str):
    """Alter stored images: 'bytes' flips ring values, 'geometry' rewrites the layout id."""
    def hook(eng, live, step, rng):
        st = eng.runner.state
        for page, img in list(eng.bm.image_of.items()):
            if kind == "bytes":
                eng.runner.cache.image_ring[:, img * st.W] += 1
            else:
                lid, pos, chk = st.meta[img]
                st.meta[img] = ("another-geometry", pos, chk)
    return hook


def preset_cfg():
    from v41.config import preset
    return preset("toy")


def mini_cfg():
    """The toy cut to 8 layers with every role of the Flash topology (WINDOW, WINDOW + Engram,
    FULL ratio 2, REUSE, FULL ratio 1 with candidates, REINDEX): boundary 5, last 7."""
    from v41.config import preset, validate
    from v41.engram.hashing import table_rows
    cfg = preset("toy")
    cfg.name, cfg.num_hidden_layers = "mini", 8
    cfg.compress_ratios = [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    cfg.kv_source_layer_ids, cfg.index_source_layer_ids = [2, 5], [2, 5, 6]
    cfg.candidate_source_layer_id, cfg.dspark_target_layer_ids = 5, [5, 6, 7]
    cfg.engram_layer_ids = [1]
    cfg.engram_num_embeddings = table_rows(cfg)
    validate(cfg)
    return cfg
