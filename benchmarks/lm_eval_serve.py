"""lm-eval through the server: starts `python -m v41.serve` on a free loopback port, runs the
local task benchmarks/lm_eval/tasks/pydoc_next_word as lm-eval's `local-completions` model and
its chat variant as `local-chat-completions`, stops the server and writes the metrics.

    make eval-setup                                   # lm-eval into .venv (the `eval` extra)
    .venv/bin/python benchmarks/lm_eval_serve.py      # writes benchmarks/results/lm-eval-toy.json
    .venv/bin/python benchmarks/lm_eval_serve.py --model /path/to/checkpoint --result FILE
    .venv/bin/python benchmarks/lm_eval_serve.py --base-url http://127.0.0.1:8000 --result FILE

The harness runs in this process through lm-eval's Python API (`simple_evaluate`, the code
behind the `lm_eval` command) with only the local tasks indexed: the CLI spends ~20 s on this
2-core machine indexing lm-eval's built-in tasks. Nothing is downloaded: the dataset is the
JSONL in the repository, and the Hugging Face libraries run offline.

The server it starts keeps prefix caching with checkpoint images (--no-encoder-swa-bounded-replay):
the three examples of a paragraph share a prefix, and a replay-mode hit (the default) truncates the
rebuilt windows, so an answer would depend on which request came first.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.serve_attack import start_server  # noqa: E402

TASKS = ROOT / "benchmarks" / "lm_eval" / "tasks"
TRAINED_TOY = ROOT / "v41" / "assets" / "toy-trained"
INSTALL = "make eval-setup (or: .venv/bin/python -m pip install -e '.[eval]')"
# (lm-eval model, its endpoint, task, apply_chat_template)
RUNS = (("local-completions", "/v1/completions", "pydoc_next_word", False),
        ("local-chat-completions", "/v1/chat/completions", "pydoc_next_word_chat", True))
METRIC = "exact_match,first-word"
# exact prefix hits (see above); a later --encoder-swa-bounded-replay in --server-args wins
SERVER_ARGS = ("--no-encoder-swa-bounded-replay", "--disable-access-log", "--uvicorn-log-level", "warning")


def default_model() -> str:
    """The trained toy when its checkpoint is there, else the random-weight `toy` preset."""
    return str(TRAINED_TOY.relative_to(ROOT)) if (TRAINED_TOY / "config.json").exists() else "toy"


def checkpoint_sha256(model: str) -> str | None:
    """One digest of a checkpoint directory's files (names and bytes); None for a preset."""
    d = ROOT / model  # the server runs in ROOT; an absolute `model` stays as it is
    if not d.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(x for x in d.iterdir() if x.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def cpu_name() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        m = None
    return m.group(1) if m else platform.processor() or platform.machine()


def evaluate(base: str, model_name: str, limit: int | None, concurrency: int, timeout: int) -> list[dict]:
    """One lm-eval run per entry of RUNS against the server at `base`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    out = []
    for lm, route, task, chat in RUNS:
        args = {"model": model_name, "base_url": base + route, "tokenizer_backend": "none",
                "num_concurrent": concurrency, "max_retries": 1, "timeout": timeout}
        t0 = time.perf_counter()
        cwd = os.getcwd()
        os.chdir(ROOT)  # the task's data_files path is relative to the repository root
        try:
            res = lm_eval.simple_evaluate(model=lm, model_args=args, tasks=[task], task_manager=manager,
                                          limit=limit, apply_chat_template=chat, log_samples=True,
                                          bootstrap_iters=1000)
        finally:
            os.chdir(cwd)
        seconds = time.perf_counter() - t0
        r = res["results"][task]
        out.append({
            "lm_eval_model": lm, "endpoint": route, "task": task, "apply_chat_template": chat,
            "limit": limit, "n_samples": res["n-samples"][task]["effective"],
            "metrics": {"exact_match": r[METRIC], "exact_match_stderr": r[METRIC.replace(",", "_stderr,")]},
            "seconds": round(seconds, 2),
            "samples": [{"id": s["doc"]["id"], "target": s["target"], "response": s["resps"][0][0],
                         "first_word": s["filtered_resps"][0], "exact_match": s["exact_match"]}
                        for s in res["samples"][task]],
        })
        print(f"{lm} {task}: exact_match {r[METRIC]:.3f} over {out[-1]['n_samples']} examples "
              f"({seconds:.0f} s)", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/lm_eval_serve.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="what the server loads: a checkpoint directory or a preset (default: "
                         "v41/assets/toy-trained if present, else toy)")
    ap.add_argument("--base-url", default=None, help="evaluate a server already running there instead")
    ap.add_argument("--server-args", default="--max-model-len 512",
                    help=f"more flags of python -m v41.serve, after {' '.join(SERVER_ARGS)}")
    ap.add_argument("--limit", type=int, default=None, help="examples per task (default: all 46)")
    ap.add_argument("--num-concurrent", type=int, default=4, help="requests in flight")
    ap.add_argument("--request-timeout", type=int, default=120, help="seconds per request")
    ap.add_argument("--result", default=None,
                    help="output file; needed with --model or --base-url (default: the toy's lm-eval-toy.json)")
    ap.add_argument("--no-save", dest="save", action="store_false")
    a = ap.parse_args(argv)
    if a.limit is not None and a.limit < 1:
        ap.error(f"--limit: must be at least 1, got {a.limit}")
    if a.result is None and a.save:
        if a.model or a.base_url:  # never overwrite the toy's figures with another model's
            ap.error("--result: name the output file when --model or --base-url is given")
        a.result = str(ROOT / "benchmarks" / "results" / "lm-eval-toy.json")
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # before datasets is imported: no hub look-up
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import lm_eval
    except ImportError:
        print(f"error: lm_eval is not installed: {INSTALL}", file=sys.stderr)
        return 2
    model = a.model or default_model()
    proc = log = None
    if a.base_url:
        base = a.base_url.rstrip("/")
    else:
        proc, base, log = start_server(["--model", model, *SERVER_ARGS, *a.server_args.split()])
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            version = c.get("/version").json()
            served = c.get("/v1/models").json()["data"][0]["id"]
        runs = evaluate(base, served, a.limit, a.num_concurrent, a.request_timeout)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    tracebacks = None
    if log is not None:
        tracebacks = Path(log).read_text(errors="replace").count("Traceback")
        os.unlink(log)
    out = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tool": "benchmarks/lm_eval_serve.py",
        "model": {"served_name": served, "path": version.get("model") or model,
                  "sha256": None if a.base_url else checkpoint_sha256(model),
                  "server_args": None if a.base_url else " ".join([*SERVER_ARGS, a.server_args]),
                  "dtype": version.get("engine_args", {}).get("dtype")},
        "device": version.get("device"),
        "host": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch_threads": version.get("torch_threads")},
        "versions": {"lm_eval": lm_eval.__version__, "torch": version.get("torch"), "v41": version.get("version"),
                     "git": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip()},
        "task_data": "benchmarks/lm_eval/tasks/pydoc_next_word.jsonl (held-out pydoc_data.topics, PSF License 2.0)",
        "metric": "exact_match of the answer's first run of letters against the next word, case ignored",
        "runs": runs,
        "server_tracebacks": tracebacks,
    }
    print(json.dumps({r["lm_eval_model"]: r["metrics"] for r in runs}))
    if a.save:
        Path(a.result).write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {a.result}", file=sys.stderr)
    return 0 if not tracebacks else 1


if __name__ == "__main__":
    sys.exit(main())
