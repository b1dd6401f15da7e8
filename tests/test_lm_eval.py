"""lm-eval through the real server: benchmarks/lm_eval_serve.py on the first examples of the
local task, then each recorded answer asked again of the same server (greedy) to show that
lm-eval's requests reached it as the task defines them and were scored on what it returned."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.lm_eval import make_task  # noqa: E402
from benchmarks.lm_eval_serve import RUNS, TASKS, default_model  # noqa: E402
from benchmarks.serve_attack import start_server  # noqa: E402

LIMIT = 3
JSONL = TASKS / "pydoc_next_word.jsonl"
EXAMPLES = [json.loads(line) for line in JSONL.open()]
CHAT_PROMPT = "Continue this passage from the Python documentation. Reply with its next word only.\n\n"


@pytest.fixture(scope="module")
def lm_eval():
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # the tasks' data is the local JSONL; never a hub look-up
    os.environ["HF_HUB_OFFLINE"] = "1"
    return pytest.importorskip("lm_eval", reason="lm-eval is not installed: make eval-setup "
                                                 "(.venv/bin/python -m pip install -e '.[eval]')")


def scored(response: str, target: str) -> float:
    """The task's score, written out: the first run of letters equals the target, case ignored."""
    m = re.match(r"\s*([A-Za-z]+)", response)
    return float(m is not None and m.group(1).lower() == target.lower())


def again(c: httpx.Client, route: str, name: str, context: str) -> str:
    body = {"model": name, "max_tokens": 6, "temperature": 0, "stop": ["\n"]}
    if route == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": CHAT_PROMPT + context}],
                 "chat_template_kwargs": {"thinking": False}}
        return c.post(route, json=body).json()["choices"][0]["message"]["content"]
    return c.post(route, json=body | {"prompt": context}).json()["choices"][0]["text"]


def test_examples_are_the_held_out_slice(tmp_path):
    """The committed JSONL is what make_task.py writes from train_toy's split, and no example's
    last words and target occur in the training slice."""
    out = tmp_path / "examples.jsonl"
    assert make_task.main(["--out", str(out)]) == 0
    assert out.read_text() == JSONL.read_text(), "regenerate: .venv/bin/python benchmarks/lm_eval/make_task.py"
    train, _ = make_task.corpus_split(EXAMPLES[0]["holdout"])
    assert len(EXAMPLES) >= 36 and len({(e["context"], e["target"]) for e in EXAMPLES}) == len(EXAMPLES)
    assert not [e["id"] for e in EXAMPLES if f"{e['context'][-40:]} {e['target']}" in train]


@pytest.mark.parametrize("response,target", [
    (" the", "the"), (" The end", "the"), ("the", "the"), ("\n\tthe.", "the"), (" them", "the"),
    (".the", "the"), ("", "the"), (" 3the", "the"), (" as", "a"), ("ABC", "abc")])
def test_task_scores_as_written(lm_eval, response, target):
    """Both tasks' filters and metric (lm-eval's own code) score a response as `scored` says."""
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False).load([t for _, _, t, _ in RUNS])
    for task in tasks["tasks"].values():
        doc = {**EXAMPLES[0], "target": target}
        resps = [[response]]
        for make_filter in task._filters[0].filters:
            resps = make_filter().apply(resps, [doc])
        assert task.process_results(doc, list(resps))["exact_match"] == scored(response, target)


def test_lm_eval_through_the_server(lm_eval, tmp_path):
    # float64: greedy tokens do not depend on which requests share a step (bf16 and float32 can
    # flip a near tie); checkpoint images: a prefix hit is exact (a replay hit truncates windows,
    # and its greedy tokens differ). So the answers asked for again, all at once, must be lm-eval's.
    proc, base, log = start_server(["--model", default_model(), "--dtype", "float64", "--max-model-len", "512",
                                    "--no-encoder-swa-bounded-replay", "--disable-access-log"])
    try:
        out = tmp_path / "lm-eval.json"
        run = subprocess.run([sys.executable, "benchmarks/lm_eval_serve.py", "--base-url", base, "--limit",
                              str(LIMIT), "--result", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-4000:]
        res = json.loads(out.read_text())
        with httpx.Client(base_url=base, timeout=60) as c, ThreadPoolExecutor(2 * LIMIT) as pool:
            name = c.get("/v1/models").json()["data"][0]["id"]
            replies = {route: list(pool.map(lambda ex, r=route: again(c, r, name, ex["context"]), EXAMPLES[:LIMIT]))
                       for _, route, _, _ in RUNS}
    finally:
        proc.terminate()
        proc.wait(30)
        Path(log).unlink()
    assert res["versions"]["lm_eval"] == lm_eval.__version__ and res["model"]["served_name"] == name
    assert [(r["lm_eval_model"], r["task"]) for r in res["runs"]] == [(m, t) for m, _, t, _ in RUNS]
    for r in res["runs"]:
        assert r["n_samples"] == LIMIT
        assert [s["id"] for s in r["samples"]] == [ex["id"] for ex in EXAMPLES[:LIMIT]]
        assert [s["target"] for s in r["samples"]] == [ex["target"] for ex in EXAMPLES[:LIMIT]]
        assert [s["response"] for s in r["samples"]] == replies[r["endpoint"]]
        scores = [scored(s["response"], s["target"]) for s in r["samples"]]
        assert [s["exact_match"] for s in r["samples"]] == scores
        assert r["metrics"]["exact_match"] == pytest.approx(sum(scores) / LIMIT)
