"""The benchmark-only forced acceptance (EngineArgs.dspark_forced_acceptance, issue 17): the
engine's measured mean acceptance is the one asked for, the committed tokens are the drafts up
to the forced count then the target's own token at that row, the STATE slot after every verify
step is a plain decode's of those tokens (the rollback runs as for a real acceptance), nothing
leaks; admission refuses it without DSpark or out of [0, k], the server refuses it unless
--allow-benchmark-only; benchmarks/dspark_bench.py runs on the CPU toy and writes issue 17's
JSON shape."""
from __future__ import annotations

import json

import pytest

from benchmarks import dspark_bench
from runtime.engine_args import EngineArgs
from runtime.geometry import AdmissionError
from runtime.sequence import SamplingParams
from tests import harness as H
from tests.test_dspark_engine import DSPARK
from tests.test_dspark_sampled import follow_with_plain
from v41 import serve

A = 3.51


def test_measured_acceptance_is_the_forced_one(toy_weights):
    """Eight requests of 100 tokens (greedy and sampled): over 176 verify steps the mean
    accepted drafts per step (SpecStep.stats, what /metrics publishes) is A within 0.05."""
    eng = H.make_engine(toy_weights, **DSPARK, dspark_forced_acceptance=A)
    for i, p in enumerate(H.prompts((5, 16, 17, 33, 9, 40, 21, 12), seed=3)):
        sp = SamplingParams(max_tokens=100, ignore_eos=True, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
        eng.add_request(p, sp, request_id=f"r{i}")
    while eng.has_unfinished():
        eng.step()
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    st = eng.runner.spec.stats
    assert st["drafts"] > 150, st
    assert abs(st["accepted"] / st["drafts"] - A) < 0.05, st
    assert set(i for i, n in enumerate(st["acceptance_length"]) if n) >= {4, 5}, st   # floor and ceil of A


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_forced_tokens_and_state(toy_weights, sampled):
    """Every verify step commits its forced count of drafts then the target's token at that row
    (the argmax, or the draw from that row's distribution), and the STATE slot is a plain
    decode's of the committed tokens after every step."""
    prompt = H.prompts((19,), seed=8)[0]
    p = SamplingParams(max_tokens=30, ignore_eos=True, **({"temperature": 0.7, "seed": 5} if sampled else {}))
    first, _ = _forced_run(toy_weights, prompt, p)
    eng = H.make_engine(toy_weights, **DSPARK, dspark_forced_acceptance=A)
    spec, steps = eng.runner.spec, []
    accept = spec.accept

    def seen(rows, drafts, seqs):
        last, out = accept(rows, drafts, seqs)
        steps.extend((list(drafts[j]), a, toks) for j, (a, toks) in out.items())
        return last, out
    spec.accept = seen
    seq, verified = follow_with_plain(toy_weights, eng, prompt, p, first)
    assert seq.completion_token_ids == first and verified >= 4
    for drafts, a, toks in steps:
        assert a <= len(drafts) and toks[:-1] == drafts[:a]
    assert {a for _, a, _ in steps} >= {3, 4}


def _forced_run(weights, prompt, p):
    eng = H.make_engine(weights, **DSPARK, dspark_forced_acceptance=A)
    seq = eng.add_request(prompt, p, request_id="q0")
    while eng.has_unfinished():
        eng.step()
    return seq.completion_token_ids, eng


@pytest.mark.parametrize("kw, why", [
    ({"dspark_forced_acceptance": 3.5}, "needs --speculative-method dspark"),
    ({**DSPARK, "dspark_forced_acceptance": 5.5}, "in [0, 5]"),
    ({**DSPARK, "dspark_forced_acceptance": -0.1}, "in [0, 5]"),
    ({**DSPARK, "dspark_forced_acceptance": float("nan")}, "in [0, 5]")])
def test_admission_refuses(kw, why):
    with pytest.raises(AdmissionError, match=r"--dspark-forced-acceptance.*" + why.replace("[", r"\[")):
        EngineArgs(model="toy", **kw).admit()


def test_server_refuses_it_without_allow_benchmark_only(monkeypatch, capsys):
    """`python -m v41.serve --method dspark --dspark-forced-acceptance 3.51`: refused before any
    weight is read, naming both flags; with --allow-benchmark-only the server's checks pass."""
    import v41.loader
    monkeypatch.setattr(v41.loader, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    argv = ["--port", "0", "--method", "dspark", "--dspark-forced-acceptance", "3.51"]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "--dspark-forced-acceptance" in err and "--allow-benchmark-only" in err and "benchmark-only" in err
    a = serve.build_parser()[0].parse_args(argv + ["--allow-benchmark-only"])
    serve.check_server_args(a)
    assert EngineArgs.from_cli_args(a).dspark_forced_acceptance == A


def test_bench_smoke(tmp_path):
    """benchmarks/dspark_bench.py on the CPU toy, tiny sizes: plain and dspark rows of issue
    17's shape at each batch size, DSpark at the forced acceptance."""
    out = tmp_path / "bench.json"
    res = dspark_bench.main(["--model", "toy", "--device", "cpu", "--dtype", "float32", "--ctx", "20",
                             "--steps", "3", "--batch-sizes", "1,2", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    for key in ("model", "device", "torch", "date", "method", "forced_acceptance"):
        assert res[key] is not None, key
    rows = res["results"]
    assert [(r["variant"], r["requests"]) for r in rows] == [("plain", 1), ("plain", 2), ("dspark", 1), ("dspark", 2)]
    for r in rows:
        assert {"variant", "forced_acceptance", "requests", "tokens_per_s", "ms_per_step"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert r["forced_acceptance"] == (A if r["variant"] == "dspark" else None)
    assert all(r["tokens_per_step"] == 1 for r in rows[:2])
    assert all(3 <= r["measured_acceptance"] <= 4 and r["tokens_per_step"] > 4 for r in rows[2:])
