"""The three commands' flags: `python -m v41.serve`, `v41.generate` and `v41.prebuild` take the
same engine flags (`EngineArgs.add_cli_args`), refuse what is not built by name before a weight
is read (`runtime.cli.exit_on_refusal`: `error: ...`, status 2), have one compile switch, and
their help lists only what works. In-process with the engine and the loader made to fail, plus
one subprocess per flag of the brief through the real `python -m` entry point."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.engine_args import NOT_BUILT, EngineArgs
from runtime.geometry import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, AdmissionError
from v41 import generate, prebuild, serve

ROOT = Path(__file__).resolve().parents[1]
MAINS = {"serve": (serve.main, []), "generate": (generate.main, ["--prompt", "x"]),
         "prebuild": (prebuild.main, [])}


@pytest.fixture
def no_weights(monkeypatch):
    """Reading a weight or the tokenizer fails the test (LLMEngine admits, then loads them)."""
    import v41.loader
    import v41.tokenizer
    monkeypatch.setattr(v41.loader, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    monkeypatch.setattr(v41.tokenizer, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))


REFUSED = [
    (["--block-size", "16"], "--block-size", "PAGE >= 32"),
    (["--enable-expert-parallel"], "--enable-expert-parallel", "not built in v41 yet"),
    (["--kv-transfer-config", "{}"], "--kv-transfer-config", "not built in v41 yet"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size", "not built in v41 yet"),
    (["--context-parallel-size", "2"], "--context-parallel-size", "not built in v41 yet"),
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size", "num_attention_heads = 4 is not divisible by TP 3"),
    (["--tensor-parallel-size", "2", "-O3"], "--tensor-parallel-size", "runs the eager model"),
    (["--speculative-method", "eagle"], "--speculative-method", "not built in v41 yet"),
    (["--method", "dspark", "--num-speculative-tokens", "4"], "--num-speculative-tokens", "drafts five tokens"),
    (["--cudagraph-mode", "TR_HYBRID"], "--cudagraph-mode", "CUDA graphs need a CUDA device"),
    (["--cudagraph-mode", "FULL"], "--cudagraph-mode", "CUDA graphs need a CUDA device"),
    (["--cudagraph-mode", "PIECEWISE"], "--cudagraph-mode", "is not one of NONE, FULL, TR_HYBRID"),
    (["--cudagraph-capture-sizes", "1,4,9999"], "--cudagraph-capture-sizes", "[9999]"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "is not in (0, 1]"),
] + [([flag], flag, "not built in v41 yet") for flag in NOT_BUILT
     if flag not in ("--enable-expert-parallel", "--kv-transfer-config")]


@pytest.mark.parametrize("cmd", MAINS)
@pytest.mark.parametrize("args,flag,why", REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_by_name_before_weights(cmd, args, flag, why, no_weights, capsys):
    main, base = MAINS[cmd]
    argv = ["--port", "0"] if cmd == "serve" else []
    assert main(argv + base + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and why in err, err
    assert err.count("\n") == 1, err                # one line, no traceback


@pytest.mark.parametrize("args,flag", [(["--block-size", "16"], "--block-size"),
                                       (["--enable-expert-parallel"], "--enable-expert-parallel"),
                                       (["--kv-transfer-config", "{}"], "--kv-transfer-config")])
def test_serve_process_refuses_quickly(args, flag):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "v41.serve", "--port", "0", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    dt = time.monotonic() - t0
    assert r.returncode == 2 and r.stderr.startswith("error: ") and flag in r.stderr, r.stderr
    assert "not built in v41 yet" in r.stderr or "PAGE >= 32" in r.stderr
    assert "weights" not in r.stderr and "ready" not in r.stderr      # nothing was loaded
    assert dt < 30, dt          # the imports only (torch: a few seconds on a loaded 2-core machine)


def test_block_size_floor_keeps_the_earlier_reasons():
    """An odd PAGE or one below the window keeps its reason; 32 (the toy's own PAGE) is admitted."""
    for page, msg in ((31, "even"), (8, "sliding_window - 1"), (16, "a ratio-2 owner halves the PAGE")):
        with pytest.raises(Exception, match=msg):
            EngineArgs(model="toy", block_size=page).admit()
    assert EngineArgs(model="toy", block_size=32).admit()[1].page_tokens == 32
    assert EngineArgs(model="toy").admit()[1].page_tokens == 32


# ---- one set of engine flags --------------------------------------------------------------

def _engine_options(ap) -> dict[str, tuple[set, object]]:
    """dest -> (option strings, default) of every engine flag (fields, -O, not-built flags)."""
    dests = {f.name for f in dataclasses.fields(EngineArgs)} | {"compilation_level"}
    return {a.dest: (set(a.option_strings), a.default) for a in ap._actions
            if a.dest in dests or a.dest.startswith("_not_built_")}


def test_serve_generate_prebuild_share_the_engine_flags():
    s, g, p = (_engine_options(m.build_parser()[0]) for m in (serve, generate, prebuild))
    assert set(s) == set(g) == set(p)
    fields = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "extra"]
    assert set(fields) <= set(s) and len(s) == len(fields) + 1 + len(NOT_BUILT)
    for dest in s:
        if dest == "seed":       # generate's --seed seeds sampling; the weights' seed is --weight-seed
            assert s[dest][0] == p[dest][0] == {"--seed", "--weight-seed"} and g[dest][0] == {"--weight-seed"}
        else:
            assert s[dest][0] == g[dest][0] == p[dest][0], dest
        if dest != "enforce_eager":                     # prebuild compiles by default
            assert s[dest][1] == g[dest][1] == p[dest][1], dest
    assert (s["enforce_eager"][1], p["enforce_eager"][1]) == (True, False)
    defaults = EngineArgs()
    assert all(s[f][1] == getattr(defaults, f) for f in fields)
    # every flag name the repo's tests, Makefile, README, docs and benchmarks use
    for flag in ("--model", "--dtype", "--device", "--load-format", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--index-cache-dtype", "--kv-cache-dtype", "--block-size",
                 "--pipeline-parallel-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--no-enforce-eager", "--enforce-eager", "--level", "--compilation-level",
                 "--no-decoder-swa-bounded-replay", "--compile-cache-dir", "--capture-sizes",
                 "--dump-dir", "--method", "--enable-dp-attention", "--no-encoder-swa-bounded-replay"):
        for m in (serve, generate, prebuild):
            assert flag in m.build_parser()[0]._option_string_actions, (m.__name__, flag)


