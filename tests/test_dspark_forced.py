"""The benchmark-only forced acceptance length (EngineArgs.spec_decode_acceptance_length, ATOM's
`--spec-decode-acceptance-length L`, issue 17): L counts the tokens a verify step commits, 1 +
accepted drafts. The engine's measured mean acceptance length is the one asked for, the
committed tokens are the drafts up to the forced count then the target's own token at that row,
the STATE slot after every verify step is a plain decode's of those tokens (the rollback runs as
for a real acceptance), nothing leaks; admission refuses it without DSpark or out of [1, k+1],
the server refuses it unless --allow-benchmark-only; benchmarks/dspark_bench.py runs on the CPU
toy and writes issue 17's JSON shape ("forced_acceptance": L)."""
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

L = 3.51                  # the recipe's acceptance length: 2.51 accepted drafts per verify step


def test_measured_acceptance_is_the_forced_one(toy_weights):
    """Eight requests of 100 tokens (greedy and sampled): over their verify steps the mean
    acceptance length, 1 + accepted drafts per step (SpecStep.stats, what /metrics publishes),
    is L within 0.05."""
    eng = H.make_engine(toy_weights, **DSPARK, spec_decode_acceptance_length=L)
    for i, p in enumerate(H.prompts((5, 16, 17, 33, 9, 40, 21, 12), seed=3)):
        sp = SamplingParams(max_tokens=100, ignore_eos=True, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
        eng.add_request(p, sp, request_id=f"r{i}")
    while eng.has_unfinished():
        eng.step()
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    st = eng.runner.spec.stats
    assert st["drafts"] > 150, st
    assert abs(1 + st["accepted"] / st["drafts"] - L) < 0.05, st
    assert set(i for i, n in enumerate(st["acceptance_length"]) if n) >= {3, 4}, st   # floor and ceil of L


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_forced_tokens_and_state(toy_weights, sampled):
    """Every verify step commits its forced count of drafts then the target's token at that row
    (the argmax, or the draw from that row's distribution), and the STATE slot is a plain
    decode's of the committed tokens after every step."""
    prompt = H.prompts((19,), seed=8)[0]
    p = SamplingParams(max_tokens=30, ignore_eos=True, **({"temperature": 0.7, "seed": 5} if sampled else {}))
    first, _ = _forced_run(toy_weights, prompt, p)
    eng = H.make_engine(toy_weights, **DSPARK, spec_decode_acceptance_length=L)
    spec, steps = eng.runner.spec, []
    accept = spec.accept

    def seen(rows, drafts, seqs, *ahead):
        last, out = accept(rows, drafts, seqs, *ahead)
        steps.extend((list(drafts[j]), a, toks) for j, (a, toks) in out.items())
        return last, out
    spec.accept = seen
    seq, verified = follow_with_plain(toy_weights, eng, prompt, p, first)
    assert seq.completion_token_ids == first and verified >= 4
    for drafts, a, toks in steps:
        assert a <= len(drafts) and toks[:-1] == drafts[:a]
    assert {a for _, a, _ in steps} >= {2, 3}


def _forced_run(weights, prompt, p):
    eng = H.make_engine(weights, **DSPARK, spec_decode_acceptance_length=L)
    seq = eng.add_request(prompt, p, request_id="q0")
    while eng.has_unfinished():
        eng.step()
    return seq.completion_token_ids, eng


@pytest.mark.parametrize("kw, why", [
    ({"spec_decode_acceptance_length": 3.5}, "needs --speculative-method dspark"),
    ({**DSPARK, "spec_decode_acceptance_length": 6.5}, "in [1, 6]"),
    ({**DSPARK, "spec_decode_acceptance_length": 0.9}, "in [1, 6]"),
    ({**DSPARK, "spec_decode_acceptance_length": float("nan")}, "in [1, 6]")])
def test_admission_refuses(kw, why):
    with pytest.raises(AdmissionError, match=r"--spec-decode-acceptance-length.*" + why.replace("[", r"\[")):
        EngineArgs(model="toy", **kw).admit()


@pytest.mark.parametrize("length", [1, 6])
def test_admission_takes_the_ends(length):
    """L = 1 (no draft accepted) and L = k + 1 (all five) are admitted."""
    EngineArgs(model="toy", **DSPARK, spec_decode_acceptance_length=length).admit()


def test_server_refuses_it_without_allow_benchmark_only(monkeypatch, capsys):
    """`python -m v41.serve --method dspark --spec-decode-acceptance-length 3.51`: refused before
    any weight is read, naming both flags; with --allow-benchmark-only the server's checks pass."""
    import v41.loader
    monkeypatch.setattr(v41.loader, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    argv = ["--port", "0", "--method", "dspark", "--spec-decode-acceptance-length", "3.51"]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "--spec-decode-acceptance-length" in err and "--allow-benchmark-only" in err and "benchmark-only" in err
    a = serve.build_parser()[0].parse_args(argv + ["--allow-benchmark-only"])
    serve.check_server_args(a)
    assert EngineArgs.from_cli_args(a).spec_decode_acceptance_length == L


def test_bench_smoke(tmp_path):
    """benchmarks/dspark_bench.py on the CPU mini model, tiny sizes: plain and dspark rows of issue
    17's shape at each batch size, DSpark at the forced acceptance length (the default 3.51), and
    a profiled step per case with the step's and DSpark's phases named, and each phase's host
    time over the timed steps without the profiler."""
    out, prof = tmp_path / "bench.json", tmp_path / "profiles.txt"
    mini = tmp_path / "mini"        # 8 layers, not the toy's 40: each profiled step parses 5x fewer events
    mini.mkdir()
    (mini / "config.json").write_text(json.dumps(H.mini_cfg().to_hf_dict()))
    res = dspark_bench.main(["--model", str(mini), "--device", "cpu", "--dtype", "float32", "--ctx", "20",
                             "--steps", "3", "--batch-sizes", "1,2", "--rounds", "1", "--out", str(out),
                             "--profile", str(prof)])
    assert json.loads(out.read_text()) == res
    for key in ("model", "device", "torch", "date", "method", "forced_acceptance"):
        assert res[key] is not None, key
    rows = res["results"]
    assert [(r["variant"], r["requests"]) for r in rows] == [("plain", 1), ("plain", 2), ("dspark", 1), ("dspark", 2)]
    for r in rows:
        assert {"variant", "forced_acceptance", "requests", "tokens_per_s", "ms_per_step"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert r["forced_acceptance"] == (L if r["variant"] == "dspark" else None)
        host = r["host_ms_by_phase"]
        assert ("runner.spec.propose" in host) == (r["variant"] == "dspark")
        assert 0 < host["runner.prepare"] < host["runner.run"] <= r["ms_per_step"] * 1.5, host
        # the floor: a DSpark step's is its verify forward's and its draft's
        assert r["floor_tokens_per_s"] == pytest.approx(r["tokens_per_step"] * r["requests"] / r["floor_ms"] * 1e3,
                                                        rel=1e-2)
        assert ("floor_ms_draft" in r) == (r["variant"] == "dspark")
        if r["variant"] == "dspark":
            assert r["floor_ms"] == pytest.approx(r["floor_ms_verify"] + r["floor_ms_draft"], abs=2e-3)
            plain = next(p for p in rows if p["variant"] == "plain" and p["requests"] == r["requests"])
            assert r["floor_ms_verify"] >= plain["floor_ms"] > 0 and r["floor_ms_draft"] > 0
    assert res["forced_acceptance"] == L
    assert all(r["tokens_per_step"] == 1 for r in rows[:2])
    # three timed steps: 1 + floor/ceil counts of 2.51 accepted drafts, and as many tokens per step
    assert all(3 <= r["measured_acceptance_length"] <= 4 and 3 <= r["tokens_per_step"] <= 4 for r in rows[2:])
    cases = prof.read_text().split("==== ")[1:]
    assert [c.splitlines()[0] for c in cases] == [f"{v}, {n} request(s), round 0" for v in ("plain", "dspark")
                                                  for n in (1, 2)]
    for c in cases:
        assert "runner.prepare" in c and "scheduler.postprocess" in c
        assert ("runner.spec.propose" in c) == c.startswith("dspark"), c[:40]


def test_bench_one_variant(tmp_path):
    """--variants dspark times DSpark alone (a device call that fits one cold compile);
    --weight-format native builds the engine with native weights (fewer bytes than dequantized)."""
    argv = ["--model", "toy", "--device", "cpu", "--dtype", "float32", "--ctx", "20", "--steps", "2",
            "--batch-sizes", "1", "--rounds", "1", "--variants", "dspark"]
    res = dspark_bench.main(argv)
    assert [r["variant"] for r in res["results"]] == ["dspark"] and res["weight_format"] == "dequant"
    native = dspark_bench.main(argv + ["--weight-format", "native"])
    assert native["weight_format"] == "native" and [r["variant"] for r in native["results"]] == ["dspark"]
    assert 0 < native["weights_gb"]["dspark"] < res["weights_gb"]["dspark"] / 2
    with pytest.raises(SystemExit):
        dspark_bench.main(["--variants", "plain,draft"])
