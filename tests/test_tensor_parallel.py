"""Tensor parallelism on the CPU (v41.parallel): 2 gloo ranks, each a process running the same
float64 toy engine on its shard of the checkpoint, against the unsharded engine (TP1):
- greedy tokens equal, uninterrupted and under chunking, preemption and cancellation
  (the schedule-invariance scenarios, whose hooks draw from the same seeded RNG on each rank),
  and for prefix forks served from the cache in both StateTransfer modes;
- teacher-forced logits of every prompt row within 1e-9 relative (partial sums change only the
  order of the additions);
- every page and slot free afterwards (H.run checks).
Also: the shard layout (heads, output groups, whole experts per rank) and the refusals."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp

from runtime.sequence import SamplingParams
from tests import harness as H
from tests.test_runtime_parity import rel_err, teacher_forced
from v41.config import ConfigError, preset
from v41.parallel import TensorParallel, set_tensor_parallel, shard_checkpoint

SCENARIOS = [
    H.Scenario("uninterrupted"),
    H.CHUNKS,
    H.PREEMPT,
    H.CANCEL,
]
REQS = H.prompts((5, 17, 33, 64), seed=4)
TF_REQS = H.prompts((40, 70), seed=5)


def unsharded(weights) -> dict:
    """What a TP1 engine computes: tokens per scenario and teacher-forced logits."""
    tokens = {sc.name: H.run(weights, REQS, max_tokens=6, scenario=sc) for sc in SCENARIOS}
    for mode, transfer in (("copy", {"encoder_swa_bounded_replay": False}), ("replay", {})):
        tokens[f"prefix forks, {mode}"] = H.run_in_order(weights, H.forks()[:4], 4, enable_prefix_caching=True,
                                                         max_prefill_chunk=48, **transfer)
    eng = H.make_engine(weights, decoder_swa_bounded_replay=False)
    return {"tokens": tokens, "logits": teacher_forced(eng, TF_REQS)}


def rank_main(rank: int, size: int, init: str, results) -> None:
    """One rank: the toy checkpoint (the conftest's deterministic tensors), its shard, the runs."""
    import torch.distributed as dist

    from v41.loader import dummy_weights
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        set_tensor_parallel(TensorParallel(rank, size))
        cfg = preset("toy")
        shard = shard_checkpoint(cfg, dummy_weights(cfg, progress=False), rank, size)
        # Plain pickle bytes: a queued tensor travels as a shared fd that dies with this process,
        # which can exit before the parent unpickles it.
        results.put((rank, pickle.dumps(unsharded(shard))))
    except BaseException as e:            # the parent reports it instead of waiting forever
        results.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('gloo') / 'rendezvous'}"
    procs = [ctx.Process(target=rank_main, args=(r, 2, init, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {rank: pickle.loads(r) if isinstance(r, bytes) else r
           for rank, r in (results.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs), got
    return got


def test_tp2_gives_the_tokens_of_tp1(toy_weights, tp2):
    want = unsharded(toy_weights)
    for rank in (0, 1):
        assert tp2[rank]["tokens"] == want["tokens"], rank
        for got, ref in zip(tp2[rank]["logits"], want["logits"]):
            assert rel_err(got, ref) < 1e-9


def test_shard_layout(toy_cfg, toy_weights):
    H_, E, hd = toy_cfg.num_attention_heads, toy_cfg.n_routed_experts, toy_cfg.head_dim
    r1 = shard_checkpoint(toy_cfg, toy_weights, 1, 2)
    assert r1["layers.3.attn.wq_b.weight"].shape[0] == H_ // 2 * hd
    assert torch.equal(r1["layers.3.attn.wq_b.weight"].view(torch.uint8),
                       toy_weights["layers.3.attn.wq_b.weight"][H_ // 2 * hd:].view(torch.uint8))
    assert torch.equal(r1["layers.3.attn.attn_sink"], toy_weights["layers.3.attn.attn_sink"][H_ // 2:])
    assert r1["layers.3.attn.wo_b.weight"].shape[1] == toy_weights["layers.3.attn.wo_b.weight"].shape[1] // 2
    experts = {k for k in r1 if k.startswith("layers.3.ffn.experts.") and k.endswith(".w1.weight")}
    assert len(experts) == E // 2                      # whole experts, renumbered from 0
    assert torch.equal(r1["layers.3.ffn.experts.0.w1.weight"].view(torch.uint8),
                       toy_weights[f"layers.3.ffn.experts.{E // 2}.w1.weight"].view(torch.uint8))
    assert torch.equal(r1["layers.3.attn.wkv.weight"].view(torch.uint8),     # the KV path: replicated
                       toy_weights["layers.3.attn.wkv.weight"].view(torch.uint8))
    assert shard_checkpoint(toy_cfg, toy_weights, 0, 1).keys() == dict(toy_weights.items()).keys()


def test_refusals_name_the_field(toy_cfg, toy_weights):
    with pytest.raises(ConfigError, match="tensor_parallel_size: num_attention_heads = 4 is not divisible by TP 3"):
        shard_checkpoint(toy_cfg, toy_weights, 0, 3)
    with pytest.raises(ConfigError, match="tensor_parallel_size: index_n_heads = 2 is not divisible by TP 4"):
        shard_checkpoint(toy_cfg, toy_weights, 0, 4)



def generate(eng, aborted: int = 2) -> list[list[int]]:
    """Greedy and seeded sampled requests, one aborted after its prompt; their tokens."""
    seqs = []
    for i, p in enumerate(REQS):
        sp = SamplingParams(max_tokens=6, ignore_eos=True) if i % 2 else \
            SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.95, seed=10 + i)
        seqs.append(eng.add_request(p, sp, request_id=f"r{i}"))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 3:
            eng.abort(f"r{aborted}")
    return [s.completion_token_ids for s in seqs]


def test_the_engine_runs_its_own_ranks():
    """--tensor-parallel-size 2 is all it takes: the engine spawns rank 1, steps it in lockstep,
    and gives the tokens of one rank, sampled ones included; a rank that dies stops the next step
    with a clear error instead of a hang."""
    from runtime.engine import EngineArgs, LLMEngine
    base = dict(model="toy", dtype="float64", device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=256, enable_prefix_caching=False)
    want = generate(LLMEngine(EngineArgs(**base)))
    eng = LLMEngine(EngineArgs(**base, tensor_parallel_size=2))
    try:
        assert [p.is_alive() for p in eng.driver.workers] == [True]
        assert generate(eng) == want
        eng.bm.check([])
        eng.driver.workers[0].kill()
        eng.driver.workers[0].join(30)
        eng.add_request(REQS[0], SamplingParams(max_tokens=2), request_id="after")
        with pytest.raises(RuntimeError, match="worker v41-tp-rank1 exited"):
            eng.step()
    finally:
        eng.close()
        set_tensor_parallel(TensorParallel())