def test_generate_takes_the_flags_it_missed(monkeypatch, capsys):
    seen = {}

    class FakeLLM:
        def __init__(self, **kw):
            seen.update(kw)

        def generate(self, prompts, params, use_tqdm=False):
            seen["params"] = params
            return []

    import v41.llm
    monkeypatch.setattr(v41.llm, "LLM", FakeLLM)
    argv = ["--prompt", "x", "--max-model-len", "256", "--no-enable-prefix-caching", "--kv-cache-dtype", "bf16",
            "--capture-sizes", "1,2", "--max-prefill-chunk", "64", "--num-pages", "40", "--seed", "7",
            "--weight-seed", "3", "-O3", "--json"]
    assert generate.main(argv) == 0
    assert (seen["max_model_len"], seen["enable_prefix_caching"], seen["kv_cache_dtype"], seen["capture_sizes"],
            seen["max_prefill_chunk"], seen["num_pages"]) == (256, False, "bf16", "1,2", 64, 40)
    assert seen["seed"] == 3 and seen["params"].seed == 7 and seen["enforce_eager"] is False
    assert set(seen) - {"params"} == {f.name for f in dataclasses.fields(EngineArgs)}


# ---- one compile switch ---------------------------------------------------------------------

def test_one_compile_switch():
    ap, _ = serve.build_parser()
    eager = lambda argv: EngineArgs.from_cli_args(ap.parse_args(argv)).enforce_eager  # noqa: E731
    assert eager([]) is True
    assert eager(["--no-enforce-eager"]) is eager(["-O3"]) is eager(["--level", "3"]) is False
    assert eager(["--compilation-level", "0"]) is eager(["-O", "0"]) is True
    assert eager(["-O3", "--enforce-eager"]) is True and eager(["--enforce-eager", "-O3"]) is False  # last wins
    assert "compilation_level" not in {f.name for f in dataclasses.fields(EngineArgs)}
    assert EngineArgs(compilation_level=3).enforce_eager is False
    assert EngineArgs(enforce_eager=False).compilation_level == 3 and EngineArgs().compilation_level == 0
    assert dataclasses.replace(EngineArgs(), enforce_eager=False).compilation_level == 3
    with pytest.raises(AdmissionError, match="compilation_level"):
        EngineArgs(compilation_level=1)


def test_prebuild_refuses_eager(no_weights, capsys):
    for argv in (["--enforce-eager"], ["-O0"], ["--compilation-level", "0"]):
        assert prebuild.main(argv) == 2
        assert "prebuild compiles the model" in capsys.readouterr().err


# ---- honest help ----------------------------------------------------------------------------

def _help(flag: str) -> str:
    return serve.build_parser()[0]._option_string_actions[flag].help


def test_help_lists_only_what_is_built():
    kv = _help("--kv-cache-dtype")
    assert "fp4" not in kv and all(d in kv for d in KV_CACHE_DTYPES)
    assert all(d in _help("--index-cache-dtype") for d in INDEX_CACHE_DTYPES)
    for d in KV_CACHE_DTYPES:
        EngineArgs(model="toy", kv_cache_dtype=d).admit()
    for d in INDEX_CACHE_DTYPES:
        EngineArgs(model="toy", index_cache_dtype=d).admit()
    assert "CUDA graph" not in _help("--enforce-eager")            # not built: no claim about them
    for flag in ("--pipeline-parallel-size", "--context-parallel-size"):
        assert "not built" in _help(flag)
    for flag in NOT_BUILT:
        assert "not built in v41 yet" in _help(flag)
    r = subprocess.run([sys.executable, "-m", "v41.generate", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--kv-cache-dtype" in r.stdout and "--max-model-len" in r.stdout


def test_exit_on_refusal_catches_refusals_only(capsys):
    from runtime.cli import exit_on_refusal
    with exit_on_refusal() as refused:
        raise AdmissionError("x: no")
    assert refused and refused.status == 2 and capsys.readouterr().err == "error: x: no\n"
    with exit_on_refusal() as refused:
        pass
    assert not refused
    with pytest.raises(KeyError), exit_on_refusal():
        raise KeyError("a bug is not a refusal")
